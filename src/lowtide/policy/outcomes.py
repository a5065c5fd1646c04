"""What an attempt's end means for its step: success, retry with backoff, failure, or requeue.

The contract (docs/architecture.md §6.2): exit 0 means "done", never "interrupted". A non-zero exit of a step
that was not asked to stop is a failure: retried with exponential backoff while retries remain,
FAILED after. A step that was asked to stop because its job was cancelled ends CANCELLED whatever
its exit. A preempted step (given notice to return GPUs) that exits non-zero or is killed is
PREEMPTED: requeued without backoff and without using a retry (after `max_preemptions`
preemptions, if the step sets one, it FAILS instead). An attempt lost while the control
plane was down is requeued without using a retry (it is not the step's fault). An attempt that
ends before its notice went out ended on its own: its exit code decides (`noticed=False`).
A step whose walltime is spent (`timed_out`, the verdict of `policy.walltime`) and that did not
exit 0 is FAILED with that verdict, without a retry or a requeue (like Slurm's TIMEOUT); only a
cancellation comes before it.
An attempt that ended because the machinery failed (`infrastructure` set: a container engine's
exit 125, docs/architecture.md §6.4) is not the step's failure: requeued after a backoff without
using a retry, like a temporary launch failure (unless the step was being stopped anyway).
A launch that failed because of the infrastructure (`classify_launch_failure(infrastructure=...)`:
lowtide's storage, permissions, disk, runtime engine, secret files or store; docs/architecture.md
§4.4) is requeued the same way, with a backoff that grows with the step's consecutive
infrastructure failures (capped by `RetryPolicy.backoff_max_s`); a step-caused launch failure
(its command cannot run) uses a retry like a non-zero exit.
What the executor says about the end (`reason`, domain.exit_reasons) refines this: EVICTED or
DELETED without notice is the platform's doing (requeued without a retry, like a lost process);
UNSCHEDULABLE is the machinery's (requeued after a backoff, like an infrastructure failure);
OOM_KILLED and IMAGE_PULL are the step's own failures (a retry each), with words that say so.
Neighbours: the loop classifies each exit with `classify_exit` and hands the decision to the store.
Must not: read the clock (`now` is passed in) or touch the store.
"""

from __future__ import annotations

from dataclasses import dataclass

from lowtide.domain.exit_reasons import ExitReason
from lowtide.domain.states import AttemptState, StepState


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    backoff_s: float = 10.0
    backoff_max_s: float = 600.0

    def delay(self, retry_number: int) -> float:
        """Backoff before retry number `retry_number` (1-based): base × 2^(n-1), capped."""
        return float(min(self.backoff_max_s, self.backoff_s * 2 ** max(0, retry_number - 1)))


@dataclass(frozen=True, slots=True)
class ExitDecision:
    attempt_state: AttemptState
    step_state: StepState
    retries_used: int
    eligible_at: float
    message: str
    requeued: bool = False
    preempted: bool = False


def describe_exit(
    exit_code: int | None,
    signal: int | None,
    killed_at_deadline: bool,
    reason: ExitReason | None = None,
    detail: str | None = None,
) -> str:
    if killed_at_deadline:
        return "killed at the grace deadline"
    worded = _REASON_WORDS.get(reason) if reason is not None else None
    if worded is not None:
        code = f", exit code {exit_code}" if exit_code is not None else ""
        return f"{worded}{code}" + (f": {detail}" if detail else "")
    if exit_code is not None:
        return f"exit code {exit_code}"
    if signal is not None:
        return f"killed by signal {signal}"
    return "exit status unknown"


_REASON_WORDS = {
    ExitReason.OOM_KILLED: "killed for using too much memory (OOMKilled)",
    ExitReason.EVICTED: "evicted by its node",
    ExitReason.DELETED: "its pod was deleted outside lowtide",
    ExitReason.UNSCHEDULABLE: "could not be scheduled",
    ExitReason.IMAGE_PULL: "its image could not be pulled",
}

#: Ends that are the platform's doing, not the step's: requeued without using a retry.
_PLATFORM_INTERRUPTIONS = frozenset({ExitReason.EVICTED, ExitReason.DELETED})


def classify_exit(
    *,
    step_state: StepState,
    noticed: bool = False,
    exit_code: int | None,
    signal: int | None,
    killed_at_deadline: bool,
    retries_used: int,
    max_retries: int,
    now: float,
    retry: RetryPolicy,
    preemptions: int = 0,
    max_preemptions: int | None = None,
    infrastructure: str | None = None,
    timed_out: str | None = None,
    reason: ExitReason | None = None,
    detail: str | None = None,
) -> ExitDecision:
    how = describe_exit(exit_code, signal, killed_at_deadline, reason, detail)
    if reason == ExitReason.UNSCHEDULABLE and infrastructure is None:
        infrastructure = "scheduling: " + (detail or "no node could take it")
    if infrastructure is not None and step_state == StepState.RUNNING and not killed_at_deadline:
        return ExitDecision(
            AttemptState.FAILED,
            StepState.READY,
            retries_used,
            now + retry.delay(1),
            f"{infrastructure}; not the step's failure, will try again",
            requeued=True,
        )
    if reason in _PLATFORM_INTERRUPTIONS and step_state == StepState.RUNNING and timed_out is None:
        return ExitDecision(
            AttemptState.INTERRUPTED,
            StepState.READY,
            retries_used,
            0.0,
            f"{how}; not the step's failure, requeued",
            requeued=True,
        )
    ok = exit_code == 0 and not killed_at_deadline
    # Without notice the process ended on its own: its exit says succeeded or failed, even if a
    # stop was requested in the meantime. Only an exit after notice counts as "interrupted".
    stopped = AttemptState.INTERRUPTED if noticed else AttemptState.FAILED

    if step_state == StepState.CANCELLING:
        attempt = AttemptState.SUCCEEDED if ok else stopped
        return ExitDecision(attempt, StepState.CANCELLED, retries_used, 0.0, f"cancelled ({how})")

    if timed_out is not None and not ok:  # walltime spent (`policy.walltime`): no retry, no requeue
        preempted = step_state == StepState.PREEMPTING and noticed
        return ExitDecision(
            stopped, StepState.FAILED, retries_used, 0.0, f"{timed_out}; {how}", preempted=preempted
        )

    if step_state == StepState.PREEMPTING and noticed:
        if ok:
            return ExitDecision(
                AttemptState.SUCCEEDED,
                StepState.SUCCEEDED,
                retries_used,
                0.0,
                "finished after notice (exit 0 means done)",
            )
        if max_preemptions is not None and preemptions + 1 > max_preemptions:
            return ExitDecision(
                AttemptState.INTERRUPTED,
                StepState.FAILED,
                retries_used,
                0.0,
                f"preempted ({how}) {preemptions + 1} times; max_preemptions is {max_preemptions}",
                preempted=True,
            )
        return ExitDecision(
            AttemptState.INTERRUPTED,
            StepState.PREEMPTED,
            retries_used,
            0.0,
            f"preempted ({how}); requeued",
            requeued=True,
            preempted=True,
        )

    if ok:
        return ExitDecision(AttemptState.SUCCEEDED, StepState.SUCCEEDED, retries_used, 0.0, "succeeded")
    if retries_used < max_retries:
        n = retries_used + 1
        delay = retry.delay(n)
        return ExitDecision(
            AttemptState.FAILED,
            StepState.READY,
            n,
            now + delay,
            f"failed ({how}); retry {n} of {max_retries} in {delay:g}s",
            requeued=True,
        )
    suffix = f" after {max_retries} retries" if max_retries else ""
    return ExitDecision(AttemptState.FAILED, StepState.FAILED, retries_used, 0.0, f"failed ({how}){suffix}")


def classify_lost(*, step_state: StepState, retries_used: int, timed_out: str | None = None) -> ExitDecision:
    """The process vanished while the control plane was down: requeue without using a retry
    (unless it had been given notice for its timeout: then FAILED, `policy.walltime`)."""
    if step_state == StepState.CANCELLING:
        return ExitDecision(
            AttemptState.LOST, StepState.CANCELLED, retries_used, 0.0, "cancelled (process lost)"
        )
    if timed_out is not None:
        return ExitDecision(
            AttemptState.LOST, StepState.FAILED, retries_used, 0.0, f"{timed_out}; process lost"
        )
    if step_state == StepState.PREEMPTING:
        return ExitDecision(
            AttemptState.LOST,
            StepState.PREEMPTED,
            retries_used,
            0.0,
            "process lost during preemption; requeued",
            requeued=True,
            preempted=True,
        )
    return ExitDecision(
        AttemptState.LOST,
        StepState.READY,
        retries_used,
        0.0,
        "process lost while the control plane was down; requeued",
        requeued=True,
    )


def classify_launch_failure(
    *,
    step_state: StepState,
    message: str,
    temporary: bool,
    retries_used: int,
    max_retries: int,
    now: float,
    retry: RetryPolicy,
    infrastructure: str | None = None,
    infrastructure_failures: int = 0,
) -> ExitDecision:
    """The executor could not start the attempt. An infrastructure failure (`infrastructure`
    names what failed; `infrastructure_failures` counts the step's earlier ones in a row) is
    requeued after a growing backoff without using a retry; a temporary failure (resources
    exhausted) after a backoff without using a retry; a permanent one (command not found) is a
    failure like a non-zero exit."""
    if step_state == StepState.RUNNING and infrastructure is not None:
        delay = retry.delay(infrastructure_failures + 1)
        return ExitDecision(
            AttemptState.FAILED,
            StepState.READY,
            retries_used,
            now + delay,
            f"launch failed ({infrastructure}: {message}); not the step's failure, "
            f"will try again in {delay:g}s",
            requeued=True,
        )
    if step_state == StepState.RUNNING and temporary:
        return ExitDecision(
            AttemptState.FAILED,
            StepState.READY,
            retries_used,
            now + retry.delay(1),
            f"launch failed ({message}); will try again",
            requeued=True,
        )
    decision = classify_exit(
        step_state=step_state,
        exit_code=None,
        signal=None,
        killed_at_deadline=False,
        retries_used=retries_used,
        max_retries=max_retries,
        now=now,
        retry=retry,
    )
    return ExitDecision(
        decision.attempt_state,
        decision.step_state,
        decision.retries_used,
        decision.eligible_at,
        decision.message.replace("exit status unknown", f"launch failed: {message}"),
        requeued=decision.requeued,
        preempted=decision.preempted,
    )
