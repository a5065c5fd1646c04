"""How many replicas each inference service should have: the autoscaler (pure).

Role: turn a service's load (`ServiceSignals`), what it has (`ReplicaSupply`) and what was decided
before (`ScaleState`) into a `ScaleDecision`. Neighbours: `policy.inference` calls
`decide_scale` once per service per tick (`control.inference` keeps the returned state between
ticks); `policy.lending` reads
the decision (desired replicas, unknown); `policy.replicas` starts and parks replicas to match.
Must not: read the clock (`now` is passed), do I/O, mutate its inputs, or turn unknown load
into "no load".

The formula (every threshold is per service, in `ServiceSpec.autoscale` = `AutoscaleTargets`;
defaults in brackets). Only *fresh* replicas count: a stale replica's numbers are not trusted.

    concurrency  = ⌈ Σ (running + waiting)        / concurrency_per_replica [32]          ⌉
    kv           = ⌈ Σ kv_usage                    / kv_usage [0.8]                        ⌉
                   (Σ of per-replica usage 0..1 = "replicas' worth" of KV cache)
    tokens       = ⌈ Σ generation_tokens_per_s     / (generation_tokens_per_s_per_replica
                                                       [None: signal off] × token_utilization [0.8]) ⌉
    raw          = max of the signals that are known (a signal whose target is None is off; a
                   signal is known when every fresh replica reports it: a partial sum would
                   look like less load)
    base         = serving + starting + waking − headroom_replicas   (the supply the load sees;
                   starting and waking replicas count, so slow cold starts never cascade)
    band         : |raw − base| ≤ tolerance [0.1] × base  →  rec = base, else rec = raw
    TTFT guard   : max p90 TTFT of the fresh replicas > ttft_p90_slo_s [None: off]
                   →  rec ≥ max(supply, serving + 1) − headroom (one replica more than serve
                   now, unless one is already starting or waking), and no scale-down
    stale guard  : any replica stale → no scale-down (part of the load is not seen)
    history      : (t, rec) of every tick within max(up window, stabilisation window)
    up           = max rec over [now − scale_up_window_s [30 s], now]          (fast: includes now)
    down         = max rec over [now − scale_down_stabilization_s [300 s], now] (HPA-style)
    needed       = up if up > previous needed; else down if down < previous needed (and no guard
                   forbids it); else previous needed — then clamped to [min_replicas, max_replicas]
    desired      = min(max_replicas, needed + headroom_replicas)
    flap guard   : a replica's load grows faster than linearly when one is removed (batching), so
                   n → n−1 can look right and be wrong (n−1 asks for n again). When a scale-down
                   from n is undone within 2 stabilisation windows, needed stays ≥ n until the load
                   (Σ signal / target, unrounded) is below what it was at that scale-down × (1 −
                   scale_down_tolerance [0.1]); the simulator found n ↔ n−1 preempting research
                   every five minutes without it.

Unknown data (no fresh replica reports any signal, or the source failed): `unknown=True`,
`recommendation=None`, needed and desired stay where they were (never a scale-down on unknown
data) and a hold entry (t, previous needed) goes into the history, so that when data returns a
scale-down still waits a whole stabilisation window. The first decision takes what exists
(supply − headroom, clamped) as the previous needed and records it the same way: after a
control-plane restart nothing is scaled down before a stabilisation window has passed.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from lowtide.domain.metrics import ReplicaSignals, ServiceSignals
from lowtide.domain.services import ServiceSpec

#: Float noise allowance for ceilings and the tolerance band (0.8 × 3 / 0.8 is not exactly 3).
_EPS = 1e-9


@dataclass(frozen=True, slots=True)
class ReplicaSupply:
    """A service's replicas that serve now or soon (draining, parking, parked, failed do not count)."""

    serving: int
    starting: int = 0
    waking: int = 0

    def __post_init__(self) -> None:
        if min(self.serving, self.starting, self.waking) < 0:
            raise ValueError(f"replica counts cannot be negative: {self}")

    @property
    def total(self) -> int:
        return self.serving + self.starting + self.waking


@dataclass(frozen=True, slots=True)
class ScaleState:
    """What the autoscaler remembers between ticks for one service; the caller keeps it.

    `history`: (time, recommendation) of the ticks within the longest window, oldest first (on
    unknown ticks, and at the first decision, the held needed count). `desired`/`needed`: the last
    decision's values, None before the first decision."""

    service: str = ""
    history: tuple[tuple[float, int], ...] = ()
    desired: int | None = None
    needed: int | None = None
    #: The last scale-down: (from needed, the load in replicas' worth then, when).
    down_from: tuple[int, float, float] | None = None
    #: After a scale-down had to be undone: (level, load then) — no going below `level` again
    #: until the load is below that load × (1 − scale_down_tolerance).
    flap_guard: tuple[int, float] | None = None


@dataclass(frozen=True, slots=True)
class ScaleDecision:
    desired: int  # replicas to have: needed + headroom, within [min_replicas, max_replicas]
    needed: int  # what the load needs, after the windows and the clamp
    recommendation: int | None  # this tick's recommendation (after band and guards); None: unknown
    per_signal: Mapping[str, int | None]  # "concurrency" | "kv" | "tokens" → replicas (None: unknown)
    guard: str | None  # what kept the replicas up (TTFT over SLO, stale replicas), if anything
    unknown: bool  # no fresh data: desired held
    reason: str  # human-readable: every term of the decision
    state: ScaleState  # keep it for the next tick


def initial_state(spec: ServiceSpec) -> ScaleState:
    """The state before a service's first decision (the first decision starts from its supply)."""
    return ScaleState(service=spec.name)


def decide_scale(
    spec: ServiceSpec, signals: ServiceSignals, supply: ReplicaSupply, state: ScaleState, now: float
) -> ScaleDecision:
    """Desired replicas for `spec` at `now`; see the module docstring for the formula."""
    if state.service and state.service != spec.name:
        raise ValueError(f"scale state of {state.service!r} passed for service {spec.name!r}")
    t = spec.autoscale
    notes: list[str] = []
    lo, hi = spec.min_replicas, spec.max_replicas
    if lo > hi:  # config rejects this; be safe rather than crash the tick: keep the larger
        notes.append(f"min_replicas {lo} > max_replicas {hi}: using {lo}")
        hi = lo
    headroom = max(spec.headroom_replicas, 0)
    base = max(supply.total - headroom, 0)

    first = state.needed is None
    prev_needed = _clamp(base, lo, hi) if state.needed is None else _clamp(state.needed, lo, hi)
    keep = max(t.scale_up_window_s, t.scale_down_stabilization_s)
    history = tuple((at, r) for at, r in state.history if at >= now - keep)

    fresh: list[ReplicaSignals] = [] if signals.source_error else [r for r in signals.replicas if not r.stale]
    n_stale = len(signals.replicas) - len(fresh)
    per_signal, parts = _signals(spec, fresh)
    known = [v for v in per_signal.values() if v is not None]

    if not known:
        history = (*history, (now, prev_needed))
        needed = prev_needed
        desired = _desired(needed, headroom, hi)
        why = _why_unknown(signals, fresh, n_stale, per_signal)
        reason = "; ".join([*notes, f"{why} → hold {desired}"])
        return ScaleDecision(
            desired=desired,
            needed=needed,
            recommendation=None,
            per_signal=per_signal,
            guard=None,
            unknown=True,
            reason=reason,
            state=ScaleState(spec.name, history, desired, needed, state.down_from, state.flap_guard),
        )

    raw = max(known)
    rec = raw
    if base > 0 and abs(raw - base) <= t.tolerance * base + _EPS and raw != base:
        parts.append(f"{raw} within ±{_num(t.tolerance * 100)} % of {base}: keep {base}")
        rec = base
    guards: list[str] = []
    ttfts = [r.ttft_p90_s for r in fresh if r.ttft_p90_s is not None and not math.isnan(r.ttft_p90_s)]
    if t.ttft_p90_slo_s is not None and ttfts and max(ttfts) > t.ttft_p90_slo_s:
        floor = max(supply.total, supply.serving + 1) - headroom
        guards.append(
            f"TTFT p90 {_num(max(ttfts))}s over SLO {_num(t.ttft_p90_slo_s)}s: "
            f"at least {floor + headroom} replicas, no scale-down"
        )
        rec = max(rec, floor)
    if n_stale:
        guards.append(f"{n_stale} of {len(signals.replicas)} replicas stale: no scale-down")
    history = (*history, (now, rec))
    if first:  # nothing goes down before a whole stabilisation window has been seen
        history = ((now, prev_needed), *history)

    up = max(r for at, r in history if at >= now - t.scale_up_window_s)
    down = max(r for at, r in history if at >= now - t.scale_down_stabilization_s)
    worth = _worth(spec, fresh)
    flap_guard = state.flap_guard
    if flap_guard is not None and (
        prev_needed > flap_guard[0] or worth < flap_guard[1] * (1 - t.scale_down_tolerance)
    ):
        flap_guard = None  # grown past it, or the load fell clearly below what misled us
    if up > prev_needed:
        needed = up
    elif down < prev_needed and not guards:
        needed = down
        if flap_guard is not None and needed < flap_guard[0] <= prev_needed:
            guards.append(
                f"flap guard: {flap_guard[0]} replicas until the load is below "
                f"{_num(flap_guard[1] * (1 - t.scale_down_tolerance))} replicas' worth "
                f"(now {_num(worth)}; going below it was undone before)"
            )
            needed = flap_guard[0]
    else:
        needed = prev_needed
    needed = _clamp(needed, lo, hi)
    desired = _desired(needed, headroom, hi)
    down_from = state.down_from
    if needed < prev_needed:
        down_from = (prev_needed, worth, now)
    elif needed > prev_needed and down_from is not None:
        level, load_then, at = down_from
        if needed >= level and now - at <= 2 * t.scale_down_stabilization_s:
            flap_guard = (level, load_then)  # the scale-down was a mistake: do not repeat it
        down_from = None

    window = _num(t.scale_down_stabilization_s)
    if needed > prev_needed:
        move = "scale-up"
    elif needed < prev_needed:
        move = f"scale-down to the highest of the last {window}s"
    elif rec < prev_needed and lo < prev_needed:
        move = "no scale-down: guard" if guards else f"scale-down waits: {down} within the last {window}s"
    else:
        move = "steady"
    if needed == hi and max(up, rec) > hi:
        move += f", capped at max_replicas {hi}"
    elif needed == lo and rec < lo:
        move += f", min_replicas {lo}"
    tail = f"→ {needed} ({move})"
    if desired != needed:
        tail += f"; desired {desired} (+{desired - needed} headroom)"
    reason = "; ".join([*notes, *parts, *guards, tail])
    return ScaleDecision(
        desired=desired,
        needed=needed,
        recommendation=rec,
        per_signal=per_signal,
        guard="; ".join(guards) or None,
        unknown=False,
        reason=reason,
        state=ScaleState(spec.name, history, desired, needed, down_from, flap_guard),
    )


# -- the signals --------------------------------------------------------------------------------


def _signals(spec: ServiceSpec, fresh: Sequence[ReplicaSignals]) -> tuple[dict[str, int | None], list[str]]:
    """Replicas each configured signal asks for (None: unknown), with a phrase each."""
    t = spec.autoscale
    per: dict[str, int | None] = {}
    parts: list[str] = []
    if t.concurrency_per_replica is not None:
        total = _total(fresh, lambda r: r.concurrency)
        if total is None:
            per["concurrency"] = None
            parts.append("concurrency unknown")
        else:
            n = _ceil(total / t.concurrency_per_replica)
            per["concurrency"] = n
            target = _num(t.concurrency_per_replica)
            parts.append(f"concurrency {_num(total)} over target {target}/replica → {n}")
    if t.kv_usage is not None:
        total = _total(fresh, lambda r: r.kv_usage)
        if total is None:
            per["kv"] = None
            parts.append("KV unknown")
        else:
            worth = total / t.kv_usage
            n = _ceil(worth)
            per["kv"] = n
            target = _num(t.kv_usage)
            parts.append(
                f"KV {_num(total)} over target {target}/replica = {_num(worth)} replicas' worth → {n}"
            )
    if t.generation_tokens_per_s_per_replica is not None:
        total = _total(fresh, lambda r: r.generation_tokens_per_s)
        per_replica = t.generation_tokens_per_s_per_replica * t.token_utilization
        if total is None:
            per["tokens"] = None
            parts.append("tokens unknown")
        else:
            n = _ceil(total / per_replica)
            per["tokens"] = n
            parts.append(
                f"tokens {_num(total)}/s over {_num(per_replica)}/s per replica "
                f"({_num(t.generation_tokens_per_s_per_replica)} × {_num(t.token_utilization)}) → {n}"
            )
    return per, parts


def _worth(spec: ServiceSpec, fresh: Sequence[ReplicaSignals]) -> float:
    """The load in replicas' worth, unrounded: the largest known Σ signal / target (0: none)."""
    t = spec.autoscale
    values = []
    if t.concurrency_per_replica is not None:
        total = _total(fresh, lambda r: r.concurrency)
        if total is not None:
            values.append(total / t.concurrency_per_replica)
    if t.kv_usage is not None:
        total = _total(fresh, lambda r: r.kv_usage)
        if total is not None:
            values.append(total / t.kv_usage)
    if t.generation_tokens_per_s_per_replica is not None:
        total = _total(fresh, lambda r: r.generation_tokens_per_s)
        if total is not None:
            values.append(total / (t.generation_tokens_per_s_per_replica * t.token_utilization))
    return max(values, default=0.0)


def _total(fresh: Sequence[ReplicaSignals], get: Callable[[ReplicaSignals], float | None]) -> float | None:
    """Σ over the fresh replicas, None when there are none or any of them does not know it."""
    values = [get(r) for r in fresh]
    if not values or any(v is None or not math.isfinite(v) for v in values):
        return None
    return math.fsum(max(v, 0.0) for v in values if v is not None)


def _why_unknown(
    signals: ServiceSignals, fresh: Sequence[ReplicaSignals], n_stale: int, per: Mapping[str, int | None]
) -> str:
    if signals.source_error:
        return f"no fresh data (source failed: {signals.source_error})"
    if not signals.replicas:
        return "no fresh data (no replica reports)"
    if not fresh:
        reasons = sorted({r.stale_reason for r in signals.replicas if r.stale_reason})
        detail = f": {'; '.join(reasons)}" if reasons else ""
        return f"no fresh data ({n_stale} of {n_stale} replicas stale{detail})"
    if not per:
        return "no signal configured"
    return "no fresh data (no signal known on every fresh replica)"


# -- arithmetic ---------------------------------------------------------------------------------


def _ceil(x: float) -> int:
    return max(math.ceil(x - _EPS), 0)


def _clamp(n: int, lo: int, hi: int) -> int:
    return min(max(n, lo), hi)


def _desired(needed: int, headroom: int, hi: int) -> int:
    return min(hi, needed + headroom)


def _num(x: float) -> str:
    """A number for a reason: 210, 3.1, 2.48, 0.0167."""
    if math.isfinite(x) and x == round(x) and abs(x) < 1e15:
        return str(round(x))
    if abs(x) < 1:
        return f"{x:.3g}"
    return f"{x:.2f}".rstrip("0").rstrip(".")


def next_decision_at(decision: ScaleDecision, spec: ServiceSpec) -> float | None:
    """When this decision could change if the load stayed as it is now (None: not on its own).

    Only a waiting scale-down changes with time alone: `needed` drops once every history entry
    at or above it has left the stabilisation window. The caller (the loop, the simulator) need
    not decide again before then unless the load or the supply changes.
    """
    rec = decision.recommendation
    if rec is None or decision.guard is not None or rec >= decision.needed:
        return None
    if decision.needed <= spec.min_replicas:
        return None
    holding = [at for at, r in decision.state.history if r >= decision.needed]
    if not holding:
        return None
    return max(holding) + spec.autoscale.scale_down_stabilization_s
