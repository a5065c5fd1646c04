"""A window of `ReplicaScrape`s → `ReplicaSignals`: rates, latency quantiles, staleness (pure).

Role: the arithmetic between raw readings and what the autoscaler and the lender look at.
Neighbours: `adapters.vllm_metrics` makes the readings, `adapters.metrics_sources.ScrapeSource`
keeps a window per replica and calls `replica_signals`; `policy.autoscale` / `policy.lending` read
the signals (and `service_totals`). Must not: do I/O, read the clock (time is `now`), or turn an
unknown into 0.

Definitions (W = `window_s`; "ok readings" = readings with ``ok=True``, oldest first):

- **gauges** (running, waiting, KV usage, KV tokens = usage × capacity, waiting by reason, sleep
  state) come from the newest ok reading, even when it is old: the ``stale`` flag says whether to
  trust them.
- **rates** (prompt/generation tokens/s, requests/s, preemptions/s): over the ok readings of the
  last W seconds that know the counter, ``increase / (t_last − t_first)`` where ``increase``
  adds each step's rise and, when a counter drops (a restart), the new value, counted from 0 as
  Prometheus's ``rate`` does (without its extrapolation to the window edges). Fewer than two
  such readings, or no time between them → None.
- **quantiles** (TTFT and e2e p50/p90/p99): the observations made during the window, i.e. the
  bucket counts of the newest histogram minus those of the oldest (restarts, seen as ``_count``
  or ``_sum`` dropping, count from 0; only readings with the newest bucket layout are combined),
  then `histogram_quantile` with Prometheus's semantics: linear interpolation inside the bucket
  holding the rank, the first bucket starting at 0, a rank in the +Inf bucket answering the
  largest finite bound, no observations → None.
- **stale** (first rule that holds, with ``stale_reason`` and ``stale_since``):
  1. no readings at all: "no readings yet" (``stale_since`` None);
  2. the newest reading failed: "scrape failed: …", since the first of the failures in a row;
  3. the newest ok reading is older than `stale_after_s`: since it became that old;
  4. **frozen gauges** (vLLM issues 22545 and 29928: gauges stuck after aborts): requests in
     flight (running + waiting > 0) while the gauges, the token and request counters and the
     histogram counts stayed exactly the same over ok readings spanning at least
     `frozen_after_s`; needs at least one counter known. Since: that span's start +
     `frozen_after_s`. The window passed in must reach that far back (the scrape source keeps
     max(W, frozen_after_s) + stale_after_s).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from operator import attrgetter

from lowtide.domain.metrics import Histogram, ReplicaScrape, ReplicaSignals, ServiceSignals

QUANTILES = (0.5, 0.9, 0.99)
#: How a stale reason of rule 4 (frozen gauges) begins (`policy.inference.hung_reason` reads it).
FROZEN_REASON = "gauges frozen"
_AT = attrgetter("at")


def _prepared(buckets: Sequence[tuple[float, float]]) -> tuple[list[float], list[float]] | None:
    """Bounds and cumulative counts as Prometheus uses them: sorted, equal bounds merged, counts
    forced monotonic; None when no quantile exists (no +Inf bucket, fewer than two buckets, no
    observations)."""
    ordered = buckets if _ascending(buckets) else sorted(buckets)
    bounds: list[float] = []
    counts: list[float] = []
    for bound, count in ordered:
        if bounds and bounds[-1] == bound:
            counts[-1] += count
        else:
            bounds.append(bound)
            counts.append(count)
    highest = -math.inf
    for i, count in enumerate(counts):
        if count > highest:
            highest = count
        elif count < highest:
            counts[i] = highest
    if len(bounds) < 2 or bounds[-1] != math.inf or not counts[-1] > 0:
        return None
    return bounds, counts


def _ascending(buckets: Sequence[tuple[float, float]]) -> bool:
    return all(buckets[i][0] < buckets[i + 1][0] for i in range(len(buckets) - 1))


def _quantile(q: float, bounds: list[float], counts: list[float]) -> float | None:
    if math.isnan(q):
        return None
    if q < 0:
        return -math.inf
    if q > 1:
        return math.inf
    n = len(bounds)
    rank = q * counts[-1]
    b = n - 1
    for i in range(n - 1):
        if counts[i] >= rank:
            b = i
            break
    if b == n - 1:
        return bounds[n - 2]
    if b == 0 and bounds[0] <= 0:
        return bounds[0]
    start, end, count = 0.0, bounds[b], counts[b]
    if b > 0:
        start = bounds[b - 1]
        count -= counts[b - 1]
        rank -= counts[b - 1]
    if count <= 0:
        return None
    return start + (end - start) * (rank / count)


def histogram_quantile(q: float, buckets: Sequence[tuple[float, float]]) -> float | None:
    """The q-quantile of cumulative `buckets` ((upper bound, count), any order), as Prometheus's
    ``histogram_quantile`` computes it; None where Prometheus answers NaN (no +Inf bucket, fewer
    than two buckets, no observations)."""
    if math.isnan(q):
        return None
    if q < 0:
        return -math.inf
    if q > 1:
        return math.inf
    prepared = _prepared(buckets)
    if prepared is None:
        return None
    return _quantile(q, *prepared)


def counter_increase(points: Sequence[tuple[float, float]]) -> float | None:
    """Increase of a cumulative counter over (time, value) points, oldest first; a drop is a
    restart and the new value counts from 0. None with fewer than two points."""
    if len(points) < 2:
        return None
    total = 0.0
    previous = points[0][1]
    for _, value in points[1:]:
        total += value - previous if value >= previous else value
        previous = value
    return total


def counter_rate(points: Sequence[tuple[float, float]]) -> float | None:
    """`counter_increase` per second between the first and last point; None if unknowable."""
    increase = counter_increase(points)
    if increase is None:
        return None
    span = points[-1][0] - points[0][0]
    return increase / span if span > 0 else None


def _bounds(h: Histogram) -> tuple[float, ...]:
    return tuple(bound for bound, _ in h.buckets)


def histogram_increase(hists: Sequence[Histogram]) -> Histogram | None:
    """Observations between the first and last histogram (oldest first); a drop of ``count`` or
    ``sum`` is a restart (counted from 0). Readings whose bucket layout differs from the newest
    are left out. None with fewer than two histograms."""
    n = len(hists)
    if n < 2:
        return None
    layout = _bounds(hists[-1])
    width = len(layout)
    restarts = [
        i for i in range(1, n) if hists[i].count < hists[i - 1].count or hists[i].sum < hists[i - 1].sum
    ]
    ends = [*(i - 1 for i in restarts), n - 1]
    starts = [0, *restarts]
    counts = [0.0] * width
    total_count = 0.0
    total_sum = 0.0
    for start, end in zip(starts, ends, strict=True):
        last = hists[end]
        if len(last.buckets) != width or _bounds(last) != layout:
            continue
        if start == 0:  # the window's first segment: only what happened after the first reading
            first = hists[0]
            if len(first.buckets) != width:
                continue
            for i in range(width):
                counts[i] += last.buckets[i][1] - first.buckets[i][1]
            total_count += last.count - first.count
            total_sum += last.sum - first.sum
        else:  # after a restart, everything the new process counted
            for i in range(width):
                counts[i] += last.buckets[i][1]
            total_count += last.count
            total_sum += last.sum
    return Histogram(buckets=tuple(zip(layout, counts, strict=True)), count=total_count, sum=total_sum)


def _quantiles(h: Histogram | None) -> tuple[float | None, float | None, float | None]:
    prepared = _prepared(h.buckets) if h is not None else None
    if prepared is None:
        return None, None, None
    p50, p90, p99 = (_quantile(q, *prepared) for q in QUANTILES)
    return p50, p90, p99


def _activity(s: ReplicaScrape) -> tuple[object, ...]:
    return (
        s.running,
        s.waiting,
        s.kv_usage,
        s.prompt_tokens_total,
        s.generation_tokens_total,
        s.requests_total,
        s.preemptions_total,
        s.ttft.count if s.ttft is not None else None,
        s.e2e.count if s.e2e is not None else None,
    )


def _staleness(
    readings: Sequence[ReplicaScrape],
    ok: Sequence[ReplicaScrape],
    now: float,
    stale_after_s: float,
    frozen_after_s: float,
) -> tuple[str, float | None] | None:
    """(reason, since) when the data is not to be trusted, else None."""
    if not readings:
        return "no readings yet", None
    newest = readings[-1]
    if not newest.ok:
        first = len(readings) - 1
        while first > 0 and not readings[first - 1].ok:
            first -= 1
        in_row = len(readings) - first
        suffix = f" ({in_row} failures in a row)" if in_row > 1 else ""
        return f"scrape failed: {newest.error or 'unknown error'}{suffix}", readings[first].at
    age = now - newest.at
    if age > stale_after_s:
        return f"no successful scrape for {age:.0f}s (limit {stale_after_s:g}s)", newest.at + stale_after_s
    in_flight = (newest.running or 0.0) + (newest.waiting or 0.0)
    counters = (newest.prompt_tokens_total, newest.generation_tokens_total, newest.requests_total)
    if in_flight > 0 and any(c is not None for c in counters):
        current = _activity(newest)
        k = len(ok) - 1
        while k > 0 and _activity(ok[k - 1]) == current:
            k -= 1
        held = newest.at - ok[k].at
        if held >= frozen_after_s:
            return (
                f"{FROZEN_REASON}: {newest.running:g} running, {newest.waiting or 0:g} waiting, and no "
                f"counter moved for {held:.0f}s (vLLM gauges can stick after aborts)"
                if newest.running is not None
                else f"{FROZEN_REASON}: {in_flight:g} requests in flight and no counter moved "
                f"for {held:.0f}s",
                ok[k].at + frozen_after_s,
            )
    return None


def replica_signals(
    replica: str,
    window: Sequence[ReplicaScrape],
    *,
    now: float,
    window_s: float,
    stale_after_s: float,
    frozen_after_s: float,
) -> ReplicaSignals:
    """What `window` (this replica's kept readings, any order) says at `now`; see the module doc."""
    readings = sorted(window, key=_AT)
    ok = [s for s in readings if s.ok]
    stale = _staleness(readings, ok, now, stale_after_s, frozen_after_s)
    reason, since = stale if stale is not None else ("", None)
    if not ok:
        return ReplicaSignals(replica=replica, at=now, stale=True, stale_reason=reason, stale_since=since)
    newest = ok[-1]
    start = now - window_s
    recent = [s for s in ok if s.at >= start]

    def rate(attr: str) -> float | None:
        points = [(s.at, v) for s in recent if (v := getattr(s, attr)) is not None]
        return counter_rate(points)

    ttft = histogram_increase([s.ttft for s in recent if s.ttft is not None])
    e2e = histogram_increase([s.e2e for s in recent if s.e2e is not None])
    ttft_q = _quantiles(ttft)
    e2e_q = _quantiles(e2e)
    kv_tokens = (
        newest.kv_usage * newest.kv_capacity_tokens
        if newest.kv_usage is not None and newest.kv_capacity_tokens is not None
        else None
    )
    return ReplicaSignals(
        replica=replica,
        at=now,
        running=newest.running,
        waiting=newest.waiting,
        kv_usage=newest.kv_usage,
        kv_tokens_used=kv_tokens,
        prompt_tokens_per_s=rate("prompt_tokens_total"),
        generation_tokens_per_s=rate("generation_tokens_total"),
        requests_per_s=rate("requests_total"),
        ttft_p50_s=ttft_q[0],
        ttft_p90_s=ttft_q[1],
        ttft_p99_s=ttft_q[2],
        e2e_p50_s=e2e_q[0],
        e2e_p90_s=e2e_q[1],
        e2e_p99_s=e2e_q[2],
        waiting_capacity=newest.waiting_capacity,
        waiting_deferred=newest.waiting_deferred,
        preemptions_per_s=rate("preemptions_total"),
        sleep_state=newest.sleep_state,
        stale=stale is not None,
        stale_reason=reason,
        stale_since=since,
    )


def stale_signals(replica: str, now: float, reason: str, since: float | None = None) -> ReplicaSignals:
    """Nothing known about `replica`, for `reason` (a source that failed as a whole)."""
    return ReplicaSignals(replica=replica, at=now, stale=True, stale_reason=reason, stale_since=since)


@dataclass(frozen=True, slots=True)
class ServiceTotals:
    """A service's load in a few numbers, for the autoscaler and the lender.

    Sums use every replica's value (stale ones included: their last known value) and are None
    when any replica's value is unknown, or there are no replicas: a partial sum would look like
    less load. The TTFT maximum is over the replicas that know it (a replica that served nothing
    in the window adds no latency) and None when none does. `stale` counts stale replicas; with
    `source_error` every replica is stale."""

    replicas: int
    stale: int
    running: float | None
    waiting: float | None
    generation_tokens_per_s: float | None
    ttft_p90_s_max: float | None

    @property
    def concurrency(self) -> float | None:
        """running + waiting over the service (None if either is unknown)."""
        if self.running is None or self.waiting is None:
            return None
        return self.running + self.waiting


def _sum(values: Sequence[float | None]) -> float | None:
    if not values or any(v is None for v in values):
        return None
    return math.fsum(v for v in values if v is not None)


def service_totals(signals: ServiceSignals) -> ServiceTotals:
    """Sums and maxima over `signals.replicas`; see `ServiceTotals` for how unknowns count."""
    reps = signals.replicas
    ttfts = [r.ttft_p90_s for r in reps if r.ttft_p90_s is not None]
    return ServiceTotals(
        replicas=len(reps),
        stale=sum(1 for r in reps if r.stale),
        running=_sum([r.running for r in reps]),
        waiting=_sum([r.waiting for r in reps]),
        generation_tokens_per_s=_sum([r.generation_tokens_per_s for r in reps]),
        ttft_p90_s_max=max(ttfts) if ttfts else None,
    )
