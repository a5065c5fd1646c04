"""The capacity model: what a service's vLLM replicas would report at a given request rate (pure).

Role: give the simulator's fake replicas the metrics a real vLLM fleet would show (running,
waiting, KV usage, token and request rates, TTFT and e2e quantiles) from nothing but the arrival
rate and the number of serving replicas, cheaply enough to be called for every service at every
simulated tick (~10⁵ calls a run), and faithfully enough that the production autoscaler
(`policy.autoscale`) reacts as it would to the real thing.

The model
=========
One replica (`ReplicaCapacity`) batches at most ``servers`` sequences: ``max_concurrency``
(vLLM's ``max_num_seqs``), or fewer when the KV cache cannot hold that many, a running sequence
holding ``prompt + output/2`` tokens on average. A service's load is split evenly over its
serving replicas; each is an **M/M/c queue** with c = ``servers`` (Poisson arrivals, service
times exponential with mean S: output lengths vary about that much in the Azure and ServeGen
traces; for fixed lengths M/M/c overstates the waits, i.e. it errs on the safe side).

**Batching slowdown** (the one non-textbook part, kept linear). Every request that a replica
takes per second costs the others ``contention_s`` seconds per second of engine time: its
prefill shares the engine's steps, and its place in the batch makes each decode step longer.
At λ requests/s per replica everything a request does takes ``1 / (1 − contention_s·λ)`` times as
long as unloaded: ``S(λ) = service_s / (1 − contention_s·λ)``, unloaded TTFT likewise. This is
the mean-field solution of ``S = service_s + contention_s·a`` with the batch ``a = λ·S`` (Little
on the servers). The batch is full (``a = c``) at ``throughput_rps = c / full_batch_s`` with
``full_batch_s = service_s + contention_s·c``; beyond it the replica is **overloaded**.
`ReplicaCapacity.from_engine` takes the numbers from `emulator.engine.EngineConfig` (the
request-level emulator): with P prompt and O output tokens, ``prefill_s = P/prefill_tokens_per_s
+ one step``, ``service_s = P/prefill_tokens_per_s + O steps`` (a step alone lasts
``decode_base_s + decode_per_seq_s``), ``contention_s = P/prefill_tokens_per_s +
O·decode_per_seq_s``, so the full-batch throughput is the engine's: one request costs its
prefill plus a 1/c share of O full-batch steps (defaults, P = 1000, O = 250: 12.2 req/s).

Stationary metrics per replica (`steady_state`), stable case (λ < ``throughput_rps``):

    running a = λ·S              waiting = λ·min(W̄q, cap)         (Little's law, both)
    P(wait) C = Erlang C(c, a)   P(Wq > t) = C·e^(−(c−a)·t/S)   W̄q = C·S/(c − a)
    TTFT_q  = min(cap, Wq quantile q + prefill_s·S/service_s)
    e2e_p90 = min(cap, Wq p90) + S·ln 10    (sum of the quantiles: a slight overestimate)
    KV usage = a·(P + O/2) / kv_capacity_tokens; tokens/s = λ·P, λ·O; requests/s = λ

Erlang C is computed as the Poisson ratio P(X = c)/P(X ≤ c) (Erlang B) in log space with the tail
summed outward from c, so it is exact to double precision and cheap for any c (thousands too);
where P(X = c) underflows, C is 0. ``cap`` = `TTFT_CAP_S` (an hour): clients give up on a
request that has waited that long, so no wait, and no queue, exceeds it.

Overload (λ ≥ ``throughput_rps``) has no steady state: the queue grows. `steady_state` reports
its long-run limit (the replicas run a full batch, serve ``throughput_rps`` each, the queue is
an hour of their work, TTFT p90 = cap, ``overloaded``). `advance` carries a **backlog** B
(requests queued service-wide beyond the stationary queue) from tick to tick as a fluid, exact
for a rate and replica count constant over the step, however long: it grows at ``λ − M``
(M = replicas × ``throughput_rps``) while λ ≥ M, drains at ``M − λ`` otherwise, never exceeds
M·cap (the excess is dropped: clients gave up) and is dropped whole when no replica serves.
`current_load` adds the backlog to the stationary (or, overloaded, full-batch) figures: it runs
as far as the batch has room and waits beyond, every arrival waits B/M more. The fluid drains at
full speed even when the backlog would fit in the batch: a backlog smaller than a batch drains
in about one service time either way.

Checked against the request-level engine (one default replica, P = 1000, O = 250, Poisson
arrivals at 2–11 req/s): running and mean e2e agree within 3 %; TTFT p90 is low by about one
decode step (15–50 ms), the wait for the step in progress, which the model leaves out.

Limits: one request shape (mean prompt and output tokens) per service; no preemption or
head-of-line blocking (KV only caps the batch); quantiles are the model's, not the linear
interpolation inside vLLM's histogram buckets that Prometheus would answer, except that
`replica_signals` caps them at the largest finite bucket bound as ``histogram_quantile`` does.
Little's law holds exactly in the stable steady state, not in overload or with a backlog.
A service with no serving replica serves nothing: with any load it is overloaded with TTFT =
cap; with none, every latency is 0 (nobody waits) — use `slo_violated`, which counts a violation
only when requests arrive or wait.

Neighbours: `sim.world` / `sim.ports` call `steady_state` (or `advance` + `current_load`) and
`service_signals` every tick for `policy.autoscale`; `sim.fleet` sizes the default fleet with
`derive_replica_capacity`; `sim.oracle` searches replica counts with `steady_state`; the constants
come from `emulator.engine`. Must not: do I/O, read the clock, draw random numbers, or import
numpy; every function is deterministic and O(1) in the replica count, except the signals built
per replica.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from lowtide.domain.metrics import ReplicaSignals, ServiceSignals
from lowtide.emulator.engine import REQUEST_LATENCY_BUCKETS, TTFT_BUCKETS, EngineConfig

#: The longest a request waits: TTFT is capped here and no queue holds more than this much work.
TTFT_CAP_S = 3600.0
#: What vLLM's histograms can tell apart: ``histogram_quantile`` answers at most these bounds.
TTFT_SIGNAL_MAX_S = TTFT_BUCKETS[-1]
E2E_SIGNAL_MAX_S = REQUEST_LATENCY_BUCKETS[-1]

_LN10 = math.log(10.0)
_LN2 = math.log(2.0)
_TAIL_EPS = 1e-17  # Poisson tail terms below this no longer change P(X ≤ c) in double precision
_LOG_TINY = -740.0  # below this exp() underflows: P(X = c), hence Erlang C, is 0


# -- one replica --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ReplicaCapacity:
    """What one replica can do; see the module docstring for the model.

    ``service_s``: mean end-to-end time of a request when unloaded; ``prefill_s``: unloaded TTFT
    (≤ ``service_s``); ``contention_s``: engine seconds each request/s of load costs the others
    (0: no batching slowdown); ``prompt_tokens`` / ``output_tokens``: the mean request."""

    max_concurrency: int
    service_s: float
    prefill_s: float
    prompt_tokens: float
    output_tokens: float
    kv_capacity_tokens: float
    contention_s: float = 0.0
    # derived (set in __post_init__)
    servers: int = field(init=False, compare=False)  # sequences batched at most (KV included)
    full_batch_s: float = field(init=False, compare=False)  # mean service time at a full batch
    throughput_rps: float = field(init=False, compare=False)  # servers / full_batch_s
    kv_tokens_per_seq: float = field(init=False, compare=False)  # prompt + output/2
    full_batch_ttft_s: float = field(init=False, repr=False, compare=False)
    _log_servers_factorial: float = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        problems = []
        if not self.max_concurrency >= 1:
            problems.append("max_concurrency must be at least 1")
        if not (self.service_s > 0 and math.isfinite(self.service_s)):
            problems.append("service_s must be positive and finite")
        if not 0 <= self.prefill_s <= self.service_s:
            problems.append("prefill_s must be in [0, service_s]")
        if not (self.contention_s >= 0 and math.isfinite(self.contention_s)):
            problems.append("contention_s must be finite and >= 0")
        for name in ("prompt_tokens", "output_tokens"):
            if not (getattr(self, name) >= 0 and math.isfinite(getattr(self, name))):
                problems.append(f"{name} must be finite and >= 0")
        if not self.kv_capacity_tokens > 0:
            problems.append("kv_capacity_tokens must be positive")
        if problems:
            raise ValueError("; ".join(problems))
        per_seq = self.prompt_tokens + self.output_tokens / 2.0
        servers = self.max_concurrency
        if per_seq > 0 and math.isfinite(self.kv_capacity_tokens):
            servers = max(1, min(servers, math.floor(self.kv_capacity_tokens / per_seq)))
        full = self.service_s + self.contention_s * servers
        set_ = object.__setattr__
        set_(self, "servers", servers)
        set_(self, "kv_tokens_per_seq", per_seq)
        set_(self, "full_batch_s", full)
        set_(self, "throughput_rps", servers / full)
        set_(self, "full_batch_ttft_s", self.prefill_s * full / self.service_s)
        set_(self, "_log_servers_factorial", math.lgamma(servers + 1))

    @classmethod
    def from_engine(
        cls, prompt_tokens: float, output_tokens: float, engine: EngineConfig | None = None
    ) -> ReplicaCapacity:
        """A replica shaped like the emulator's engine (`EngineConfig`, default: one 4-GPU 8B
        replica) serving requests of this mean size (token counts below 1 count as 1)."""
        e = engine if engine is not None else EngineConfig()
        p = max(float(prompt_tokens), 1.0)
        o = max(float(output_tokens), 1.0)
        k = e.speedup
        step = (e.decode_base_s + e.decode_per_seq_s) / k  # a step of a batch of one
        prefill = p / (e.prefill_tokens_per_s * k)
        chunks = math.ceil(p / e.max_num_batched_tokens)  # chunked prefill: one step per chunk
        return cls(
            max_concurrency=e.max_num_seqs,
            service_s=prefill + (chunks - 1 + o) * step,
            prefill_s=prefill + chunks * step,
            prompt_tokens=p,
            output_tokens=o,
            kv_capacity_tokens=float(e.kv_capacity_tokens),
            contention_s=prefill + o * e.decode_per_seq_s / k,
        )

    def scaled(self, factor: float) -> ReplicaCapacity:
        """The same replica with every duration multiplied by `factor` (the emulator's ``speedup``
        is 1/factor): throughput divides by it, batch and KV limits stay."""
        if not (factor > 0 and math.isfinite(factor)):
            raise ValueError(f"the time factor must be positive and finite, got {factor}")
        return replace(
            self,
            service_s=self.service_s * factor,
            prefill_s=self.prefill_s * factor,
            contention_s=self.contention_s * factor,
        )

    def service_time_s(self, rate_rps: float) -> float:
        """Mean service time at `rate_rps` per replica (the full-batch time at or beyond capacity)."""
        if rate_rps >= self.throughput_rps:
            return self.full_batch_s
        return self.service_s / (1.0 - self.contention_s * max(rate_rps, 0.0))


# -- what the replicas report -------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ModelledLoad:
    """A service's modelled load: the per-replica figures (every serving replica reports the same)
    and the service's. ``ttft_p90_s`` is both (the load is split evenly)."""

    replicas: int  # serving replicas
    rate_rps: float  # offered to the service (arrivals)
    backlog: float  # requests queued service-wide beyond the stationary queue (see `advance`)
    utilisation: float  # per-replica rate / throughput_rps (inf: load and no replica)
    overloaded: bool  # arrivals at or above what the replicas serve: the queue grows
    # per replica
    running: float
    waiting: float
    kv_usage: float  # 0..1
    kv_tokens: float
    requests_per_s: float  # served (completions)
    prompt_tokens_per_s: float
    generation_tokens_per_s: float
    ttft_p50_s: float
    ttft_p90_s: float
    e2e_p90_s: float
    e2e_mean_s: float  # mean time in the system (wait + service)

    @property
    def concurrency(self) -> float:
        """Requests in one replica: running + waiting (what the autoscaler's first signal reads)."""
        return self.running + self.waiting

    @property
    def served_rps(self) -> float:
        return self.requests_per_s * self.replicas


@dataclass(frozen=True, slots=True)
class ServiceLoadState:
    """What the transient model carries from one tick to the next for a service (`advance`)."""

    backlog: float = 0.0  # requests queued beyond the stationary queue, service-wide
    dropped: float = 0.0  # requests given up on so far (no replica, or queued longer than the cap)

    def __post_init__(self) -> None:
        if not (self.backlog >= 0 and self.dropped >= 0):
            raise ValueError(f"backlog and dropped must be >= 0: {self}")


def erlang_c(servers: int, offered_load: float) -> float:
    """P(an arrival waits) in an M/M/c queue with c = `servers` and `offered_load` = λ/μ Erlangs
    (1 when offered_load ≥ servers: the queue is unstable)."""
    if servers < 1:
        raise ValueError(f"servers must be at least 1, got {servers}")
    if not offered_load >= 0:
        raise ValueError(f"offered_load must be >= 0, got {offered_load}")
    return _erlang_c(servers, offered_load, math.lgamma(servers + 1))


def _erlang_c(c: int, a: float, log_c_factorial: float) -> float:
    if a <= 0.0:
        return 0.0
    if a >= c:
        return 1.0
    log_pc = c * math.log(a) - a - log_c_factorial  # ln P(X = c), X ~ Poisson(a)
    if log_pc < _LOG_TINY:
        return 0.0
    pc = math.exp(log_pc)
    tail = 0.0  # P(X > c), summed outward: each term is the last × a/j, a/j < 1
    if pc * a / (c + 1 - a) >= _TAIL_EPS:  # a bound on the whole tail
        term = pc
        j = c + 1
        while True:
            term *= a / j
            tail += term
            j += 1
            if term * a / (j - a) < _TAIL_EPS:
                break
    erlang_b = pc / (1.0 - tail)
    rho = a / c
    return erlang_b / (1.0 - rho * (1.0 - erlang_b))


def _base(cap: ReplicaCapacity, lam: float) -> tuple[float, float, float, float, float, float, float, bool]:
    """One replica at `lam` req/s with no backlog: running, waiting, served, TTFT p50 and p90,
    e2e p90 and mean, stable. Overloaded: the full batch at the onset (no queue yet)."""
    if lam < cap.throughput_rps:
        stretch = 1.0 / (1.0 - cap.contention_s * lam)
        s = cap.service_s * stretch
        a = lam * s
        c = cap.servers
        if a < c:
            ttft = cap.prefill_s * stretch
            pw = _erlang_c(c, a, cap._log_servers_factorial)
            if pw <= 0.0:
                return a, 0.0, lam, ttft, ttft, s * _LN10, s, True
            gap = (c - a) / s  # cμ − λ
            wq = min(pw / gap, TTFT_CAP_S)
            w50 = math.log(pw) + _LN2 if pw > 0.5 else 0.0  # P(Wq > t) = pw·e^(−gap·t) = 1 − q
            w90 = math.log(pw) + _LN10 if pw > 0.1 else 0.0
            w50 = min(w50 / gap, TTFT_CAP_S)
            w90 = min(w90 / gap, TTFT_CAP_S)
            return (
                a,
                lam * wq,
                lam,
                min(TTFT_CAP_S, w50 + ttft),
                min(TTFT_CAP_S, w90 + ttft),
                w90 + s * _LN10,
                s + wq,
                True,
            )
    s = cap.full_batch_s
    ttft = cap.full_batch_ttft_s
    return float(cap.servers), 0.0, cap.throughput_rps, ttft, ttft, s * _LN10, s, False


def _check(rate_rps: float, replicas: int) -> None:
    if not (rate_rps >= 0 and rate_rps < math.inf):
        raise ValueError(f"rate_rps must be finite and >= 0, got {rate_rps}")
    if replicas < 0:
        raise ValueError(f"replicas cannot be negative, got {replicas}")


def _load(cap: ReplicaCapacity, rate: float, n: int, backlog: float) -> ModelledLoad:
    if n == 0:
        unserved = rate > 0
        latency = TTFT_CAP_S if unserved else 0.0
        return ModelledLoad(
            replicas=0,
            rate_rps=rate,
            backlog=0.0,
            utilisation=math.inf if unserved else 0.0,
            overloaded=unserved,
            running=0.0,
            waiting=0.0,
            kv_usage=0.0,
            kv_tokens=0.0,
            requests_per_s=0.0,
            prompt_tokens_per_s=0.0,
            generation_tokens_per_s=0.0,
            ttft_p50_s=latency,
            ttft_p90_s=latency,
            e2e_p90_s=latency,
            e2e_mean_s=latency,
        )
    lam = rate / n
    running, waiting, served, t50, t90, e90, emean, stable = _base(cap, lam)
    if backlog > 0.0:
        extra = backlog / n
        delay = extra / cap.throughput_rps  # B / M: every arrival waits for the backlog first
        total = running + waiting + extra
        running = min(float(cap.servers), running + extra)
        waiting = total - running
        served = cap.throughput_rps
        t50 = min(TTFT_CAP_S, t50 + delay)
        t90 = min(TTFT_CAP_S, t90 + delay)
        e90 += delay
        emean += delay
    kv_tokens = running * cap.kv_tokens_per_seq
    return ModelledLoad(
        replicas=n,
        rate_rps=rate,
        backlog=backlog,
        utilisation=lam / cap.throughput_rps,
        overloaded=not stable,
        running=running,
        waiting=waiting,
        kv_usage=min(1.0, kv_tokens / cap.kv_capacity_tokens),
        kv_tokens=kv_tokens,
        requests_per_s=served,
        prompt_tokens_per_s=served * cap.prompt_tokens,
        generation_tokens_per_s=served * cap.output_tokens,
        ttft_p50_s=t50,
        ttft_p90_s=t90,
        e2e_p90_s=e90,
        e2e_mean_s=emean,
    )


def steady_state(capacity: ReplicaCapacity, rate_rps: float, replicas: int) -> ModelledLoad:
    """The stationary load of `replicas` serving replicas sharing `rate_rps` evenly; overloaded,
    the long-run limit (full batch, an hour of work queued, TTFT p90 = `TTFT_CAP_S`)."""
    _check(rate_rps, replicas)
    backlog = 0.0
    if replicas > 0 and rate_rps / replicas >= capacity.throughput_rps:
        backlog = replicas * capacity.throughput_rps * TTFT_CAP_S
    return _load(capacity, rate_rps, replicas, backlog)


def current_load(
    state: ServiceLoadState, capacity: ReplicaCapacity, rate_rps: float, replicas: int
) -> ModelledLoad:
    """The load now, given the backlog `advance` carried here (none: the stationary load, or at
    an overload's onset the full batch with no queue yet)."""
    _check(rate_rps, replicas)
    backlog = min(state.backlog, replicas * capacity.throughput_rps * TTFT_CAP_S)
    return _load(capacity, rate_rps, replicas, backlog)


def advance(
    state: ServiceLoadState, capacity: ReplicaCapacity, rate_rps: float, replicas: int, dt: float
) -> ServiceLoadState:
    """The state after `dt` seconds at a constant `rate_rps` and `replicas`: exact for any `dt`,
    so advancing by a then b equals advancing by a + b (see the module docstring)."""
    _check(rate_rps, replicas)
    if not dt >= 0:
        raise ValueError(f"dt must be >= 0, got {dt}")
    served = replicas * capacity.throughput_rps
    most = served * TTFT_CAP_S
    backlog, dropped = state.backlog, state.dropped
    if backlog > most:  # fewer replicas than the backlog was queued on: the rest give up
        dropped += backlog - most
        backlog = most
    growth = rate_rps - served
    if growth > 0:
        fill_s = (most - backlog) / growth
        if dt > fill_s:
            dropped += growth * (dt - fill_s)
            backlog = most
        else:
            backlog += growth * dt
    elif growth < 0:
        backlog = max(0.0, backlog + growth * dt)
    if backlog == state.backlog and dropped == state.dropped:
        return state
    return ServiceLoadState(backlog=backlog, dropped=dropped)


# -- SLO ----------------------------------------------------------------------------------------


def slo_violated(load: ModelledLoad, slo_s: float) -> bool:
    """TTFT p90 above `slo_s` while requests arrive or wait (an idle service violates nothing)."""
    return (load.rate_rps > 0 or load.backlog > 0) and load.ttft_p90_s > slo_s


def slo_violation_s(
    state: ServiceLoadState,
    capacity: ReplicaCapacity,
    rate_rps: float,
    replicas: int,
    dt: float,
    slo_s: float,
) -> float:
    """Seconds of the next `dt` (rate and replicas constant) during which `slo_violated` holds for
    `current_load` of the state `advance` reaches; divide by 60 for SLO-violation minutes.
    Exact: additive over any split of `dt`, like `advance`."""
    _check(rate_rps, replicas)
    if not dt > 0:
        return 0.0
    if replicas == 0:
        return dt if rate_rps > 0 and slo_violated(_load(capacity, rate_rps, 0, 0.0), slo_s) else 0.0
    served = replicas * capacity.throughput_rps
    most = served * TTFT_CAP_S
    b0 = min(state.backlog, most)
    growth = rate_rps - served
    q = _base(capacity, rate_rps / replicas)[4]  # TTFT p90 with no backlog
    # With a backlog B > 0 TTFT p90 is min(cap, B/served + q): above the SLO iff B > level.
    level = max(0.0, (slo_s - q) * served) if slo_s < TTFT_CAP_S else math.inf
    if growth > 0:  # B rises to `most` (B = 0 only at an instant)
        if b0 > level:
            above = dt
        elif level >= most:
            above = 0.0
        else:
            above = max(0.0, dt - (level - b0) / growth)
        empty = 0.0
    elif growth < 0:  # B falls to 0 and stays there
        above = min(dt, (b0 - level) / -growth) if b0 > level else 0.0
        empty = dt if b0 <= 0 else max(0.0, dt - b0 / -growth)
    else:
        above = dt if b0 > level else 0.0
        empty = dt if b0 <= 0 else 0.0
    empty_violates = rate_rps > 0 and q > slo_s
    return above + (empty if empty_violates else 0.0)


# -- sizing -------------------------------------------------------------------------------------


def derive_replica_capacity(
    peak_rate_rps: float,
    prompt_tokens: float,
    output_tokens: float,
    *,
    replicas_at_peak: int,
    target_concurrency: float,
    engine: EngineConfig | None = None,
) -> ReplicaCapacity:
    """A replica such that `replicas_at_peak` of them at `peak_rate_rps` carry exactly
    `target_concurrency` requests each (running + waiting: the autoscaler's
    ``concurrency_per_replica``), so the autoscaler asks for `replicas_at_peak` at the peak.

    The shape (batch limit, KV cache, the split between prefill, decode and contention) is the
    emulator engine's for this request size (`ReplicaCapacity.from_engine`); only its speed is
    chosen, by a time factor f (every duration × f). Per replica λ = peak / replicas_at_peak,
    and with the queue empty the concurrency is the batch a = λ·S(λ) = λ·f·s₀/(1 − f·β·λ)
    (s₀ = ``service_s``, β = ``contention_s`` of the shape). Setting a = T (the target):

        f = T / (λ·(s₀ + β·T))

    so that S(λ) = T/λ (Little). If the M/M/c queue is not empty there (only when T is close to
    the batch limit), f is lowered by bisection until running + waiting = T. If the engine's KV
    cache cannot hold a full batch of these requests, the replica gets a cache that can (as a
    larger tensor-parallel group would), so that KV never binds before the batch does. Example:
    100 req/s over 9 replicas, T = 32, P = 1000, O = 250: λ = 11.1, s₀ = 3.07 s, β = 0.07 s,
    f = 0.54: each request takes 2.88 s, a replica serves at most 22.6 req/s (half-loaded at the
    target). Raises ValueError unless the peak and the target are positive, `replicas_at_peak` ≥ 1
    and the target is below the batch limit."""
    if not (peak_rate_rps > 0 and math.isfinite(peak_rate_rps)):
        raise ValueError(f"the peak rate must be positive and finite, got {peak_rate_rps}")
    if replicas_at_peak < 1:
        raise ValueError(f"replicas_at_peak must be at least 1, got {replicas_at_peak}")
    shape = ReplicaCapacity.from_engine(prompt_tokens, output_tokens, engine)
    if shape.servers < shape.max_concurrency:
        kv = math.ceil(shape.kv_tokens_per_seq * shape.max_concurrency) + 1.0
        shape = replace(shape, kv_capacity_tokens=kv)
    if not 0 < target_concurrency < shape.servers:
        raise ValueError(
            f"target_concurrency must be in (0, {shape.servers}) (the batch limit), got {target_concurrency}"
        )
    lam = peak_rate_rps / replicas_at_peak
    factor = target_concurrency / (lam * (shape.service_s + shape.contention_s * target_concurrency))
    capacity = shape.scaled(factor)
    if steady_state(capacity, lam, 1).concurrency <= target_concurrency * (1 + 1e-12):
        return capacity
    lo, hi = 0.0, factor  # concurrency rises with the factor; at `hi` it is above the target
    for _ in range(200):
        mid = (lo + hi) / 2
        if mid in (lo, hi):
            break
        if steady_state(shape.scaled(mid), lam, 1).concurrency > target_concurrency:
            hi = mid
        else:
            lo = mid
    return shape.scaled(lo)


# -- signals ------------------------------------------------------------------------------------


def replica_signals(load: ModelledLoad, replica_id: str, now: float) -> ReplicaSignals:
    """What one serving replica's metrics would say: the gauges and rates the autoscaler reads and
    the modelled quantiles, capped at vLLM's largest finite bucket (as ``histogram_quantile``
    answers) and None when nothing completes (no observation in the window). TTFT and e2e p99
    and e2e p50 are not modelled: None."""
    return _signals_of(load, now)(replica_id)


def _signals_of(load: ModelledLoad, now: float) -> Callable[[str], ReplicaSignals]:
    """`replica_signals` of `load` at `now` for any replica id: every serving replica reports the
    same figures, so they are worked out once per service and tick, not once per replica."""
    observed = load.requests_per_s > 0
    running, waiting, kv_usage, kv_tokens = load.running, load.waiting, load.kv_usage, load.kv_tokens
    prompt, generation, requests = load.prompt_tokens_per_s, load.generation_tokens_per_s, load.requests_per_s
    ttft_p50 = min(load.ttft_p50_s, TTFT_SIGNAL_MAX_S) if observed else None
    ttft_p90 = min(load.ttft_p90_s, TTFT_SIGNAL_MAX_S) if observed else None
    e2e_p90 = min(load.e2e_p90_s, E2E_SIGNAL_MAX_S) if observed else None

    def make(replica_id: str) -> ReplicaSignals:
        # Positional, in `ReplicaSignals`' field order (a keyword call binds each name: slower
        # at tens of replicas per load change); tests/unit/test_sim_capacity.py checks the order.
        return ReplicaSignals(
            replica_id,
            now,
            running,
            waiting,
            kv_usage,
            kv_tokens,
            prompt,
            generation,
            requests,
            ttft_p50,
            ttft_p90,
            None,  # ttft_p99_s
            None,  # e2e_p50_s
            e2e_p90,
        )

    return make


def service_signals(
    service: str, load: ModelledLoad, replica_ids: Sequence[str], now: float
) -> ServiceSignals:
    """The service's signals: one fresh `replica_signals` per serving replica; `replica_ids` must
    be the `load.replicas` replicas the load was computed for (none: no replica reports, the
    autoscaler holds)."""
    if len(replica_ids) != load.replicas:
        raise ValueError(
            f"{service}: {len(replica_ids)} replica ids for a load computed over {load.replicas} replicas"
        )
    make = _signals_of(load, now)
    return ServiceSignals(service=service, at=now, replicas=tuple([make(r) for r in replica_ids]))
