"""The vLLM families only newer servers have, end to end: the emulator exports them as vLLM does,
`adapters.vllm_metrics` reads them (and reads older texts without them as unknown, never 0),
`policy.signals` turns the preemption counter into a rate, and the API shows them.

vLLM's side (vllm/v1/metrics/loggers.py, `PrometheusStatLogger`, the 0.33 line; cited in
`adapters.vllm_metrics`): ``vllm:num_requests_waiting_by_reason{reason="capacity"|"deferred"}``
sums to ``vllm:num_requests_waiting``; ``vllm:num_preemptions_total`` counts preempted requests;
``vllm:engine_sleep_state{sleep_state="awake"|"weights_offloaded"|"discard_all"}`` is one-hot,
every engine alike. The real captures under ``../shared/data/reference`` predate all three but
``num_preemptions``; tests that need them skip when the data directory is absent.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from lowtide.adapters.vllm_metrics import ParseCache, parse_vllm_metrics, sleep_state_of, strip_transcript
from lowtide.api.services import signals_out
from lowtide.domain.metrics import ReplicaScrape, ReplicaSignals
from lowtide.emulator.engine import Engine, EngineConfig, EngineGroup
from lowtide.emulator.vllm_metrics_export import VllmMetricsExporter
from lowtide.policy.signals import replica_signals

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "metrics"
DATA = Path(os.environ.get("LOWTIDE_DATA_DIR") or Path(__file__).resolve().parents[3] / "shared" / "data")
AT = 1_790_000_000.0

#: vLLM's help texts for these families, as its `PrometheusStatLogger` declares them.
VLLM_HELP = {
    "vllm:num_requests_waiting_by_reason": (
        "Number of waiting requests by reason. Reason labels: 'capacity' = waiting for scheduling "
        "capacity; 'deferred' = deferred by transient constraints (LoRA budget, KV transfer, blocked "
        "status). Sum of all reasons equals vllm:num_requests_waiting."
    ),
    "vllm:engine_sleep_state": (
        "Engine sleep state; awake = 0 means engine is sleeping; awake = 1 means engine is awake; "
        "weights_offloaded = 1 means sleep level 1; discard_all = 1 means sleep level 2."
    ),
    "vllm:num_preemptions": "Cumulative number of preemption from the engine.",
}


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def render(engine: Engine | EngineGroup, version: str = "v1") -> str:
    return VllmMetricsExporter(engine, "m", version).render().decode()  # type: ignore[arg-type]


def parse(text: str, cache: ParseCache | None = None) -> ReplicaScrape:
    return parse_vllm_metrics(text, at=AT, cache=cache)


def families(text: str) -> dict[str, Metric]:
    return {f.name: f for f in text_string_to_metric_families(text)}


def preempting_engine(clock: Clock) -> Engine:
    """An engine whose cache holds one of its two sequences: the newer one is preempted."""
    engine = Engine(EngineConfig(cold_start_s=0.0, kv_cache_tokens=160, max_model_len=160), clock)
    for _ in range(2):
        engine.submit(prompt_tokens=60, max_tokens=40)
    while engine.stats.preemptions == 0 and (end := engine.next_event_at()) is not None:
        clock.t = end
        engine.advance()
    assert engine.stats.preemptions >= 1
    return engine


# -- the emulator exports them as vLLM does --------------------------------------------------------


def test_the_emulator_uses_vllms_names_types_labels_and_help_texts() -> None:
    clock = Clock()
    engine = Engine(EngineConfig(cold_start_s=0.0, max_num_seqs=1), clock)
    for _ in range(3):
        engine.submit(prompt_tokens=10, max_tokens=5)
    text = render(engine)
    parsed = families(text)
    for name, help_text in VLLM_HELP.items():
        assert parsed[name].documentation == help_text, name
    assert parsed["vllm:num_requests_waiting_by_reason"].type == "gauge"
    assert parsed["vllm:engine_sleep_state"].type == "gauge"
    assert parsed["vllm:num_preemptions"].type == "counter"
    # prometheus_client writes a counter's header with `_total`, as vLLM's server shows it
    assert "# TYPE vllm:num_preemptions_total counter\n" in text
    by_reason = {s.labels["reason"]: s.value for s in parsed["vllm:num_requests_waiting_by_reason"].samples}
    assert by_reason == {"capacity": 2.0, "deferred": 0.0}  # one runs, two wait: summing to waiting
    (waiting,) = parsed["vllm:num_requests_waiting"].samples
    assert sum(by_reason.values()) == waiting.value == engine.num_waiting
    for sample in parsed["vllm:engine_sleep_state"].samples:
        assert set(sample.labels) == {"model_name", "engine", "sleep_state"}
    # V0 servers had the preemption counter but neither of the others
    v0 = families(render(engine, "v0"))
    assert "vllm:num_preemptions" in v0
    assert "vllm:num_requests_waiting_by_reason" not in v0 and "vllm:engine_sleep_state" not in v0


@pytest.mark.parametrize(
    ("level", "state"), [(None, "awake"), (1, "weights_offloaded"), (2, "discard_all"), (0, "asleep")]
)
def test_the_sleep_state_follows_the_emulators_sleep(level: int | None, state: str) -> None:
    clock = Clock()
    group = EngineGroup(EngineConfig(cold_start_s=0.0), clock, 2)
    if level is not None:
        group.sleep(level=level)
    text = render(group)
    one_hot = {
        (s.labels["engine"], s.labels["sleep_state"]): s.value
        for s in families(text)["vllm:engine_sleep_state"].samples
    }
    labels = ("awake", "weights_offloaded", "discard_all")
    # every engine, every label; level 0 sets none of them to 1
    assert one_hot == {(e, x): 1.0 if x == state else 0.0 for e in ("0", "1") for x in labels}
    scrape = parse(text)
    assert scrape.ok and scrape.sleep_state == state
    if level is not None:  # after the wake the server is awake again
        clock.t = group.wake_up()
        group.advance()
        assert parse(render(group)).sleep_state == "awake"


def test_preemptions_are_read_from_the_emulator_and_summed_over_engines() -> None:
    clock = Clock()
    engine = preempting_engine(clock)
    scrape = parse(render(engine))
    assert scrape.ok and scrape.problems == ()
    assert scrape.preemptions_total == engine.stats.preemptions
    assert (scrape.waiting_capacity, scrape.waiting_deferred) == (engine.num_waiting, 0.0)
    assert scrape.waiting_capacity == scrape.waiting
    v0 = parse(render(engine, "v0"))
    assert v0.preemptions_total == engine.stats.preemptions
    assert (v0.waiting_capacity, v0.waiting_deferred, v0.sleep_state) == (None, None, None)


# -- the parser on other shapes -------------------------------------------------------------------


def _text(*lines: str) -> str:
    return "\n".join(lines) + "\n"


DP2 = _text(
    "# HELP vllm:num_requests_waiting Number of requests waiting to be processed.",
    "# TYPE vllm:num_requests_waiting gauge",
    'vllm:num_requests_waiting{engine="0",model_name="m"} 5.0',
    'vllm:num_requests_waiting{engine="1",model_name="m"} 2.0',
    "# HELP vllm:num_requests_waiting_by_reason x",
    "# TYPE vllm:num_requests_waiting_by_reason gauge",
    'vllm:num_requests_waiting_by_reason{engine="0",model_name="m",reason="capacity"} 4.0',
    'vllm:num_requests_waiting_by_reason{engine="0",model_name="m",reason="deferred"} 1.0',
    'vllm:num_requests_waiting_by_reason{engine="1",model_name="m",reason="capacity"} 0.0',
    'vllm:num_requests_waiting_by_reason{engine="1",model_name="m",reason="deferred"} 2.0',
    "# HELP vllm:num_preemptions_total Cumulative number of preemption from the engine.",
    "# TYPE vllm:num_preemptions_total counter",
    'vllm:num_preemptions_total{engine="0",model_name="m"} 7.0',
    'vllm:num_preemptions_total{engine="1",model_name="m"} 3.0',
    'vllm:num_preemptions_created{engine="0",model_name="m"} 1.7e9',
    'vllm:num_preemptions_created{engine="1",model_name="m"} 1.7e9',
    "# HELP vllm:engine_sleep_state x",
    "# TYPE vllm:engine_sleep_state gauge",
    'vllm:engine_sleep_state{engine="0",model_name="m",sleep_state="awake"} 1.0',
    'vllm:engine_sleep_state{engine="0",model_name="m",sleep_state="weights_offloaded"} 0.0',
    'vllm:engine_sleep_state{engine="0",model_name="m",sleep_state="discard_all"} 0.0',
    'vllm:engine_sleep_state{engine="1",model_name="m",sleep_state="awake"} 1.0',
    'vllm:engine_sleep_state{engine="1",model_name="m",sleep_state="weights_offloaded"} 0.0',
    'vllm:engine_sleep_state{engine="1",model_name="m",sleep_state="discard_all"} 0.0',
)


def test_two_engines_are_summed_per_reason_and_read_as_one_server() -> None:
    scrape = parse(DP2)
    assert scrape.ok and scrape.version == "v1"
    assert (scrape.waiting, scrape.waiting_capacity, scrape.waiting_deferred) == (7.0, 4.0, 3.0)
    assert scrape.preemptions_total == 10.0  # the _created series are not the counter
    assert scrape.sleep_state == "awake"


def test_engines_in_different_sleep_states_are_mixed() -> None:
    text = DP2.replace(
        'engine="1",model_name="m",sleep_state="awake"} 1.0',
        'engine="1",model_name="m",sleep_state="awake"} 0.0',
    ).replace(
        'engine="1",model_name="m",sleep_state="weights_offloaded"} 0.0',
        'engine="1",model_name="m",sleep_state="weights_offloaded"} 1.0',
    )
    assert parse(text).sleep_state == "mixed"


def test_the_waiting_reason_and_sleep_state_are_version_evidence() -> None:
    for family, labels in (
        ("vllm:num_requests_waiting_by_reason", 'reason="capacity"'),
        ("vllm:engine_sleep_state", 'sleep_state="awake"'),
    ):
        assert parse(_text("vllm:num_requests_running 1", f"{family}{{{labels}}} 1")).version == "v1"


def test_a_nan_makes_that_field_unknown_and_is_noted() -> None:
    text = DP2.replace('reason="deferred"} 2.0', 'reason="deferred"} NaN').replace(
        'engine="1",model_name="m",sleep_state="awake"} 1.0',
        'engine="1",model_name="m",sleep_state="awake"} NaN',
    )
    scrape = parse(text)
    assert scrape.ok
    assert scrape.waiting_capacity == 4.0 and scrape.waiting_deferred is None
    assert scrape.sleep_state is None
    assert 'vllm:num_requests_waiting_by_reason{reason="deferred"}: NaN; deferred requests unknown' in (
        scrape.problems
    )
    assert any(p.startswith('vllm:engine_sleep_state{sleep_state="awake"}: NaN') for p in scrape.problems)


def test_series_without_the_label_or_with_another_value_are_not_counted() -> None:
    text = _text(
        "vllm:num_requests_running 1",
        "vllm:num_requests_waiting_by_reason 9",
        'vllm:num_requests_waiting_by_reason{reason="lora"} 9',
        'vllm:num_requests_waiting_by_reason{reason="capacity"} 2',
    )
    scrape = parse(text)
    assert (scrape.waiting_capacity, scrape.waiting_deferred) == (2.0, None)


def test_the_cache_gives_the_same_readings_for_the_newer_families() -> None:
    cache = ParseCache()
    clock = Clock()
    engine = Engine(EngineConfig(cold_start_s=0.0, max_num_seqs=1), clock)
    texts = []
    for i in range(4):
        engine.submit(prompt_tokens=10, max_tokens=5)
        if i == 2:
            engine.sleep(level=1, mode="keep")
        texts.append(render(engine))
    for text in texts:
        assert parse(text, cache) == parse(text)
    assert cache.hits >= 2
    assert [parse(t).sleep_state for t in texts] == [
        "awake",
        "awake",
        "weights_offloaded",
        "weights_offloaded",
    ]
    assert [parse(t).waiting_capacity for t in texts] == [0.0, 1.0, 3.0, 4.0]


@pytest.mark.parametrize(
    ("sums", "engines", "state"),
    [
        ((1.0, 0.0, 0.0), 1, "awake"),
        ((2.0, None, None), 2, "awake"),  # a server that shows only the awake series
        ((0.0, 2.0, 0.0), 2, "weights_offloaded"),
        ((0.0, 0.0, 2.0), 2, "discard_all"),
        ((0.0, 0.0, 0.0), 2, "asleep"),  # level 0: no label at 1
        ((1.0, 1.0, 0.0), 2, "mixed"),
        ((0.0, 1.0, 1.0), 2, "mixed"),
        ((1.0, 1.0, 0.0), 1, "mixed"),  # not one-hot
        ((None, 1.0, 0.0), 1, None),
        ((1.0, 0.0, 0.0), 0, None),
    ],
)
def test_sleep_state_of(
    sums: tuple[float | None, float | None, float | None], engines: int, state: str
) -> None:
    assert sleep_state_of(*sums, engines) == state


# -- older servers: absent is unknown, never 0, and no noise ----------------------------------------


def test_a_server_from_before_these_families_reads_them_as_unknown_without_a_note() -> None:
    scrape = parse((FIXTURES / "v1_dp2.txt").read_text())  # ~0.10: the preemption counter only
    assert scrape.ok and scrape.problems == ()
    assert scrape.preemptions_total == 0.0
    assert (scrape.waiting_capacity, scrape.waiting_deferred, scrape.sleep_state) == (None, None, None)


def test_the_real_capture_has_none_of_them() -> None:
    path = DATA / "reference" / "vllm_metrics_sample_v1.txt"
    if not path.exists():
        pytest.skip(f"reference data absent: {path} (set LOWTIDE_DATA_DIR to ../shared/data)")
    lines = strip_transcript(path.read_text(encoding="utf-8")).splitlines()
    scrape = parse("\n".join(line for line in lines if "..." not in line) + "\n")
    assert scrape.ok, scrape.error
    assert (scrape.preemptions_total, scrape.waiting_capacity, scrape.sleep_state) == (None, None, None)
    assert not [p for p in scrape.problems if re.search("preempt|reason|sleep", p)]


# -- signals and the API ----------------------------------------------------------------------------


def reading(t: float, preemptions: float | None, **fields: object) -> ReplicaScrape:
    base: dict[str, object] = {"running": 4.0, "waiting": 2.0, "generation_tokens_total": 10.0 * t}
    base.update(fields)
    return ReplicaScrape(at=AT + t, preemptions_total=preemptions, **base)  # type: ignore[arg-type]


def signals(window: list[ReplicaScrape], now: float) -> ReplicaSignals:
    return replica_signals(
        "svc/0", window, now=AT + now, window_s=60.0, stale_after_s=30.0, frozen_after_s=120.0
    )


def test_the_preemption_rate_is_over_the_window_and_counts_a_restart_from_zero() -> None:
    window = [reading(0, 100.0), reading(10, 104.0), reading(20, 1.0), reading(30, 7.0)]
    s = signals(window, 30)
    assert s.preemptions_per_s == pytest.approx((4 + 1 + 6) / 30)
    # readings older than the window do not count
    s = signals([reading(-100, 0.0), reading(0, 50.0), reading(20, 50.0)], 20)
    assert s.preemptions_per_s == 0.0


def test_kv_pressure_is_preempting_while_requests_wait_for_capacity() -> None:
    base = [reading(0, 10.0), reading(10, 12.0)]
    assert signals(base, 10).kv_pressure is True
    # the same preemptions, but nothing waits for capacity (only deferred requests wait)
    deferred = [reading(0, 10.0), reading(10, 12.0, waiting_capacity=0.0, waiting_deferred=2.0)]
    s = signals(deferred, 10)
    assert (s.waiting_capacity, s.waiting_deferred, s.kv_pressure) == (0.0, 2.0, False)
    assert signals([reading(0, 10.0), reading(10, 10.0)], 10).kv_pressure is False  # no preemption
    assert signals([reading(0, None), reading(10, None)], 10).kv_pressure is None  # an older server


def test_the_newest_reading_gives_the_sleep_state() -> None:
    window = [reading(0, 0.0, sleep_state="awake"), reading(10, 0.0, sleep_state="weights_offloaded")]
    assert signals(window, 10).sleep_state == "weights_offloaded"


def test_a_preemption_counter_that_moves_is_activity_not_frozen_gauges() -> None:
    window = [reading(t, float(t)) for t in range(0, 200, 10)]
    window = [
        ReplicaScrape(
            at=r.at,
            running=4.0,
            waiting=2.0,
            generation_tokens_total=10.0,
            preemptions_total=r.preemptions_total,
        )
        for r in window
    ]
    assert not signals(window, 190).stale
    frozen = [ReplicaScrape(at=r.at, running=4.0, waiting=2.0, generation_tokens_total=10.0) for r in window]
    assert signals(frozen, 190).stale


def test_the_api_shows_them_with_each_replicas_signals() -> None:
    s = signals([reading(0, 10.0), reading(10, 15.0, waiting_capacity=2.0, sleep_state="awake")], 10)
    out = signals_out(s).model_dump()
    assert out["preemptions_per_s"] == pytest.approx(0.5)
    assert (out["waiting_capacity"], out["waiting_deferred"]) == (2.0, None)
    assert (out["kv_pressure"], out["sleep_state"]) == (True, "awake")
