"""The vLLM emulator as a real server process (`python -m lowtide.cli.emulate_cmd vllm ...`) on a free
port, used over HTTP the way lowtide, a gateway or a load generator uses vLLM: health during the cold
start, OpenAI completions and chat (plain and streamed), vLLM's `/metrics` (V1 and V0), a queue under
load, sleep mode, error bodies, and a clean exit on SIGTERM and SIGINT.

Nothing here asserts a duration: the servers run with ``--speedup`` and the tests wait for states
(bounded polling). Counters on the shared server are compared as deltas.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families
from typer.testing import CliRunner

from lowtide.cli.emulate_cmd import emulate_app
from support import wait_until

MODEL = "meta-llama/Llama-3.1-8B-Instruct"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Emulator:
    proc: subprocess.Popen[bytes]
    url: str
    log: Path

    def get(self, path: str, **kw: Any) -> httpx.Response:
        return httpx.get(self.url + path, timeout=10, **kw)

    def post(self, path: str, **kw: Any) -> httpx.Response:
        return httpx.post(self.url + path, timeout=30, **kw)

    def metrics(self) -> dict[str, Any]:
        """family name → family, parsed by prometheus_client."""
        response = self.get("/metrics")
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/plain; version=0.0.4")
        return {f.name: f for f in text_string_to_metric_families(response.text)}

    def value(self, family: str, **labels: str) -> float:
        samples = [s for s in self.metrics()[family].samples if labels.items() <= s.labels.items()]
        samples = [s for s in samples if s.name in (family, family + "_total")]
        assert len(samples) == 1, samples
        return float(samples[0].value)

    def stop(self, sig: int = signal.SIGTERM) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"the emulator ignored signal {sig}; log:\n{self.log.read_text()}") from None


def start(tmp: Path, *args: str, dev_mode: bool = True, wait: bool = True) -> Emulator:
    """An emulator process; with `dev_mode`, VLLM_SERVER_DEV_MODE=1 (vLLM's dev endpoints, /sleep...)."""
    port = free_port()
    log = tmp / f"emulator-{port}.log"
    command = [sys.executable, "-m", "lowtide.cli.emulate_cmd", "vllm", "--port", str(port), "--model", MODEL]
    env = {k: v for k, v in os.environ.items() if k != "VLLM_SERVER_DEV_MODE"}
    if dev_mode:
        env["VLLM_SERVER_DEV_MODE"] = "1"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [*command, "--no-access-log", *args], stdout=out, stderr=subprocess.STDOUT, env=env
        )
    emulator = Emulator(proc, f"http://127.0.0.1:{port}", log)

    def answers() -> bool:
        if proc.poll() is not None:
            raise AssertionError(f"the emulator exited with {proc.returncode}:\n{log.read_text()}")
        try:
            emulator.get("/health")
        except httpx.TransportError:
            return False
        return True

    if wait:
        wait_until(answers, timeout=30, what="the emulator to answer /health")
    return emulator


@pytest.fixture
def emulators(tmp_path: Path) -> Iterator[list[Emulator]]:
    """Servers a test starts; whatever is still running at the end is stopped."""
    started: list[Emulator] = []
    yield started
    for emulator in started:
        emulator.stop()


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Emulator]:
    emulator = start(tmp_path_factory.mktemp("emulator"), "--cold-start", "0")
    yield emulator
    assert emulator.stop() == 0


def sse_events(response: httpx.Response) -> Iterator[dict[str, Any] | str]:
    """The `data:` payloads of a stream: dicts, and the final "[DONE]"."""
    for line in response.iter_lines():
        if not line:
            continue
        assert line.startswith("data: "), line
        payload = line[len("data: ") :]
        yield payload if payload == "[DONE]" else json.loads(payload)


def assert_error(response: httpx.Response, status: int, param: str | None = None, match: str = "") -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == status and isinstance(error["message"], str) and match in error["message"]
    assert (
        error["type"]
        == {400: "BadRequestError", 404: "NotFoundError", 503: "ServiceUnavailableError"}[status]
    )
    if param is not None:
        assert error["param"] == param


# -- lifecycle -----------------------------------------------------------------------------------


def connection_refused(emulator: Emulator) -> bool:
    """True while the port refuses connections (bound, not listening), as vLLM's while it loads."""
    try:
        emulator.get("/health")
    except httpx.ConnectError:
        return True
    return False


def test_connections_are_refused_during_the_cold_start_then_health_is_200(
    tmp_path: Path, emulators: list[Emulator]
) -> None:
    emulator = start(tmp_path, "--cold-start", "3", wait=False)
    emulators.append(emulator)
    assert connection_refused(emulator)  # not a 503: vLLM does not listen before its engine is up
    with pytest.raises(httpx.ConnectError):
        emulator.post("/v1/completions", json={"prompt": "hello", "max_tokens": 4})

    wait_until(lambda: not connection_refused(emulator), timeout=30, what="the end of the cold start")
    assert emulator.get("/health").status_code == 200
    done = emulator.post("/v1/completions", json={"prompt": "hello", "max_tokens": 4})
    assert done.status_code == 200 and done.json()["usage"]["completion_tokens"] == 4
    assert emulator.value("vllm:num_requests_running") == 0

    assert emulator.stop(signal.SIGTERM) == 0
    log = emulator.log.read_text()
    assert "Application shutdown complete" in log and "stopped by SIGTERM" in log


def test_sigterm_during_the_cold_start_exits_cleanly(tmp_path: Path, emulators: list[Emulator]) -> None:
    emulator = start(tmp_path, "--cold-start", "600", wait=False)
    emulators.append(emulator)
    wait_until(lambda: "connections refused" in emulator.log.read_text() or emulator.proc.poll() is not None,
               timeout=30, what="the emulator to begin its cold start")  # fmt: skip
    assert connection_refused(emulator)
    assert emulator.stop(signal.SIGTERM) == 0
    assert "during the cold start" in emulator.log.read_text()


def test_host_is_honoured(tmp_path: Path, emulators: list[Emulator]) -> None:
    emulator = start(tmp_path, "--cold-start", "0", "--host", "127.0.0.1")
    emulators.append(emulator)
    port = int(emulator.url.rsplit(":", 1)[1])
    assert emulator.get("/health").status_code == 200
    # Bound to loopback only: the same port is free on the wildcard address for another socket
    # only if nothing holds 0.0.0.0:port (binding the wildcard fails while a specific address of
    # the same port is bound without SO_REUSEADDR on both; so check the listener's own address).
    listening = [
        c.laddr for c in psutil.Process(emulator.proc.pid).net_connections(kind="tcp") if c.status == "LISTEN"
    ]
    assert listening and all(addr.ip == "127.0.0.1" and addr.port == port for addr in listening)


def test_sigint_ends_requests_in_flight_and_stops_the_server_cleanly(
    tmp_path: Path, emulators: list[Emulator]
) -> None:
    emulator = start(tmp_path, "--cold-start", "0", "--shutdown-grace", "0.5")
    emulators.append(emulator)
    request = {"prompt": "hi", "max_tokens": 20000, "stream": True}
    with httpx.stream("POST", emulator.url + "/v1/completions", json=request, timeout=30) as response:
        events = sse_events(response)
        assert isinstance(next(events), dict)
        emulator.proc.send_signal(signal.SIGINT)
        rest = list(events)
    assert rest[-1] == "[DONE]"
    last = rest[-2]
    assert isinstance(last, dict) and last["choices"][0]["finish_reason"] == "abort"
    assert emulator.proc.wait(timeout=15) == 0  # one SIGINT: a second one would force-quit uvicorn
    log = emulator.log.read_text()
    assert "aborted 1 request(s) still in flight" in log and "stopped by SIGINT" in log
    assert "Traceback" not in log


# -- the OpenAI API ------------------------------------------------------------------------------


def test_models_lists_the_served_model(shared: Emulator) -> None:
    body = shared.get("/v1/models").json()
    assert body["object"] == "list"
    assert [(m["id"], m["object"], m["max_model_len"]) for m in body["data"]] == [(MODEL, "model", 32768)]


def test_completion_counts_tokens_and_honours_the_extension_fields(shared: Emulator) -> None:
    prompt_before = shared.value("vllm:prompt_tokens")
    plain = shared.post(
        "/v1/completions",
        json={"model": MODEL, "prompt": "one two three four five six seven", "max_tokens": 7},
    )
    assert plain.status_code == 200
    body = plain.json()
    assert body["object"] == "text_completion" and body["model"] == MODEL and body["id"].startswith("cmpl-")
    (choice,) = body["choices"]
    assert choice["finish_reason"] == "length" and len(choice["text"].split()) == 7
    assert body["usage"] == {"prompt_tokens": 10, "completion_tokens": 7, "total_tokens": 17}  # ceil(7 × 1.3)

    exact = shared.post(
        "/v1/completions", json={"prompt": "x", "max_tokens": 20, "prompt_tokens": 321, "output_tokens": 5}
    )
    assert exact.json()["usage"] == {"prompt_tokens": 321, "completion_tokens": 5, "total_tokens": 326}
    assert exact.json()["choices"][0]["finish_reason"] == "stop"
    token_ids = shared.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 1})
    assert token_ids.json()["usage"]["prompt_tokens"] == 3
    assert shared.value("vllm:prompt_tokens") - prompt_before == 10 + 321 + 3


def test_a_stream_sends_token_chunks_then_usage_and_done(shared: Emulator) -> None:
    request = {"prompt": "hi", "max_tokens": 40, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", shared.url + "/v1/completions", json=request, timeout=30) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = list(sse_events(response))
    assert events[-1] == "[DONE]"
    chunks = [e for e in events[:-1] if isinstance(e, dict) and e["choices"]]
    assert len(chunks) >= 2
    assert all(c["object"] == "text_completion" and c["id"] == chunks[0]["id"] for c in chunks)
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * (len(chunks) - 1) + ["length"]
    text = "".join(c["choices"][0]["text"] for c in chunks)
    assert text.startswith(" lorem ipsum dolor") and len(text.split()) == 40
    (usage,) = [e for e in events[:-1] if isinstance(e, dict) and not e["choices"]]
    assert usage["usage"] == {"prompt_tokens": 2, "completion_tokens": 40, "total_tokens": 42}


def test_stream_chunks_arrive_while_the_request_runs_and_a_disconnect_aborts_it(shared: Emulator) -> None:
    aborted_before = shared.value("vllm:request_success", finished_reason="abort")
    request = {"prompt": "hi", "max_tokens": 20000, "prompt_tokens": 10, "stream": True}
    with httpx.stream("POST", shared.url + "/v1/completions", json=request, timeout=30) as response:
        events = sse_events(response)  # kept: dropping the generator would close the connection
        first = next(events)
        assert isinstance(first, dict) and first["choices"][0]["text"]
        # The first tokens are here while the request is still generating: the stream is incremental.
        assert shared.value("vllm:num_requests_running") == 1
        assert 0 < shared.value("vllm:kv_cache_usage_perc") < 1
    wait_until(
        lambda: shared.value("vllm:num_requests_running") == 0, what="the aborted request to leave the batch"
    )
    assert shared.value("vllm:request_success", finished_reason="abort") == aborted_before + 1
    assert shared.value("vllm:kv_cache_usage_perc") == 0


def test_a_client_that_gives_up_on_a_plain_request_aborts_it(shared: Emulator) -> None:
    aborted_before = shared.value("vllm:request_success", finished_reason="abort")

    async def scenario() -> None:
        async with httpx.AsyncClient(base_url=shared.url, timeout=60) as client:
            body = {"prompt": "x", "prompt_tokens": 10, "max_tokens": 20000}
            work = asyncio.create_task(client.post("/v1/completions", json=body))
            await asyncio.to_thread(
                wait_until, lambda: shared.value("vllm:num_requests_running") == 1, what="the request to run"
            )
            work.cancel()  # closes the connection
            with contextlib.suppress(asyncio.CancelledError):
                await work

    asyncio.run(scenario())
    wait_until(
        lambda: shared.value("vllm:num_requests_running") == 0, what="the abandoned request to be aborted"
    )
    assert shared.value("vllm:request_success", finished_reason="abort") == aborted_before + 1


def test_chat_completions_plain_and_streamed(shared: Emulator) -> None:
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "say hello to me"}]
    plain = shared.post("/v1/chat/completions", json={"model": MODEL, "messages": messages, "max_tokens": 3})
    assert plain.status_code == 200
    body = plain.json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    (choice,) = body["choices"]
    assert choice["message"] == {"role": "assistant", "content": " lorem ipsum dolor"}
    assert choice["finish_reason"] == "length"
    assert body["usage"]["prompt_tokens"] == 3 + (4 + 3) + (4 + 6)  # template + ceil(words × 1.3)

    streamed = {"messages": messages, "max_completion_tokens": 4, "stream": True}
    with httpx.stream("POST", shared.url + "/v1/chat/completions", json=streamed, timeout=30) as response:
        events = list(sse_events(response))
    assert events[-1] == "[DONE]"
    chunks = [e for e in events[:-1] if isinstance(e, dict)]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == " lorem ipsum dolor sit"
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_bad_requests_get_openai_error_bodies(shared: Emulator) -> None:
    bad_json = shared.post(
        "/v1/completions", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert_error(bad_json, 400, match="not valid JSON")
    assert_error(shared.post("/v1/completions", json={"max_tokens": 3}), 400, "prompt")
    assert_error(shared.post("/v1/completions", json={"prompt": "a", "max_tokens": 0}), 400, "max_tokens")
    assert_error(shared.post("/v1/completions", json={"prompt": "a", "n": 2}), 400, "n")
    assert_error(shared.post("/v1/completions", json={"prompt": ["a", "b"]}), 400, "prompt", "one prompt")
    assert_error(shared.post("/v1/completions", json=[1, 2]), 400)
    assert_error(shared.post("/v1/chat/completions", json={"messages": []}), 400, "messages")
    too_long = shared.post(
        "/v1/completions", json={"prompt": "a", "prompt_tokens": 32000, "max_tokens": 1000}
    )
    assert_error(too_long, 400, match="maximum context length is 32768 tokens")
    assert_error(shared.post("/v1/completions", json={"model": "other", "prompt": "a"}), 404, "model")
    assert shared.get("/v1/completions").status_code == 405


# -- /metrics ------------------------------------------------------------------------------------

V1_TYPES = {
    "vllm:num_requests_running": "gauge",
    "vllm:num_requests_waiting": "gauge",
    "vllm:kv_cache_usage_perc": "gauge",
    "vllm:prompt_tokens": "counter",
    "vllm:generation_tokens": "counter",
    "vllm:request_success": "counter",
    "vllm:time_to_first_token_seconds": "histogram",
    "vllm:inter_token_latency_seconds": "histogram",
    "vllm:e2e_request_latency_seconds": "histogram",
    "vllm:request_queue_time_seconds": "histogram",
    "vllm:cache_config_info": "gauge",
}


def test_metrics_v1_has_every_family_with_its_type_labels_and_created_series(shared: Emulator) -> None:
    done = shared.post("/v1/completions", json={"prompt": "a b c", "max_tokens": 3})
    assert done.status_code == 200
    families = shared.metrics()
    for name, kind in V1_TYPES.items():
        family = families[name]
        assert family.type == kind, name
        assert family.samples, name
        for sample in family.samples:
            assert sample.labels["engine"] == "0"
            if name != "vllm:cache_config_info":
                assert sample.labels["model_name"] == MODEL
        if kind in ("counter", "histogram"):
            created = families[f"{name}_created"]
            assert created.type == "gauge" and all(s.value > 1.7e9 for s in created.samples)
    assert {s.labels["finished_reason"] for s in families["vllm:request_success"].samples} == {
        "stop",
        "length",
        "abort",
    }
    ttft = families["vllm:time_to_first_token_seconds"].samples
    assert [s.labels["le"] for s in ttft if s.name.endswith("_bucket")][:3] == ["0.001", "0.005", "0.01"]
    assert next(s.value for s in ttft if s.name.endswith("_count")) > 0
    info = families["vllm:cache_config_info"].samples[0]
    assert (info.labels["num_gpu_blocks"], info.labels["block_size"], info.value) == ("37500", "16", 1.0)
    assert (
        "vllm:gpu_cache_usage_perc" not in families and "vllm:time_per_output_token_seconds" not in families
    )


def test_metrics_v0_uses_v0_names(tmp_path: Path, emulators: list[Emulator]) -> None:
    emulator = start(tmp_path, "--cold-start", "0", "--metrics-version", "v0", "--gpus", "2")
    emulators.append(emulator)
    assert emulator.post("/v1/completions", json={"prompt": "a", "max_tokens": 2}).status_code == 200
    families = emulator.metrics()
    for name in (
        "vllm:gpu_cache_usage_perc",
        "vllm:time_per_output_token_seconds",
        "vllm:num_requests_swapped",
    ):
        assert name in families
    for name in ("vllm:kv_cache_usage_perc", "vllm:inter_token_latency_seconds"):
        assert name not in families
    assert not [name for name in families if name.endswith("_created")]
    assert all("engine" not in s.labels for f in families.values() for s in f.samples)
    assert emulator.value("vllm:request_success", finished_reason="length") == 1
    info = families["vllm:cache_config_info"].samples[0]
    assert info.labels["num_gpu_blocks"] == str(300_000 // 16)  # --gpus 2: half the cache


# -- load ----------------------------------------------------------------------------------------


def test_fifty_concurrent_requests_queue_behind_max_num_seqs(
    tmp_path: Path, emulators: list[Emulator]
) -> None:
    emulator = start(tmp_path, "--cold-start", "0", "--max-num-seqs", "8", "--speedup", "2")
    emulators.append(emulator)

    async def scenario() -> tuple[list[httpx.Response], list[tuple[float, float]]]:
        seen: list[tuple[float, float]] = []
        async with httpx.AsyncClient(base_url=emulator.url, timeout=60) as client:

            async def watch() -> None:
                while True:
                    text = (await client.get("/metrics")).text
                    values = {
                        s.name: s.value
                        for f in text_string_to_metric_families(text)
                        for s in f.samples
                        if s.name in ("vllm:num_requests_running", "vllm:num_requests_waiting")
                    }
                    seen.append((values["vllm:num_requests_running"], values["vllm:num_requests_waiting"]))
                    await asyncio.sleep(0.02)

            watcher = asyncio.create_task(watch())
            body = {"prompt": "x", "prompt_tokens": 64, "max_tokens": 32}
            responses = await asyncio.gather(*(client.post("/v1/completions", json=body) for _ in range(50)))
            watcher.cancel()
        return list(responses), seen

    responses, seen = asyncio.run(scenario())
    assert [r.status_code for r in responses] == [200] * 50
    assert all(r.json()["usage"]["completion_tokens"] == 32 for r in responses)
    assert max(waiting for _, waiting in seen) > 0
    assert max(running for running, _ in seen) == 8
    assert emulator.value("vllm:request_success", finished_reason="length") == 50
    assert emulator.value("vllm:generation_tokens") == 50 * 32
    assert emulator.value("vllm:prompt_tokens") == 50 * 64
    assert (emulator.value("vllm:num_requests_running"), emulator.value("vllm:num_requests_waiting")) == (
        0,
        0,
    )
    queue = emulator.metrics()["vllm:request_queue_time_seconds"].samples
    assert [s.value for s in queue if s.name.endswith("_count")] == [50]
    assert next(s.value for s in queue if s.name.endswith("_sum")) > 0


def test_data_parallel_engines_each_have_their_series(tmp_path: Path, emulators: list[Emulator]) -> None:
    emulator = start(tmp_path, "--cold-start", "0", "--data-parallel-size", "2")
    emulators.append(emulator)
    for n in range(2):
        done = emulator.post("/v1/completions", json={"prompt": f"p{n}", "max_tokens": 2})
        assert done.status_code == 200
    metrics = emulator.metrics()
    for family in ("vllm:num_requests_running", "vllm:kv_cache_usage_perc", "vllm:engine_sleep_state"):
        assert {s.labels["engine"] for s in metrics[family].samples} == {"0", "1"}, family
    successes = {
        s.labels["engine"]: s.value
        for s in metrics["vllm:request_success"].samples
        if s.name == "vllm:request_success_total" and s.labels["finished_reason"] == "length"
    }
    assert sum(successes.values()) == 2 and set(successes) == {"0", "1"}


# -- sleep mode ----------------------------------------------------------------------------------


def test_sleep_aborts_in_flight_requests_queues_new_ones_and_wake_up_serves_them(
    tmp_path: Path, emulators: list[Emulator]
) -> None:
    emulator = start(tmp_path, "--cold-start", "0", "--wake", "1", "--speedup", "2")
    emulators.append(emulator)
    assert emulator.get("/is_sleeping").json() == {"is_sleeping": False}
    assert emulator.value("vllm:engine_sleep_state", sleep_state="awake") == 1

    request = {"prompt": "hi", "max_tokens": 20000, "prompt_tokens": 10, "stream": True}
    with httpx.stream("POST", emulator.url + "/v1/completions", json=request, timeout=30) as response:
        events = sse_events(response)
        assert isinstance(next(events), dict)
        slept = emulator.post("/sleep", params={"level": 1})
        assert slept.status_code == 200 and slept.json() == {"status": "sleeping", "level": 1}
        rest = list(events)
    assert rest[-1] == "[DONE]"
    last = rest[-2]
    assert isinstance(last, dict) and last["choices"][0]["finish_reason"] == "abort"

    assert emulator.get("/is_sleeping").json() == {"is_sleeping": True}
    assert emulator.get("/health").status_code == 200  # vLLM's /health is 200 while asleep
    assert emulator.value("vllm:engine_sleep_state", sleep_state="awake") == 0
    assert emulator.value("vllm:engine_sleep_state", sleep_state="weights_offloaded") == 1
    assert emulator.value("vllm:kv_cache_usage_perc") == 0
    assert emulator.value("vllm:num_requests_running") == 0
    assert emulator.value("vllm:request_success", finished_reason="abort") == 1
    assert_error(emulator.post("/sleep", params={"level": "deep"}), 400, "level")
    assert_error(emulator.post("/sleep", params={"level": 3}), 400, "level")
    assert_error(emulator.post("/sleep", params={"mode": "later"}), 400, "mode")

    async def queued_then_woken() -> tuple[httpx.Response, httpx.Response]:
        async with httpx.AsyncClient(base_url=emulator.url, timeout=60) as client:
            # Asleep, a request is held (vLLM queues it while paused), not refused.
            held = asyncio.create_task(client.post("/v1/completions", json={"prompt": "a", "max_tokens": 3}))
            await asyncio.to_thread(
                wait_until,
                lambda: emulator.value("vllm:num_requests_waiting") == 1,
                what="the request to wait while the engine sleeps",
            )
            assert not held.done()
            assert emulator.value("vllm:num_requests_waiting_by_reason", reason="capacity") == 1
            woke = await client.post("/wake_up", json={})  # a JSON body is accepted
            return await held, woke

    served, woke = asyncio.run(queued_then_woken())
    assert woke.status_code == 200 and woke.json() == {"status": "awake", "tags_woken": None}
    assert emulator.get("/is_sleeping").json() == {"is_sleeping": False}
    assert served.status_code == 200 and served.json()["usage"]["completion_tokens"] == 3


def test_wake_up_by_tags_stays_asleep_until_every_tag_is_awake(
    tmp_path: Path, emulators: list[Emulator]
) -> None:
    emulator = start(tmp_path, "--cold-start", "0", "--wake", "0.5")
    emulators.append(emulator)
    slept = emulator.post("/sleep", params={"level": 2, "mode": "keep"}, json={"level": 1})  # body ignored
    assert slept.status_code == 200 and slept.json()["level"] == 2
    assert emulator.value("vllm:engine_sleep_state", sleep_state="discard_all") == 1

    weights = emulator.post("/wake_up", params={"tags": "weights"})
    assert weights.status_code == 200 and weights.json() == {"status": "sleeping", "tags_woken": ["weights"]}
    assert emulator.get("/is_sleeping").json() == {"is_sleeping": True}
    assert_error(emulator.post("/wake_up", params={"tags": "gpu"}), 400, "tags")

    kv = emulator.post("/wake_up", params={"tags": "kv_cache"})
    assert kv.status_code == 200 and kv.json() == {"status": "awake", "tags_woken": ["kv_cache"]}
    assert emulator.get("/is_sleeping").json() == {"is_sleeping": False}
    assert emulator.value("vllm:engine_sleep_state", sleep_state="awake") == 1

    # Level 0 is accepted too, and a sleep in keep mode keeps the requests for after the wake.
    assert emulator.post("/sleep", params={"level": 0, "mode": "keep"}).status_code == 200
    assert emulator.post("/wake_up").json()["status"] == "awake"


def test_dev_endpoints_exist_only_in_dev_mode(tmp_path: Path, emulators: list[Emulator]) -> None:
    plain = start(tmp_path, "--cold-start", "0", dev_mode=False)
    emulators.append(plain)
    for method, path in [
        ("POST", "/sleep"),
        ("POST", "/wake_up"),
        ("GET", "/is_sleeping"),
        ("POST", "/collective_rpc"),
        ("POST", "/reset_prefix_cache"),
        ("GET", "/server_info"),
    ]:
        assert httpx.request(method, plain.url + path, timeout=10).status_code == 404, path
    assert plain.get("/health").status_code == 200

    dev = start(tmp_path, "--cold-start", "0", dev_mode=True)
    emulators.append(dev)
    assert dev.post("/collective_rpc", json={"method": "noop"}).status_code == 200
    assert dev.post("/reset_prefix_cache").status_code == 200
    assert dev.get("/is_sleeping").json() == {"is_sleeping": False}
    assert "SECURITY WARNING" in dev.log.read_text()


def test_a_stopped_process_answers_nothing_and_health_is_200_again_once_continued(
    tmp_path: Path, emulators: list[Emulator]
) -> None:
    emulator = start(tmp_path, "--cold-start", "0")
    emulators.append(emulator)
    emulator.proc.send_signal(signal.SIGSTOP)
    try:
        with pytest.raises(httpx.ReadTimeout):
            httpx.get(emulator.url + "/health", timeout=1)
    finally:
        emulator.proc.send_signal(signal.SIGCONT)
    assert emulator.get("/health").status_code == 200


def test_sleep_in_wait_mode_answers_after_in_flight_requests_finish(
    tmp_path: Path, emulators: list[Emulator]
) -> None:
    emulator = start(tmp_path, "--cold-start", "0", "--wake", "0", "--speedup", "4")
    emulators.append(emulator)

    async def scenario() -> tuple[httpx.Response, httpx.Response]:
        async with httpx.AsyncClient(base_url=emulator.url, timeout=60) as client:
            work = asyncio.create_task(
                client.post("/v1/completions", json={"prompt": "x", "max_tokens": 200})
            )
            await asyncio.to_thread(
                wait_until,
                lambda: emulator.value("vllm:num_requests_running") == 1,
                what="the request to run",
            )
            slept = await client.post("/sleep", params={"level": 1, "mode": "wait"})
            return await work, slept

    finished, slept = asyncio.run(scenario())
    assert slept.status_code == 200
    assert finished.status_code == 200 and finished.json()["usage"]["completion_tokens"] == 200
    assert emulator.get("/is_sleeping").json() == {"is_sleeping": True}
    assert emulator.value("vllm:request_success", finished_reason="abort") == 0


# -- the command line ----------------------------------------------------------------------------


def test_cli_help_and_bad_options() -> None:
    runner = CliRunner()
    top = runner.invoke(emulate_app, ["--help"])
    assert top.exit_code == 0 and "vllm" in top.output
    help_ = runner.invoke(emulate_app, ["vllm", "--help"], env={"COLUMNS": "200"})
    assert help_.exit_code == 0
    options = ["--port", "--model", "--gpus", "--metrics-version", "--max-num-seqs", "--kv-cache-tokens",
               "--prefill-tps", "--decode-base-ms", "--decode-per-seq-ms", "--cold-start", "--wake",
               "--speedup"]  # fmt: skip
    for option in options:
        assert option in help_.output, option
    bad = runner.invoke(emulate_app, ["vllm", "--port", "1", "--model", "m", "--kv-cache-tokens", "10"])
    assert bad.exit_code == 2 and "at least one block" in bad.output
    wrong = runner.invoke(emulate_app, ["vllm", "--port", "1", "--model", "m", "--metrics-version", "v2"])
    assert wrong.exit_code == 2
