"""Inference load for the simulator: a trace turned into a piecewise-constant request-rate curve.

Role: the simulator covers up to 90 days, far too many requests to replay one by one, so it
asks "what is the request rate now, and when does it next change?". `load_curve` builds a
`LoadCurve` from the same ``--trace`` specs the emulator replays (`emulator.traces`:
``servegen:DIR``, ``servegen-aggregate:CSV``, ``azure:CSV``, ``synthetic:KIND``); the curve answers
`LoadCurve.rate_at` and `LoadCurve.next_change_after` in O(1) amortised time for a clock that
moves forward (a cached segment index, bisect on a jump), so an event-driven loop can jump from
change to change.
Neighbours: `emulator.traces` parses the spec and reads the files (all format checks and
located errors live there; this module only adds them up); `sim.jobs` is the other workload input
(research jobs); the simulator turns the rate into replica demand. Must not: generate individual
requests, read the clock, do network I/O, or re-implement trace parsing.

How each source becomes a curve (rates are req/s; ``scale`` of the spec multiplies every rate):

* ``servegen``: per 600-s window, the sum of the selected clients' rates (windows whose pattern is
  empty carry no traffic, as in the emulator's replay). Token means: the spec's ``tokens`` sampler.
* ``servegen-aggregate``: the CSV's ``total_rate_rps`` per window. Tokens as for servegen.
* ``azure``: request timestamps binned into 60-s windows (count / 60); the trace's last,
  incomplete minute is dropped (its rate would rest on a few seconds). Token means from the
  file's ``ContextTokens`` and ``GeneratedTokens`` (at least 1, as the replay's ``max_tokens``).
* ``synthetic``: ``constant`` is one segment; ``step`` two, switching at ``at`` (default half the
  run, as the emulator does); ``ramp`` is sampled at the middle of each 60-s window over the run
  (``days``) and holds its peak afterwards; ``diurnal`` is sampled the same way over one period and
  repeats with it. Token means: the spec's ``tokens`` sampler.

Periodicity (a choice, documented here): a curve read from a file is periodic with the length of
the file's trace (ServeGen: 14 days; Azure: ~58 minutes), so a 90-day run replays the 14 ServeGen
days six and a half times, and its day/night cycle stays in phase (14 days are whole days). The
spec's ``start`` rotates the trace: ``t = 0`` of the curve is trace time ``start`` and the part of
the trace before ``start`` follows its end. A run shorter than the trace never reaches the wrap.
Non-periodic curves (synthetic constant, ramp, step) hold their last rate forever.
"""

from __future__ import annotations

import bisect
import itertools
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from statistics import NormalDist

from lowtide.emulator.traces import (
    EmpiricalTokens,
    FixedTokens,
    LogNormalTokens,
    RateWindow,
    TokenSampler,
    TraceSpec,
    iter_azure_csv,
    parse_trace_spec,
    read_servegen_aggregate,
    read_servegen_client,
    servegen_client_files,
    synthetic_rate,
)

#: Width of the windows Azure timestamps are binned into, and of synthetic sampling.
BIN_S = 60.0
DAY_S = 86400.0
#: Requests of a trace without token counts, when the spec's sampler is not a known kind.
_TOKEN_SAMPLES = 20_000


@dataclass(frozen=True)
class LoadCurve:
    """A piecewise-constant request rate: ``rates[i]`` req/s on ``[starts[i], starts[i + 1])``.

    ``starts`` begin at 0 and ascend strictly; rates are finite and ≥ 0. With `period_s` set the
    curve repeats with that period (``starts[-1] < period_s``; the last segment lasts until the
    period ends); without it the last rate holds forever. `prompt_tokens` and `output_tokens` are
    the mean sizes of a request. Negative times are an error.

    Lookups keep a cached segment index, so a forward-moving clock costs O(1) per call and any
    jump O(log n). Equal neighbouring rates are kept as given (`next_change_after` skips them).
    """

    starts: tuple[float, ...]
    rates: tuple[float, ...]
    period_s: float | None = None
    prompt_tokens: float = 0.0
    output_tokens: float = 0.0
    # The segment index of the last lookup (mutable cache; not part of the value).
    _hint: list[int] = field(default_factory=lambda: [0], init=False, repr=False, compare=False)
    # Where each run of equal rates ends: next index whose rate differs (len(rates) if none).
    _next_diff: tuple[int, ...] = field(default=(), init=False, repr=False, compare=False)
    # ∫ rate over [0, starts[i]) for every i, then (periodic) over one whole period.
    _prefix: tuple[float, ...] = field(default=(), init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        starts, rates = tuple(map(float, self.starts)), tuple(map(float, self.rates))
        if not starts or len(starts) != len(rates):
            raise ValueError(f"need as many starts as rates, at least one (got {len(starts)}, {len(rates)})")
        if starts[0] != 0.0:
            raise ValueError(f"the first segment must start at 0, not {starts[0]:g}")
        for a, b in itertools.pairwise(starts):
            if not b > a:
                raise ValueError(f"segment starts must increase ({a:g} then {b:g})")
        if not all(math.isfinite(s) for s in starts):
            raise ValueError("segment starts must be finite")
        for rate in rates:
            if not (rate >= 0 and math.isfinite(rate)):
                raise ValueError(f"rates must be finite and >= 0, got {rate}")
        if self.period_s is not None and not (math.isfinite(self.period_s) and self.period_s > starts[-1]):
            raise ValueError(
                f"period_s must be finite and after the last start ({starts[-1]:g}), got {self.period_s}"
            )
        for name in ("prompt_tokens", "output_tokens"):
            value = getattr(self, name)
            if not (value >= 0 and math.isfinite(value)):
                raise ValueError(f"{name} must be finite and >= 0, got {value}")
        next_diff = [len(rates)] * len(rates)
        for i in range(len(rates) - 2, -1, -1):
            next_diff[i] = i + 1 if rates[i + 1] != rates[i] else next_diff[i + 1]
        object.__setattr__(self, "starts", starts)
        object.__setattr__(self, "rates", rates)
        prefix = [0.0]
        for i in range(1, len(starts)):
            prefix.append(prefix[-1] + rates[i - 1] * (starts[i] - starts[i - 1]))
        if self.period_s is not None:
            prefix.append(prefix[-1] + rates[-1] * (self.period_s - starts[-1]))
        object.__setattr__(self, "_next_diff", tuple(next_diff))
        object.__setattr__(self, "_prefix", tuple(prefix))

    # -- lookups ----------------------------------------------------------------------------------

    def _fold(self, t: float) -> tuple[int, float]:
        """(how many whole periods precede t, t within its period); (0, t) if non-periodic."""
        if not (t >= 0 and math.isfinite(t)):
            raise ValueError(f"load curves are defined for finite t >= 0; asked for t={t}")
        period = self.period_s
        if period is None:
            return 0, t
        n = math.floor(t / period)
        local = t - n * period
        if local >= period:  # rounding at a period boundary
            n, local = n + 1, 0.0
        elif local < 0:
            n, local = n - 1, max(local + period, 0.0)
        return n, local

    def _segment(self, local: float) -> int:
        starts, hint = self.starts, self._hint
        i = hint[0]
        last = len(starts) - 1
        if starts[i] <= local and (i == last or local < starts[i + 1]):
            return i
        if i < last and starts[i + 1] <= local and (i + 1 == last or local < starts[i + 2]):
            i += 1
        else:
            i = bisect.bisect_right(starts, local) - 1
        hint[0] = i
        return i

    def rate_at(self, t: float) -> float:
        """The request rate (req/s) at time `t` (seconds from 0)."""
        return self.rates[self._segment(self._fold(t)[1])]

    def next_change_after(self, t: float) -> float:
        """The first time after `t` at which the rate differs from `rate_at(t)`; inf if never."""
        n, local = self._fold(t)
        base = n * self.period_s if self.period_s is not None else 0.0
        i = self._segment(local)
        j = self._next_diff[i]
        if j < len(self.starts):
            return max(base + self.starts[j], math.nextafter(t, math.inf))
        if self.period_s is None:
            return math.inf
        # The run of equal rates reaches the period's end: where does the next period change?
        rate = self.rates[i]
        if self.rates[0] != rate:
            return max(base + self.period_s, math.nextafter(t, math.inf))
        k = self._next_diff[0]
        if k >= len(self.starts):
            return math.inf  # one rate all period long
        return base + self.period_s + self.starts[k]

    def expected_requests(self, t0: float, t1: float) -> float:
        """∫ rate dt over [t0, t1): how many requests the curve expects in that span."""
        if t1 < t0:
            raise ValueError(f"need t0 <= t1, got {t0}, {t1}")
        return self._cumulative(t1) - self._cumulative(t0)

    def _cumulative(self, t: float) -> float:
        n, local = self._fold(t)
        i = self._segment(local)
        within = self._prefix[i] + self.rates[i] * (local - self.starts[i])
        return within if self.period_s is None else n * self._prefix[-1] + within

    # -- statistics -------------------------------------------------------------------------------

    @property
    def span_s(self) -> float:
        """The length the statistics cover by default: one period, or (non-periodic) one segment
        past the last start, as long as the segment before it (as the trace readers size the last
        window); a single-segment curve spans 1 s (its rate is the same everywhere)."""
        if self.period_s is not None:
            return self.period_s
        if len(self.starts) == 1:
            return 1.0
        return self.starts[-1] + (self.starts[-1] - self.starts[-2])

    def max_rate(self) -> float:
        """The highest rate anywhere on the curve."""
        return max(self.rates)

    def mean_rate(self, until_s: float | None = None) -> float:
        """Time-weighted mean rate over [0, until_s) (default `span_s`)."""
        horizon = self.span_s if until_s is None else until_s
        if not horizon > 0:
            raise ValueError(f"need a horizon > 0, got {horizon}")
        return self.expected_requests(0.0, horizon) / horizon

    def peak_window_rate(self, window_s: float = 600.0, until_s: float | None = None) -> float:
        """The highest mean rate over any `window_s`-long window inside [0, until_s).

        ``until_s`` defaults to `span_s` (periodic curves: windows may straddle the wrap, i.e. any
        window of the repeating curve). A window longer than the horizon averages the horizon.
        """
        if not window_s > 0:
            raise ValueError(f"window_s must be > 0, got {window_s}")
        period = self.period_s
        wraps = until_s is None and period is not None
        horizon = self.span_s if until_s is None else until_s
        if not horizon > 0:
            raise ValueError(f"need a horizon > 0, got {horizon}")
        if window_s >= horizon and not wraps:
            return self.mean_rate(horizon)
        # The window's mean is piecewise linear in its position, so the best window starts or
        # ends at a change point: only those positions need checking.
        reach = horizon + window_s if wraps else horizon
        points: list[float] = [reach]
        copies = 1 if period is None else math.ceil(reach / period)
        for n in range(copies):
            base = 0.0 if period is None else n * period
            points.extend(base + s for s in self.starts if base + s < reach)
        highest = reach - window_s
        best = 0.0
        for p in points:
            for edge in (p, p - window_s):
                lo = min(max(edge, 0.0), highest)
                best = max(best, self.expected_requests(lo, lo + window_s) / window_s)
        return best

    def scaled(self, factor: float) -> LoadCurve:
        """The same curve with every rate multiplied by `factor` (≥ 0); token means unchanged."""
        if not (factor >= 0 and math.isfinite(factor)):
            raise ValueError(f"scale factor must be finite and >= 0, got {factor}")
        return LoadCurve(
            self.starts,
            tuple(r * factor for r in self.rates),
            self.period_s,
            self.prompt_tokens,
            self.output_tokens,
        )


# -- building curves from trace specs ------------------------------------------------------------


def load_curve(spec: TraceSpec | str, *, days: float, data_root: Path | None = None) -> LoadCurve:
    """The rate curve of a ``--trace`` spec for a run of `days` days (see the module docstring).

    A string is parsed with `parse_trace_spec` (relative paths also looked up under `data_root`,
    default the data directory); its `TraceSpecError` and the readers' located ValueErrors
    (``file:line: what``) propagate unchanged. `days` sizes synthetic ramp and step curves and
    must be > 0; trace curves are periodic with the trace's own length whatever `days` is.
    """
    if not (days > 0 and math.isfinite(days)):
        raise ValueError(f"days must be a finite number > 0, got {days}")
    parsed = parse_trace_spec(spec, data_root) if isinstance(spec, str) else spec
    if parsed.kind == "synthetic":
        return _synthetic_curve(parsed, days * DAY_S)
    assert parsed.path is not None
    if parsed.kind == "azure":
        starts, rates, end, prompt, output = _azure_bins(parsed.path)
    else:
        if parsed.kind == "servegen":
            windows = _servegen_windows(parsed.path, parsed.clients)
        else:
            windows = read_servegen_aggregate(parsed.path)
        starts, rates, end = _sum_windows(windows)
        prompt, output = token_means(parsed.tokens)
    starts, rates = _rotate(starts, rates, end, parsed.start_s, parsed.text)
    scale = parsed.rate_scale
    return LoadCurve(tuple(starts), tuple(r * scale for r in rates), end, prompt, output)


def _servegen_windows(directory: Path, clients: Sequence[int] | None) -> list[RateWindow]:
    files = servegen_client_files(directory)
    chosen = list(files) if clients is None else list(dict.fromkeys(clients))
    missing = [c for c in chosen if c not in files]
    if missing:
        raise ValueError(f"{directory}: no trace file for client(s) {', '.join(map(str, missing))}")
    windows: list[RateWindow] = []
    for client in chosen:
        windows.extend(w for w in read_servegen_client(files[client]) if w.pattern and w.rate > 0)
    if not windows:
        raise ValueError(f"{directory}: the selected clients have no traffic")
    return windows


def _sum_windows(windows: Sequence[RateWindow]) -> tuple[list[float], list[float], float]:
    """Sum overlapping windows into (starts from 0, rates, end): zero where none covers."""
    end = max(w.end_s for w in windows)
    bounds = sorted({0.0, *(w.start_s for w in windows), *(w.end_s for w in windows)} - {end})
    if bounds[0] < 0:
        raise ValueError(f"trace windows must start at t >= 0, got {bounds[0]:g}")
    index = {b: i for i, b in enumerate(bounds)}
    parts: list[list[float]] = [[] for _ in bounds]
    for w in windows:
        last = index[w.end_s] if w.end_s != end else len(bounds)
        for i in range(index[w.start_s], last):
            parts[i].append(w.rate)
    return bounds, [math.fsum(p) for p in parts], end


def _azure_bins(path: Path) -> tuple[list[float], list[float], float, float, float]:
    """Requests per 60-s bin (the last, partial bin left out), mean prompt and output tokens; read
    row by row, so a week-long trace costs its bins, not its millions of rows."""
    counts: list[int] = []
    rows = 0
    last = 0.0
    prompt_sum = output_sum = 0
    for at, prompt, output in iter_azure_csv(path):
        k = int(at // BIN_S)
        if k >= len(counts):
            counts.extend([0] * (k + 1 - len(counts)))
        counts[k] += 1
        rows += 1
        last = at
        prompt_sum += prompt
        output_sum += max(output, 1)
    if not rows:
        raise ValueError(f"{path}: no requests")
    bins = math.floor(last / BIN_S)
    if bins < 1:
        raise ValueError(f"{path}: the trace lasts under {BIN_S:g} s; too short for a rate curve")
    counts = counts[:bins]
    return (
        [k * BIN_S for k in range(bins)],
        [c / BIN_S for c in counts],
        bins * BIN_S,
        prompt_sum / rows,
        output_sum / rows,
    )


def _rotate(
    starts: list[float], rates: list[float], end: float, start_s: float, text: str
) -> tuple[list[float], list[float]]:
    """Make trace time `start_s` the curve's t=0; what came before follows the trace's end."""
    if start_s == 0:
        return starts, rates
    if not start_s < end:
        raise ValueError(f"{text}: start {start_s:g} s is at or after the trace's end ({end:g} s)")
    i = bisect.bisect_right(starts, start_s) - 1
    new_starts = [0.0] + [s - start_s for s in starts[i + 1 :]] + [s + end - start_s for s in starts[: i + 1]]
    new_rates = [rates[i], *rates[i + 1 :], *rates[: i + 1]]
    if starts[i] == start_s:  # the split fell on a boundary: no empty piece at the end
        new_starts.pop()
        new_rates.pop()
    return new_starts, new_rates


def _synthetic_curve(spec: TraceSpec, duration_s: float) -> LoadCurve:
    prompt, output = token_means(spec.tokens)
    kind = spec.synthetic_kind
    high = 4.0 * spec.rate if spec.peak is None else spec.peak
    if kind == "constant":
        return LoadCurve((0.0,), (spec.rate,), None, prompt, output)
    if kind == "step":
        at = duration_s / 2 if spec.step_at_s is None else spec.step_at_s
        if at <= 0:
            return LoadCurve((0.0,), (high,), None, prompt, output)
        return LoadCurve((0.0, at), (spec.rate, high), None, prompt, output)
    span = duration_s if kind == "ramp" else spec.period_s
    curve = synthetic_rate(kind, spec.rate, duration_s, spec.peak, spec.period_s, spec.step_at_s)
    starts = [k * BIN_S for k in range(math.ceil(span / BIN_S))]
    ends = [*starts[1:], span]
    rates = [max(curve((a + b) / 2), 0.0) for a, b in zip(starts, ends, strict=True)]
    if kind == "ramp":
        starts.append(span)  # after the ramp: its peak, forever
        rates.append(high)
        return LoadCurve(tuple(starts), tuple(rates), None, prompt, output)
    return LoadCurve(tuple(starts), tuple(rates), spec.period_s, prompt, output)


def token_means(sampler: TokenSampler) -> tuple[float, float]:
    """Mean (prompt, output) tokens per request of a sampler.

    Exact for `FixedTokens` and `EmpiricalTokens`; for `LogNormalTokens` the mean of the
    log-normal clipped at its maxima (rounding and the floor of 1 token are ignored: < 0.1 %);
    any other sampler: the mean of 20,000 draws from a fixed seed.
    """
    if isinstance(sampler, FixedTokens):
        return float(sampler.prompt_tokens), float(sampler.max_tokens)
    if isinstance(sampler, EmpiricalTokens):
        n = len(sampler.pairs)
        return math.fsum(p for p, _ in sampler.pairs) / n, math.fsum(o for _, o in sampler.pairs) / n
    if isinstance(sampler, LogNormalTokens):
        return (
            _clipped_lognormal_mean(sampler.prompt_log_mean, sampler.prompt_log_sd, sampler.prompt_max),
            _clipped_lognormal_mean(sampler.output_log_mean, sampler.output_log_sd, sampler.output_max),
        )
    rng = random.Random("load-curve-token-means")
    draws = [sampler.sample(rng) for _ in range(_TOKEN_SAMPLES)]
    return math.fsum(p for p, _ in draws) / len(draws), math.fsum(o for _, o in draws) / len(draws)


def _clipped_lognormal_mean(mu: float, sigma: float, cap: float) -> float:
    """E[min(X, cap)] for ln X ~ N(mu, sigma²)."""
    if sigma <= 0:
        return min(math.exp(mu), cap)
    unit = NormalDist()
    log_cap = math.log(cap)
    below = math.exp(mu + sigma * sigma / 2) * unit.cdf((log_cap - mu - sigma * sigma) / sigma)
    return below + cap * (1.0 - unit.cdf((log_cap - mu) / sigma))
