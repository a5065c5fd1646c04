"""Team fair share: which team has had the least of the pool lately, so it goes first.

Role: turn a snapshot's running steps and decayed usage history into one number per team, the
*dominant share*, that `policy.scheduler.decide` uses to order steps of the same priority class
(lower share goes first); and `fold_usage`, how a finished attempt adds to its team's history.
Neighbours: `policy.snapshot` (input), `policy.scheduler` (caller), the stores (`fold_usage` when
an attempt ends, `decay` when they build a snapshot).
Must not: read the clock, the store or anything mutable outside its own ledger; time is `now`.

Usage decays exponentially with half-life ``h``: a GPU-second used ``a`` seconds ago counts
``2^(-a/h)``. For one team::

    held   = GPUs the team's running steps hold now
    usage  = team_usage[team]                            (history, already decayed to now)
           + Σ over its running steps of g·h/ln2·(1 − 2^(−(now − started_at)/h))
    P      = GPUs in the pool (all nodes' GPUs)
    C      = P · h / ln2         (decayed capacity: the whole pool busy forever until now)

    share  = max(held / P, usage / C) / weight(team)

Both terms are fractions of the pool: ``held / P`` is what the team holds right now and
``usage / C`` what it held on average over the recent past (1.0 = the whole pool, always). Taking
the larger means a team cannot jump the queue by having just finished a long run, nor by having
a quiet history while holding much of the pool now. A weight of 2 entitles a team to twice the
share of a weight-1 team. ``team_usage`` must exclude the attempts still running: those are
counted here, up to ``now``, so counting them in history too would charge them twice.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from lowtide.policy.snapshot import Snapshot

LN2 = math.log(2)
DEFAULT_HALF_LIFE_S = 6 * 3600.0


def decayed_integral(gpus: float, start: float, end: float, now: float, half_life_s: float) -> float:
    """GPU-seconds of `gpus` held over [start, end], each second weighted 2^(-(now - t)/h).

    Closed form of ∫ g·2^(-(now-t)/h) dt = g·h/ln2·(2^(-(now-end)/h) − 2^(-(now-start)/h)).
    An empty or reversed interval counts zero.
    """
    if end <= start:
        return 0.0
    h = half_life_s
    return gpus * h / LN2 * (math.exp2(-(now - end) / h) - math.exp2(-(now - start) / h))


def decay(value: float, since: float, now: float, half_life_s: float) -> float:
    """An accumulator decayed to `since`, carried forward to `now`.

    A `now` before `since` (clock skew between writers) leaves the value as it is: decay never
    inflates usage.
    """
    elapsed = max(0.0, now - since)
    return value * math.exp2(-elapsed / half_life_s)


def fold_usage(
    prior: tuple[float, float] | None,
    *,
    gpus: int,
    start: float,
    end: float,
    now: float,
    half_life_s: float,
) -> tuple[float, float] | None:
    """A team's usage accumulator after a finished attempt is added: ``(value, as_of=now)``.

    `prior` is the accumulator as stored, ``(value, as_of)``, or None if the team has none yet:
    it is decayed to `now` and the attempt's decayed integral over [start, end] is added. An
    attempt that held no GPU adds nothing and creates no accumulator (None: leave it as it is).
    """
    if gpus <= 0:
        return None
    add = decayed_integral(gpus, start, end, now, half_life_s)
    if prior is None:
        return add, now
    value, as_of = prior
    return decay(value, as_of, now, half_life_s) + add, now


def dominant_share(
    *, held_gpus: float, decayed_usage: float, pool_gpus: int, half_life_s: float, weight: float = 1.0
) -> float:
    """max(held / P, usage / (P·h/ln2)) / weight: see the module docstring.

    An empty pool gives every team 0, so ordering falls back to submit time.
    """
    if pool_gpus <= 0:
        return 0.0
    capacity = pool_gpus * half_life_s / LN2
    return max(held_gpus / pool_gpus, decayed_usage / capacity) / weight


@dataclass(frozen=True)
class FairSharePolicy:
    """How fair share is measured: the decay half-life and each team's weight (default 1.0)."""

    half_life_s: float = DEFAULT_HALF_LIFE_S
    team_weights: Mapping[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.half_life_s > 0:
            raise ValueError(f"half_life_s must be positive, got {self.half_life_s}")
        for team, weight in self.team_weights.items():
            if not weight > 0:
                raise ValueError(f"weight of team {team!r} must be positive, got {weight}")

    def weight(self, team: str) -> float:
        return self.team_weights.get(team, 1.0)


class TeamShares:
    """Each team's dominant share, updated as one decision hands out GPUs.

    A working ledger for a single `decide` call: `add_held` raises a team's `held` term when a
    step of that team is placed, so the next pick sees the new share and teams interleave.
    Placing a step adds nothing to `usage`: a step started at `now` has used nothing yet.
    """

    __slots__ = ("_capacity", "_held", "_pool", "_usage", "_weights")

    def __init__(
        self,
        *,
        held: Mapping[str, float],
        usage: Mapping[str, float],
        pool_gpus: int,
        policy: FairSharePolicy,
    ) -> None:
        self._held = dict(held)
        self._usage = dict(usage)
        self._pool = pool_gpus
        self._capacity = pool_gpus * policy.half_life_s / LN2
        self._weights = dict(policy.team_weights)

    @classmethod
    def from_snapshot(cls, snapshot: Snapshot, policy: FairSharePolicy) -> TeamShares:
        now, h = snapshot.now, policy.half_life_s
        held: dict[str, float] = {}
        usage: dict[str, float] = dict(snapshot.team_usage)
        for step in snapshot.running:  # once per running step per decision: `decayed_integral` inlined
            g = len(step.gpus)
            team = step.team
            held[team] = held.get(team, 0.0) + g
            since = step.started_at if step.started_at <= now else now
            # decayed_integral(g, since, now, now, h), whose first term is 2^0 = 1.0
            used = 0.0 if now <= since else g * h / LN2 * (1.0 - math.exp2(-(now - since) / h))
            usage[team] = usage.get(team, 0.0) + used
        return cls(held=held, usage=usage, pool_gpus=snapshot.total_gpus, policy=policy)

    def share(self, team: str) -> float:
        # Inlined `dominant_share` (same formula): called once per queued step per decision.
        if self._pool <= 0:
            return 0.0
        held = self._held.get(team, 0.0) / self._pool
        used = self._usage.get(team, 0.0) / self._capacity
        return (held if held > used else used) / self._weights.get(team, 1.0)

    def add_held(self, team: str, gpus: int) -> None:
        self._held[team] = self._held.get(team, 0.0) + gpus

    def held(self, team: str) -> float:
        return self._held.get(team, 0.0)

    def usage(self, team: str) -> float:
        return self._usage.get(team, 0.0)
