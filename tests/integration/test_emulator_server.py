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
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
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


def start(tmp: Path, *args: str) -> Emulator:
    port = free_port()
    log = tmp / f"emulator-{port}.log"
    command = [sys.executable, "-m", "lowtide.cli.emulate_cmd", "vllm", "--port", str(port), "--model", MODEL]
    with log.open("wb") as out:
        proc = subprocess.Popen([*command, "--no-access-log", *args], stdout=out, stderr=subprocess.STDOUT)
    emulator = Emulator(proc, f"http://127.0.0.1:{port}", log)

    def answers() -> bool:
        if proc.poll() is not None:
            raise AssertionError(f"the emulator exited with {proc.returncode}:\n{log.read_text()}")
        try:
            emulator.get("/health")
        except httpx.TransportError:
            return False
        return True

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


def test_health_is_503_during_the_cold_start_then_200(tmp_path: Path, emulators: list[Emulator]) -> None:
    emulator = start(tmp_path, "--cold-start", "2")
    emulators.append(emulator)
    starting = emulator.get("/health")
    assert_error(starting, 503, match="starting")
    assert int(starting.headers["Retry-After"]) >= 1
    refused = emulator.post("/v1/completions", json={"prompt": "hello", "max_tokens": 4})
    assert_error(refused, 503, match="starting")
    assert emulator.value("vllm:num_requests_running") == 0  # /metrics answers from the start

    wait_until(
        lambda: emulator.get("/health").status_code == 200, timeout=20, what="the end of the cold start"
    )
    done = emulator.post("/v1/completions", json={"prompt": "hello", "max_tokens": 4})
    assert done.status_code == 200 and done.json()["usage"]["completion_tokens"] == 4

    assert emulator.stop(signal.SIGTERM) == 0
    log = emulator.log.read_text()
    assert "Application shutdown complete" in log and "stopped by SIGTERM" in log


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


# -- sleep mode ----------------------------------------------------------------------------------


def test_sleep_aborts_in_flight_requests_refuses_new_ones_and_wake_up_restores(
    tmp_path: Path, emulators: list[Emulator]
) -> None:
    emulator = start(tmp_path, "--cold-start", "0", "--wake", "1", "--speedup", "2")
    emulators.append(emulator)
    assert emulator.get("/is_sleeping").json() == {"is_sleeping": False}

    request = {"prompt": "hi", "max_tokens": 20000, "prompt_tokens": 10, "stream": True}
    with httpx.stream("POST", emulator.url + "/v1/completions", json=request, timeout=30) as response:
        events = sse_events(response)
        assert isinstance(next(events), dict)
        assert emulator.post("/sleep", params={"level": 1}).status_code == 200
        rest = list(events)
    assert rest[-1] == "[DONE]"
    last = rest[-2]
    assert isinstance(last, dict) and last["choices"][0]["finish_reason"] == "abort"

    assert emulator.get("/is_sleeping").json() == {"is_sleeping": True}
    assert emulator.get("/health").status_code == 200
    assert_error(emulator.post("/v1/completions", json={"prompt": "a"}), 503, match="sleeping")
    assert emulator.value("vllm:kv_cache_usage_perc") == 0
    assert emulator.value("vllm:num_requests_running") == 0
    assert emulator.value("vllm:request_success", finished_reason="abort") == 1
    assert_error(emulator.post("/sleep", params={"level": "deep"}), 400, "level")
    assert_error(emulator.post("/sleep", params={"mode": "later"}), 400, "mode")

    assert emulator.post("/wake_up").status_code == 200  # answers once awake
    assert emulator.get("/is_sleeping").json() == {"is_sleeping": False}
    after = emulator.post("/v1/completions", json={"prompt": "a", "max_tokens": 3})
    assert after.status_code == 200 and after.json()["usage"]["completion_tokens"] == 3


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
