"""What the inference side remembers across a restart of the control plane (issue 12, defect 5):
the autoscaler's windows and guards are saved in the store's `control_state` and restored by
`InferenceController.recover`, and an OPEN reclaim keeps the GPUs its victims free for its
service, so a crash during a reclaim's grace never lends them back to research (the victim used
to restart on the same GPUs and be preempted again).

The production loop with a fake clock and fake ports (executor, service manager, metrics), on
SQLite and on the in-memory store (`sim.harness.LoopHarness`, as tests/integration/test_reclaim_loop.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from test_reclaim_loop import BACKENDS, GRACE, job_doc, world

from lowtide.control.inference import MEMORY_KEY, MEMORY_SAVE_EVERY_S
from lowtide.sim.harness import LoopHarness


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def surge_in_grace(root: Path, backend: str) -> tuple[LoopHarness, str, int]:
    """A reclaim opened for chat/1 and its victim still in its grace: (world, victim job, attempt)."""
    w = world(root, backend=backend)
    w.tick(2)
    a = w.submit(job_doc("often-checkpoints", gpus=2))
    b = w.submit(job_doc("never-checkpoints", gpus=2))
    w.tick(10)
    w.store.record_checkpoint(w.last_attempt(a).id, label="s", progress=None, source="api", now=w.clock.now())
    w.tick(5)
    w.sources["chat"].concurrency = 8.0  # type: ignore[attr-defined]
    w.tick(2)
    (reclaim,) = w.store.reclaims()
    assert reclaim.state == "OPEN" and reclaim.service == "chat"
    victim = w.store.attempt(reclaim.victims[0])
    assert victim.state.value == "STOPPING"
    job = a if victim.job_id == a else b
    return w, job, victim.id


@pytest.mark.parametrize("memory", ["restored", "lost"])
def test_a_crash_during_a_reclaims_grace_never_lends_the_freed_gpus_back_to_research(
    tmp_path: Path, backend: str, memory: str
) -> None:
    w, job, victim = surge_in_grace(tmp_path, backend)
    node = w.store.attempt(victim).node
    w.tick(3)
    # The control plane crashes; the new one starts while the load looks low (the old gateway used
    # to die with it), with its memory restored from the store or (worse) lost.
    if memory == "lost":
        w.store.put_state(MEMORY_KEY, {}, now=w.clock.now())
    w.sources["chat"].concurrency = 0.0  # type: ignore[attr-defined]
    w.restart()
    w.tick()
    # The victim checkpoints and exits within its grace: its GPUs are chat's, not research's.
    w.executor.finish(victim, 143)  # type: ignore[attr-defined]
    for _ in range(int(GRACE)):
        w.tick()
        assert w.step(job).state.value != "RUNNING", "the victim was restarted on the reclaimed GPUs"
        if w.store.replica("chat/1").state.value == "SERVING":
            break
    assert w.store.replica("chat/1").state.value == "SERVING"
    assert w.store.replica("chat/1").node == node
    (reclaim,) = w.store.reclaims()
    assert reclaim.state == "DONE"
    assert w.step(job).state.value == "PREEMPTED"


def test_the_autoscalers_memory_is_saved_and_restored_on_start(tmp_path: Path, backend: str) -> None:
    w = world(tmp_path, backend=backend)
    w.tick(2)
    w.sources["chat"].concurrency = 8.0  # type: ignore[attr-defined]
    w.tick(4)
    w.sources["chat"].concurrency = 0.0  # type: ignore[attr-defined]
    w.tick(8)  # the load is gone, inside the scale-down stabilisation window (20 s)
    before = w.inference.memory
    state = before.scale_states["chat"]
    assert state.desired == 2 and state.history
    saved = w.store.get_state(MEMORY_KEY)
    assert isinstance(saved, dict) and saved["services"]["chat"]["scale"]["desired"] == 2
    w.restart()
    after = w.inference.memory
    restored = after.scale_states["chat"]
    # What the decisions read is back: the last decision and the guards (saved whenever they
    # change), the windows' readings as of the last save (at most MEMORY_SAVE_EVERY_S old).
    assert (restored.desired, restored.needed, restored.down_from, restored.flap_guard) == (
        state.desired,
        state.needed,
        state.down_from,
        state.flap_guard,
    )
    # The history keeps only readings that can still be a window's highest: each restored one is
    # still there or has been outdone by a later reading at least as high.
    assert restored.history and all(
        entry in state.history or any(at >= entry[0] and r >= entry[1] for at, r in state.history)
        for entry in restored.history
    )
    assert state.history[-1][0] - restored.history[-1][0] <= MEMORY_SAVE_EVERY_S
    assert restored.recent and state.recent[-1][0] - restored.recent[-1][0] <= MEMORY_SAVE_EVERY_S
    assert restored.steps and restored.steps[-1] in state.steps
    needed = after.needed_history["chat"]
    assert needed and before.needed_history["chat"][-1][0] - needed[-1][0] <= MEMORY_SAVE_EVERY_S
    # And the stabilisation window goes on where it was: no scale-down before it ends.
    w.tick()
    assert w.inference.status["chat"].decision is not None
    assert w.inference.status["chat"].decision.desired == 2
