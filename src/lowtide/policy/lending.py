"""The lending envelope: how many of the pool's GPUs research may hold now (pure).

Role: from each service's scale decision, the age of its load data, its recent growth and its
forecast, work out how many GPUs inference claims and how many may be lent, when lent GPUs must
start coming back, and why. Neighbours: `policy.autoscale` (the decisions), `policy.forecast` (the
weekly profile the caller turns into `forecast_needed`), `policy.inference` (calls `envelope`
each tick and gives research at most `lendable_gpus`), `policy.replicas` (starts what `claims`
asks for). Must not: read the clock (`now` is passed), do I/O, mutate its inputs, or lend on
data it cannot trust. Service stability comes first: when in doubt, lend less.

Per service s (g = gpus_per_replica, lead = `LendingPolicy.reclaim_lead_s` = tick + grace +
unpark, computed by the caller):

    claim_s   = desired replicas, or max(desired, min_safe_replicas) when s is stale too long
    growth_s  = min(max_replicas, ⌈needed + growth_per_s × lead⌉ + headroom) − claim_s, ≥ 0
                (growth_per_s = slope of s's *needed replicas*, replicas/s, over the recent past;
                None or ≤ 0: no growth reserve)
    fcast_s   = min(max_replicas, forecast_needed + headroom) − claim_s, ≥ 0   (mode forecast only;
                forecast_needed = the profile's peak of needed replicas within the lead time
                over the hours that climb, `WeeklyProfile.ramp_within`)
    reserve_s = max(growth_s, fcast_s)

    inference_claim = Σ_s (claim_s + reserve_s) × g
    lendable        = max(0, pool − inference_claim)

Modes (`LendingPolicy.mode`):
- `continuous`: the formula above; `return_by` None.
- `forecast`: the formula with the forecast term; when it reserves replicas for a predicted ramp at
  time T (`forecast_at`; unknown: now), `return_by` = T − lead: the GPUs for it come back first.
- `window`: the formula, but only inside a local-time window (`windows`, `timezone`; overlapping or
  adjacent windows merge; DST is handled by `zoneinfo`; a window edge inside a skipped hour moves
  to after the jump). New lending stops at close − lead, when every lent GPU's notice must go out:
  `return_by` = close − lead, and lendable is 0 from then on. Outside a window lendable = 0 and
  `return_by` = now. Windows covering the whole day never close (`return_by` None).

Fail safe (per service; `signals_age_s` None means it never had data and counts as stale too long):
- age > `stale_after_s`: lend nothing NEW: lendable = min(lendable, currently_lent_gpus);
- age > `stale_reclaim_after_s`: its claim is at least `min_safe_replicas` replicas, so lendable
  may fall below what is lent now: that difference is a reclaim.
GPUs lent above `lendable_gpus` are due back now, whatever the mode.

GPUs under a sleeping replica are lendable but not empty (`gpu_shares`): the step placed there
learns the memory left to it (`GpuShare`, LOWTIDE_GPU_MEMORY_LIMIT_GIB in its contract).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import date, datetime, timedelta
from functools import lru_cache
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from lowtide.domain.gpus import GpuRef, Node
from lowtide.domain.services import LendingPolicy, ServiceSpec, TimeWindow
from lowtide.policy.autoscale import ScaleDecision, reachable_within

_EPS = 1e-9
_DAY_MINUTES = 1440


@dataclass(frozen=True, slots=True)
class ServiceLendingInput:
    """One service, as the envelope sees it."""

    spec: ServiceSpec
    decision: ScaleDecision
    held_gpus: int  # GPUs its replicas hold now (any GPU-holding state)
    signals_age_s: float | None  # age of the freshest trustworthy data; None: never had data
    growth_per_s: float | None = None  # slope of needed replicas (replicas/s); None: unknown
    forecast_needed: int | None = None  # needed replicas the forecast predicts within the lead time
    forecast_at: float | None = None  # when that peak is predicted (None: take it as now)


@dataclass(frozen=True, slots=True)
class Envelope:
    lendable_gpus: int  # GPUs research may hold now (0 ≤ lendable ≤ pool)
    inference_claim_gpus: int  # GPUs inference keeps: claimed replicas + reserve (may exceed pool)
    claims: Mapping[str, int]  # replicas each service must keep
    lending_open: bool  # new lending allowed now (inside a window, no fail safe)
    return_by: float | None  # when lent GPUs must start coming back (see the module docstring)
    reasons: tuple[str, ...]
    fail_safe: str | None  # why lending is held back for lack of trustworthy data, if it is
    reserve_gpus: int = 0  # the part of the claim reserved for growth and the forecast


def envelope(
    *,
    now: float,
    pool_gpus: int,
    services: Sequence[ServiceLendingInput],
    policy: LendingPolicy,
    currently_lent_gpus: int,
) -> Envelope:
    """How many GPUs may be lent at `now`; see the module docstring for the rules."""
    if pool_gpus < 0 or currently_lent_gpus < 0:
        raise ValueError(f"GPU counts cannot be negative (pool {pool_gpus}, lent {currently_lent_gpus})")
    names = [s.spec.name for s in services]
    if len(set(names)) != len(names):
        raise ValueError(f"a service appears twice: {names}")
    lead = policy.reclaim_lead_s if policy.reclaim_lead_s > 0 else 0.0
    reasons: list[str] = []
    fail: list[str] = []
    claims: dict[str, int] = {}
    claim_terms: list[str] = []
    reserve_terms: list[str] = []
    claim_gpus = reserve_gpus = 0
    ramp_return: float | None = None

    for s in services:
        spec, d, name = s.spec, s.decision, s.spec.name
        g = max(spec.gpus_per_replica, 0)
        claim = d.desired
        age = s.signals_age_s
        if not _within(age, policy.stale_after_s):
            what = "no trustworthy metrics yet" if age is None else f"metrics {_num(age)}s old"
            if not _within(age, policy.stale_reclaim_after_s):
                safe = min(max(spec.min_safe_replicas, 0), spec.max_replicas)
                limit = f"> {_num(policy.stale_reclaim_after_s)}s" if age is not None else "never fresh"
                fail.append(f"{name}: {what} ({limit}): no new lending, keeps at least {safe} replicas")
                claim = max(claim, safe)
            else:
                fail.append(f"{name}: {what} (> {_num(policy.stale_after_s)}s): no new lending")
        claims[name] = claim
        claim_gpus += claim * g
        claim_terms.append(f"{name} {claim}×{g}")
        if s.held_gpus > claim * g:
            reasons.append(
                f"{name} holds {s.held_gpus} GPUs, claims {claim * g}: the rest frees as replicas park"
            )

        extra, why = _growth_reserve(s, claim, lead)
        source = "growth"
        if policy.mode == "forecast" and s.forecast_needed is not None:
            target = min(spec.max_replicas, max(s.forecast_needed, 0) + max(spec.headroom_replicas, 0))
            f_extra = max(0, target - claim)
            if f_extra > 0:
                at = now if s.forecast_at is None else s.forecast_at
                back = at - lead
                ramp_return = back if ramp_return is None else min(ramp_return, back)
                if f_extra >= extra:
                    extra, source = f_extra, "forecast"
                    due = "now" if back <= now else f"in {_num(back - now)}s"
                    why = (
                        f"{name}: the forecast needs {s.forecast_needed} replicas "
                        f"(+{spec.headroom_replicas} headroom) in {_num(at - now)}s: reserve {f_extra}, "
                        f"return due {due} (lead {_num(lead)}s)"
                    )
        if extra > 0:
            reserve_gpus += extra * g
            reserve_terms.append(f"reserve {name} {extra}×{g} ({source})")
            reasons.append(why)

    claim_total = claim_gpus + reserve_gpus
    computed = pool_gpus - claim_total
    lendable = max(0, computed)
    arithmetic = " − ".join([f"pool {pool_gpus}", *claim_terms, *reserve_terms])
    result = f"= {computed} → 0 lendable" if computed < 0 else f"= {computed} lendable"
    reasons.insert(0, f"{arithmetic} {result}")

    lending_open = True
    return_by: float | None = None
    if policy.mode == "window":
        lendable, lending_open, return_by, line, problem = _window(now, policy, lead, lendable)
        reasons.append(line)
        if problem:
            fail.append(problem)
    elif policy.mode == "forecast":
        return_by = ramp_return

    if fail:
        lending_open = False
        before = lendable
        lendable = min(lendable, currently_lent_gpus)
        if before != lendable:
            reasons.append(
                f"fail safe: lendable {before} → {lendable} (no more than the {currently_lent_gpus} lent now)"
            )
        reasons.extend(f"fail safe: {f}" for f in fail)
    if lendable < currently_lent_gpus:
        reasons.append(
            f"{currently_lent_gpus - lendable} of {currently_lent_gpus} lent GPUs must come back now"
        )

    return Envelope(
        lendable_gpus=lendable,
        inference_claim_gpus=claim_total,
        claims=claims,
        lending_open=lending_open,
        return_by=return_by,
        reasons=tuple(reasons),
        fail_safe="; ".join(fail) or None,
        reserve_gpus=reserve_gpus,
    )


def _within(age: float | None, limit: float) -> bool:
    """Age known and not past `limit` (NaN is not within anything)."""
    return age is not None and age <= limit


def _growth_reserve(s: ServiceLendingInput, claim: int, lead: float) -> tuple[int, str]:
    """Replicas above the claim that the recent growth reaches within the lead time, and why."""
    rate = s.growth_per_s
    if rate is None or not math.isfinite(rate) or rate <= 0 or lead <= 0:
        return 0, ""
    spec = s.spec
    projected = s.decision.needed + rate * lead
    capped = ""
    cap = reachable_within(spec.autoscale, s.decision.needed, lead)
    if cap is not None and projected > cap:
        # The autoscaler cannot climb faster than its step cap: reserving beyond what it can
        # reach within the lead would preempt research for replicas it will not start.
        projected, capped = float(cap), f" (step cap: at most {cap})"
    target = min(spec.max_replicas, max(math.ceil(projected - _EPS), 0) + max(spec.headroom_replicas, 0))
    extra = max(0, target - claim)
    why = (
        f"{spec.name}: needed {s.decision.needed} growing {_num(rate)} replicas/s → {_num(projected)} "
        f"in {_num(lead)}s{capped}: reserve {extra}"
    )
    return extra, why


# -- windows ------------------------------------------------------------------------------------


def _window(
    now: float, policy: LendingPolicy, lead: float, lendable: int
) -> tuple[int, bool, float | None, str, str | None]:
    """(lendable, open, return_by, reason, problem) for mode `window`."""
    try:
        zone = ZoneInfo(policy.timezone)
    except (ZoneInfoNotFoundError, ValueError):
        bad_zone = f"unknown time zone {policy.timezone!r}: no lending windows"
        return 0, False, now, f"outside the lending windows ({bad_zone})", bad_zone
    windows = [w for w in policy.windows if _valid(w)]
    problem: str | None = None
    if len(windows) != len(policy.windows):
        problem = "a lending window outside 00:00..24:00: ignored"
    if _covers_day(windows):
        return lendable, True, None, "the lending windows cover the whole day: lending never closes", problem
    intervals = window_intervals(now, windows, zone)
    for start, end in intervals:
        if start <= now < end:
            stop = end - lead
            if now < stop:
                return (
                    lendable,
                    True,
                    stop,
                    f"inside a lending window until {_local(end, zone)}: new lending stops and notice "
                    f"goes out at {_local(stop, zone)} (lead {_num(lead)}s)",
                    problem,
                )
            return (
                0,
                False,
                stop,
                f"lending window closes at {_local(end, zone)}: everything comes back "
                f"(notice from {_local(stop, zone)}, lead {_num(lead)}s)",
                problem,
            )
    upcoming = [start for start, _ in intervals if start > now]
    nxt = f" (next opens {_local(min(upcoming), zone)})" if upcoming else ""
    return 0, False, now, f"outside the lending windows{nxt}", problem


def window_intervals(now: float, windows: Sequence[TimeWindow], zone: ZoneInfo) -> list[tuple[float, float]]:
    """The windows' occurrences from two local days before `now` to two after, as merged
    [start, end) epoch-second intervals, in order."""
    today = datetime.fromtimestamp(now, zone).date()
    raw: list[tuple[float, float]] = []
    for offset in range(-2, 3):
        day = today + timedelta(days=offset)
        for w in windows:
            if w.start_minute == w.end_minute:
                continue  # empty (the config rejects it)
            start = _at(day, w.start_minute, zone)
            end_day = day if w.end_minute > w.start_minute else day + timedelta(days=1)
            end = _at(end_day, w.end_minute, zone)
            if end > start:
                raw.append((start, end))
    raw.sort()
    merged: list[tuple[float, float]] = []
    for start, end in raw:
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def _at(day: date, minute: int, zone: ZoneInfo) -> float:
    """Epoch seconds of local wall time `minute` after midnight of `day` (fold 0: a time in a
    skipped hour lands after the jump, an ambiguous one on its first occurrence)."""
    wall = datetime(day.year, day.month, day.day, tzinfo=zone) + timedelta(minutes=minute)
    return wall.timestamp()


def _valid(w: TimeWindow) -> bool:
    return 0 <= w.start_minute < _DAY_MINUTES and 0 <= w.end_minute <= _DAY_MINUTES


def _covers_day(windows: Sequence[TimeWindow]) -> bool:
    minutes: set[int] = set()
    for w in windows:
        s, e = w.start_minute, w.end_minute
        if s < e:
            minutes.update(range(s, e))
        elif s > e:
            minutes.update(range(s, _DAY_MINUTES))
            minutes.update(range(e))
    return len(minutes) == _DAY_MINUTES


def _local(ts: float, zone: ZoneInfo) -> str:
    local = datetime.fromtimestamp(ts, zone)
    return local.strftime("%a %Y-%m-%d %H:%M:%S %Z" if local.second else "%a %Y-%m-%d %H:%M %Z")


def _num(x: float) -> str:
    if math.isfinite(x) and x == round(x) and abs(x) < 1e15:
        return str(round(x))
    if abs(x) < 1:
        return f"{x:.3g}"
    return f"{x:.2f}".rstrip("0").rstrip(".")


def next_lending_edge(now: float, policy: LendingPolicy) -> float | None:
    """The next instant after `now` at which the window mode's envelope changes on its own: a
    window opens, or new lending stops at close − lead (None: not window mode, or no edge)."""
    if policy.mode != "window":
        return None
    try:
        zone = ZoneInfo(policy.timezone)
    except (ZoneInfoNotFoundError, ValueError):
        return None
    windows = [w for w in policy.windows if _valid(w)]
    if not windows or _covers_day(windows):
        return None
    edges = [
        t
        for start, end in window_intervals(now, windows, zone)
        for t in (start, end - policy.reclaim_lead_s, end)
        if t > now + _EPS
    ]
    return min(edges, default=None)


# -- GPUs lent under a sleeping replica ----------------------------------------------------------


@dataclass(frozen=True, slots=True)
class GpuShare:
    """A GPU research may use although a sleeping replica still holds memory on it: at sleep
    level 1 and 2 alike, vLLM keeps what its CuMemAllocator does not manage (CUDA graphs, NCCL
    buffers, the CUDA context) on the GPU (vllm/device_allocator/cumem.py; docs/vllm.md)."""

    reserved_gib: float  # held by the sleeping replica(s) on this GPU
    limit_gib: float | None  # what a step may use: GPU memory − reserved (None: memory unknown)


def gpu_shares(
    nodes: Sequence[Node], sleeping: Iterable[tuple[str, Sequence[int], float]]
) -> dict[GpuRef, GpuShare]:
    """The GPUs under sleeping replicas, given as (node, GPU indices, residual GiB per GPU):
    what each still holds and the memory left for a step (`Node.gpu_memory_gib` − residual, at
    least 0; None where the node's GPU memory is unknown). docs/architecture.md §4.2."""
    memory = {n.name: n.gpu_memory_gib for n in nodes}
    entries = list(sleeping)
    # The common case: no GPU under two sleeping replicas. Then each GPU's share is its replica's
    # own, and each replica's shares are made once (`_replica_shares`) and only copied here.
    out: dict[GpuRef, GpuShare] = {}
    count = 0
    for node, indices, residual in entries:
        if residual > 0:
            mine = tuple(indices)
            count += len(mine)
            out.update(_replica_shares(node, mine, residual, memory.get(node)))
    if len(out) == count:
        return out
    refs = {n.name: dict(zip(n.gpus, n.refs(), strict=True)) for n in nodes}  # built once per node
    reserved: dict[tuple[str, int], float] = {}
    for node, indices, residual in entries:
        if residual <= 0:
            continue
        for i in indices:
            key = (node, i)
            reserved[key] = reserved.get(key, 0.0) + residual
    out = {}
    made: dict[tuple[float, float | None], GpuShare] = {}  # most GPUs hold the same share
    for (node, i), held in reserved.items():
        total = memory.get(node)
        share = made.get((held, total))
        if share is None:
            share = made[held, total] = GpuShare(held, None if total is None else max(0.0, total - held))
        ref = refs.get(node, {}).get(i)
        out[ref if ref is not None else GpuRef(node, i)] = share
    return out


@lru_cache(maxsize=4096)
def _replica_shares(
    node: str, indices: tuple[int, ...], residual: float, total: float | None
) -> dict[GpuRef, GpuShare]:
    """One sleeping replica's GPUs and the share each holds (`gpu_shares` with that replica
    alone); the same replica sleeps on the same GPUs tick after tick. Never changed: it is kept
    (a plain dict only so that `dict.update` copies it with the hashes it holds, instead of
    hashing every `GpuRef` again, as it must for any other mapping)."""
    share = GpuShare(residual, None if total is None else max(0.0, total - residual))
    return {GpuRef(node, i): share for i in indices}


def step_gpu_share(shares: Mapping[GpuRef, GpuShare], node: str, gpus: Iterable[int]) -> GpuShare | None:
    """The share a step placed on `gpus` gets: the tightest over its GPUs (most reserved,
    smallest limit); None when none of them is under a sleeping replica."""
    mine = [s for i in gpus if (s := shares.get(GpuRef(node, i))) is not None]
    if not mine:
        return None
    limits = [s.limit_gib for s in mine if s.limit_gib is not None]
    unknown = len(limits) < len(mine)
    return GpuShare(max(s.reserved_gib for s in mine), None if unknown else min(limits))
