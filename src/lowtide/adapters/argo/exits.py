"""How an Argo node's outcome becomes the executor port's `AttemptExit`: a pure mapping.

Role: `attempt_exit` turns what `node_status.classify_node` read from a finished Pod node into
the exit the loop records, given what lowtide itself did to the pod (gave notice, deleted it,
killed it at its deadline). The loop (`policy.outcomes.classify_exit`) decides what each exit
means for the step; this only names it truthfully.
Neighbours: `node_status` (the outcome), `executor` (calls it), `control.executor_port`.
Must not: talk to Kubernetes, read the clock (`now` comes in) or decide retries.

| outcome | exit |
|---|---|
| succeeded (with the shim's `completed` marker) | code 0, EXITED |
| failed in `main` (or unnamed) | its code, EXITED (None when Argo recorded none) |
| failed in `init`/`wait`/another container | INFRASTRUCTURE (`argo: the <c> container failed`) |
| interrupted (the interrupted code) after lowtide's notice | that code, EXITED (after notice: preempted) |
| interrupted without lowtide's notice | DELETED: someone else's SIGTERM (a drain, a delete) |
| Succeeded without the marker (the hazard) | no code, no reason: never success |
| oom_killed | OOM_KILLED with its code (137) |
| evicted, rejected | EVICTED |
| pod_deleted after lowtide deleted the pod | signal SIGTERM (15), SIGNALLED |
| pod_deleted otherwise | DELETED |
| unschedulable / image_pull | UNSCHEDULABLE / IMAGE_PULL |
| skipped (or anything else terminal) | INFRASTRUCTURE |

Argo's words (the node's message) are kept as `detail`.
"""

from __future__ import annotations

from lowtide.adapters.argo.node_status import NodeOutcome, Outcome
from lowtide.control.executor_port import AttemptExit, ExitReason

__all__ = ["HAZARD_DETAIL", "attempt_exit"]

SIGTERM = 15
HAZARD_DETAIL = "Succeeded without the shim's completion marker (exit 0 after SIGTERM?): not counted as done"


def attempt_exit(
    attempt_id: int,
    o: NodeOutcome,
    *,
    noticed: bool,
    deleted: bool,
    killed: bool,
    now: float,
) -> AttemptExit:
    """The exit of attempt `attempt_id` whose node ended as `o` (module docstring). `noticed`:
    lowtide gave it notice; `deleted`: lowtide deleted its pod; `killed`: lowtide force-deleted it
    past its deadline. Raises ValueError for an outcome that is not terminal."""
    if not o.terminal:
        raise ValueError(f"node outcome {o.outcome.value} is not an end")
    words = o.message or None
    if o.outcome == Outcome.SUCCEEDED:
        return AttemptExit(attempt_id, 0, None, now, reason=ExitReason.EXITED)
    if o.outcome == Outcome.INTERRUPTED and o.hazard:
        return AttemptExit(attempt_id, None, None, now, detail=HAZARD_DETAIL)
    if o.outcome == Outcome.FAILED and o.container not in (None, "main"):
        infra = f"argo: the {o.container} container failed"
        return AttemptExit(
            attempt_id,
            o.exit_code,
            None,
            now,
            infrastructure=infra,
            reason=ExitReason.INFRASTRUCTURE,
            detail=words,
        )
    if o.outcome == Outcome.FAILED or (o.outcome == Outcome.INTERRUPTED and noticed):
        return AttemptExit(
            attempt_id,
            o.exit_code,
            None,
            now,
            killed_at_deadline=killed,
            reason=ExitReason.EXITED,
            detail=words,
        )
    if o.outcome == Outcome.INTERRUPTED:
        return AttemptExit(attempt_id, o.exit_code, None, now, reason=ExitReason.DELETED, detail=words)
    if o.outcome == Outcome.POD_DELETED and deleted:
        return AttemptExit(
            attempt_id,
            None,
            SIGTERM,
            now,
            killed_at_deadline=killed,
            reason=ExitReason.SIGNALLED,
            detail=words,
        )
    simple = {
        Outcome.OOM_KILLED: ExitReason.OOM_KILLED,
        Outcome.EVICTED: ExitReason.EVICTED,
        Outcome.REJECTED: ExitReason.EVICTED,
        Outcome.POD_DELETED: ExitReason.DELETED,
        Outcome.UNSCHEDULABLE: ExitReason.UNSCHEDULABLE,
        Outcome.IMAGE_PULL: ExitReason.IMAGE_PULL,
    }
    reason = simple.get(o.outcome)
    if reason is not None:
        code = o.exit_code if reason in (ExitReason.OOM_KILLED, ExitReason.EVICTED) else None
        return AttemptExit(attempt_id, code, None, now, reason=reason, detail=words)
    return AttemptExit(
        attempt_id,
        None,
        None,
        now,
        infrastructure="argo",
        reason=ExitReason.INFRASTRUCTURE,
        detail=f"Argo node {o.outcome.value}: {o.message}",
    )
