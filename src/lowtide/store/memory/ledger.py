"""The in-memory GPU ledger: every interval in which a GPU is held, and by whom.

The same invariant as `store.ledger`: each managed GPU has exactly one open interval; handing a
GPU over closes one interval and opens the next at the same instant, so GPU-seconds add up to
capacity × time; that instant is never before the open interval began (`pool_rules.handover_at`,
a clamp is logged), so no interval is negative and one GPU's intervals never overlap. Which
intervals `ensure` opens and closes, which GPUs may be booked, the handover instant and the
per-kind sum are `policy.pool_rules`, shared with the SQL ledger. Indexes: the open interval of
each GPU and the GPUs of each holder, so booking and releasing cost O(GPUs moved); the full
history (`intervals`) is read only by reports.
Neighbours: `base.MemoryBase` owns one; its parts book and release through it. Must not: decide
who gets a GPU, raise anything but GpuBusy, or change anything before its checks have passed.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

from lowtide.control.records import GpuBusy
from lowtide.domain.gpus import GpuRef
from lowtide.policy.accounting import IDLE
from lowtide.policy.pool_rules import bookable, handover_at, meets_period, reconcile_gpus

log = logging.getLogger("lowtide")


@dataclass(slots=True, eq=False)
class Interval:
    gpu: GpuRef
    holder_kind: str
    holder_id: str | None
    job_id: str | None
    team: str | None
    started_at: float
    ended_at: float | None = None


class Ledger:
    def __init__(self) -> None:
        self.intervals: list[Interval] = []  # every interval, in the order opened
        # The open interval of each GPU, by (node, index): a tuple hashes in C, a `GpuRef` (a
        # frozen dataclass) in Python, and every booking looks a GPU up several times.
        self.open: dict[tuple[str, int], Interval] = {}
        self._held: dict[tuple[str, str], list[GpuRef]] = {}
        self._sorted: list[tuple[str, int]] | None = []

    def ensure(self, managed: Iterable[GpuRef], now: float) -> None:
        close, missing = reconcile_gpus({iv.gpu: iv.holder_kind for iv in self.open.values()}, managed)
        for gpu in close:
            closing = self.open.pop((gpu.node, gpu.index))
            closing.ended_at = _clamped(gpu, now, closing.started_at)
        for gpu in missing:
            self._open(Interval(gpu, IDLE, None, None, None, now))
        if close or missing:
            self._sorted = None

    def check_bookable(self, gpus: Sequence[GpuRef]) -> None:
        """Raise GpuBusy unless every GPU is idle now (and none is asked for twice)."""
        seen: set[tuple[str, int]] = set()
        for gpu in gpus:
            key = (gpu.node, gpu.index)
            current = self.open.get(key)
            if key in seen or not bookable(None if current is None else current.holder_kind):
                raise GpuBusy(f"GPU {gpu} is not idle")
            seen.add(key)

    def hold(
        self,
        gpus: Sequence[GpuRef],
        *,
        kind: str,
        holder_id: str,
        job_id: str | None,
        team: str | None,
        now: float,
    ) -> None:
        """Hand idle GPUs to a holder. Raises GpuBusy (changing nothing) if one is not idle."""
        self.check_bookable(gpus)
        for gpu in gpus:
            at = self._close(gpu, now)
            self._open(Interval(gpu, kind, holder_id, job_id, team, at))
        if gpus:
            self._held.setdefault((kind, holder_id), []).extend(gpus)

    def release(self, *, kind: str, holder_id: str, now: float) -> list[GpuRef]:
        """Close the holder's open intervals and open idle ones for its GPUs; the GPUs freed."""
        gpus = self._held.pop((kind, holder_id), [])
        for gpu in gpus:
            at = self._close(gpu, now)
            self._open(Interval(gpu, IDLE, None, None, None, at))
        return gpus

    def last_handover(self) -> float | None:
        """The latest start of an open interval (when a GPU last changed hands), or None."""
        return max((iv.started_at for iv in self.open.values()), default=None)

    def current(self) -> Iterator[Interval]:
        """The open interval of every GPU, by node and index (as `GpuRef`s sort)."""
        if self._sorted is None:
            self._sorted = sorted(self.open)
        return (self.open[g] for g in self._sorted)

    def meeting(self, start: float, end: float) -> Iterator[Interval]:
        """Every interval that meets [start, end) (`pool_rules.meets_period`)."""
        return (iv for iv in self.intervals if meets_period(iv.started_at, iv.ended_at, start, end))

    def _close(self, gpu: GpuRef, now: float) -> float:
        """Close the GPU's open interval at `now` (clamped to its start); the instant used."""
        current = self.open[(gpu.node, gpu.index)]
        current.ended_at = at = _clamped(gpu, now, current.started_at)
        return at

    def _open(self, interval: Interval) -> None:
        gpu = interval.gpu
        key = (gpu.node, gpu.index)
        if key not in self.open:
            self._sorted = None
        self.open[key] = interval
        self.intervals.append(interval)


def _clamped(gpu: GpuRef, now: float, started_at: float) -> float:
    at = handover_at(now, started_at)
    if at != now:  # a few ms: an exit stamped after the tick's time; more: a clock gone back
        log.log(
            logging.WARNING if at - now > 1.0 else logging.INFO,
            "ledger: GPU %s changes hands %.3f s before its interval began; clamped to its start",
            gpu,
            at - now,
        )
    return at
