"""Walltime: which running attempts have used up their step's `timeout`, and what that means.

Role: the pure rules of the step `timeout` (docs/architecture.md §4.1 and §6.3). The control
loop builds one `WalltimeBudget` per running attempt from what the store keeps (the attempt's
`started_at`, the running times of the step's earlier attempts, the job spec stored with the
job) and asks `overdue` which are past their deadline at `now`; it gives those notice with a
stop reason made by `stop_reason` (kept in the attempt's `stop_reason`), and when such an
attempt ends `timed_out` says so, which `policy.outcomes.classify_exit` turns into FAILED
without a retry (like Slurm's TIMEOUT). `next_deadline` is the loop's share of event time
(`TickReport.next_due`, §4.3).
Neighbours: `control.loop` (the only caller), `policy.outcomes` (the exit decision),
`domain.spec` (where `timeout` is declared: a step's own, else the job's, else
`scheduler.default_step_timeout`).
Must not: read the clock (`now` comes in), do I/O or keep state between calls: every answer
derives from stored values, so it is the same after a control-plane restart.

The rule (a choice, documented in the README)
    A step's `timeout` bounds its *running time summed over all its attempts*: each attempt
    counts from its start to its end (its notice and grace included); time spent waiting in
    the queue (after a preemption, during a retry backoff, before the first start) does not
    count. Slurm's limit is per run: `sbatch --time` sends SIGTERM, then SIGKILL after
    `KillWait`, when one run reaches it, and a requeued job "will be restarted from its
    beginning" (sbatch(1) `--time` and slurm_requeue(3), slurm.schedmd.com man pages), so its
    clock starts again. lowtide does not restart the clock, because a step preempted every 1h50m
    under a 2h limit would otherwise never be stopped, and the point of a walltime is that a
    step cannot hold GPUs for ever. An attempt of a step whose budget is already spent gets
    notice at its first tick.
    When an attempt's running time reaches what is left of the budget, it gets notice (SIGTERM
    and the notice file, reason "timeout: ...") with the job's `grace_seconds`, on top of the
    limit; it should checkpoint and exit non-zero. However it then ends, the step is FAILED
    ("timed out after 2h (walltime limit)"), with no retry; downstream steps are SKIPPED and the
    job FAILED (fail-fast, `policy.dag`). Exceptions: exit 0 still means done (SUCCEEDED), and a
    cancellation wins (CANCELLED). An attempt that ends on its own after its deadline but before
    the loop noticed is timed out too (a retry would be stopped at once), as is one preempted
    after its budget ran out.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

#: The prefix of an attempt's `stop_reason` when its notice was given for its timeout.
TIMEOUT_STOP_PREFIX = "timeout: "
_DEFAULT_GRACE_S = 30.0  # `domain.spec.DEFAULT_GRACE_SECONDS`: the stored spec always has one


@dataclass(frozen=True, slots=True)
class JobTimeouts:
    """The walltime fields of one stored job spec: the job's `timeout`, each step's own, the grace."""

    job_timeout: float | None = None
    step_timeouts: Mapping[str, float] = field(default_factory=dict)
    grace_s: float = _DEFAULT_GRACE_S

    def limit(self, step: str, default_s: float | None) -> float | None:
        """The step's walltime: its own `timeout`, else the job's, else `default_s` (None: no limit)."""
        own = self.step_timeouts.get(step)
        if own is not None:
            return own
        return self.job_timeout if self.job_timeout is not None else default_s


def job_timeouts(spec: Mapping[str, Any]) -> JobTimeouts:
    """Read the walltime fields from a job spec as stored (`JobSpec.to_document()`)."""
    steps = spec.get("steps")
    per_step: dict[str, float] = {}
    if isinstance(steps, list):
        for step in steps:
            if isinstance(step, Mapping) and _positive(step.get("timeout")) is not None:
                per_step[str(step.get("name"))] = float(step["timeout"])
    grace = spec.get("grace_seconds")
    grace_s = _DEFAULT_GRACE_S
    if isinstance(grace, int | float) and not isinstance(grace, bool) and 0 <= grace < math.inf:
        grace_s = float(grace)
    return JobTimeouts(job_timeout=_positive(spec.get("timeout")), step_timeouts=per_step, grace_s=grace_s)


def _positive(value: object) -> float | None:
    if isinstance(value, int | float) and not isinstance(value, bool) and value > 0 and math.isfinite(value):
        return float(value)
    return None


def used_before(attempts: Iterable[tuple[int, float, float | None]], number: int) -> float:
    """Running time of the step's attempts numbered below `number`, from ``(number, started_at,
    ended_at)``; an earlier attempt that has not ended (none should) counts nothing."""
    return sum(
        max(0.0, ended - started) for n, started, ended in attempts if n < number and ended is not None
    )


@dataclass(frozen=True, slots=True)
class WalltimeBudget:
    """One running attempt as the walltime rule sees it."""

    attempt_id: int
    job_id: str
    step: str
    number: int
    started_at: float
    limit_s: float | None  # the step's timeout (None: no limit)
    used_before_s: float = 0.0  # running time of the step's earlier attempts
    grace_s: float = _DEFAULT_GRACE_S  # the notice's grace: the job's grace_seconds

    @property
    def deadline(self) -> float | None:
        """When this attempt has used what is left of the budget (None: no limit)."""
        if self.limit_s is None:
            return None
        return self.started_at + max(0.0, self.limit_s - self.used_before_s)

    def used_at(self, t: float) -> float:
        """Running time of the step at `t`, over all its attempts, this one ending at `t`."""
        return self.used_before_s + max(0.0, t - self.started_at)


def overdue(budgets: Iterable[WalltimeBudget], now: float) -> list[WalltimeBudget]:
    """The attempts past their deadline at `now`, earliest deadline first (ties: attempt id).

    The caller passes running attempts that have had no notice yet; those past their deadline
    are owed notice for their timeout.
    """
    due = [b for b in budgets if (d := b.deadline) is not None and d <= now]
    return sorted(due, key=lambda b: (b.deadline, b.attempt_id))


def next_deadline(budgets: Iterable[WalltimeBudget], now: float) -> float | None:
    """The earliest deadline after `now` (None: none): when a decision changes with nothing new
    observed, for `TickReport.next_due`."""
    return min((d for b in budgets if (d := b.deadline) is not None and d > now), default=None)


def stop_reason(budget: WalltimeBudget) -> str:
    """The stop reason kept with the attempt when its timeout notice is given."""
    assert budget.limit_s is not None
    return (
        f"{TIMEOUT_STOP_PREFIX}walltime limit of {format_duration(budget.limit_s)} reached"
        f"{_across(budget)}; notice given, deadline in {budget.grace_s:g}s"
    )


def stopping_reason(budget: WalltimeBudget) -> str:
    """The step's reason while it stops for its timeout (shown by `lowtide show`)."""
    assert budget.limit_s is not None
    return (
        f"walltime limit of {format_duration(budget.limit_s)} reached{_across(budget)}: "
        f"stopping (grace {budget.grace_s:g}s), then FAILED"
    )


def is_timeout_stop(reason: str | None) -> bool:
    """Was the attempt's notice given for its timeout (its `stop_reason`)?"""
    return reason is not None and reason.startswith(TIMEOUT_STOP_PREFIX)


def timed_out(budget: WalltimeBudget | None, *, ended_at: float, stop_reason: str | None) -> str | None:
    """The verdict for an attempt that ended: "timed out after 2h (walltime limit)" when it was
    stopped for its timeout or its step's budget was spent when it ended, else None. Without a
    budget (nothing known of the limit) only the stop reason counts."""
    if budget is None or budget.limit_s is None:
        return "timed out (walltime limit)" if is_timeout_stop(stop_reason) else None
    if is_timeout_stop(stop_reason) or budget.used_at(ended_at) >= budget.limit_s:
        return f"timed out after {format_duration(budget.limit_s)} (walltime limit{_across(budget)})"
    return None


def _across(budget: WalltimeBudget) -> str:
    return f", summed over {budget.number} attempts" if budget.used_before_s > 0 else ""


def format_duration(seconds: float) -> str:
    """A limit as a person writes it: 45s, 1.5s, 90m → 1h 30m, 2h, 3d 4h."""
    if seconds < 60:
        return f"{seconds:g}s"
    whole = round(seconds)
    parts: Sequence[tuple[int, str]] = (
        (whole // 86400, "d"),
        (whole % 86400 // 3600, "h"),
        (whole % 3600 // 60, "m"),
        (whole % 60, "s"),
    )
    return " ".join(f"{n}{unit}" for n, unit in parts if n)
