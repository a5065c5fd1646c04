"""`lowtide emulate vllm`: run the vLLM emulator, a stand-in replica for machines without GPUs.

``lowtide emulate vllm --port 8101 --model meta-llama/Llama-3.1-8B-Instruct --gpus 4`` serves vLLM's
OpenAI API, sleep-mode endpoints and `/metrics` with the timing of a capacity model
(`lowtide.emulator.engine` documents the model and its defaults; `lowtide.emulator.server` the
endpoints). Capacity options left unset take the defaults for ``--gpus`` GPUs. Exit codes: 0 after a
SIGTERM/SIGINT shutdown; 2 for bad options; 1 if the server cannot start (port in use).
Also runnable as ``python -m lowtide.cli.emulate_cmd vllm ...``.
Neighbours: `cli.main` registers `emulate_app` as ``emulate``. Must not: talk to the lowtide API.
"""

from __future__ import annotations

import logging
from typing import Annotated, Any, Literal

import typer

from lowtide.cli.output import HELP_MARKUP
from lowtide.emulator.engine import EngineConfig

emulate_app = typer.Typer(
    help="Emulators for machines without GPUs (demo, tests, benchmarks).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=HELP_MARKUP,
)


@emulate_app.callback()
def _group() -> None:
    """Emulators for machines without GPUs (demo, tests, benchmarks)."""


def _opt(help_text: str, flag: str) -> Any:
    return typer.Option(flag, help=help_text, show_default=False)


@emulate_app.command("vllm")
def vllm(
    port: Annotated[int, typer.Option("--port", help="Port to listen on.", min=0, max=65535)],
    model: Annotated[str, typer.Option("--model", help="Served model name.")],
    host: Annotated[
        str, typer.Option("--host", help="Address to bind (vLLM's default: every interface).")
    ] = "0.0.0.0",  # noqa: S104 (vLLM binds every interface without --host; lowtide passes 127.0.0.1)
    gpus: Annotated[
        int, typer.Option("--gpus", help="GPUs of the replica (scales KV cache, prefill).", min=1)
    ] = 4,
    metrics_version: Annotated[
        Literal["v1", "v0"], typer.Option("--metrics-version", help="vLLM metric names: v1 or v0.")
    ] = "v1",
    data_parallel_size: Annotated[
        int,
        typer.Option(
            "--data-parallel-size", help="Engines behind the server, each a full copy (v1 metrics).", min=1
        ),
    ] = 1,
    max_num_seqs: Annotated[int | None, _opt("Most sequences in a batch [256].", "--max-num-seqs")] = None,
    max_num_batched_tokens: Annotated[
        int | None, _opt("Token budget of one engine step [8192].", "--max-num-batched-tokens")
    ] = None,
    kv_cache_tokens: Annotated[
        int | None, _opt("KV-cache capacity in tokens [150000 per GPU].", "--kv-cache-tokens")
    ] = None,
    max_model_len: Annotated[
        int | None, _opt("Longest prompt + output [32768, at most the cache].", "--max-model-len")
    ] = None,
    prefill_tps: Annotated[
        float | None, _opt("Prefill throughput, tokens/s [5000 per GPU].", "--prefill-tps")
    ] = None,
    decode_base_ms: Annotated[
        float | None, _opt("Decode step time at batch 0, ms [12].", "--decode-base-ms")
    ] = None,
    decode_per_seq_ms: Annotated[
        float | None, _opt("Decode step time per sequence, ms [0.08].", "--decode-per-seq-ms")
    ] = None,
    cold_start: Annotated[
        float | None, _opt("Seconds before /health answers 200 [60].", "--cold-start")
    ] = None,
    wake: Annotated[float | None, _opt("Seconds to wake from sleep [3].", "--wake")] = None,
    eos_prob: Annotated[
        float | None, _opt("Chance per token that the answer ends (0: always max_tokens) [0].", "--eos-prob")
    ] = None,
    speedup: Annotated[float, typer.Option("--speedup", help="Divide every duration by this factor.")] = 1.0,
    shutdown_grace: Annotated[
        float, typer.Option("--shutdown-grace", help="Seconds in-flight requests get at shutdown.", min=0)
    ] = 5.0,
    log_level: Annotated[str, typer.Option("--log-level", help="uvicorn log level.")] = "info",
    access_log: Annotated[
        bool, typer.Option("--access-log/--no-access-log", help="Log every request.")
    ] = True,
) -> None:
    """Serve an emulated vLLM replica (OpenAI API, /metrics, sleep mode) until SIGTERM or SIGINT."""
    from lowtide.emulator.server import serve  # noqa: PLC0415 (keeps `lowtide --help` fast)

    try:
        config = EngineConfig.for_gpus(
            gpus,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            kv_cache_tokens=kv_cache_tokens,
            max_model_len=max_model_len,
            prefill_tokens_per_s=prefill_tps,
            decode_base_s=None if decode_base_ms is None else decode_base_ms / 1000,
            decode_per_seq_s=None if decode_per_seq_ms is None else decode_per_seq_ms / 1000,
            cold_start_s=cold_start,
            wake_s=wake,
            eos_probability=eos_prob,
            speedup=speedup,
        )
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from exc
    if data_parallel_size > 1 and metrics_version == "v0":
        raise typer.BadParameter("--data-parallel-size needs --metrics-version v1 (V0 has no engine label)")
    logging.basicConfig(level=log_level.upper(), format="%(levelname)s:     %(name)s: %(message)s")
    serve(
        config,
        model,
        host=host,
        port=port,
        metrics_version=metrics_version,
        log_level=log_level,
        access_log=access_log,
        shutdown_grace_s=shutdown_grace,
        data_parallel_size=data_parallel_size,
    )


if __name__ == "__main__":
    emulate_app()
