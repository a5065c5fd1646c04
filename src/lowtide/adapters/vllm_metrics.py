"""vLLM `/metrics` text → one `ReplicaScrape` (docs/architecture.md §4.2 "observe"; issue 3, item 1).

Role: read a replica's Prometheus text exposition with prometheus_client's parser
(`text_string_to_metric_families`) and normalise what lowtide needs into a `ReplicaScrape`:

==========================  ===================================================================
field                       read from (V1 name | V0 name)
==========================  ===================================================================
running / waiting           ``vllm:num_requests_running`` / ``vllm:num_requests_waiting``: sum
kv_usage                    ``vllm:kv_cache_usage_perc`` | ``vllm:gpu_cache_usage_perc``: *mean*
kv_capacity_tokens          ``vllm:cache_config_info`` labels: Σ ``kv_cache_size_tokens`` where
                            present (current vLLM: right for hybrid models too), else
                            Σ num_gpu_blocks × block_size
prompt/generation tokens    ``vllm:prompt_tokens_total`` / ``vllm:generation_tokens_total``: sum
requests_total              ``vllm:request_success_total``: sum over ``finished_reason``, except
                            ``abort`` and ``error`` (not served: docs/vllm.md)
ttft / e2e / itl            ``vllm:time_to_first_token_seconds`` / ``vllm:e2e_request_latency_seconds``
                            / ``vllm:inter_token_latency_seconds`` | ``vllm:time_per_output_token_seconds``:
                            bucket counts summed per ``le``
preemptions_total           ``vllm:num_preemptions_total`` (V0 and V1): sum
waiting_capacity /          ``vllm:num_requests_waiting_by_reason`` series with ``reason="capacity"``
waiting_deferred            / ``reason="deferred"``: sum
sleep_state                 ``vllm:engine_sleep_state``, one-hot per engine over ``sleep_state`` =
                            ``awake`` | ``weights_offloaded`` | ``discard_all``: see `sleep_state_of`
==========================  ===================================================================

The last three are read where the server has them and are ``None`` (without a note in
``problems``) where it does not. What vLLM's source says of them (vllm/v1/metrics/loggers.py,
``PrometheusStatLogger``, in the trees of the 0.33 line checked for docs/vllm.md; the older
vllm-project/vllm trees indexed at 005a810b and a6f0308c have only ``num_preemptions``):

- ``vllm:num_requests_waiting_by_reason`` is a gauge with labels ``model_name``, ``engine`` and
  ``reason``, whose values are ``capacity`` (the scheduler's waiting requests: waiting for KV
  cache or a ``max_num_seqs`` slot) and ``deferred`` (its skipped ones: LoRA budget, KV transfer,
  blocked status); ``vllm:num_requests_waiting`` is set to their sum.
- ``vllm:num_preemptions`` is a counter (exposed as ``_total``) of running requests the scheduler
  preempted, which it does when it cannot allocate KV blocks for them.
- ``vllm:engine_sleep_state`` is a gauge with labels ``model_name``, ``engine`` and
  ``sleep_state``; ``record_sleep_state`` sets every engine alike: ``awake`` 1 when awake; asleep,
  ``awake`` 0 and ``weights_offloaded`` 1 at level 1, ``discard_all`` 1 at level 2, none at 1 at
  level 0. It is set at start, so a server that has the family always shows it.

"sum" is over every series of the family: the ``engine`` label (one series per engine under data
parallelism), ``finished_reason``, and ``model_name`` when a server shows several (noted in
``problems``). KV usage is a fraction per engine, so engines are *averaged* (a sum of fractions is
not a fraction; DP engines have equal caches, and Prometheus's ``avg by (instance)`` agrees). When a
server exposes both a V1 name and its deprecated V0 twin (vLLM 0.9–0.10 does), the V1 one is read.

Rules: a family that is absent gives ``None`` (unknown, never 0); a NaN in any series of a field
makes that field ``None`` and adds a note; ``*_created`` series are ignored (they are not names we
read); a histogram without its ``+Inf`` bucket gets one from ``_count`` (noted), and one with
neither is ``None``. ``version`` is ``"v1"`` when a V1-only name or an ``engine`` label is present,
``"v0"`` when only V0-only names are (``num_requests_swapped``, ``cpu_cache_usage_perc``,
``avg_*_throughput_toks_per_s``, ...), else ``None`` (the shared names say nothing).

Bad input: `parse_vllm_metrics` never raises. A text the parser rejects gives ``ok=False`` with
``error`` naming the first bad line ("unparsable at line 42: ..."), *and keeps the fields of the
families finished before that line*: prometheus_client yields each family when the next one
starts, so those survive, while the family being read when the text broke is lost. They are kept
for operators (`lowtide metrics parse`); the policies ignore a reading that is not ``ok``, so a
partial reading never counts as load. A text that does not end with a newline is truncated (the
text format requires the final line feed), and a text without any family we read is not a vLLM
reading: both give ``ok=False`` too, with the fields that were read.

Speed (benchmarks/metrics_ingest.py, 200 replicas per tick): the parser is pure Python (~18 µs a
line), so two things keep a tick short without replacing it. (1) Only the families above are
parsed: the text is cut at its ``# HELP``/``# TYPE`` lines and the other families (most of a
vLLM text: ten more histograms, process and HTTP metrics) are dropped before parsing. The text
format requires a family's lines to form one group after its header, which is what makes this
safe; a text without headers is parsed whole. Errors inside dropped families go unseen.
(2) An optional `ParseCache` remembers, per *series layout* (the selected text with every value
cut off), the structure prometheus_client parsed, as Prometheus's own scrape cache does: a
replica's series rarely change between scrapes, only their values, so a later text with the same
layout needs only its values read (``float``). A layout is learnt only from a full, successful
library parse whose every value matched our split (no timestamps, no exemplars), and a value that
``float`` rejects or that holds ``_`` falls back to the library, so the cache changes the cost,
never the result (tests/unit/test_vllm_metrics.py compares both on many texts). On a 2-core
machine a 200-replica tick takes ~45 ms of parsing with the cache, ~0.9 s without it, ~2.5 s for
prometheus_client on the whole texts.

Neighbours: `domain.metrics` (the values), `policy.signals` (windows of scrapes → signals),
`adapters.metrics_sources` (fetches the texts), `cli.metrics_cmd` (`lowtide metrics parse`).
Must not: do I/O, read the clock, or decide anything about load.
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TextIO, cast

from prometheus_client.parser import text_fd_to_metric_families, text_string_to_metric_families

from lowtide.domain.metrics import Histogram, MetricsVersion, ReplicaScrape, SleepState

RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
KV_V1 = "vllm:kv_cache_usage_perc"
KV_V0 = "vllm:gpu_cache_usage_perc"
CACHE_INFO = "vllm:cache_config_info"
PROMPT = "vllm:prompt_tokens_total"
GENERATION = "vllm:generation_tokens_total"
SUCCESS = "vllm:request_success_total"
#: Finish reasons of requests that were not served (aborted by the client or a sleep, or failed).
NOT_SERVED = frozenset({"abort", "error"})
TTFT = "vllm:time_to_first_token_seconds"
E2E = "vllm:e2e_request_latency_seconds"
ITL_V1 = "vllm:inter_token_latency_seconds"
ITL_V0 = "vllm:time_per_output_token_seconds"
PREEMPTIONS = "vllm:num_preemptions_total"
WAITING_BY_REASON = "vllm:num_requests_waiting_by_reason"
SLEEP_STATE = "vllm:engine_sleep_state"
#: Families whose series are read per value of one label: family -> that label.
_LABELLED: dict[str, str] = {WAITING_BY_REASON: "reason", SLEEP_STATE: "sleep_state"}


def _keyed(family: str, label: str, value: str) -> str:
    """The name a labelled family's series are summed under, e.g. ``...{reason="capacity"}``."""
    return f'{family}{{{label}="{value}"}}'


WAITING_CAPACITY = _keyed(WAITING_BY_REASON, "reason", "capacity")
WAITING_DEFERRED = _keyed(WAITING_BY_REASON, "reason", "deferred")
SLEEP_AWAKE = _keyed(SLEEP_STATE, "sleep_state", "awake")
SLEEP_LEVEL_1 = _keyed(SLEEP_STATE, "sleep_state", "weights_offloaded")
SLEEP_LEVEL_2 = _keyed(SLEEP_STATE, "sleep_state", "discard_all")

# scalar field -> (how engines combine, the names it is read from, preferred first)
_SCALARS: dict[str, tuple[str, tuple[str, ...]]] = {
    "running": ("sum", (RUNNING,)),
    "waiting": ("sum", (WAITING,)),
    "kv_usage": ("mean", (KV_V1, KV_V0)),
    "prompt_tokens_total": ("sum", (PROMPT,)),
    "generation_tokens_total": ("sum", (GENERATION,)),
    "requests_total": ("sum", (SUCCESS,)),
    "preemptions_total": ("sum", (PREEMPTIONS,)),
    "waiting_capacity": ("sum", (WAITING_CAPACITY,)),
    "waiting_deferred": ("sum", (WAITING_DEFERRED,)),
    # engines per sleep state; `sleep_state_of` turns them into the scrape's sleep_state
    "engines_awake": ("sum", (SLEEP_AWAKE,)),
    "engines_level_1": ("sum", (SLEEP_LEVEL_1,)),
    "engines_level_2": ("sum", (SLEEP_LEVEL_2,)),
}
#: Fields only newer servers have: absent, they are None without a note in `problems`.
_OPTIONAL = frozenset(
    {
        "preemptions_total",
        "waiting_capacity",
        "waiting_deferred",
        "engines_awake",
        "engines_level_1",
        "engines_level_2",
    }
)
_HISTOGRAMS: dict[str, tuple[str, ...]] = {"ttft": (TTFT,), "e2e": (E2E,), "itl": (ITL_V1, ITL_V0)}


def _sample_roles() -> dict[str, tuple[str, str]]:
    """sample name -> (family name, role); role: "value", "bucket", "count", "sum" or "info"."""
    roles = {CACHE_INFO: (CACHE_INFO, "info")}
    for _how, names in _SCALARS.values():
        # a labelled family's sample name is its base name (the label picks the slot later)
        roles.update({name.split("{", 1)[0]: (name.split("{", 1)[0], "value") for name in names})
    for names in _HISTOGRAMS.values():
        for name in names:
            for suffix in ("bucket", "count", "sum"):
                roles[f"{name}_{suffix}"] = (name, suffix)
    return roles


_SAMPLE_ROLES = _sample_roles()

# Names as they appear on # HELP / # TYPE lines (counters with and without `_total`).
WANTED_FAMILIES: frozenset[str] = frozenset(
    {family for family, _ in _SAMPLE_ROLES.values()}
    | {PROMPT[:-6], GENERATION[:-6], SUCCESS[:-6], PREEMPTIONS[:-6]}
)

_V1_ONLY = frozenset(
    {KV_V1, ITL_V1, "vllm:prefix_cache_queries", "vllm:prefix_cache_hits", WAITING_BY_REASON, SLEEP_STATE}
)
_V0_ONLY = frozenset(
    {
        "vllm:num_requests_swapped",
        "vllm:cpu_cache_usage_perc",
        "vllm:gpu_prefix_cache_hit_rate",
        "vllm:cpu_prefix_cache_hit_rate",
        "vllm:avg_prompt_throughput_toks_per_s",
        "vllm:avg_generation_throughput_toks_per_s",
    }
)
_SUFFIXES = ("_total", "_bucket", "_count", "_sum")
# The same, as header names (a counter's header may carry `_total`).
_V1_MARKERS = _V1_ONLY | {name + "_total" for name in _V1_ONLY}
_V0_MARKERS = _V0_ONLY | {name + "_total" for name in _V0_ONLY}
_FIELD_LABELS = {
    "running": "running requests",
    "waiting": "waiting requests",
    "kv_usage": "KV-cache usage",
    "prompt_tokens_total": "prompt tokens",
    "generation_tokens_total": "generation tokens",
    "requests_total": "finished requests",
    "ttft": "TTFT histogram",
    "e2e": "e2e latency histogram",
    "itl": "inter-token latency histogram",
    "preemptions_total": "preemptions",
    "waiting_capacity": "requests waiting for capacity",
    "waiting_deferred": "deferred requests",
    "engines_awake": "sleep state",
    "engines_level_1": "sleep state",
    "engines_level_2": "sleep state",
}


def sleep_state_of(
    awake: float | None, level_1: float | None, level_2: float | None, engines: int
) -> SleepState | None:
    """A server's sleep state from ``vllm:engine_sleep_state`` summed over its `engines` (the
    number of ``awake`` series): each sum is the number of engines at 1 for that label. None when
    the ``awake`` series are absent (or NaN)."""
    if awake is None or engines <= 0:
        return None
    one, two = level_1 or 0.0, level_2 or 0.0
    if awake == engines and one == 0 and two == 0:
        return "awake"
    if awake == 0 and one == engines and two == 0:
        return "weights_offloaded"
    if awake == 0 and two == engines and one == 0:
        return "discard_all"
    if awake == 0 and one == 0 and two == 0:
        return "asleep"
    return "mixed"


def failed_scrape(at: float, error: str) -> ReplicaScrape:
    """A reading that failed as a whole (timeout, refused, HTTP error, garbage)."""
    return ReplicaScrape(at=at, ok=False, error=error)


def strip_transcript(text: str) -> str:
    """Drop what a pasted terminal transcript adds to a `/metrics` text: shell prompt lines
    (``$ curl ...``) and documentation elisions (a line that is only ``...``). A real `/metrics`
    has neither; anything else (including ``...`` inside a line) is left for the parser to judge.
    The result ends with a newline."""
    kept = [line for line in text.splitlines() if not line.startswith("$ ") and line.strip() != "..."]
    return "\n".join(kept) + "\n"


# -- the plan: what a series layout means, independent of its values ------------------------------


@dataclass(slots=True)
class _HistPlan:
    family: str
    bounds: tuple[float, ...]  # ascending, +Inf last (possibly synthesised from _count)
    bucket_slots: tuple[int, ...]  # aligned with bounds; -1 = take the count slot (+Inf)
    count_slot: int
    sum_slot: int  # -1 when _sum is absent (sum becomes NaN)
    used: frozenset[int]  # every slot it reads


@dataclass(slots=True)
class _Plan:
    slots: tuple[int, ...]  # per sample, in text order: accumulator slot, or -1 (not read)
    n_slots: int
    scalars: dict[str, tuple[str, int, int]]  # field -> (family, slot, number of series)
    histograms: dict[str, _HistPlan]
    kv_capacity: float | None
    model: str | None
    names: frozenset[str]  # every sample name seen (version detection)
    v1_evidence: bool  # an engine label or a V1-only name among the samples
    v0_evidence: bool
    problems: tuple[str, ...]
    families: frozenset[str] = frozenset()  # the families we read that have at least one sample


def _build_plan(series: Sequence[tuple[str, dict[str, str]]]) -> _Plan:
    """Map each sample (name, labels) of a selected text to an accumulator slot."""
    problems: list[str] = []
    names: set[str] = set()
    models: set[str] = set()
    engine_label = False
    present: dict[str, int] = {}  # family -> series count (value families and histogram _count)
    slot_of: dict[tuple[str, str, float], int] = {}  # (family, role, bound) -> slot
    series_per_slot: dict[int, int] = {}
    capacity: float | None = 0.0
    info_series = 0
    slots: list[int] = []
    for name, labels in series:
        names.add(name)
        role_of = _SAMPLE_ROLES.get(name)
        if role_of is None:
            slots.append(-1)
            continue
        family, role = role_of
        if family == SUCCESS and labels.get("finished_reason") in NOT_SERVED:
            slots.append(-1)
            continue
        by = _LABELLED.get(family)
        if by is not None:
            family = _keyed(family, by, labels.get(by, ""))
        model = labels.get("model_name")
        if model is not None:
            models.add(model)
        if "engine" in labels:
            engine_label = True
        if role == "info":
            info_series += 1
            slots.append(-1)
            capacity = _add_capacity(capacity, labels, problems)
            continue
        bound = 0.0
        if role == "bucket":
            try:
                bound = float(labels.get("le", "nan"))
            except ValueError:
                bound = math.nan
            if math.isnan(bound):
                problems.append(f"{family}: a bucket without a numeric le label; histogram ignored")
                present[family + "#bad"] = 1
                slots.append(-1)
                continue
        key = (family, role, bound)
        slot = slot_of.get(key)
        if slot is None:
            slot = slot_of[key] = len(slot_of)
        series_per_slot[slot] = series_per_slot.get(slot, 0) + 1
        if role in ("value", "count"):
            present[family] = present.get(family, 0) + 1
        elif role == "bucket":
            present.setdefault(family, 0)
        slots.append(slot)

    scalars: dict[str, tuple[str, int, int]] = {}
    for fld, (_how, candidates) in _SCALARS.items():
        for family in candidates:
            slot = slot_of.get((family, "value", 0.0))
            if slot is not None:
                scalars[fld] = (family, slot, series_per_slot[slot])
                break
    histograms: dict[str, _HistPlan] = {}
    for fld, candidates in _HISTOGRAMS.items():
        for family in candidates:
            if family in present:
                plan = _hist_plan(family, slot_of, series_per_slot, present, problems)
                if plan is not None:
                    histograms[fld] = plan
                break
    if info_series == 0:
        capacity = None
    if len(models) > 1:
        problems.append(f"several model_name values ({', '.join(sorted(models))}): their series are summed")
    return _Plan(
        slots=tuple(slots),
        n_slots=len(slot_of),
        scalars=scalars,
        histograms=histograms,
        kv_capacity=capacity,
        model=", ".join(sorted(models)) if models else None,
        names=frozenset(names),
        v1_evidence=engine_label or not _V1_ONLY.isdisjoint(map(_base_name, names)),
        v0_evidence=not _V0_ONLY.isdisjoint(map(_base_name, names)),
        problems=tuple(problems),
        families=frozenset(role[0] for role in map(_SAMPLE_ROLES.get, names) if role is not None),
    )


def _add_capacity(capacity: float | None, labels: dict[str, str], problems: list[str]) -> float | None:
    if capacity is None:
        return None
    sized = labels.get("kv_cache_size_tokens")
    if sized is not None:
        try:
            return capacity + int(sized)
        except ValueError:
            pass  # not a number (e.g. "None"): fall back to blocks × block size
    try:
        blocks = int(labels["num_gpu_blocks"])
        size = int(labels["block_size"])
    except (KeyError, ValueError):
        shown = {k: labels.get(k) for k in ("num_gpu_blocks", "block_size")}
        problems.append(
            f"{CACHE_INFO}: no numeric num_gpu_blocks and block_size ({shown}); KV capacity unknown"
        )
        return None
    return capacity + blocks * size


def _hist_plan(
    family: str,
    slot_of: dict[tuple[str, str, float], int],
    series_per_slot: dict[int, int],
    present: dict[str, int],
    problems: list[str],
) -> _HistPlan | None:
    if family + "#bad" in present:
        return None
    buckets = sorted(
        (bound, slot) for (fam, role, bound), slot in slot_of.items() if fam == family and role == "bucket"
    )
    count_slot = slot_of.get((family, "count", 0.0), -1)
    sum_slot = slot_of.get((family, "sum", 0.0), -1)
    has_inf = bool(buckets) and math.isinf(buckets[-1][0])
    counts = {series_per_slot[slot] for _, slot in buckets}
    if count_slot >= 0:
        counts.add(series_per_slot[count_slot])
    if len(counts) > 1:
        problems.append(f"{family}: engines expose different buckets; histogram ignored")
        return None
    if not has_inf:
        if count_slot < 0:
            problems.append(f"{family}: neither a +Inf bucket nor _count; histogram ignored")
            return None
        problems.append(f"{family}: no +Inf bucket; taken from _count")
        buckets.append((math.inf, -1))
    elif count_slot < 0:
        count_slot = buckets[-1][1]
    if sum_slot < 0:
        problems.append(f"{family}: no _sum; sum unknown (NaN)")
    return _HistPlan(
        family=family,
        bounds=tuple(b for b, _ in buckets),
        bucket_slots=tuple(s for _, s in buckets),
        count_slot=count_slot,
        sum_slot=sum_slot,
        used=frozenset({count_slot, sum_slot, *(s for _, s in buckets)} - {-1}),
    )


@dataclass(slots=True)
class _Values:
    scalars: dict[str, float | None]
    histograms: dict[str, Histogram | None]
    problems: list[str]


def _evaluate(plan: _Plan, values: Sequence[Any]) -> _Values:
    """Sum each sample's value (a number, or its text from the cache; ValueError if not one) into
    its slot; NaN poisons the slot."""
    acc = [0.0] * plan.n_slots
    nan_slots: set[int] = set()
    for slot, raw in zip(plan.slots, values, strict=True):
        if slot < 0:
            continue
        x = float(raw)
        if x != x:  # noqa: PLR0124 (NaN; cheaper than math.isnan in this loop)
            nan_slots.add(slot)
        else:
            acc[slot] += x
    problems: list[str] = []
    scalars: dict[str, float | None] = {}
    for fld, (family, slot, n) in plan.scalars.items():
        if slot in nan_slots:
            problems.append(f"{family}: NaN; {_FIELD_LABELS[fld]} unknown")
            scalars[fld] = None
        elif _SCALARS[fld][0] == "mean":
            scalars[fld] = acc[slot] / n
        else:
            scalars[fld] = acc[slot]
    histograms: dict[str, Histogram | None] = {}
    for fld, hp in plan.histograms.items():
        if nan_slots and not hp.used.isdisjoint(nan_slots):
            problems.append(f"{hp.family}: NaN; {_FIELD_LABELS[fld]} unknown")
            histograms[fld] = None
            continue
        count = acc[hp.count_slot]
        histograms[fld] = Histogram(
            buckets=tuple(
                (bound, acc[slot] if slot >= 0 else count)
                for bound, slot in zip(hp.bounds, hp.bucket_slots, strict=True)
            ),
            count=count,
            sum=acc[hp.sum_slot] if hp.sum_slot >= 0 else math.nan,
        )
    return _Values(scalars, histograms, problems)


# -- selecting the families we read ---------------------------------------------------------------


def _select(text: str, origin: list[int] | None = None) -> tuple[str, set[str]]:
    """The text without the families we do not read, and every family name seen in a header.
    With `origin`, also fills it with the original line number of each selected line."""
    if "\r" in text:
        text = text.replace("\r\n", "\n")
    parts = text.split("\n# ")
    out: list[str] = []
    headers: set[str] = set()
    first = parts[0]
    if first.startswith("# "):
        parts[0] = first[2:]
        chunks = parts
    else:
        out.append(first)  # lines before any comment: no family header, parsed as they are
        chunks = parts[1:]
    keep = True
    wanted = WANTED_FAMILIES
    twin = "\x00"  # the other header line of the family just seen ("TYPE name " after "HELP name ")
    line = 1
    if origin is not None and out:
        line = first.count("\n") + 2
        origin.extend(range(1, line))
    for chunk in chunks:
        if chunk.startswith(twin):
            pass  # same family, same decision
        elif chunk.startswith("HELP ") or chunk.startswith("TYPE "):
            end = chunk.find(" ", 5)
            if end < 0 or chunk.find("\n", 5, end) >= 0:
                newline = chunk.find("\n", 5)
                end = newline if newline >= 0 else len(chunk)
            name = chunk[5:end]
            headers.add(name)
            keep = name in wanted
            twin = ("TYPE " if chunk[0] == "H" else "HELP ") + name + " "
        # Any other comment belongs to the family before it: same decision.
        if keep:
            out.append("# " + chunk)
        if origin is not None:
            lines = chunk.count("\n") + 1
            if keep:
                origin.extend(range(line, line + lines))
            line += lines
    return "\n".join(out) + "\n", headers


def _library_samples(text: str) -> tuple[list[tuple[str, dict[str, str], Any, Any]], str | None]:
    """Every sample prometheus_client yields before it stops, and why it stopped (None: it did not)."""
    samples: list[tuple[str, dict[str, str], Any, Any]] = []
    try:
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                samples.append((s.name, s.labels, s.value, s.timestamp))
    except Exception as exc:  # the parser raises ValueError, IndexError, ... on bad lines
        return samples, str(exc) or type(exc).__name__
    return samples, None


class _CountingLines:
    """Feeds the parser line by line and remembers which line it is on (for error messages)."""

    def __init__(self, text: str) -> None:
        self.lines = text.split("\n")
        self.number = 0

    def __iter__(self) -> Iterator[str]:
        for number, line in enumerate(self.lines, start=1):
            self.number = number
            yield line + "\n"


def _locate_error(text: str) -> tuple[int, str, str] | None:
    """The first line prometheus_client rejects among those we parse: (its number in the whole
    text, the line, the reason). Only on the error path: it parses the selection again."""
    origin: list[int] = []
    selected, _ = _select(text, origin)
    lines = _CountingLines(selected)
    try:
        for _ in text_fd_to_metric_families(cast(TextIO, lines)):
            pass
    except Exception as exc:
        k = lines.number
        if not 0 < k <= len(origin):
            return None
        return origin[k - 1], lines.lines[k - 1], str(exc) or type(exc).__name__
    return None


def _shorten(line: str, limit: int = 120) -> str:
    return line if len(line) <= limit else line[: limit - 3] + "..."


# -- the cache ------------------------------------------------------------------------------------


def _split_values(selected: str) -> tuple[str, list[str]]:
    """The layout (every sample line without its value) and the values, in order."""
    keys: list[str] = []
    values: list[str] = []
    for line in selected.split("\n"):
        if line and line[0] != "#":
            key, _, value = line.rpartition(" ")
            keys.append(key)
            values.append(value)
        else:
            keys.append(line)
    return "\n".join(keys), values


class ParseCache:
    """Series layout → the plan prometheus_client's parse gave for it (bounded, LRU, thread-safe).

    One cache serves any number of replicas: replicas of one service usually share a layout."""

    def __init__(self, max_layouts: int = 64) -> None:
        self.max_layouts = max_layouts
        self._plans: OrderedDict[str, _Plan] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def lookup(self, selected: str) -> tuple[_Plan, list[str]] | None:
        """The plan learnt for `selected`'s layout and its values (as text), or None."""
        layout, raw = _split_values(selected)
        with self._lock:
            plan = self._plans.get(layout)
            if plan is not None:
                self._plans.move_to_end(layout)
        # An underscore is valid for float() but not for the text format: let the library judge.
        if plan is None or len(raw) != len(plan.slots) or "_" in "".join(raw):
            self.misses += 1
            return None
        self.hits += 1
        return plan, raw

    def learn(
        self, selected: str, samples: Sequence[tuple[str, dict[str, str], Any, Any]], plan: _Plan
    ) -> None:
        """Remember `plan` for this layout if the library's samples are exactly our line split."""
        layout, raw = _split_values(selected)
        if len(raw) != len(samples):
            return
        try:
            for (_, _, value, timestamp), text in zip(samples, raw, strict=True):
                parsed = float(text)
                if timestamp is not None or "_" in text:
                    return
                if parsed != value and not (math.isnan(parsed) and math.isnan(value)):
                    return
        except ValueError:
            return
        with self._lock:
            self._plans[layout] = plan
            self._plans.move_to_end(layout)
            while len(self._plans) > self.max_layouts:
                self._plans.popitem(last=False)


# -- the entry point ------------------------------------------------------------------------------


def parse_vllm_metrics(text: str, *, at: float, cache: ParseCache | None = None) -> ReplicaScrape:
    """Normalise one `/metrics` text read at `at`. Never raises (see the module docstring)."""
    try:
        return _parse(text, at, cache)
    except Exception as exc:  # a bug here must cost one reading, not the tick
        return failed_scrape(at, f"could not read the metrics: {type(exc).__name__}: {exc}")


def _parse(text: str, at: float, cache: ParseCache | None) -> ReplicaScrape:
    if not text.strip():
        return failed_scrape(at, "empty response: no metrics")
    selected, headers = _select(text)
    error: str | None = None
    found = cache.lookup(selected) if cache is not None else None
    result: _Values | None = None
    if found is not None:
        plan, raw = found
        try:
            result = _evaluate(plan, raw)
        except ValueError:  # a value that is not a number: the library will say where
            result = None
    if result is None:
        samples, failure = _library_samples(selected)
        plan = _build_plan([(name, labels) for name, labels, _, _ in samples])
        result = _evaluate(plan, [value for _, _, value, _ in samples])
        if failure is not None:
            where = _locate_error(text)
            if where is None:
                error = f"unparsable: {failure}"
            else:
                number, line, reason = where
                error = f"unparsable at line {number}: {_shorten(reason)} ({_shorten(line)!r})"
        elif cache is not None:
            cache.learn(selected, samples, plan)
    problems = [*plan.problems, *result.problems]
    scalars = result.scalars
    hists = result.histograms
    read_any = bool(plan.scalars or plan.histograms or plan.kv_capacity is not None)
    if error is None and not text.endswith("\n"):
        error = "truncated: the text does not end with a newline (the last line may be cut)"
    if error is None and not read_any:
        error = "no vLLM metrics: none of the vllm: families lowtide reads is in the text"
    for fld, label in _FIELD_LABELS.items():
        if fld in _OPTIONAL:
            continue
        names = _SCALARS[fld][1] if fld in _SCALARS else _HISTOGRAMS[fld]
        if read_any and not plan.families.intersection(names):
            problems.append(f"{label} absent ({' | '.join(names)}): unknown")
    version, version_note = _version(headers, plan)
    if version_note:
        problems.append(version_note)
    return ReplicaScrape(
        at=at,
        ok=error is None,
        error=error,
        version=version,
        model=plan.model,
        running=scalars.get("running"),
        waiting=scalars.get("waiting"),
        kv_usage=scalars.get("kv_usage"),
        kv_capacity_tokens=plan.kv_capacity,
        prompt_tokens_total=scalars.get("prompt_tokens_total"),
        generation_tokens_total=scalars.get("generation_tokens_total"),
        requests_total=scalars.get("requests_total"),
        ttft=hists.get("ttft"),
        e2e=hists.get("e2e"),
        itl=hists.get("itl"),
        problems=tuple(problems),
        waiting_capacity=scalars.get("waiting_capacity"),
        waiting_deferred=scalars.get("waiting_deferred"),
        preemptions_total=scalars.get("preemptions_total"),
        sleep_state=sleep_state_of(
            scalars.get("engines_awake"),
            scalars.get("engines_level_1"),
            scalars.get("engines_level_2"),
            plan.scalars["engines_awake"][2] if "engines_awake" in plan.scalars else 0,
        ),
    )


def _base_name(name: str) -> str:
    for suffix in _SUFFIXES:
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


def _version(headers: set[str], plan: _Plan) -> tuple[MetricsVersion | None, str]:
    """V1 if a V1-only name (in a header or a sample) or an engine label is present, V0 if only
    V0-only names are, else None."""
    v1 = plan.v1_evidence or not _V1_MARKERS.isdisjoint(headers)
    v0 = plan.v0_evidence or not _V0_MARKERS.isdisjoint(headers)
    if v1 and v0:
        return "v1", "both V1-only and V0-only vllm: names present; read as V1"
    if v1:
        return "v1", ""
    if v0:
        return "v0", ""
    return None, ""
