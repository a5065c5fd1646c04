"""The spec side of the limits: a step's or job's `timeout`, and the number of steps a job may have;
plus the `scheduler:` settings that configure them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from lowtide.config import ConfigError, load_settings
from lowtide.domain.spec_issues import SpecInvalid
from lowtide.domain.spec_parse import build_job_spec


def job(**step: Any) -> dict[str, Any]:
    return {"name": "j", "steps": [{"name": "train", "command": ["x"], **step}]}


def issues(doc: dict[str, Any], **kw: Any) -> list[str]:
    with pytest.raises(SpecInvalid) as err:
        build_job_spec(doc, **kw)
    return [str(i) for i in err.value.issues]


@pytest.mark.parametrize(
    ("given", "seconds"),
    [(2, 2.0), (1.5, 1.5), ("90", 90.0), ("45s", 45.0), ("90m", 5400.0), ("2h", 7200.0), ("1h30m", 5400.0),
     ("1.5h", 5400.0), ("3d", 259200.0), (" 2h 30m ", 9000.0)],
)  # fmt: skip
def test_a_timeout_is_seconds_or_a_duration(given: object, seconds: float) -> None:
    spec = build_job_spec(job(timeout=given))
    assert spec.steps[0].timeout == seconds
    assert build_job_spec(spec.to_document()) == spec  # round trip


def test_the_job_timeout_is_kept_for_steps_without_one() -> None:
    spec = build_job_spec({**job(), "timeout": "6h"})
    assert spec.timeout == 21600.0 and spec.steps[0].timeout is None
    assert spec.to_document()["timeout"] == 21600.0
    assert build_job_spec(spec.to_document()) == spec
    assert "timeout" not in build_job_spec(job()).to_document()


@pytest.mark.parametrize(
    ("given", "says"),
    [
        (0, "must be more than 0 seconds (leave it out for no limit), got 0"),
        (-3, "must be more than 0 seconds"),
        ("2x", "must be a number of seconds or a duration such as '90m', '2h', '1h30m' or '3d', got '2x'"),
        ("", "must be a number of seconds or a duration"),
        (True, "got a boolean"),
        (None, "got null"),
        ([1], "got a list"),
        (float("nan"), "must be a finite number of seconds, got nan"),
        (float("inf"), "must be at most 31622400 seconds (366 days), got inf"),
        ("400d", "must be at most 31622400 seconds (366 days)"),
    ],
)
def test_a_bad_timeout_is_refused_where_it_is(given: object, says: str) -> None:
    (problem,) = issues(job(timeout=given))
    assert problem.startswith("steps[0].timeout: ")
    assert says in problem


def test_a_huge_integer_timeout_is_refused_without_printing_it() -> None:
    (problem,) = issues(job(timeout=10**5000))
    assert problem == (
        "steps[0].timeout: must be at most 31622400 seconds (366 days), got <an integer of about 5001 digits>"
    )


def test_a_long_timeout_text_is_echoed_as_an_excerpt_only() -> None:
    (problem,) = issues(job(timeout="9" * 100_000))
    assert problem.startswith("steps[0].timeout: must be a number of seconds")
    assert len(problem) < 300


def test_a_bad_job_timeout_is_located_at_the_top() -> None:
    assert issues({**job(), "timeout": "soon"})[0].startswith("timeout: must be a number of seconds")


def test_a_template_timeout_is_a_default_the_job_may_override() -> None:
    class Templates:
        def load(self, name: str) -> dict[str, Any] | None:
            return {"timeout": "1h", "steps": [{"name": "train", "command": ["x"]}]} if name == "t" else None

        def names(self) -> list[str]:
            return ["t"]

    assert build_job_spec({"name": "j", "use": "t"}, templates=Templates()).timeout == 3600.0
    assert build_job_spec({"name": "j", "use": "t", "timeout": 60}, templates=Templates()).timeout == 60.0


def test_a_job_over_the_step_limit_is_refused_at_steps() -> None:
    doc = {"name": "fan", "steps": [{"name": f"s{i}", "command": ["x"]} for i in range(1001)]}
    assert issues(doc, max_steps_per_job=1000) == [
        "steps: 1001 steps; the limit is 1000 (scheduler.max_steps_per_job)"
    ]
    assert len(build_job_spec(doc, max_steps_per_job=2000).steps) == 1001
    assert len(build_job_spec(doc).steps) == 1001  # no limit given: none


def test_ten_thousand_steps_pass_when_the_limit_allows_them() -> None:
    doc = {"name": "fan", "steps": [{"name": f"s{i}", "command": ["x"], "gpus": 0} for i in range(10_000)]}
    assert len(build_job_spec(doc, max_steps_per_job=10_000).steps) == 10_000


# --- configuration -------------------------------------------------------------------------------


def settings(tmp_path: Path, scheduler: dict[str, Any]) -> Any:
    path = tmp_path / "lowtide.yaml"
    path.write_text(yaml.safe_dump({"scheduler": scheduler}))
    return load_settings(path)


def test_the_scheduler_limits_have_defaults(tmp_path: Path) -> None:
    s = settings(tmp_path, {}).scheduler
    assert s.default_step_timeout is None
    assert s.max_cpu_steps_per_node == "auto"
    assert s.max_cpu_steps_per_user is None
    assert s.max_steps_per_job == 1000
    assert s.team_quotas == {}


def test_the_scheduler_limits_are_read(tmp_path: Path) -> None:
    s = settings(
        tmp_path,
        {
            "default_step_timeout": "12h",
            "max_cpu_steps_per_node": 3,
            "max_cpu_steps_per_user": 64,
            "max_steps_per_job": 10_000,
            "team_quotas": {"nlp": 8, "vision": 4},
        },
    ).scheduler
    assert s.default_step_timeout == 43200.0
    assert (s.max_cpu_steps_per_node, s.max_cpu_steps_per_user, s.max_steps_per_job) == (3, 64, 10_000)
    assert s.team_quotas == {"nlp": 8, "vision": 4}
    assert settings(tmp_path, {"max_cpu_steps_per_node": None}).scheduler.max_cpu_steps_per_node is None


@pytest.mark.parametrize(
    ("scheduler", "says"),
    [
        ({"max_cpu_steps_per_node": 0}, "must be at least 1"),
        ({"max_cpu_steps_per_user": 0}, "max_cpu_steps_per_user"),
        ({"max_steps_per_job": 0}, "max_steps_per_job"),
        ({"default_step_timeout": 0}, "a timeout must be positive"),
        ({"default_step_timeout": "soon"}, "expected a duration"),
        ({"team_quotas": {"nlp": -1}}, "team 'nlp': a quota must be 0 or more GPUs"),
    ],
)
def test_bad_scheduler_limits_name_the_key(tmp_path: Path, scheduler: dict[str, Any], says: str) -> None:
    with pytest.raises(ConfigError, match=says):
        settings(tmp_path, scheduler)


def test_lowtide_validate_applies_the_configured_step_limit(tmp_path: Path) -> None:
    from typer.testing import CliRunner  # noqa: PLC0415

    from lowtide.cli.main import app  # noqa: PLC0415

    config = tmp_path / "lowtide.yaml"
    config.write_text(
        yaml.safe_dump({"state_dir": str(tmp_path / "s"), "scheduler": {"max_steps_per_job": 2}})
    )
    spec = tmp_path / "fan.yaml"
    spec.write_text(
        yaml.safe_dump({"name": "fan", "steps": [{"name": f"s{i}", "command": ["x"]} for i in range(3)]})
    )
    result = CliRunner().invoke(app, ["--config", str(config), "validate", str(spec)], env={"COLUMNS": "200"})
    assert result.exit_code == 2, result.output
    assert "3 steps; the limit is 2" in result.stderr
