"""The oracle: what a policy that knew the future load exactly could lend (an upper bound).

For every stretch of constant load, each service needs the fewest replicas whose modelled
per-replica load stays within the autoscaler's own targets (concurrency and KV per replica, no
overload), within [min_replicas, max_replicas], plus its headroom replicas; every other GPU of
the pool is idle and could be lent at no cost (no lead time, no notice, no restart). Integrated
over the run this is `oracle_idle_gpu_hours`, the most any policy can harvest; research demand
may bound a real harvest below it. `oracle` in a comparison is this bound, not a loop run.
Neighbours: `sim.capacity` (the model), `sim.summary` (reports it). Must not: run the loop, read
files or the clock.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterator, Sequence

from lowtide.sim.capacity import steady_state
from lowtide.sim.jobs import ResearchJob
from lowtide.sim.scenario import SimService

_EPS = 1e-9


def needed_replicas(service: SimService, rate_rps: float) -> int:
    """Replicas the service needs at a steady `rate_rps`, headroom included (see the docstring).

    The fewest n in [min_replicas, max_replicas] that carry this load at the autoscaler's
    targets: not overloaded, within the TTFT SLO guard when one is set, and each signal's
    recommendation (⌈Σ concurrency / target⌉, ⌈Σ KV usage / target⌉) at most n. For the
    concurrency signal that is ⌈rate ÷ the per-replica rate at the target⌉ (the batch grows
    faster than linearly with a replica's rate, so fewer replicas cannot hold the target), the
    figure an independent computation from the curve and `replica_capacity_rps` gives. The
    autoscaler's tolerance band is left out on purpose: it is hysteresis, not need (the
    autoscaler may sit up to `tolerance` below or above this while the load moves inside the
    band; counting the band's favourable side made the bound 11 % larger than that computation on
    Azure's conv trace).
    """
    spec = service.setup.spec
    targets = spec.autoscale
    need = spec.max_replicas
    for n in range(max(spec.min_replicas, 0), spec.max_replicas + 1):
        if n == 0:
            if rate_rps <= 0:
                need = 0
                break
            continue
        load = steady_state(service.capacity, rate_rps, n)
        if load.overloaded:
            continue
        if targets.ttft_p90_slo_s is not None and load.ttft_p90_s > targets.ttft_p90_slo_s:
            continue
        raws = []
        if targets.concurrency_per_replica is not None:
            raws.append(math.ceil(n * (load.running + load.waiting) / targets.concurrency_per_replica - _EPS))
        if targets.kv_usage is not None:
            raws.append(math.ceil(n * load.kv_usage / targets.kv_usage - _EPS))
        if max(raws, default=n) <= n:
            need = n
            break
    return min(spec.max_replicas, need + spec.headroom_replicas)


def idle_stretches(
    services: Sequence[SimService], pool_gpus: int, duration_s: float
) -> Iterator[tuple[float, float, int]]:
    """(start, end, idle GPUs) of each stretch of constant load over [0, duration_s) (curve
    time): idle = (pool − Σ needed × gpus_per_replica)⁺."""
    cache: dict[tuple[str, float], int] = {}
    t = 0.0
    while t < duration_s:
        nxt = min([duration_s, *(s.curve.next_change_after(t) for s in services)])
        held = 0
        for s in services:
            rate = s.curve.rate_at(t)
            key = (s.name, rate)
            if key not in cache:
                cache[key] = needed_replicas(s, rate)
            held += cache[key] * s.setup.spec.gpus_per_replica
        yield t, nxt, max(0, pool_gpus - held)
        if not math.isfinite(nxt) or nxt <= t:
            break
        t = nxt


def oracle_idle_gpu_seconds(services: Sequence[SimService], pool_gpus: int, duration_s: float) -> float:
    """∫ (pool − Σ needed × gpus_per_replica)⁺ dt over [0, duration_s) (curve time)."""
    return sum(idle * (end - start) for start, end, idle in idle_stretches(services, pool_gpus, duration_s))


#: The spell lengths `oracle_idle_gpu_hours_in_spells` reports (label → seconds).
SPELLS: tuple[tuple[str, float], ...] = (("10m", 600.0), ("30m", 1800.0), ("1h", 3600.0))
_CELL_S = 60.0


def idle_in_spells(
    services: Sequence[SimService], pool_gpus: int, duration_s: float, spell_s: float, cell_s: float = _CELL_S
) -> float:
    """The GPU-seconds of the oracle's idle that loans of at least `spell_s` can use: the idle
    curve's morphological opening by a window of that length (a GPU counts at t when some window
    of `spell_s` around t keeps at least that many GPUs idle throughout), integrated. On a grid of
    `cell_s` cells, each cell at the least idle of the stretches it meets (so the figure never
    exceeds the exact one; both agree when every change falls on the grid, as the traces' 60-s and
    600-s bins do). It says how much of the bound a policy that must lend for minutes at least
    could reach: on a load that swings minute to minute, little."""
    idle = _idle_cells(services, pool_gpus, duration_s, cell_s)
    return _opened_total(idle, duration_s, spell_s, cell_s)


def _idle_cells(
    services: Sequence[SimService], pool_gpus: int, duration_s: float, cell_s: float
) -> list[int]:
    """The idle GPUs of each `cell_s` cell of [0, duration_s): the least of the stretches it meets."""
    cells = max(1, math.ceil(duration_s / cell_s - 1e-9))
    idle = [pool_gpus] * cells
    for start, end, value in idle_stretches(services, pool_gpus, duration_s):
        first = int(start // cell_s)
        last = min(cells - 1, max(first, math.ceil(end / cell_s) - 1))
        for c in range(first, last + 1):
            idle[c] = min(idle[c], value)
    return idle


def _opened_total(idle: list[int], duration_s: float, spell_s: float, cell_s: float) -> float:
    """∫ of the opening of the cells' idle by `spell_s` (see `idle_in_spells`)."""
    cells = len(idle)
    width = max(1, math.ceil(spell_s / cell_s - 1e-9))
    if width > cells:
        return 0.0  # no loan that long fits in the run
    if width == cells:
        return min(idle) * duration_s
    eroded = _sliding(idle, width, smallest=True)  # eroded[i]: least idle over cells i .. i + width − 1
    opened = _sliding([0] * (width - 1) + eroded + [0] * (width - 1), width, smallest=False)
    total = 0.0
    for c in range(cells):
        span = min(cell_s, duration_s - c * cell_s)
        total += opened[c] * span
    return total


def _sliding(values: Sequence[int], width: int, *, smallest: bool) -> list[int]:
    """The least (or greatest) of every `width` consecutive values, in O(n) (a monotone deque)."""
    out: list[int] = []
    window: deque[int] = deque()  # indices of candidates, the best first
    for i, v in enumerate(values):
        while window and (values[window[-1]] >= v if smallest else values[window[-1]] <= v):
            window.pop()
        window.append(i)
        if window[0] <= i - width:
            window.popleft()
        if i >= width - 1:
            out.append(values[window[0]])
    return out


def idle_in_spells_gpu_hours(
    services: Sequence[SimService], pool_gpus: int, duration_s: float
) -> dict[str, float]:
    """`idle_in_spells` for each of `SPELLS`, in GPU-hours (summary key
    `oracle_idle_gpu_hours_in_spells`)."""
    idle = _idle_cells(services, pool_gpus, duration_s, _CELL_S)  # the curve walked once for all three
    return {label: _opened_total(idle, duration_s, spell, _CELL_S) / 3600.0 for label, spell in SPELLS}


def oracle_harvest_gpu_seconds(
    services: Sequence[SimService],
    pool_gpus: int,
    duration_s: float,
    jobs: Sequence[ResearchJob],
    restart_s: float,
) -> float:
    """What an oracle could harvest from these jobs: the idle GPUs above, fed by the jobs' work.

    A fluid, work-conserving oracle: from its submit time each job needs `work_s + restart_s`
    seconds on its `gpus` GPUs (one load is unavoidable) and runs at up to its width; while the
    jobs present want more GPUs than are idle, they share the idle GPUs in proportion to their
    widths. No placement, notice, restart or lost work. A policy that preempts also spends
    GPU-time on reloads and lost work, which this does not count.
    """
    need_cache: dict[tuple[str, float], int] = {}

    def idle_at(t: float) -> int:
        held = 0
        for s in services:
            rate = s.curve.rate_at(t)
            key = (s.name, rate)
            if key not in need_cache:
                need_cache[key] = needed_replicas(s, rate)
            held += need_cache[key] * s.setup.spec.gpus_per_replica
        return max(0, pool_gpus - held)

    arrivals = sorted(
        (j.submit_s, j.gpus, j.gpus * (j.work_s + restart_s)) for j in jobs if j.submit_s < duration_s
    )
    active: list[list[float]] = []  # [width, GPU-seconds left]
    harvested = 0.0
    t, k = 0.0, 0
    while t < duration_s:
        while k < len(arrivals) and arrivals[k][0] <= t:
            active.append([float(arrivals[k][1]), arrivals[k][2]])
            k += 1
        nxt = min([duration_s, *(s.curve.next_change_after(t) for s in services)])
        if k < len(arrivals):
            nxt = min(nxt, arrivals[k][0])
        want = sum(w for w, _ in active)
        share = min(1.0, idle_at(t) / want) if want > 0 else 0.0
        if share > 0:
            # The first job to finish at these rates ends the stretch early.
            nxt = min(nxt, t + min(left / (w * share) for w, left in active))
        nxt = max(nxt, t + 1e-6)  # a finish within float noise of now still moves time on
        dt = nxt - t
        if share > 0:
            for job in active:
                job[1] -= job[0] * share * dt
            harvested += want * share * dt
            active = [job for job in active if job[1] > 1e-6]
        if not math.isfinite(nxt):
            break
        t = nxt
    return harvested
