"""The step contract environment and the settings loader."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lowtide.config import ConfigError, load_settings, parse_duration
from lowtide.control.contract import parse_checkpoint_label, resume_uri, step_environment
from lowtide.domain.spec import ResolvedStep

RESOLVED = ResolvedStep(
    name="train",
    command=("python", "t.py"),
    gpus=2,
    image=None,
    env={"HF_HOME": "/cache"},
    inputs={"prep": "/art/jobs/j/prep/outputs"},
    outputs="/art/jobs/j/train/outputs",
    checkpoint_dir="/art/jobs/j/train/checkpoints",
)


def test_the_step_environment_follows_the_contract() -> None:
    env = step_environment(
        job_id="j",
        attempt=2,
        node="n1",
        gpus=(3, 1),
        resolved=RESOLVED,
        params={"lr": 2e-05, "tags": ["a", "b"], "use_bf16": True, "base": "s3://m"},
        grace_seconds=120,
        notice_path="/w/NOTICE",
        last_checkpoint="step-7",
        api_url="http://x:1",
        step_token="lt_s",
        storage_options={"endpoint_url": "http://s3"},
    )
    assert env["CUDA_VISIBLE_DEVICES"] == "1,3"
    assert (env["LOWTIDE_JOB_ID"], env["LOWTIDE_STEP"], env["LOWTIDE_ATTEMPT"]) == ("j", "train", "2")
    assert json.loads(env["LOWTIDE_PARAMS"]) == {
        "lr": 2e-05,
        "tags": ["a", "b"],
        "use_bf16": True,
        "base": "s3://m",
    }
    assert env["LOWTIDE_PARAM_LR"] == "2e-05"
    assert env["LOWTIDE_PARAM_TAGS"] == '["a","b"]'
    assert env["LOWTIDE_PARAM_USE_BF16"] == "true"
    assert env["LOWTIDE_PARAM_BASE"] == "s3://m"
    assert json.loads(env["LOWTIDE_INPUTS"]) == {"prep": "/art/jobs/j/prep/outputs"}
    assert env["LOWTIDE_OUTPUTS"] == "/art/jobs/j/train/outputs"
    assert env["LOWTIDE_CHECKPOINT_DIR"] == "/art/jobs/j/train/checkpoints"
    assert env["LOWTIDE_RESUME_FROM"] == "/art/jobs/j/train/checkpoints/step-7"
    assert env["LOWTIDE_NOTICE_FILE"] == "/w/NOTICE" and env["LOWTIDE_GRACE_SECONDS"] == "120"
    assert env["HF_HOME"] == "/cache"
    assert json.loads(env["LOWTIDE_STORAGE_OPTIONS"]) == {"endpoint_url": "http://s3"}


def test_resume_and_checkpoint_labels() -> None:
    assert resume_uri("s3://b/ck", "step-1") == "s3://b/ck/step-1"
    assert resume_uri("/ck", "/elsewhere/step-1") == "/elsewhere/step-1"
    assert parse_checkpoint_label("  step-9\n") == "step-9"
    for bad, why in [("", "empty"), ("a\nb", "single line"), ("x" * 2000, "longer"), ("a\x00b", "control")]:
        with pytest.raises(ValueError, match=why):
            parse_checkpoint_label(bad)


def test_settings_resolve_relative_paths_against_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = tmp_path / "conf" / "lowtide.yaml"
    cfg.parent.mkdir()
    cfg.write_text("state_dir: state\nstore_url: sqlite:///db/x.db\nnodes: [{name: n1, gpus: 2}]\n")
    s = load_settings(cfg)
    assert s.state_dir == str(tmp_path / "conf" / "state")
    assert s.database_url == f"sqlite:///{tmp_path / 'conf' / 'db' / 'x.db'}"
    monkeypatch.setenv("LOWTIDE_API__PORT", "9999")
    monkeypatch.setenv("LOWTIDE_TICK_SECONDS", "0.5")
    s = load_settings(cfg)
    assert (s.api.port, s.tick_seconds) == (9999, 0.5)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("nodes: [{name: n1, gpus: -1}]", "nodes[0].gpus"),
        ("nodes: [{name: N_1, gpus: 1}]", "nodes[0].name"),
        ("nodes: [{name: a..b, gpus: 1}]", "nodes[0].name"),
        ("nodes: [{name: .a, gpus: 1}]", "nodes[0].name"),
        ("nodes: [{name: " + "a" * 60 + ".com, gpus: 1}]", "at most 63"),
        ("nodes: [{name: a, gpus: 1}, {name: a, gpus: 2}]", "duplicate node name"),
        ("tick_seconds: 0", "tick_seconds"),
        ("scheduler: {fair_share_half_life: soon}", "scheduler.fair_share_half_life"),
        ("executor: {runtime: lxc}", "executor.runtime"),
        ("colour: blue", "colour: unknown key"),
        ("services: [{name: llama}]", "services[0].model: Field required"),
        ("services: [{name: l, model: m, min_replicas: 3, max_replicas: 2}]", "min_replicas (3) is larger"),
        (
            "nodes: [{name: a, gpus: 2}]\nservices: [{name: l, model: m, gpus_per_replica: 4}]",
            "largest node has 2",
        ),
        ("services: [{name: a, model: m}, {name: b, model: m}]", "port 8100 is already used"),
        ("lending: {mode: window}", "needs at least one window"),
        ("lending: {mode: window, windows: ['20:00-08:00', '07:00-09:00']}", "overlap"),
        ("lending: {mode: window, windows: ['25:00-08:00']}", "not a time of day"),
        ("lending: {timezone: Mars/Olympus}", "unknown time zone"),
        ("- a list", "top level must be a mapping"),
        ("a: [", "not valid YAML"),
    ],
)
def test_bad_settings_name_the_field(tmp_path: Path, text: str, expected: str) -> None:
    cfg = tmp_path / "lowtide.yaml"
    cfg.write_text(text)
    with pytest.raises(ConfigError, match=None) as err:
        load_settings(cfg)
    assert expected in str(err.value) and str(cfg) in str(err.value)


def test_node_names_may_be_kubernetes_node_names_with_dots(tmp_path: Path) -> None:
    """EKS names its nodes ip-10-0-1-2.ec2.internal; cluster mode pins pods by that name."""
    cfg = tmp_path / "lowtide.yaml"
    cfg.write_text("nodes: [{name: ip-10-0-1-2.ec2.internal, gpus: 8}, {name: gpu-3, gpus: 2}]")
    assert [n.name for n in load_settings(cfg).nodes] == ["ip-10-0-1-2.ec2.internal", "gpu-3"]


def test_missing_explicit_config_and_durations(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not found"):
        load_settings(tmp_path / "nope.yaml")
    assert [parse_duration(v) for v in (5, "30s", "5m", "6h", "1d", "250ms")] == [
        5,
        30,
        300,
        21600,
        86400,
        0.25,
    ]
    with pytest.raises(ValueError):
        parse_duration("-5s")
