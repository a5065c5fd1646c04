"""Request streams from real LLM serving traces (ServeGen, Azure) and synthetic shapes.

Every loader yields `TraceRequest(at_s, prompt_tokens, max_tokens)` in trace time, sorted by
`at_s`, with ``at_s = 0`` at the start of the selected span (`start_s`). Streams are lazy (14 days
of ServeGen traffic are ~10⁸ requests) and deterministic: the same arguments and seed give the
same stream, and cropping a span (`start_s`, `duration_s`) does not change the requests inside it.
Randomness comes from `random.Random` instances seeded explicitly (no numpy).

Sources (attribution as in ``$LOWTIDE_DATA_DIR/README.md``):

* **ServeGen per-client** (`servegen_clients`; alibaba/ServeGen ``data/language/m-large``, Xiang
  et al., "ServeGen", arXiv:2505.09999 / NSDI 2026, Apache-2.0). Each ``chunk-<client>-trace.csv``
  line is ``window_start_s, rate_req_per_s, cv, pattern, p1, p2`` for a 600 s window; an empty
  pattern is no traffic. ``p1, p2`` are the *shape* and *scale* of the inter-arrival fit, exactly
  as ServeGen reads and uses them: ``servegen/clientpool.py`` stores ``pat = (name, (p1, p2))``
  and ``servegen/construct.py::_sample_iats`` unpacks ``(shape, scale)`` and draws
  ``scipy.stats.gamma.rvs(a=shape, scale=scale)`` (Gamma: density ∝ x^(shape−1)·e^(−x/scale), mean
  shape·scale, cv 1/√shape — the data's cv column equals 1/√p1 on Gamma rows) or
  ``scipy.stats.weibull_min.rvs(c=shape, scale=scale)`` (Weibull: CDF 1 − e^(−(x/scale)^shape)).
  Here: ``random.gammavariate(alpha=shape, beta=scale)`` and ``random.weibullvariate(alpha=scale,
  beta=shape)`` (Python names the Weibull scale *alpha*). Like ServeGen, the gaps of a window are
  then rescaled so that the window carries its recorded rate (the fitted scale alone misses it by
  more than 2 % on ~40 % of the m-large rows): we draw ``n + 1`` gaps for ``n = rate·600``
  (stochastically rounded, so the expected count is exactly ``rate·600``), scale them to sum to
  the window length and place ``n`` arrivals at their cumulative sums. (ServeGen draws
  ``ceil(rate·W)`` gaps and keeps the arrivals strictly inside the window, i.e. one fewer.) Each
  (seed, client, window) has its own RNG. The files carry no per-request token counts (ServeGen
  keeps those in ``chunk-*-dataset.json``, not copied here); they are drawn from a `TokenSampler`
  (default `LogNormalTokens`, fitted to the Azure conversation trace; or that trace's empirical
  pairs).
* **ServeGen aggregate** (`servegen_aggregate`; the derived per-window sum of all m-large clients,
  hundreds of req/s: use ``rate_scale``). Same window method with Gamma gaps of a given cv (cv=1:
  exponential gaps, Poisson-like).
* **Azure LLM inference 2023** (`azure`; Azure/AzurePublicDataset, Patel et al., "Splitwise", ISCA
  2024, CC-BY 4.0): exact timestamps relative to the file's first request, ``ContextTokens`` as
  prompt tokens and ``GeneratedTokens`` as ``max_tokens``. ``rate_scale`` ≤ 1 thins the stream.
* **Synthetic** (`synthetic`): a non-homogeneous Poisson process (Lewis–Shedler thinning) with a
  constant, ramp, step or diurnal rate curve (see `synthetic_rate`).

`parse_trace_spec` reads the CLI's ``--trace`` grammar (documented at `parse_trace_spec`) into a
`TraceSpec`. Neighbours: `emulator.loadgen` replays a stream over HTTP; `cli.loadgen_cmd` parses
the spec. Must not: do network I/O, import anything of lowtide but `lowtide.domain`, or materialise a
multi-day request stream (rate tables are small; requests are generated window by window).
"""

from __future__ import annotations

import csv
import heapq
import itertools
import math
import os
import random
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Literal, Protocol

DEFAULT_WINDOW_S = 600.0
SERVEGEN_PATTERNS = ("Gamma", "Weibull")
SYNTHETIC_KINDS = ("constant", "ramp", "diurnal", "step")
TRACE_KINDS = ("servegen", "servegen-aggregate", "azure", "synthetic")
TraceKind = Literal["servegen", "servegen-aggregate", "azure", "synthetic"]
SyntheticKind = Literal["constant", "ramp", "diurnal", "step"]
AZURE_HEADER = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
AZURE_CONV = Path("traces/azure-llm-2023/AzureLLMInferenceTrace_conv.csv")
AZURE_CODE = Path("traces/azure-llm-2023/AzureLLMInferenceTrace_code.csv")
_CLIENT_FILE = re.compile(r"^chunk-(\d+)-trace\.csv$")


def data_dir() -> Path:
    """The reference data directory: ``$LOWTIDE_DATA_DIR``, else ``<repo>/../shared/data``."""
    env = os.environ.get("LOWTIDE_DATA_DIR")
    if env:
        return Path(env)
    repo = Path(__file__).resolve().parents[3]  # src/lowtide/emulator/traces.py -> repo
    return repo.parent / "shared" / "data"


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of a stream: when (trace seconds since the span start) and how big."""

    at_s: float
    prompt_tokens: int
    max_tokens: int


# -- token counts ------------------------------------------------------------------------------


class TokenSampler(Protocol):
    """Draws (prompt_tokens, max_tokens) for a request whose trace has no token counts."""

    def sample(self, rng: random.Random) -> tuple[int, int]: ...

    def describe(self) -> str: ...


@dataclass(frozen=True, slots=True)
class FixedTokens:
    """Every request has the same size."""

    prompt_tokens: int
    max_tokens: int

    def sample(self, rng: random.Random) -> tuple[int, int]:
        return self.prompt_tokens, self.max_tokens

    def describe(self) -> str:
        return f"fixed {self.prompt_tokens}/{self.max_tokens}"


@dataclass(frozen=True, slots=True)
class LogNormalTokens:
    """Independent log-normal prompt and output lengths, rounded and clipped to [1, max].

    Defaults: mean and standard deviation of ln(tokens) over the Azure LLM conversation trace
    (19,366 requests): prompt 6.633 / 0.985 (median ≈ 760 tokens), output 5.019 / 0.859
    (median ≈ 150). The joint empirical pairs are `EmpiricalTokens.from_azure_csv`.
    """

    prompt_log_mean: float = 6.633
    prompt_log_sd: float = 0.985
    output_log_mean: float = 5.019
    output_log_sd: float = 0.859
    prompt_max: int = 16384
    output_max: int = 2048

    def sample(self, rng: random.Random) -> tuple[int, int]:
        prompt = round(math.exp(rng.gauss(self.prompt_log_mean, self.prompt_log_sd)))
        output = round(math.exp(rng.gauss(self.output_log_mean, self.output_log_sd)))
        return min(max(prompt, 1), self.prompt_max), min(max(output, 1), self.output_max)

    def describe(self) -> str:
        return "lognormal (fitted to Azure conv)"


@dataclass(frozen=True, slots=True)
class EmpiricalTokens:
    """(prompt, output) pairs drawn uniformly from a recorded trace (joint distribution kept)."""

    pairs: tuple[tuple[int, int], ...]
    source: str = "empirical"

    def __post_init__(self) -> None:
        if not self.pairs:
            raise ValueError("EmpiricalTokens needs at least one (prompt, output) pair")

    @classmethod
    def from_azure_csv(cls, path: Path) -> EmpiricalTokens:
        pairs = tuple((prompt, output) for _, prompt, output in read_azure_csv(path))
        return cls(pairs, source=f"empirical from {path.name}")

    def sample(self, rng: random.Random) -> tuple[int, int]:
        return self.pairs[rng.randrange(len(self.pairs))]

    def describe(self) -> str:
        return self.source


DEFAULT_TOKENS = LogNormalTokens()


# -- inter-arrival gaps and windows ---------------------------------------------------------------


def interarrival_sampler(pattern: str, shape: float, scale: float) -> Callable[[random.Random], float]:
    """A gap sampler for a ServeGen pattern: Gamma(shape, scale) or Weibull(shape, scale)."""
    if not (shape > 0 and scale > 0 and math.isfinite(shape) and math.isfinite(scale)):
        raise ValueError(f"{pattern} needs finite shape > 0 and scale > 0, got {shape}, {scale}")
    if pattern == "Gamma":
        return lambda rng: rng.gammavariate(shape, scale)
    if pattern == "Weibull":
        return lambda rng: rng.weibullvariate(scale, shape)
    raise ValueError(f"unknown inter-arrival pattern {pattern!r} (known: {', '.join(SERVEGEN_PATTERNS)})")


@dataclass(frozen=True, slots=True)
class RateWindow:
    """A span of trace time with a mean rate and the shape of its inter-arrival gaps.

    `pattern` is ``Gamma``/``Weibull`` (with `shape`, `scale`) or ``""`` (no traffic).
    """

    start_s: float
    size_s: float
    rate: float
    cv: float
    pattern: str
    shape: float
    scale: float

    @property
    def end_s(self) -> float:
        return self.start_s + self.size_s


def window_arrivals(window: RateWindow, rate_scale: float, rng: random.Random) -> list[float]:
    """Arrival times (absolute trace seconds, ascending, inside the window) for one window.

    ``n = rate·rate_scale·size`` stochastically rounded; ``n + 1`` gaps from the window's pattern,
    rescaled to fill the window; arrivals at the first ``n`` cumulative sums.
    """
    if not window.pattern or window.rate <= 0 or rate_scale <= 0:
        return []
    expected = window.rate * rate_scale * window.size_s
    n = int(expected)
    if rng.random() < expected - n:
        n += 1
    if n == 0:
        return []
    draw = interarrival_sampler(window.pattern, window.shape, window.scale)
    gaps = [draw(rng) for _ in range(n + 1)]
    total = math.fsum(gaps)
    if not (total > 0 and math.isfinite(total)):  # degenerate draw: spread evenly
        gaps, total = [1.0] * (n + 1), float(n + 1)
    factor = window.size_s / total
    last = math.nextafter(window.end_s, window.start_s)
    out: list[float] = []
    t = window.start_s
    for gap in gaps[:n]:
        t += gap * factor
        out.append(min(t, last))
    return out


def _span(start_s: float, duration_s: float | None) -> tuple[float, float]:
    if not (start_s >= 0 and math.isfinite(start_s)):
        raise ValueError(f"start_s must be a finite number >= 0, got {start_s}")
    if duration_s is not None and not (duration_s > 0):
        raise ValueError(f"duration_s must be > 0, got {duration_s}")
    return start_s, math.inf if duration_s is None else start_s + duration_s


def _windows_stream(
    windows: Iterable[RateWindow],
    lo: float,
    hi: float,
    rate_scale: float,
    tokens: TokenSampler,
    seed_prefix: str,
) -> Iterator[TraceRequest]:
    for window in windows:
        if window.end_s <= lo or not window.pattern or window.rate <= 0:
            continue
        if window.start_s >= hi:
            break
        rng = random.Random(f"{seed_prefix}:{window.start_s!r}")
        arrivals = window_arrivals(window, rate_scale, rng)
        sizes = [tokens.sample(rng) for _ in arrivals]  # drawn for all: cropping keeps the rest
        for t, (prompt, output) in zip(arrivals, sizes, strict=True):
            if lo <= t < hi:
                yield TraceRequest(t - lo, prompt, output)


# -- ServeGen ----------------------------------------------------------------------------------------


def _float(text: str, where: str, what: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"{where}: {what} is not a number: {text!r}") from None
    if not math.isfinite(value):
        raise ValueError(f"{where}: {what} is not finite: {text!r}")
    return value


def _check_ascending(starts: list[float], lines: list[int], path: Path) -> None:
    """ValueError at the first line whose window start does not exceed the previous one."""
    for i in range(1, len(starts)):
        if starts[i] <= starts[i - 1]:
            raise ValueError(
                f"{path}:{lines[i]}: window starts must increase ({starts[i - 1]:g} then {starts[i]:g})"
            )


def _sizes(starts: list[float]) -> list[float]:
    """Window sizes from consecutive starts; the last window is as long as the one before."""
    sizes = [b - a for a, b in itertools.pairwise(starts)]
    sizes.append(sizes[-1] if sizes else DEFAULT_WINDOW_S)
    return sizes


def read_servegen_client(path: Path) -> list[RateWindow]:
    """Parse one ServeGen ``chunk-<client>-trace.csv``; ValueError names the file and line."""
    rows: list[tuple[float, float, float, str, float, float]] = []
    lines: list[int] = []
    with path.open(newline="") as handle:
        for lineno, fields in enumerate(csv.reader(handle), start=1):
            where = f"{path}:{lineno}"
            if not fields:
                continue
            if len(fields) != 6:
                raise ValueError(f"{where}: expected 6 fields, got {len(fields)}")
            start, rate, cv = (_float(fields[i], where, n) for i, n in enumerate(("start", "rate", "cv")))
            pattern = fields[3].strip()
            p1, p2 = _float(fields[4], where, "p1"), _float(fields[5], where, "p2")
            if rate < 0 or cv < 0:
                raise ValueError(f"{where}: rate and cv must be >= 0")
            if pattern and pattern not in SERVEGEN_PATTERNS:
                raise ValueError(f"{where}: unknown pattern {pattern!r} (known: Gamma, Weibull, empty)")
            if pattern and not (p1 > 0 and p2 > 0):
                raise ValueError(f"{where}: {pattern} needs shape p1 > 0 and scale p2 > 0")
            rows.append((start, rate, cv, pattern, p1, p2))
            lines.append(lineno)
    if not rows:
        raise ValueError(f"{path}: no windows (empty file)")
    starts = [r[0] for r in rows]
    _check_ascending(starts, lines, path)
    return [
        RateWindow(start, size, rate, cv, pattern, p1, p2)
        for (start, rate, cv, pattern, p1, p2), size in zip(rows, _sizes(starts), strict=True)
    ]


def servegen_client_files(directory: Path) -> dict[int, Path]:
    """Client id → trace file for every ``chunk-<id>-trace.csv`` in `directory`."""
    found: dict[int, Path] = {}
    for entry in directory.iterdir():
        match = _CLIENT_FILE.match(entry.name)
        if match and entry.is_file():
            found[int(match.group(1))] = entry
    return dict(sorted(found.items()))


def servegen_clients(
    directory: Path,
    clients: Iterable[int] | None = None,
    start_s: float = 0.0,
    duration_s: float | None = None,
    seed: int = 0,
    rate_scale: float = 1.0,
    tokens: TokenSampler = DEFAULT_TOKENS,
) -> Iterator[TraceRequest]:
    """Arrivals of the chosen ServeGen clients (all when None), merged in time order."""
    lo, hi = _span(start_s, duration_s)
    if not rate_scale > 0:
        raise ValueError(f"rate_scale must be > 0, got {rate_scale}")
    files = servegen_client_files(Path(directory))
    if not files:
        raise ValueError(f"{directory}: no chunk-<client>-trace.csv files")
    chosen = list(files) if clients is None else list(dict.fromkeys(clients))
    missing = [c for c in chosen if c not in files]
    if missing:
        raise ValueError(f"{directory}: no trace file for client(s) {', '.join(map(str, missing))}")
    streams = [
        _windows_stream(read_servegen_client(files[c]), lo, hi, rate_scale, tokens, f"servegen:{seed}:{c}")
        for c in chosen
    ]
    return heapq.merge(*streams, key=lambda r: r.at_s)


def read_servegen_aggregate(path: Path) -> list[RateWindow]:
    """Parse the aggregate CSV (``window_start_s``, ``total_rate_rps`` columns) into windows.

    The pattern is left empty; `servegen_aggregate` fills in the Gamma gap shape.
    """
    starts: list[float] = []
    rates: list[float] = []
    lines: list[int] = []
    with path.open(newline="") as handle:
        reader = csv.DictReader(handle)
        header = reader.fieldnames or []
        for column in ("window_start_s", "total_rate_rps"):
            if column not in header:
                raise ValueError(f"{path}:1: missing column {column!r} (have: {', '.join(header)})")
        for row in reader:
            lineno = reader.line_num  # physical line: DictReader skips blank lines
            where = f"{path}:{lineno}"
            starts.append(_float(row["window_start_s"] or "", where, "window_start_s"))
            rate = _float(row["total_rate_rps"] or "", where, "total_rate_rps")
            if rate < 0:
                raise ValueError(f"{where}: total_rate_rps must be >= 0")
            rates.append(rate)
            lines.append(lineno)
    if not starts:
        raise ValueError(f"{path}: no windows (a header but no rows)")
    _check_ascending(starts, lines, path)
    return [
        RateWindow(start, size, rate, 0.0, "", 0.0, 0.0)
        for start, size, rate in zip(starts, _sizes(starts), rates, strict=True)
    ]


def servegen_aggregate(
    csv_path: Path,
    start_s: float = 0.0,
    duration_s: float | None = None,
    seed: int = 0,
    rate_scale: float = 1.0,
    cv: float = 1.0,
    tokens: TokenSampler = DEFAULT_TOKENS,
) -> Iterator[TraceRequest]:
    """Arrivals at each window's total rate × `rate_scale`, Gamma gaps with the given cv."""
    lo, hi = _span(start_s, duration_s)
    if not rate_scale > 0:
        raise ValueError(f"rate_scale must be > 0, got {rate_scale}")
    if not (cv > 0 and math.isfinite(cv)):
        raise ValueError(f"cv must be a finite number > 0, got {cv}")
    shape = 1.0 / (cv * cv)
    windows = (
        RateWindow(w.start_s, w.size_s, w.rate, cv, "Gamma", shape, 1.0 / (max(w.rate, 1e-12) * shape))
        for w in read_servegen_aggregate(Path(csv_path))
    )
    return _windows_stream(windows, lo, hi, rate_scale, tokens, f"aggregate:{seed}")


# -- Azure ---------------------------------------------------------------------------------------------


def read_azure_csv(path: Path) -> list[tuple[float, int, int]]:
    """(seconds since the first request, context tokens, generated tokens) for every row."""
    return list(iter_azure_csv(path))


def iter_azure_csv(path: Path) -> Iterator[tuple[float, int, int]]:
    """`read_azure_csv` row by row (a week-long Azure trace holds millions of rows: a caller that
    only counts them need not hold them); a malformed row raises ValueError naming file and line."""
    last = -math.inf
    first: datetime | None = None
    with path.open(newline="") as handle:
        reader = csv.reader(handle)
        header = tuple(h.strip() for h in next(reader, []))
        if header != AZURE_HEADER:
            raise ValueError(f"{path}:1: expected header {','.join(AZURE_HEADER)}, got {','.join(header)}")
        for lineno, fields in enumerate(reader, start=2):
            where = f"{path}:{lineno}"
            if not fields:
                continue
            if len(fields) != 3:
                raise ValueError(f"{where}: expected 3 fields, got {len(fields)}")
            try:
                stamp = datetime.fromisoformat(fields[0].strip())
            except ValueError as exc:
                raise ValueError(f"{where}: {exc}") from None
            try:
                prompt = int(fields[1])
            except ValueError:
                raise ValueError(f"{where}: ContextTokens is not an integer: {fields[1]!r}") from None
            try:
                output = int(fields[2])
            except ValueError:
                raise ValueError(f"{where}: GeneratedTokens is not an integer: {fields[2]!r}") from None
            if prompt < 0 or output < 0:
                raise ValueError(f"{where}: token counts must be >= 0")
            first = stamp if first is None else first
            at = (stamp - first).total_seconds()
            if at < last:
                raise ValueError(f"{where}: timestamps go backwards")
            last = at
            yield at, prompt, output


def azure(
    csv_path: Path,
    start_s: float = 0.0,
    duration_s: float | None = None,
    rate_scale: float = 1.0,
    seed: int = 0,
) -> Iterator[TraceRequest]:
    """The Azure trace's requests with their exact relative timestamps and token counts.

    ``rate_scale`` < 1 keeps each request with that probability (seeded, per row).
    ``max_tokens`` is the recorded ``GeneratedTokens`` (at least 1).
    """
    lo, hi = _span(start_s, duration_s)
    if not 0 < rate_scale <= 1:
        raise ValueError(f"azure traces can only be thinned: rate_scale must be in (0, 1], got {rate_scale}")
    rows = read_azure_csv(Path(csv_path))

    def stream() -> Iterator[TraceRequest]:
        rng = random.Random(f"azure:{seed}")
        for at, prompt, output in rows:
            keep = rate_scale >= 1 or rng.random() < rate_scale
            if at >= hi:
                return
            if keep and at >= lo:
                yield TraceRequest(at - lo, prompt, max(output, 1))

    return stream()


# -- synthetic -------------------------------------------------------------------------------------


def synthetic_rate(
    kind: str,
    rate: float,
    duration_s: float,
    peak: float | None = None,
    period_s: float = 86400.0,
    step_at_s: float | None = None,
) -> Callable[[float], float]:
    """The rate curve r(t) (req/s) of a synthetic kind; `peak` defaults to 4 × `rate`.

    constant: r = rate. ramp: linear from rate (t=0) to peak (t=duration). step: rate before
    `step_at_s` (default duration/2), peak from then on. diurnal: rate + (peak − rate)·(1 −
    cos(2πt/period))/2, i.e. the trough (night) at t=0 and the peak at period/2.
    """
    if kind not in SYNTHETIC_KINDS:
        raise ValueError(f"unknown synthetic kind {kind!r} (known: {', '.join(SYNTHETIC_KINDS)})")
    high = 4.0 * rate if peak is None else peak
    if not (rate >= 0 and high >= 0 and math.isfinite(rate) and math.isfinite(high)):
        raise ValueError(f"rates must be finite and >= 0, got rate={rate}, peak={high}")
    if not (duration_s > 0 and math.isfinite(duration_s)):
        raise ValueError(f"synthetic traces need a finite duration > 0, got {duration_s}")
    if kind == "constant":
        return lambda t: rate
    if kind == "ramp":
        return lambda t: rate + (high - rate) * min(max(t / duration_s, 0.0), 1.0)
    if kind == "step":
        at = duration_s / 2 if step_at_s is None else step_at_s
        return lambda t: rate if t < at else high
    if not period_s > 0:
        raise ValueError(f"period must be > 0, got {period_s}")
    return lambda t: rate + (high - rate) * (1.0 - math.cos(2.0 * math.pi * t / period_s)) / 2.0


def synthetic(
    kind: str = "constant",
    rate: float = 1.0,
    duration_s: float = 60.0,
    seed: int = 0,
    peak: float | None = None,
    period_s: float = 86400.0,
    step_at_s: float | None = None,
    tokens: TokenSampler = DEFAULT_TOKENS,
) -> Iterator[TraceRequest]:
    """Poisson arrivals following `synthetic_rate` over [0, duration_s)."""
    curve = synthetic_rate(kind, rate, duration_s, peak, period_s, step_at_s)
    high = 4.0 * rate if peak is None else peak
    r_max = max(rate, high)

    def stream() -> Iterator[TraceRequest]:
        if r_max <= 0:
            return
        rng = random.Random(f"synthetic:{seed}:{kind}")
        t = 0.0
        while True:
            t += rng.expovariate(r_max)
            if t >= duration_s:
                return
            if rng.random() * r_max < curve(t):
                prompt, output = tokens.sample(rng)
                yield TraceRequest(t, prompt, output)

    return stream()


# -- the --trace grammar -------------------------------------------------------------------------


class TraceSpecError(ValueError):
    """A bad ``--trace`` spec; `position` is the 0-based character where the problem is."""

    def __init__(self, spec: str, position: int, reason: str) -> None:
        self.spec, self.position, self.reason = spec, position, reason
        super().__init__(f"trace spec, at char {position + 1}: {reason}\n  {spec}\n  {' ' * position}^")


_OPTIONS: dict[str, tuple[str, ...]] = {
    "servegen": ("clients", "scale", "start", "tokens"),
    "servegen-aggregate": ("scale", "start", "cv", "tokens"),
    "azure": ("scale", "start"),
    "synthetic": ("rate", "peak", "period", "at", "tokens"),
}
_DURATION = re.compile(r"(\d+(?:\.\d*)?|\.\d+)([dhms]?)")
_UNIT_S = {"d": 86400.0, "h": 3600.0, "m": 60.0, "s": 1.0, "": 1.0}


def parse_seconds(text: str) -> float:
    """``90``, ``90s``, ``10m``, ``10h``, ``1d``, ``1d10h30m`` → seconds; ValueError otherwise."""
    pos, total = 0, 0.0
    text = text.strip()
    while pos < len(text):
        match = _DURATION.match(text, pos)
        if not match or (match.group(2) == "" and match.end() != len(text)):
            raise ValueError(f"not a duration: {text!r} (e.g. 3600, 90s, 10m, 10h, 1d10h)")
        total += float(match.group(1)) * _UNIT_S[match.group(2)]
        pos = match.end()
    if not text:
        raise ValueError("empty duration")
    return total


@dataclass(frozen=True)
class TraceSpec:
    """A parsed ``--trace``: which source, where, and its options (see `parse_trace_spec`)."""

    text: str
    kind: TraceKind
    path: Path | None = None
    clients: tuple[int, ...] | None = None
    rate_scale: float = 1.0
    start_s: float = 0.0
    cv: float = 1.0
    tokens: TokenSampler = DEFAULT_TOKENS
    synthetic_kind: SyntheticKind = "constant"
    rate: float = 1.0
    peak: float | None = None
    period_s: float = 86400.0
    step_at_s: float | None = None

    def requests(self, duration_s: float | None = None, seed: int = 0) -> Iterator[TraceRequest]:
        """The request stream over [start, start + duration_s) (trace seconds), lazily."""
        if self.kind == "servegen":
            assert self.path is not None
            return servegen_clients(
                self.path, self.clients, self.start_s, duration_s, seed, self.rate_scale, self.tokens
            )
        if self.kind == "servegen-aggregate":
            assert self.path is not None
            return servegen_aggregate(
                self.path, self.start_s, duration_s, seed, self.rate_scale, self.cv, self.tokens
            )
        if self.kind == "azure":
            assert self.path is not None
            return azure(self.path, self.start_s, duration_s, self.rate_scale, seed)
        if duration_s is None:
            raise ValueError("synthetic traces need a duration")
        return synthetic(
            self.synthetic_kind,
            self.rate,
            duration_s,
            seed,
            self.peak,
            self.period_s,
            self.step_at_s,
            self.tokens,
        )

    def describe(self) -> str:
        if self.kind == "synthetic":
            shape = f"{self.synthetic_kind} rate={self.rate:g}"
            if self.synthetic_kind != "constant":
                shape += f" peak={4 * self.rate if self.peak is None else self.peak:g}"
            return f"synthetic {shape} req/s, tokens {self.tokens.describe()}"
        parts = [f"{self.kind} {self.path}"]
        if self.clients is not None:
            parts.append(f"clients {','.join(map(str, self.clients))}")
        if self.start_s:
            parts.append(f"from {self.start_s:g} s")
        if self.rate_scale != 1:
            parts.append(f"rate ×{self.rate_scale:g}")
        if self.kind != "azure":
            parts.append(f"tokens {self.tokens.describe()}")
        return ", ".join(parts)


def _resolve(raw: str, data_root: Path, want_dir: bool) -> Path | str:
    """The existing path `raw` names (as given, then under the data dir), or why there is none."""
    given = Path(raw).expanduser()
    candidates = [given] if given.is_absolute() else [given, data_root / given]
    for candidate in candidates:
        if (candidate.is_dir() if want_dir else candidate.is_file()) and os.access(candidate, os.R_OK):
            return candidate
    kind = "directory" if want_dir else "file"
    return f"no readable {kind} {raw!r} (looked at: {', '.join(str(c) for c in candidates)})"


def _parse_clients(value: str) -> tuple[int, ...]:
    out: list[int] = []
    for item in value.split(","):
        lo, sep, hi = item.strip().partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ValueError(f"expected client ids or ranges like 1,2,10-20, got {item!r}")
        first, last = int(lo), int(hi) if sep else int(lo)
        if last < first:
            raise ValueError(f"empty client range {item!r}")
        out.extend(range(first, last + 1))
    return tuple(dict.fromkeys(out))


def _parse_tokens(value: str, data_root: Path) -> TokenSampler:
    if value == "lognormal":
        return DEFAULT_TOKENS
    if value in ("azure-conv", "azure-code"):
        path = data_root / (AZURE_CONV if value == "azure-conv" else AZURE_CODE)
        if not path.is_file():
            raise ValueError(f"tokens={value} needs {path}, which does not exist (LOWTIDE_DATA_DIR?)")
        return EmpiricalTokens.from_azure_csv(path)
    prompt, sep, output = value.partition("/")
    if sep and prompt.isdigit() and output.isdigit() and int(prompt) > 0 and int(output) > 0:
        return FixedTokens(int(prompt), int(output))
    raise ValueError(
        f"expected lognormal, azure-conv, azure-code or PROMPT/OUTPUT (e.g. 512/128), got {value!r}"
    )


def _number(value: str, what: str, minimum: float, inclusive: bool) -> float:
    bound = f"{'>=' if inclusive else '>'} {minimum:g}"
    try:
        number = float(value)
    except ValueError:
        raise ValueError(f"{what} must be a number {bound}, got {value!r}") from None
    if not math.isfinite(number) or number < minimum or (number == minimum and not inclusive):
        raise ValueError(f"{what} must be a number {bound}, got {value!r}")
    return number


def _positive(value: str, what: str) -> float:
    return _number(value, what, 0.0, inclusive=False)


def _non_negative(value: str, what: str) -> float:
    return _number(value, what, 0.0, inclusive=True)


def parse_trace_spec(text: str, data_root: Path | None = None) -> TraceSpec:
    """Parse a ``--trace`` spec; `TraceSpecError` (a ValueError) points at the offending char.

    Grammar::

        SPEC     := SOURCE ( "#" OPTION )*
        SOURCE   := "servegen:" DIR                 per-client ServeGen files (chunk-<id>-trace.csv)
                  | "servegen-aggregate:" CSV       the derived per-window total
                  | "azure:" CSV                    an Azure LLM inference trace
                  | "synthetic" [ ":" KIND ( "," OPTION )* ]    KIND: constant | ramp | diurnal | step
        OPTION   := KEY "=" VALUE

    Options (each at most once; ``synthetic:KIND,a=1`` is the same as ``synthetic:KIND#a=1``):

    ==========  =======================  ==============================================================
    key         sources                  value
    ==========  =======================  ==============================================================
    clients     servegen                 ids and ranges, ``1,2,10-20`` (default: every client file)
    scale       servegen, aggregate,     rate multiplier > 0 (azure: ≤ 1, thinning)
                azure
    start       servegen, aggregate,     where the span starts in the trace: ``36000``, ``10h``,
                azure                    ``1d10h`` (default 0 = 00:00 of day 1 for ServeGen)
    cv          aggregate                cv of the Gamma gaps (default 1: exponential)
    tokens      servegen, aggregate,     ``lognormal`` (default), ``azure-conv``, ``azure-code``
                synthetic                (empirical pairs from the data dir), or ``PROMPT/OUTPUT``
    rate        synthetic                base rate in req/s (default 1)
    peak        synthetic                high rate in req/s (default 4 × rate)
    period      synthetic                diurnal period (default ``1d``)
    at          synthetic                when a step happens (default: half the duration)
    ==========  =======================  ==============================================================

    A relative DIR/CSV is looked up in the working directory, then under the data directory
    (`data_root`, default `data_dir()`): ``servegen:traces/servegen-m-large`` works anywhere.
    Paths cannot contain ``#``. Examples: ``servegen:traces/servegen-m-large#clients=142#start=10h``,
    ``servegen-aggregate:traces/servegen-m-large-aggregate.csv#scale=0.05``,
    ``azure:traces/azure-llm-2023/AzureLLMInferenceTrace_conv.csv``, ``synthetic:ramp,rate=2,peak=20``.
    """
    root = data_dir() if data_root is None else data_root
    if not text.strip():
        raise TraceSpecError(text, 0, f"empty trace spec (expected one of: {', '.join(TRACE_KINDS)})")
    # Split on '#' keeping positions.
    pieces: list[tuple[int, str]] = []
    pos = 0
    for piece in text.split("#"):
        pieces.append((pos, piece))
        pos += len(piece) + 1
    source_at, source = pieces[0]
    scheme, colon, argument = source.partition(":")
    if scheme not in TRACE_KINDS:
        raise TraceSpecError(text, 0, f"unknown trace source {scheme!r} (known: {', '.join(TRACE_KINDS)})")
    kind: TraceKind = scheme  # type: ignore[assignment]
    arg_at = source_at + len(scheme) + len(colon)
    options: list[tuple[int, str]] = []
    values: dict[str, object] = {"text": text, "kind": kind}
    if kind == "synthetic":
        if colon:
            items = argument.split(",")
            synth_kind = items[0].strip()
            if synth_kind not in SYNTHETIC_KINDS:
                raise TraceSpecError(
                    text,
                    arg_at,
                    f"unknown synthetic kind {synth_kind!r} (known: {', '.join(SYNTHETIC_KINDS)})",
                )
            values["synthetic_kind"] = synth_kind
            at = arg_at + len(items[0]) + 1
            for item in items[1:]:
                options.append((at, item))
                at += len(item) + 1
    else:
        if not colon or not argument.strip():
            what = "DIR" if kind == "servegen" else "CSV"
            raise TraceSpecError(
                text, arg_at if colon else len(source), f"{kind} needs a path: {kind}:{what}"
            )
        resolved = _resolve(argument.strip(), root, want_dir=kind == "servegen")
        if isinstance(resolved, str):
            raise TraceSpecError(text, arg_at, resolved)
        if kind == "servegen" and not servegen_client_files(resolved):
            raise TraceSpecError(text, arg_at, f"{resolved} has no chunk-<client>-trace.csv files")
        values["path"] = resolved
    options.extend(pieces[1:])
    seen: set[str] = set()
    for at, option in options:
        key, eq, value = option.partition("=")
        key = key.strip()
        if not eq or not key:
            raise TraceSpecError(text, at, f"expected KEY=VALUE, got {option!r}")
        allowed = _OPTIONS[kind]
        if key not in allowed:
            raise TraceSpecError(text, at, f"unknown option {key!r} for {kind} (known: {', '.join(allowed)})")
        if key in seen:
            raise TraceSpecError(text, at, f"option {key!r} given twice")
        seen.add(key)
        value_at = at + option.index("=") + 1
        try:
            values.update(_option_value(kind, key, value.strip(), root, values.get("path")))
        except ValueError as exc:
            raise TraceSpecError(text, value_at, f"{key}: {exc}") from None
    spec = TraceSpec(**values)  # type: ignore[arg-type]
    if kind == "synthetic":
        try:  # catch peak/rate problems now, with a nominal duration
            synthetic_rate(spec.synthetic_kind, spec.rate, 1.0, spec.peak, spec.period_s, spec.step_at_s)
        except ValueError as exc:
            raise TraceSpecError(text, 0, str(exc)) from None
        if max(spec.rate, 4 * spec.rate if spec.peak is None else spec.peak) <= 0:
            raise TraceSpecError(text, 0, "synthetic traffic needs rate or peak > 0")
    return spec


def _option_value(kind: str, key: str, value: str, root: Path, path: object) -> dict[str, object]:
    if key == "clients":
        clients = _parse_clients(value)
        assert isinstance(path, Path)
        missing = [c for c in clients if c not in servegen_client_files(path)]
        if missing:
            raise ValueError(f"no trace file for client(s) {', '.join(map(str, missing))} in {path}")
        return {"clients": clients}
    if key == "scale":
        scale = _positive(value, "scale")
        if kind == "azure" and scale > 1:
            raise ValueError("azure traces can only be thinned (scale <= 1)")
        return {"rate_scale": scale}
    if key == "start":
        return {"start_s": parse_seconds(value)}
    if key == "cv":
        return {"cv": _positive(value, "cv")}
    if key == "tokens":
        return {"tokens": _parse_tokens(value, root)}
    if key == "rate":
        return {"rate": _non_negative(value, "rate")}
    if key == "peak":
        return {"peak": _non_negative(value, "peak")}
    if key == "period":
        period = parse_seconds(value)
        if period <= 0:
            raise ValueError("period must be > 0")
        return {"period_s": period}
    if key == "at":
        return {"step_at_s": parse_seconds(value)}
    raise ValueError(f"unknown option {key!r}")  # pragma: no cover - _OPTIONS guards this
