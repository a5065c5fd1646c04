"""`lowtide argo render` through the real command line (Typer's CliRunner on `lowtide.cli.main.app`):
a job spec (templates expanded, `-p` parameters) printed as the Argo Workflow it becomes, in
YAML or JSON; bad input exits 2 with a message that says where and why.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from typer.testing import CliRunner

from lowtide.cli.main import app

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples" / "jobs"


@pytest.fixture
def config(tmp_path: Path) -> Path:
    path = tmp_path / "lowtide.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "state_dir": str(tmp_path / "state"),
                "templates_dir": str(REPO / "examples" / "templates"),
                "artifact_root": str(tmp_path / "artifacts"),  # local: embedded mode's
                "argo": {
                    "artifact_root": "s3://research/lowtide",
                    "default_image": "ghcr.io/example/lowtide-steps:0.1",
                    "namespace": "research",
                    "grace_margin_seconds": "10s",
                },
                "secrets": {
                    "hf-token": {"env": "HF_TOKEN", "teams": ["*"], "source": {"env": "LOWTIDE_TEST_HF"}}
                },
            }
        ),
        encoding="utf-8",
    )
    return path


def run(config: Path, *args: str) -> Any:
    return CliRunner().invoke(app, ["--config", str(config), "argo", "render", *args])


def said(result: Any) -> str:
    """stderr with Rich's line wrapping undone."""
    return " ".join(str(result.stderr).split())


def test_renders_a_templated_job_as_yaml(config: Path) -> None:
    result = run(
        config, str(EXAMPLES / "sft-from-template.yaml"), "-p", "lr=0.1", "--job-id", "job-00000000beef"
    )
    assert result.exit_code == 0, result.output
    wf = yaml.safe_load(result.stdout)
    assert wf["kind"] == "Workflow" and wf["metadata"]["name"] == "job-00000000beef"
    assert wf["metadata"]["namespace"] == "research"
    templates = {t["name"]: t for t in wf["spec"]["templates"]}
    assert set(templates) == {"lowtide-job", "prep", "train", "eval"}  # expanded from templates/sft.yaml
    assert {"name": "lr", "value": "0.1"} in wf["spec"]["arguments"]["parameters"]
    train = templates["train"]
    assert "0.1" in train["container"]["args"]
    assert json.loads(train["podSpecPatch"])["terminationGracePeriodSeconds"] == 70  # grace 60 + 10 s
    env = {e["name"]: e.get("value") for e in train["container"]["env"]}
    assert env["LOWTIDE_OUTPUTS"] == "s3://research/lowtide/jobs/job-00000000beef/train/outputs"


def test_json_output_parses_and_matches_yaml(config: Path) -> None:
    path = str(EXAMPLES / "sft-dag.yaml")
    as_json = run(config, path, "-o", "json")
    as_yaml = run(config, path)
    assert as_json.exit_code == 0 and as_yaml.exit_code == 0
    assert json.loads(as_json.stdout) == yaml.safe_load(as_yaml.stdout)


def test_an_invalid_spec_exits_2_with_located_problems(config: Path, tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\nsteps:\n  - name: a\n    command: [echo]\n    gpus: -1\n", encoding="utf-8")
    result = run(config, str(bad))
    assert result.exit_code == 2
    assert f"{bad}: invalid job spec" in said(result)
    assert "steps[0].gpus" in said(result)
    assert result.stdout == ""


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["no-such-file.yaml"], "cannot read no-such-file.yaml"),
        ([str(EXAMPLES / "sft-dag.yaml"), "-p", "nope=1"], "nope"),
        ([str(EXAMPLES / "sft-dag.yaml"), "-p", "=1"], "--param"),
        ([str(EXAMPLES / "sft-dag.yaml"), "--job-id", "Job_1"], "job id 'Job_1' is not a DNS-1123 label"),
    ],
)
def test_bad_arguments_exit_2(config: Path, args: list[str], message: str) -> None:
    result = run(config, *args)
    assert result.exit_code == 2
    assert message in said(result)


def test_a_step_without_image_names_the_step(config: Path, tmp_path: Path) -> None:
    doc = yaml.safe_load(config.read_text(encoding="utf-8"))
    del doc["argo"]["default_image"]
    config.write_text(yaml.safe_dump(doc), encoding="utf-8")
    result = run(config, str(EXAMPLES / "demo-pretrain.yaml"))  # its steps name no image
    assert result.exit_code == 2
    assert "steps.prep.image: cluster mode runs images" in said(result)


def test_a_local_artifact_root_is_refused(config: Path) -> None:
    doc = yaml.safe_load(config.read_text(encoding="utf-8"))
    del doc["argo"]["artifact_root"]  # falls back to the top-level one, a local directory
    config.write_text(yaml.safe_dump(doc), encoding="utf-8")
    result = run(config, str(EXAMPLES / "sft-dag.yaml"))
    assert result.exit_code == 2
    assert "must be remote object storage" in said(result)


def test_a_local_argo_artifact_root_is_a_config_error(config: Path) -> None:
    doc = yaml.safe_load(config.read_text(encoding="utf-8"))
    doc["argo"]["artifact_root"] = "/var/lowtide"
    config.write_text(yaml.safe_dump(doc), encoding="utf-8")
    result = run(config, str(EXAMPLES / "sft-dag.yaml"))
    assert result.exit_code == 2
    assert "argo.artifact_root" in said(result) and "must be remote object storage" in said(result)


def test_secrets_render_as_references(config: Path, tmp_path: Path) -> None:
    spec = tmp_path / "s.yaml"
    spec.write_text(
        "name: s\nsecrets: [hf-token]\nsteps:\n  - name: a\n    image: img:1\n    command: [echo]\n",
        encoding="utf-8",
    )
    result = run(config, str(spec), "-o", "json")
    assert result.exit_code == 0, result.output
    (template,) = [t for t in json.loads(result.stdout)["spec"]["templates"] if t["name"] == "a"]
    env = {e["name"]: e for e in template["container"]["env"]}
    assert env["HF_TOKEN"]["valueFrom"] == {"secretKeyRef": {"name": "hf-token", "key": "value"}}
    assert "value" not in env["HF_TOKEN"]
