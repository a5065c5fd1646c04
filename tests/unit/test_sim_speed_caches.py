"""What the simulator's speed-ups remember must never differ from what they stand for.

`policy.placement._usable` remembers the usable GPUs per node by the identity of its arguments;
`sim.ports.SimExecutor` keeps the GPUs its steps hold, the earliest exit and the earliest time a
checkpoint can be due instead of recomputing them every tick. Each is checked here against the
plain computation, over sequences where the remembered value would go stale if it were kept
too long.
"""

from __future__ import annotations

import math

from builders import running, snapshot
from hypothesis import given, settings
from hypothesis import strategies as st

from lowtide.control.executor_port import LaunchRequest
from lowtide.policy.placement import FreeGpus
from lowtide.sim.ports import SimExecutor, StepBehaviour


def test_free_gpus_follow_a_new_unavailable_set_on_the_same_nodes() -> None:
    first = snapshot(nodes={"n1": 4, "n2": 2}, unavailable=["n1:3"])
    again = snapshot(nodes={"n1": 4, "n2": 2}, unavailable=["n1:0", "n2:1"])
    # the same nodes object, a different unavailable set: nothing remembered may leak across
    second = type(first)(now=again.now, nodes=first.nodes, unavailable=again.unavailable)
    assert FreeGpus.from_snapshot(first).free_indices("n1") == (0, 1, 2)
    assert FreeGpus.from_snapshot(second).free_indices("n1") == (1, 2, 3)
    assert FreeGpus.from_snapshot(second).free_indices("n2") == (0,)
    assert FreeGpus.from_snapshot(first).free_indices("n2") == (0, 1)
    busy = type(first)(
        now=first.now, nodes=first.nodes, unavailable=first.unavailable, running=(running("n1", [1]),)
    )
    assert FreeGpus.from_snapshot(busy).free_indices("n1") == (0, 2)
    assert FreeGpus.from_snapshot(busy).capacity("n1") == 3


def _request(attempt_id: int, gpus: int) -> LaunchRequest:
    return LaunchRequest(
        attempt_id=attempt_id,
        job_id=f"job-{attempt_id}",
        step="train",
        attempt=1,
        node="n1",
        gpus=tuple(range(gpus)),
        command=("simulated",),
        image=None,
        env={},
        work_dir="w",
        log_path="l",
        notice_path="n",
    )


def _plain_due(ex: SimExecutor, now: float) -> set[int]:
    """Attempts that can have a checkpoint to report at `now`, computed from scratch."""
    return {
        aid
        for aid, att in ex.running.items()
        if (att.notice_ckpt is not None and att.notice_ckpt[0] <= now) or att.next_checkpoint_at() <= now
    }


_ops = st.lists(
    st.tuples(st.sampled_from(["launch", "notice", "advance"]), st.integers(1, 4), st.floats(1.0, 900.0)),
    min_size=1,
    max_size=40,
)


@settings(max_examples=60, deadline=None)
@given(_ops)
def test_sim_executor_bookkeeping_matches_a_recount(ops: list[tuple[str, int, float]]) -> None:
    ex = SimExecutor()
    now = 0.0
    next_id = 1
    for kind, n, dt in ops:
        if kind == "launch":
            ex.behaviours[f"job-{next_id}"] = StepBehaviour(
                work_s=600.0 * n, restart_s=30.0, checkpoint_every_s=120.0, checkpoint_write_s=10.0
            )
            ex.launch(_request(next_id, n), now)
            next_id += 1
        elif kind == "notice" and ex.running:
            aid = sorted(ex.running)[n % len(ex.running)]
            ex.notify_stop(aid, now + dt / 10, now)
        else:
            now += dt
        due_before = _plain_due(ex, now)
        reported = {aid for aid, _, _ in ex.checkpoints_due(now)}
        assert reported <= due_before  # nothing reported that could not be due
        earliest = min((a.first_report_at() for a in ex.running.values()), default=math.inf)
        assert ex._quiet_until <= earliest  # the remembered "nothing due before" hides nothing
        for exit_ in ex.poll(now).exits:
            ex.ack_exit(exit_.attempt_id)
        assert ex.held_gpus == sum(len(a.request.gpus) for a in ex.running.values())
        expected_next = min((a.exit_at for a in ex.running.values()), default=None)
        assert ex.next_event() == expected_next
        # the remembered "nothing due before" never hides a due checkpoint
        earliest = min((a.first_report_at() for a in ex.running.values()), default=math.inf)
        assert ex._quiet_until <= earliest
