"""Research jobs for the simulator: job traces (Alibaba GPU 2023, Philly runtimes) and a generator.

Role: turn a job-trace spec (``alibaba:CSV``, ``philly:CSV``, ``synthetic``; grammar at
`parse_jobs_spec`) into the research jobs submitted during a simulated run: when each arrives,
how many GPUs it needs (on one node), how long it must run uninterrupted, its team and priority.
`research_jobs` returns them sorted by submit time, deterministic for a seed; `job_workload`
returns the same jobs with what was clipped, censored or dropped on the way.
Neighbours: `sim.load` is the other workload input (the inference request rate); the simulator
submits these jobs to the production control loop on its virtual clock; `emulator.traces` owns the
data directory (`data_dir`), path lookup and duration parsing reused here. Must not: read the wall
clock, do network I/O, copy the reference data, or decide scheduling (it only describes demand).

Sources and the assumptions made for each (attribution as in ``$LOWTIDE_DATA_DIR/README.md``):

* **Alibaba GPU v2023** (``openb_pod_list_default.csv``; alibaba/clusterdata, Weng et al., ATC'23):
  one job per pod with ``num_gpu`` ≥ 1. A pod with ``num_gpu`` = 1 and ``gpu_milli`` < 1000 shares a
  GPU: it counts as 1 whole GPU (the simulator lends whole GPUs). Submit = ``creation_time``; work =
  ``deletion_time − scheduled_time``. Pods never scheduled (empty ``scheduled_time``) and pods with a
  zero duration are skipped. Pods whose phase is ``Running`` were still running when the trace was
  taken: their ``deletion_time`` is where the record stops, so their work is a lower bound
  (right-censored); they are kept with that censored duration and counted in
  `JobWorkload.censored` (an empty ``deletion_time`` is censored at the file's last timestamp).
  Priority: qos ``BE`` (best effort) → ``low``, every other qos → ``normal``. Team: a stable hash
  (CRC-32) of the pod name into ``teams`` teams (``team-a``, ``team-b``, …).
  Time mapping: the trace covers 149 days but ~99 % of its GPU pods arrive in the last ~34 (before
  day 115 there are a few dozen). By default the span from the 1st-percentile creation time of the
  usable pods (``start=auto``) to the file's last timestamp is mapped linearly onto the run's
  days, so a 14-day run sees the whole mix, compressed in time (durations are never scaled).
  ``start=`` sets the span's start in trace time (``start=0``: all 149 days); ``scale=F`` maps
  trace seconds to F simulated seconds instead (``scale=1``: real time; pods beyond the run are
  dropped).
* **Philly** (``philly_runtime.csv``; runtimes of 83,154 DNN training jobs, Jeon et al., ATC'19):
  runtimes only, so arrivals and GPU counts are **assumptions**: Poisson arrivals at ``rate`` jobs
  per hour (default 10), each job's work a runtime drawn uniformly from the file's positive
  runtimes (zero-second jobs did no GPU work and are left out), and GPUs drawn from `DL_GPU_MIX`
  (1: 70 %, 2: 10 %, 4: 12 %, 8: 8 % — a round-number guess at the usual shape of deep-learning
  cluster jobs, mostly single-GPU with a tail of whole-node jobs; not measured from this file).
* **synthetic**: a non-homogeneous Poisson process whose rate follows a day/night cycle, ``rate``
  jobs per hour on average, ``rate·(1 + swing·cos(2π(h − 14)/24))`` at hour of day h (peak at
  14:00, trough at 02:00), log-normal work (median ``median``, log-sd ``sigma``) and `DL_GPU_MIX`.
  For machines without the data and for tests.

For philly and synthetic jobs, ``low`` (default 0.42, the best-effort share of the Alibaba pods,
3,398 of 8,152) is the probability that a job has priority ``low``; the rest are ``normal``. No
source yields ``high``. ``jobs=N`` keeps N jobs: for alibaba a seeded sample of N of the pods in
the run (fewer if there are fewer), spread over the span as the trace is; for philly and
synthetic exactly N arrivals over the run (the process conditioned on N arrivals), or, with
``rate`` given too, the first N of its arrivals. Jobs wider than the largest node (`max_gpus`, or
the spec's ``max_gpus`` if smaller) are clipped to it and counted in `JobWorkload.clipped`.
"""

from __future__ import annotations

import csv
import math
import random
import string
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from lowtide.emulator.traces import _resolve, data_dir, parse_seconds

DAY_S = 86400.0
HOUR_S = 3600.0
PRIORITIES = ("low", "normal", "high")
Priority = Literal["low", "normal", "high"]
JOB_KINDS = ("alibaba", "philly", "synthetic")
JobKind = Literal["alibaba", "philly", "synthetic"]
ALIBABA_PODS = Path("traces/alibaba-gpu-v2023/openb_pod_list_default.csv")
PHILLY_RUNTIMES = Path("traces/philly/philly_runtime.csv")
ALIBABA_COLUMNS = (
    "name",
    "num_gpu",
    "gpu_milli",
    "qos",
    "pod_phase",
    "creation_time",
    "deletion_time",
    "scheduled_time",
)
#: GPUs per job for sources without GPU counts (an assumption, see the module docstring).
DL_GPU_MIX: tuple[tuple[int, float], ...] = ((1, 0.70), (2, 0.10), (4, 0.12), (8, 0.08))
#: The busy span of the Alibaba trace starts at this quantile of the creation times (start=auto).
ALIBABA_START_QUANTILE = 0.01
_WorkDraw = Callable[[random.Random], float]
_OPTIONS: dict[str, tuple[str, ...]] = {
    "alibaba": ("jobs", "scale", "start", "max_gpus", "teams"),
    "philly": ("jobs", "rate", "max_gpus", "teams", "low"),
    "synthetic": ("jobs", "rate", "swing", "median", "sigma", "max_gpus", "teams", "low"),
}


class JobTraceError(ValueError):
    """A bad job-trace spec (`position`: 0-based character) or file (`path`, 1-based `line`)."""

    def __init__(
        self,
        reason: str,
        *,
        spec: str | None = None,
        position: int | None = None,
        path: Path | None = None,
        line: int | None = None,
    ) -> None:
        self.reason, self.spec, self.position, self.path, self.line = reason, spec, position, path, line
        if spec is not None and position is not None:
            message = f"job spec, at char {position + 1}: {reason}\n  {spec}\n  {' ' * position}^"
        elif path is not None:
            message = f"{path}:{line}: {reason}" if line is not None else f"{path}: {reason}"
        else:
            message = reason
        super().__init__(message)


@dataclass(frozen=True, slots=True)
class ResearchJob:
    """A research job: submitted at `submit_s` (seconds from t=0), needs `gpus` GPUs on one node
    for `work_s` seconds of uninterrupted work."""

    name: str
    team: str
    submit_s: float
    gpus: int
    work_s: float
    priority: str

    def __post_init__(self) -> None:
        if not (self.submit_s >= 0 and math.isfinite(self.submit_s)):
            raise ValueError(f"{self.name}: submit_s must be finite and >= 0, got {self.submit_s}")
        if self.gpus < 1:
            raise ValueError(f"{self.name}: a job needs at least one GPU, got {self.gpus}")
        if not (self.work_s > 0 and math.isfinite(self.work_s)):
            raise ValueError(f"{self.name}: work_s must be finite and > 0, got {self.work_s}")
        if self.priority not in PRIORITIES:
            raise ValueError(f"{self.name}: priority must be one of {', '.join(PRIORITIES)}")


@dataclass(frozen=True, slots=True)
class JobWorkload:
    """The jobs of a run and what happened on the way (`notes` says it in words)."""

    jobs: tuple[ResearchJob, ...]
    clipped: int = 0
    censored: int = 0
    notes: tuple[str, ...] = ()


@dataclass(frozen=True)
class JobTraceSpec:
    """A parsed job-trace spec (see `parse_jobs_spec`); None means "the source's default"."""

    text: str
    kind: JobKind
    path: Path | None = None
    jobs: int | None = None
    scale: float | None = None
    start_s: float | None = None
    max_gpus: int | None = None
    teams: int = 4
    rate_per_h: float | None = None
    low_share: float = 0.42
    swing: float = 0.6
    median_s: float = 3600.0
    sigma: float = 1.5


# -- the spec grammar -------------------------------------------------------------------------------


def parse_jobs_spec(text: str, data_root: Path | None = None) -> JobTraceSpec:
    """Parse a job-trace spec; `JobTraceError` (a ValueError) points at the offending character.

    Grammar (as ``--trace``, `emulator.traces.parse_trace_spec`)::

        SPEC    := SOURCE ( "#" OPTION )*
        SOURCE  := "alibaba" [ ":" CSV ]     default CSV: traces/alibaba-gpu-v2023/openb_pod_list_default.csv
                 | "philly" [ ":" CSV ]      default CSV: traces/philly/philly_runtime.csv
                 | "synthetic" [ ":" OPTION ( "," OPTION )* ]
        OPTION  := KEY "=" VALUE

    ==========  ==================  ==================================================================
    key         sources             value
    ==========  ==================  ==================================================================
    jobs        all                 keep this many jobs (integer ≥ 1; see the module docstring)
    scale       alibaba             simulated seconds per trace second (> 0; default: fit the span)
    start       alibaba             trace time where the span starts (``115d``, ``0``; default auto)
    max_gpus    all                 clip jobs to this many GPUs (integer ≥ 1)
    teams       all                 number of teams jobs are hashed into (1–26, default 4)
    rate        philly, synthetic   mean arrivals per hour (> 0; default 10)
    low         philly, synthetic   share of low-priority jobs (0–1, default 0.42)
    swing       synthetic           day/night amplitude (0–1, default 0.6: peak 1.6×, trough 0.4×)
    median      synthetic           median work (``3600``, ``1h``; default 1h)
    sigma       synthetic           log-sd of the work (≥ 0, default 1.5)
    ==========  ==================  ==================================================================

    A relative CSV is looked up in the working directory, then under `data_root` (default
    `data_dir()`). The file is read by `job_workload`, not here.
    """
    root = data_dir() if data_root is None else data_root
    if not text.strip():
        raise JobTraceError(
            f"empty job spec (expected one of: {', '.join(JOB_KINDS)})", spec=text, position=0
        )
    pieces: list[tuple[int, str]] = []
    pos = 0
    for piece in text.split("#"):
        pieces.append((pos, piece))
        pos += len(piece) + 1
    source = pieces[0][1]
    scheme, colon, argument = source.partition(":")
    if scheme not in JOB_KINDS:
        raise JobTraceError(
            f"unknown job source {scheme!r} (known: {', '.join(JOB_KINDS)})", spec=text, position=0
        )
    kind: JobKind = scheme  # type: ignore[assignment]
    arg_at = len(scheme) + len(colon)
    values: dict[str, object] = {"text": text, "kind": kind}
    options: list[tuple[int, str]] = []
    if kind == "synthetic":
        if colon:
            at = arg_at
            for item in argument.split(","):
                options.append((at, item))
                at += len(item) + 1
    else:
        default = ALIBABA_PODS if kind == "alibaba" else PHILLY_RUNTIMES
        raw = argument.strip() if colon and argument.strip() else str(default)
        resolved = _resolve(raw, root, want_dir=False)
        if isinstance(resolved, str):
            raise JobTraceError(resolved, spec=text, position=arg_at if colon else len(source))
        values["path"] = resolved
    options.extend(pieces[1:])
    seen: set[str] = set()
    for at, option in options:
        key, eq, value = option.partition("=")
        key = key.strip()
        if not eq or not key:
            raise JobTraceError(f"expected KEY=VALUE, got {option!r}", spec=text, position=at)
        allowed = _OPTIONS[kind]
        if key not in allowed:
            raise JobTraceError(
                f"unknown option {key!r} for {kind} (known: {', '.join(allowed)})", spec=text, position=at
            )
        if key in seen:
            raise JobTraceError(f"option {key!r} given twice", spec=text, position=at)
        seen.add(key)
        try:
            values.update(_option_value(key, value.strip()))
        except ValueError as exc:
            raise JobTraceError(f"{key}: {exc}", spec=text, position=at + option.index("=") + 1) from None
    return JobTraceSpec(**values)  # type: ignore[arg-type]


def _number(value: str, lo: float, hi: float = math.inf, *, open_lo: bool = False) -> float:
    bound = f"{'>' if open_lo else '>='} {lo:g}" + ("" if hi == math.inf else f" and <= {hi:g}")
    try:
        number = float(value)
    except ValueError:
        raise ValueError(f"expected a number {bound}, got {value!r}") from None
    if not math.isfinite(number) or number < lo or number > hi or (open_lo and number == lo):
        raise ValueError(f"expected a number {bound}, got {value!r}")
    return number


def _integer(value: str, lo: int, hi: int | None = None) -> int:
    if not value.isdigit() or int(value) < lo or (hi is not None and int(value) > hi):
        limit = f">= {lo}" if hi is None else f"from {lo} to {hi}"
        raise ValueError(f"expected an integer {limit}, got {value!r}")
    return int(value)


def _option_value(key: str, value: str) -> dict[str, object]:
    if key == "jobs":
        return {"jobs": _integer(value, 1)}
    if key == "scale":
        return {"scale": _number(value, 0.0, open_lo=True)}
    if key == "start":
        return {"start_s": None if value == "auto" else parse_seconds(value)}
    if key == "max_gpus":
        return {"max_gpus": _integer(value, 1)}
    if key == "teams":
        return {"teams": _integer(value, 1, len(string.ascii_lowercase))}
    if key == "rate":
        return {"rate_per_h": _number(value, 0.0, open_lo=True)}
    if key == "low":
        return {"low_share": _number(value, 0.0, 1.0)}
    if key == "swing":
        return {"swing": _number(value, 0.0, 1.0)}
    if key == "median":
        median = parse_seconds(value)
        if not median > 0:
            raise ValueError("must be > 0")
        return {"median_s": median}
    if key == "sigma":
        return {"sigma": _number(value, 0.0)}
    raise ValueError(f"unknown option {key!r}")  # pragma: no cover - _OPTIONS guards this


# -- readers ---------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class AlibabaPod:
    """One GPU pod of the Alibaba trace, as recorded (times in trace seconds)."""

    name: str
    gpus: int
    qos: str
    phase: str
    creation_s: float
    scheduled_s: float | None
    deletion_s: float | None
    line: int


def _field_number(text: str | None, path: Path, line: int, column: str) -> float:
    try:
        value = float(text or "")
    except ValueError:
        raise JobTraceError(f"{column} is not a number: {text!r}", path=path, line=line) from None
    if not math.isfinite(value):
        raise JobTraceError(f"{column} is not finite: {text!r}", path=path, line=line)
    return value


def read_alibaba_pods(path: Path) -> tuple[list[AlibabaPod], float]:
    """The pods with ``num_gpu`` ≥ 1 and the file's last timestamp; `JobTraceError` names the line.

    Checked: the header has the `ALIBABA_COLUMNS`; numbers are numbers (``num_gpu`` a non-negative
    integer); ``scheduled_time`` and ``deletion_time`` are not before ``creation_time`` and
    ``deletion_time`` not before ``scheduled_time``. Empty ``scheduled_time``/``deletion_time``
    mean never scheduled / not deleted.
    """
    pods: list[AlibabaPod] = []
    last = 0.0
    with path.open(newline="") as handle:
        reader = csv.DictReader(handle)
        header = reader.fieldnames
        if not header:
            raise JobTraceError("empty file: expected a header line", path=path, line=1)
        header = [h.strip() for h in header]
        reader.fieldnames = header
        for column in ALIBABA_COLUMNS:
            if column not in header:
                raise JobTraceError(
                    f"missing column {column!r} (have: {', '.join(header)})", path=path, line=1
                )
        for row in reader:
            line = reader.line_num
            gpus_text = (row["num_gpu"] or "").strip()
            if not gpus_text.isdigit():
                raise JobTraceError(
                    f"num_gpu is not a non-negative integer: {row['num_gpu']!r}", path=path, line=line
                )
            _field_number(row["gpu_milli"], path, line, "gpu_milli")
            created = _field_number(row["creation_time"], path, line, "creation_time")
            scheduled = deleted = None
            if (row["scheduled_time"] or "").strip():
                scheduled = _field_number(row["scheduled_time"], path, line, "scheduled_time")
                if scheduled < created:
                    raise JobTraceError(
                        f"scheduled_time {scheduled:g} is before creation_time {created:g}",
                        path=path,
                        line=line,
                    )
            if (row["deletion_time"] or "").strip():
                deleted = _field_number(row["deletion_time"], path, line, "deletion_time")
                if deleted < created:
                    raise JobTraceError(
                        f"deletion_time {deleted:g} is before creation_time {created:g}", path=path, line=line
                    )
                if scheduled is not None and deleted < scheduled:
                    raise JobTraceError(
                        f"negative duration: deletion_time {deleted:g} "
                        f"is before scheduled_time {scheduled:g}",
                        path=path,
                        line=line,
                    )
            last = max(last, created, scheduled or 0.0, deleted or 0.0)
            gpus = int(gpus_text)
            if gpus >= 1:
                name = (row["name"] or "").strip() or f"pod-line-{line}"
                qos, phase = (row["qos"] or "").strip(), (row["pod_phase"] or "").strip()
                pods.append(AlibabaPod(name, gpus, qos, phase, created, scheduled, deleted, line))
    return pods, last


def read_philly_runtimes(path: Path) -> list[float]:
    """The runtimes (seconds) of a ``runtime`` CSV, zeros included; `JobTraceError` names the line."""
    out: list[float] = []
    with path.open(newline="") as handle:
        reader = csv.reader(handle)
        header = [h.strip() for h in next(reader, [])]
        if header != ["runtime"]:
            raise JobTraceError(f"expected the header 'runtime', got {','.join(header)!r}", path=path, line=1)
        for fields in reader:
            line = reader.line_num
            if not fields:
                continue
            if len(fields) != 1:
                raise JobTraceError(f"expected 1 field, got {len(fields)}", path=path, line=line)
            runtime = _field_number(fields[0], path, line, "runtime")
            if runtime < 0:
                raise JobTraceError(f"negative runtime {runtime:g}", path=path, line=line)
            out.append(runtime)
    return out


# -- building the jobs -------------------------------------------------------------------------------


def research_jobs(spec: JobTraceSpec, *, days: float, seed: int, max_gpus: int) -> tuple[ResearchJob, ...]:
    """The jobs submitted in [0, days) of a run, sorted by submit time (see `job_workload`)."""
    return job_workload(spec, days=days, seed=seed, max_gpus=max_gpus).jobs


def job_workload(spec: JobTraceSpec, *, days: float, seed: int, max_gpus: int) -> JobWorkload:
    """The jobs submitted in [0, days) of a run, sorted by submit time, deterministic for `seed`,
    with the counts of clipped and censored jobs and notes on what was mapped or dropped.

    `max_gpus` is the largest node's GPU count (the spec's ``max_gpus`` lowers it further).
    """
    if not (days > 0 and math.isfinite(days)):
        raise ValueError(f"days must be a finite number > 0, got {days}")
    if max_gpus < 1:
        raise ValueError(f"max_gpus must be >= 1, got {max_gpus}")
    cap = max_gpus if spec.max_gpus is None else min(max_gpus, spec.max_gpus)
    horizon = days * DAY_S
    rng = random.Random(f"jobs:{spec.kind}:{seed}")
    notes: list[str] = []
    censored = 0
    if spec.kind == "alibaba":
        assert spec.path is not None
        raw, censored = _alibaba_jobs(spec, spec.path, horizon, rng, notes)
    elif spec.kind == "philly":
        assert spec.path is not None
        runtimes = [r for r in read_philly_runtimes(spec.path) if r > 0]
        if not runtimes:
            raise JobTraceError("no positive runtime", path=spec.path)
        raw = _generated_jobs(spec, horizon, rng, lambda r: runtimes[r.randrange(len(runtimes))], notes)
    else:
        mu, sigma = math.log(spec.median_s), spec.sigma
        raw = _generated_jobs(spec, horizon, rng, lambda r: max(math.exp(r.gauss(mu, sigma)), 1.0), notes)
    jobs: list[ResearchJob] = []
    clipped = 0
    for job in raw:
        if job.gpus > cap:
            clipped += 1
            job = ResearchJob(job.name, job.team, job.submit_s, cap, job.work_s, job.priority)  # noqa: PLW2901
        jobs.append(job)
    if clipped:
        notes.append(f"{clipped} job(s) wider than {cap} GPUs clipped to {cap}")
    jobs.sort(key=lambda j: (j.submit_s, j.name))
    return JobWorkload(tuple(jobs), clipped, censored, tuple(notes))


def _team(name: str, teams: int) -> str:
    return f"team-{string.ascii_lowercase[zlib.crc32(name.encode()) % teams]}"


def _alibaba_jobs(
    spec: JobTraceSpec, path: Path, horizon: float, rng: random.Random, notes: list[str]
) -> tuple[list[ResearchJob], int]:
    pods, trace_end = read_alibaba_pods(path)
    usable = [
        p
        for p in pods
        if p.scheduled_s is not None and (p.deletion_s is None or p.deletion_s > p.scheduled_s)
    ]
    skipped = len(pods) - len(usable)
    if skipped:
        notes.append(f"{skipped} GPU pod(s) never scheduled or with zero duration skipped")
    if not usable:
        raise JobTraceError("no scheduled GPU pod with a positive duration", path=path)
    creations = sorted(p.creation_s for p in usable)
    start = creations[int(ALIBABA_START_QUANTILE * len(creations))] if spec.start_s is None else spec.start_s
    if spec.scale is not None:
        scale = spec.scale
    else:
        if not trace_end > start:
            raise JobTraceError(
                f"start {start:g} s is not before the trace's end ({trace_end:g} s)", path=path
            )
        scale = horizon / (trace_end - start)
    notes.append(
        f"alibaba: trace time {start / DAY_S:.2f}–{trace_end / DAY_S:.2f} d mapped ×{scale:.4g} "
        f"onto the run (durations unscaled)"
    )
    kept: list[tuple[ResearchJob, bool]] = []
    for pod in usable:
        submit = (pod.creation_s - start) * scale
        if not 0 <= submit < horizon:
            continue
        assert pod.scheduled_s is not None
        deletion = trace_end if pod.deletion_s is None else pod.deletion_s
        is_censored = pod.deletion_s is None or pod.phase == "Running"
        work = deletion - pod.scheduled_s
        if work <= 0:
            continue
        priority = "low" if pod.qos == "BE" else "normal"
        job = ResearchJob(pod.name, _team(pod.name, spec.teams), submit, pod.gpus, work, priority)
        kept.append((job, is_censored))
    outside = len(usable) - len(kept)
    if outside:
        notes.append(f"{outside} pod(s) outside the mapped span dropped")
    if spec.jobs is not None and spec.jobs < len(kept):
        chosen = sorted(rng.sample(range(len(kept)), spec.jobs))
        kept = [kept[i] for i in chosen]
        notes.append(f"a seeded sample of {spec.jobs} of them kept")
    censored = sum(flag for _, flag in kept)
    if censored:
        notes.append(f"{censored} job(s) still running at trace end: censored durations (lower bounds)")
    return [job for job, _ in kept], censored


def _arrivals(spec: JobTraceSpec, horizon: float, rng: random.Random) -> Iterator[float]:
    """Arrival times of a philly/synthetic run, ascending (see the module docstring)."""
    swing = spec.swing if spec.kind == "synthetic" else 0.0

    def rate(t: float) -> float:  # jobs per second
        per_h = 10.0 if spec.rate_per_h is None else spec.rate_per_h
        hour = (t % DAY_S) / HOUR_S
        return per_h / HOUR_S * (1.0 + swing * math.cos(2.0 * math.pi * (hour - 14.0) / 24.0))

    r_max = rate(14.0 * HOUR_S)
    if spec.jobs is not None and spec.rate_per_h is None:
        times: list[float] = []
        while len(times) < spec.jobs:  # N points of the normalised intensity (rejection)
            t = rng.uniform(0.0, horizon)
            if rng.random() * r_max < rate(t):
                times.append(t)
        yield from sorted(times)
        return
    t, count = 0.0, 0
    while True:
        t += rng.expovariate(r_max)
        if t >= horizon or (spec.jobs is not None and count >= spec.jobs):
            return
        if rng.random() * r_max < rate(t):
            count += 1
            yield t


def _generated_jobs(
    spec: JobTraceSpec,
    horizon: float,
    rng: random.Random,
    work: _WorkDraw,
    notes: list[str],
) -> list[ResearchJob]:
    sizes = [g for g, _ in DL_GPU_MIX]
    weights = [w for _, w in DL_GPU_MIX]
    out: list[ResearchJob] = []
    for i, submit in enumerate(_arrivals(spec, horizon, rng)):
        name = f"{spec.kind}-{i:06d}"
        gpus = rng.choices(sizes, weights)[0]
        priority = "low" if rng.random() < spec.low_share else "normal"
        out.append(ResearchJob(name, _team(name, spec.teams), submit, gpus, work(rng), priority))
    notes.append(f"{spec.kind}: {len(out)} generated job(s); GPU counts drawn from {dict(DL_GPU_MIX)}")
    return out
