"""Secrets by reference (docs/architecture.md §11): the spec's `secrets:` forms and locations,
the check against the operator's rules, the adapter that reads values, and the config."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from lowtide.adapters.secrets import MAX_SECRET_BYTES, ConfiguredSecrets, SecretSource
from lowtide.config import ConfigError, load_settings
from lowtide.control.executor_port import ExecutorError
from lowtide.control.secrets_port import SecretRule, secret_issues
from lowtide.domain.layout import ArtifactLayout
from lowtide.domain.spec import SecretUse
from lowtide.domain.spec_issues import SpecInvalid
from lowtide.domain.spec_parse import build_job_spec
from lowtide.domain.spec_render import render_step
from lowtide.store.convert import resolved_from_doc, resolved_to_doc

RULES = {"wandb": SecretRule("WANDB_API_KEY", ("nlp",)), "hf": SecretRule("HF_TOKEN", ("*",))}


def doc(**extra: Any) -> dict[str, Any]:
    steps = extra.pop("steps", [{"name": "train", "command": ["python", "t.py"]}])
    return {"name": "sft", "team": "nlp", "steps": steps, **extra}


def issues(d: dict[str, Any]) -> list[tuple[str, str]]:
    with pytest.raises(SpecInvalid) as exc:
        build_job_spec(d)
    return [(i.loc, i.msg) for i in exc.value.issues]


def test_secrets_are_names_in_a_list_or_a_mapping_and_round_trip() -> None:
    spec = build_job_spec(
        doc(
            secrets=["hf"],
            steps=[
                {"name": "a", "command": ["x"], "secrets": {"WB": "wandb"}},
                {"name": "b", "command": ["x"], "secrets": ["wandb", {"HF2": "hf"}]},
            ],
        )
    )
    assert spec.secrets == (SecretUse("hf"),)
    assert spec.steps[0].secrets == (SecretUse("wandb", "WB"),)
    assert spec.steps[1].secrets == (SecretUse("wandb"), SecretUse("hf", "HF2"))
    assert build_job_spec(spec.to_document()) == spec
    assert spec.to_document()["steps"][1]["secrets"] == ["wandb", {"HF2": "hf"}]
    # Rendered per step: the job's first, then the step's own; stored and read back by name.
    resolved = render_step(spec, spec.steps[1], job_id="job-1", layout=ArtifactLayout("/a", "/w"))
    assert resolved.secrets == (SecretUse("hf"), SecretUse("wandb"), SecretUse("hf", "HF2"))
    assert resolved_from_doc(resolved_to_doc(resolved)) == resolved
    assert build_job_spec(doc()).steps[0].secrets == ()


def test_malformed_secrets_are_located() -> None:
    found = issues(
        doc(
            secrets="wandb",
            steps=[
                {"name": "a", "command": ["x"], "secrets": ["Bad Name", 3, {"A": "x", "B": "y"}, "ok", "ok"]},
                {
                    "name": "b",
                    "command": ["x"],
                    "secrets": {"LOWTIDE_TOKEN": "x", "1X": "y", "CUDA_VISIBLE_DEVICES": "z"},
                },
            ],
        )
    )
    locs = [loc for loc, _ in found]
    assert locs == [
        "secrets",
        "steps[0].secrets[0]",
        "steps[0].secrets[1]",
        "steps[0].secrets[2]",
        "steps[0].secrets[4]",
        "steps[1].secrets.LOWTIDE_TOKEN",
        "steps[1].secrets.1X",
        "steps[1].secrets.CUDA_VISIBLE_DEVICES",
    ]
    assert "secret 'ok' is given twice" in dict(found)["steps[0].secrets[4]"]
    assert "reserved" in dict(found)["steps[1].secrets.LOWTIDE_TOKEN"]


def test_a_templates_secrets_apply_unless_the_job_gives_its_own() -> None:
    class Templates:
        def load(self, name: str) -> dict[str, Any] | None:
            return {"steps": [{"name": "t", "command": ["x"], "secrets": ["hf"]}], "secrets": ["wandb"]}

        def names(self) -> list[str]:
            return ["sft"]

    templated = build_job_spec({"name": "j", "use": "sft"}, templates=Templates())
    assert templated.secrets == (SecretUse("wandb"),) and templated.steps[0].secrets == (SecretUse("hf"),)
    own = build_job_spec({"name": "j", "use": "sft", "secrets": []}, templates=Templates())
    assert own.secrets == ()


def test_secret_issues_name_unknown_secrets_foreign_teams_and_clashing_variables() -> None:
    spec = build_job_spec(
        doc(
            team="vision",
            secrets=["hf", "wandb"],
            steps=[
                {
                    "name": "a",
                    "command": ["x"],
                    "secrets": ["nope", {"HF_TOKEN": "hf"}],
                    "env": {"HF_TOKEN": "1"},
                },
                {"name": "b", "command": ["x"], "secrets": ["hf"]},
            ],
        )
    )
    found = [(i.loc, i.status) for i in secret_issues(spec, RULES)]
    assert found == [
        ("secrets[1]", 403),  # wandb is nlp's
        ("secrets[0]", 422),  # HF_TOKEN also in steps[0].env
        ("steps[0].secrets[0]", 422),  # unknown
        ("steps[0].secrets[1]", 422),  # HF_TOKEN twice
    ]
    ok = build_job_spec(
        doc(secrets=["wandb"], steps=[{"name": "a", "command": ["x"], "secrets": {"H": "hf"}}])
    )
    assert secret_issues(ok, RULES) == []


def test_the_adapter_reads_files_and_lowtides_environment_and_fails_by_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "wandb").write_text("v@lue\n")
    (tmp_path / "big").write_bytes(b"x" * (MAX_SECRET_BYTES + 1))
    (tmp_path / "nul").write_bytes(b"a\x00b")
    monkeypatch.setenv("LT_TEST_OPERATOR_VAR", "from-env")
    monkeypatch.delenv("LT_TEST_UNSET_VAR", raising=False)
    secrets = ConfiguredSecrets(
        {
            "wandb": SecretSource("WANDB_API_KEY", "file", str(tmp_path / "wandb")),
            "hf": SecretSource("HF_TOKEN", "env", "LT_TEST_OPERATOR_VAR"),
            "gone": SecretSource("G", "file", str(tmp_path / "missing")),
            "unset": SecretSource("U", "env", "LT_TEST_UNSET_VAR"),
            "big": SecretSource("B", "file", str(tmp_path / "big")),
            "nul": SecretSource("N", "file", str(tmp_path / "nul")),
        }
    )
    assert secrets.environment([SecretUse("wandb"), SecretUse("hf", "MY_HF")]) == {
        "WANDB_API_KEY": "v@lue",
        "MY_HF": "from-env",
    }
    for name, reason in [
        ("gone", "cannot read its file"),
        ("unset", "environment has no LT_TEST_UNSET_VAR"),
        ("big", "larger than"),
        ("nul", "NUL"),
        ("other", "not configured"),
    ]:
        with pytest.raises(ExecutorError, match=reason) as exc:
            secrets.environment([SecretUse(name)])
        assert not exc.value.temporary and f"'{name}'" in str(exc.value)


@pytest.mark.parametrize(
    ("secrets", "where"),
    [
        ({"Bad": {"env": "X", "teams": ["*"], "source": {"env": "Y"}}}, "not a valid secret name"),
        ({"s": {"env": "LOWTIDE_X", "teams": ["*"], "source": {"env": "Y"}}}, "reserved"),
        ({"s": {"env": "X", "teams": [], "source": {"env": "Y"}}}, "teams"),
        ({"s": {"env": "X", "teams": ["Nope!"], "source": {"env": "Y"}}}, "not a team name"),
        ({"s": {"env": "X", "teams": ["*"], "source": {"env": "Y", "file": "/f"}}}, "exactly one"),
        ({"s": {"env": "X", "teams": ["*"], "source": {"file": "rel/path"}}}, "absolute path"),
    ],
)
def test_config_refuses_malformed_secrets_naming_the_field(
    tmp_path: Path, secrets: dict[str, Any], where: str
) -> None:
    config = tmp_path / "lowtide.yaml"
    config.write_text(yaml.safe_dump({"secrets": secrets}))
    with pytest.raises(ConfigError, match=where) as exc:
        load_settings(config)
    assert "secrets" in str(exc.value)
