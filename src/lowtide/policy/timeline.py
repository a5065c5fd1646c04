"""The dashboard's GPU timeline, as arithmetic: how many GPU-equivalents were parked (a replica
PARKED, asleep or stopped) or lendable in each bucket, and how a bucket's idle ledger time splits
into parked, lent and idle, and free (pure; docs/architecture.md §8.1, §12).

Why it is needed: the GPU ledger books a PARKED replica's GPUs as `idle` (they are lendable,
`domain.states.ReplicaState`), so the ledger alone cannot tell a parked replica's GPUs (with
`park: sleep` its weights wait in host RAM and some GPU memory stays in use) from GPUs nobody
wants. The replica state history does: every guarded replica move writes a service event whose
kind is the new state in lower case (`store.replicas_repo.move_replica`, `begin_replica`).

Rules
- A replica is parked from a `parked` event until its next state event (`waking`, `starting`,
  `failed`, ...); other event kinds (alerts) do not end it. A replica PARKED now whose move is older
  than every event read is parked from its record's `since`.
- Parked GPU-equivalents in a bucket = the parked GPU-seconds inside it ÷ its length.
- A parked replica's GPUs may be lent to research meanwhile (that time is research in the ledger),
  so the parked share shown is at most the bucket's idle share: parked = min(parked, idle), and
  free = idle − parked. The ledger's totals stay exact; only the idle part is split.
- Lendable GPU-equivalents in a bucket = the lending envelope's `lendable_gpus`, weighted by the
  time each recorded point (`policy.lending_history`) held inside the bucket; a point holds until
  the next one, and before the first point read the bucket counts nothing lendable.
- Of the rest of idle (idle − parked), the part inside the envelope that research did not use is
  lent and idle: lent_idle = min(idle − parked, lendable − research), at least 0; free = what is
  left (the reserve and headroom inference keeps back, or GPUs no envelope covered). So
  idle = parked + lent_idle + free, exactly.
Neighbours: `api.dashboard` reads the events, the replicas, the envelope's points and one usage
report per bucket from the store and calls `split_bucket`. Must not: read the clock (`now` is
passed), do I/O, or touch the ledger's own totals.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from lowtide.domain.states import ReplicaState
from lowtide.policy.lending_history import LendingPoint

#: Event kinds that are replica state moves (the new state, lower case).
STATE_KINDS = frozenset(s.value.lower() for s in ReplicaState)
PARKED_KIND = ReplicaState.PARKED.value.lower()


@dataclass(frozen=True, slots=True)
class ReplicaMove:
    """One replica state event: at `at`, replica `replica_id` entered the state `kind`."""

    replica_id: str
    at: float
    kind: str


@dataclass(frozen=True, slots=True)
class ParkedNow:
    """A replica as it is now (its record): its state and since when."""

    replica_id: str
    state: ReplicaState
    since: float


@dataclass(frozen=True, slots=True)
class ParkedSpan:
    replica_id: str
    start: float
    end: float  # `now` while still parked
    gpus: int


def parked_spans(
    moves: Iterable[ReplicaMove],
    current: Sequence[ParkedNow],
    gpus_of: Mapping[str, int],
    *,
    now: float,
) -> list[ParkedSpan]:
    """The intervals in which each replica was PARKED, each with the replica's GPU count
    (`gpus_of`; a replica it does not know counts 0 and is left out)."""
    by_replica: dict[str, list[ReplicaMove]] = {}
    for m in moves:
        if m.kind in STATE_KINDS:
            by_replica.setdefault(m.replica_id, []).append(m)
    spans: list[ParkedSpan] = []
    for rid, seq in by_replica.items():
        seq.sort(key=lambda m: m.at)
        begun: float | None = None
        for m in seq:
            if m.kind == PARKED_KIND:
                if begun is None:
                    begun = m.at
            elif begun is not None:
                spans.append(ParkedSpan(rid, begun, max(begun, m.at), gpus_of.get(rid, 0)))
                begun = None
        if begun is not None:
            spans.append(ParkedSpan(rid, begun, max(begun, now), gpus_of.get(rid, 0)))
    covered = {s.replica_id for s in spans if s.end >= now}
    for r in current:
        if r.state == ReplicaState.PARKED and r.replica_id not in covered and r.since <= now:
            # Parked before every event read (or its event was not read): its record knows since when.
            earliest = min((m.at for m in by_replica.get(r.replica_id, ())), default=now)
            if r.since <= earliest:
                spans.append(ParkedSpan(r.replica_id, r.since, now, gpus_of.get(r.replica_id, 0)))
    return [s for s in spans if s.gpus > 0 and s.end > s.start]


def parked_gpus(spans: Sequence[ParkedSpan], start: float, end: float) -> float:
    """Parked GPU-equivalents over [start, end): parked GPU-seconds inside it ÷ its length."""
    if end <= start:
        raise ValueError(f"empty bucket [{start}, {end})")
    seconds = sum(s.gpus * max(0.0, min(s.end, end) - max(s.start, start)) for s in spans)
    return seconds / (end - start)


def split_idle(idle: float, parked: float) -> tuple[float, float]:
    """(parked, free): the bucket's idle GPU-equivalents, the parked share first (at most idle)."""
    shown = max(0.0, min(parked, idle))
    return shown, max(0.0, idle - shown)


def lendable_gpus(points: Sequence[LendingPoint], start: float, end: float) -> float:
    """Lendable GPU-equivalents over [start, end): each point's `lendable_gpus` times the part of
    the bucket it held (from its `at` until the next point's), ÷ the bucket's length. Before the
    first point nothing counts (unknown is not lendable)."""
    if end <= start:
        raise ValueError(f"empty bucket [{start}, {end})")
    ordered = sorted(points, key=lambda p: p.at)
    seconds = 0.0
    for i, p in enumerate(ordered):
        until = ordered[i + 1].at if i + 1 < len(ordered) else end
        seconds += p.lendable_gpus * max(0.0, min(until, end) - max(p.at, start))
    return seconds / (end - start)


@dataclass(frozen=True, slots=True)
class IdleSplit:
    """A bucket's idle GPU-equivalents, split: parked + lent_idle + free = idle."""

    parked: float
    lent_idle: float
    free: float


def split_bucket(idle: float, parked: float, lendable: float, research: float) -> IdleSplit:
    """Split a bucket's idle GPU-equivalents: parked first (`split_idle`), then of the rest the
    part of the envelope research left unused (lendable − research), then free."""
    shown, rest = split_idle(idle, parked)
    lent_idle = max(0.0, min(rest, lendable - research))
    return IdleSplit(shown, lent_idle, max(0.0, rest - lent_idle))
