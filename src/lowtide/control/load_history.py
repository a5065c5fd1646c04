"""A service's recent load, kept by the inference controller for the dashboard's charts: one
sample (requests running, requests waiting, replicas desired) at most every `every_s` seconds,
the last `keep_s` seconds of them (docs/architecture.md §12).

In memory only: a restarted control plane starts a new history (the store keeps decisions and
events, not every reading); Prometheus keeps the long one when metrics come from it.
Neighbours: `control.inference` adds a sample after each decision; `api.services` shows them.
Must not: read the clock (`at` is the signals' time), decide anything, or grow without bound.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from lowtide.domain.metrics import ReplicaSignals, ServiceSignals


@dataclass(frozen=True, slots=True)
class LoadSample:
    at: float
    running: float
    waiting: float
    desired: int | None


class LoadHistory:
    def __init__(self, every_s: float = 5.0, keep_s: float = 3600.0) -> None:
        self.every_s = every_s
        self.keep_s = keep_s
        self._samples: deque[LoadSample] = deque()
        # The last replicas' signals summed (the very tuple, kept) and their sums (None: all
        # stale): a metrics source may hand back the same tuple while its figures stay the same.
        self._summed: tuple[tuple[ReplicaSignals, ...], tuple[float, float] | None] | None = None

    def add(self, signals: ServiceSignals | None, desired: int | None) -> None:
        """Keep a sample of `signals` (none: nothing read, nothing kept) unless the last one is
        younger than `every_s`; drop those older than `keep_s` before the newest."""
        if signals is None or signals.source_error is not None:
            return
        sums = self._sums(signals.replicas)
        if sums is None:  # stale readings say nothing about the load
            return
        if self._samples and signals.at - self._samples[-1].at < self.every_s:
            return
        running, waiting = sums
        self._samples.append(LoadSample(signals.at, running, waiting, desired))
        while self._samples and self._samples[0].at < signals.at - self.keep_s:
            self._samples.popleft()

    def _sums(self, replicas: tuple[ReplicaSignals, ...]) -> tuple[float, float] | None:
        """Σ running and Σ waiting over the fresh replicas (None: no fresh replica)."""
        last = self._summed
        if last is not None and last[0] is replicas:
            return last[1]
        fresh = [r for r in replicas if not r.stale]
        sums = (sum(r.running or 0.0 for r in fresh), sum(r.waiting or 0.0 for r in fresh)) if fresh else None
        self._summed = (replicas, sums)
        return sums

    def samples(self) -> list[LoadSample]:
        return list(self._samples)
