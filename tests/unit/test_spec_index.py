"""`attempt_rules.index_spec` / `SpecIndex.scoped` give what `step_scoped_spec` always gave (the
job's spec with only one step), and `job_rules.job_may_move_counted` answers as `job_may_move`."""

from __future__ import annotations

from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from lowtide.domain.states import JobState, StepState
from lowtide.policy import attempt_rules as ar
from lowtide.policy import job_rules as jr
from lowtide.store.convert import resolved_from_doc


def scan(spec: dict[str, Any], step: str) -> dict[str, Any]:
    """The scan `step_scoped_spec` did before the index: the reference."""
    steps = spec.get("steps")
    mine = (
        [s for s in steps if isinstance(s, dict) and s.get("name") == step] if isinstance(steps, list) else []
    )
    return {**{k: v for k, v in spec.items() if k != "steps"}, "steps": mine}


SPECS: list[dict[str, Any]] = [
    {"name": "j", "params": {"a": 1}, "steps": [{"name": "x", "command": ["t"]}, {"name": "y"}]},
    {"steps": [{"name": "x", "v": 1}, "junk", {"v": 2}, {"name": 3}, {"name": "x", "v": 3}], "team": "t"},
    {"name": "no steps"},
    {"name": "odd", "steps": {"x": 1}},
    {"steps": [], "params": None},
]


def test_the_index_scopes_a_spec_as_the_scan_did() -> None:
    for spec in SPECS:
        index = ar.index_spec(spec)
        for step in ("x", "y", "z"):
            assert index.scoped(step) == scan(spec, step) == ar.step_scoped_spec(spec, step)
            assert list(index.scoped(step)) == list(scan(spec, step))  # same key order too
        assert ar.launch_params(index.job_fields) == ar.launch_params(spec)


def test_a_record_from_the_index_equals_one_from_the_spec() -> None:
    spec = SPECS[0]
    resolved_doc = {"name": "x", "command": ["t"], "gpus": 0, "outputs": "/o"}
    resolved = resolved_from_doc(resolved_doc)
    kw: dict[str, Any] = dict(
        resolved_doc=resolved_doc, resolved=resolved, last_checkpoint=None, node="n", gpus=()
    )
    assert ar.reproducibility_record(spec=ar.index_spec(spec), **kw) == ar.reproducibility_record(
        spec=spec, **kw
    )


@given(st.sampled_from(list(JobState)), st.lists(st.sampled_from(list(StepState)), max_size=6))
def test_counting_open_steps_answers_as_job_may_move(job: JobState, steps: list[StepState]) -> None:
    open_steps = sum(1 for s in steps if jr.is_open_step(s))
    assert jr.job_may_move_counted(job, open_steps) == jr.job_may_move(job, steps)
