"""A step's `gpu_memory_gib`: GiB each of its GPUs must have free (spec checks, the JSON Schema,
the resolved step, and the bound by the pool's largest GPU memory)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from lowtide.domain.layout import ArtifactLayout
from lowtide.domain.spec_issues import SpecInvalid
from lowtide.domain.spec_parse import build_job_spec
from lowtide.domain.spec_render import render_step
from lowtide.domain.spec_schema import job_spec_schema


def job(**step: Any) -> dict[str, Any]:
    return {"name": "j", "steps": [{"name": "train", "command": ["x"], "gpus": 2, **step}]}


def issues(doc: dict[str, Any], **kw: Any) -> list[str]:
    with pytest.raises(SpecInvalid) as err:
        build_job_spec(doc, **kw)
    return [str(i) for i in err.value.issues]


@pytest.mark.parametrize("given", [70, 70.5, 0.25])
def test_a_need_is_a_number_of_gib_kept_through_the_document_and_the_resolved_step(given: float) -> None:
    spec = build_job_spec(job(gpu_memory_gib=given))
    assert spec.steps[0].gpu_memory_gib == float(given)
    assert build_job_spec(spec.to_document()) == spec  # round trip
    jsonschema.validate(spec.to_document(), job_spec_schema())
    resolved = render_step(spec, spec.steps[0], job_id="job-1", layout=ArtifactLayout("/a", "/w"))
    assert resolved.gpu_memory_gib == float(given)


def test_without_a_need_nothing_is_added() -> None:
    spec = build_job_spec(job())
    assert spec.steps[0].gpu_memory_gib is None
    assert "gpu_memory_gib" not in spec.to_document()["steps"][0]


@pytest.mark.parametrize(
    ("given", "message"),
    [
        (0, "more than 0"),
        (-4, "more than 0"),
        (float("nan"), "more than 0"),
        (float("inf"), "more than 0"),
        (True, "must be a number of GiB per GPU, got a boolean"),
        ("70", "must be a number of GiB per GPU, got a string"),
        (10**400, "at most 1000000 GiB"),
    ],
)
def test_a_need_that_is_not_a_positive_number_is_refused_at_its_field(given: object, message: str) -> None:
    found = issues(job(gpu_memory_gib=given))
    assert len(found) == 1 and found[0].startswith("steps[0].gpu_memory_gib: "), found
    assert message in found[0], found


@pytest.mark.parametrize("gpus", [{"gpus": 0}, {}])
def test_a_need_is_only_for_a_step_with_gpus(gpus: dict[str, int]) -> None:
    doc = {"name": "j", "steps": [{"name": "s", "command": ["x"], "gpu_memory_gib": 10, **gpus}]}
    assert issues(doc) == ["steps[0].gpu_memory_gib: only for a step with GPUs: give gpus (1 or more) too"]


def test_a_need_above_the_largest_gpu_memory_of_the_pool_is_refused_when_it_is_known() -> None:
    assert issues(job(gpu_memory_gib=96), max_gpu_memory_gib=80.0) == [
        "steps[0].gpu_memory_gib: 96 GiB per GPU requested but no node's GPUs have more than 80 GiB"
    ]
    assert build_job_spec(job(gpu_memory_gib=80), max_gpu_memory_gib=80.0).steps[0].gpu_memory_gib == 80.0
    assert build_job_spec(job(gpu_memory_gib=96)).steps[0].gpu_memory_gib == 96.0  # unknown: no bound


def test_the_json_schema_refuses_what_the_checks_refuse() -> None:
    schema = job_spec_schema()
    for bad in (0, -1, "70", True):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(job(gpu_memory_gib=bad), schema)


def test_lowtide_validate_bounds_a_need_by_the_declared_gpu_memory_and_says_it(tmp_path: Path) -> None:
    from typer.testing import CliRunner  # noqa: PLC0415

    from lowtide.cli.main import app  # noqa: PLC0415

    config = tmp_path / "lowtide.yaml"
    nodes = [{"name": "a", "gpus": 4, "gpu_memory_gib": 80}, {"name": "b", "gpus": 2, "gpu_memory_gib": 40}]
    config.write_text(yaml.safe_dump({"state_dir": str(tmp_path / "s"), "nodes": nodes}))

    def validate(need: float) -> Any:
        spec = tmp_path / "j.yaml"
        spec.write_text(yaml.safe_dump(job(gpu_memory_gib=need)))
        args = ["--config", str(config), "validate", str(spec)]
        return CliRunner().invoke(app, args, env={"COLUMNS": "200"})

    refused = validate(96)
    assert refused.exit_code == 2, refused.output
    assert "steps[0].gpu_memory_gib: 96 GiB per GPU requested but no node's GPUs have more than 80 GiB" in (
        refused.stderr
    )
    accepted = validate(70)
    assert accepted.exit_code == 0, accepted.output
    assert "up to 2 GPU(s) per step, needing up to 70 GiB per GPU" in accepted.stdout
