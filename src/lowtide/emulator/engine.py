"""A capacity model of one vLLM replica: continuous batching in model time, with no HTTP and no GPU.

Role: stand in for vLLM's engine on machines without GPUs (demo, tests, benchmarks), so that queues
build, KV-cache use grows and latencies stretch under load as they do on a real replica, and lowtide's
autoscaler sees the same signals. `Engine` is a discrete-event model driven by a clock it is given
(``time.monotonic`` in the server, a fake clock in tests): it never sleeps and never reads the time
except through that clock. It records what vLLM's Prometheus logger records (`EngineStats`).

The model (V1 scheduler, simplified)
====================================
A request arrives with ``prompt_tokens`` and ``max_tokens`` (and optionally the number of tokens the
"model" would produce before EOS) and joins the FCFS **waiting** queue. Work happens in engine
**steps**. At the start of a step the scheduler, like vLLM's V1 scheduler:

1. serves the **running** sequences in admission order within a token budget
   (``max_num_batched_tokens``): each needs the tokens it has not yet computed, i.e. 1 for a
   decoding sequence, or (a chunk of) its prompt when it is prefilling (chunked prefill). The KV
   blocks for those tokens are allocated now; when the cache is full the most recently admitted
   running sequence is **preempted** (its blocks freed, back to the head of the queue; it later
   recomputes prompt + generated tokens), as vLLM does;
2. if nothing was preempted, **admits** waiting requests in order while fewer than ``max_num_seqs``
   run, budget remains, and the KV blocks for the chunk it would compute *fit* (head-of-line: a
   request that does not fit blocks the ones behind it).

A sequence whose computed tokens reach its length in a step emits one token at the step's end (the
first such token ends its prefill: TTFT = queueing + prefill). A step lasts::

    step_s = decode_base_s + decode_per_seq_s × seqs_in_step + prefill_tokens_in_step / prefill_tokens_per_s

so ``decode_step_s(batch) = base + per_seq × batch``: throughput ``batch / decode_step_s(batch)`` grows
sublinearly with the batch and every sequence's inter-token latency grows with it. A sequence holds
``ceil((prompt + generated) / block_size)`` blocks; ``kv_cache_usage = used blocks / all blocks``.
It finishes at ``max_tokens`` (reason ``length``), or earlier (``stop``) at an explicit output length
or one sampled with ``eos_probability`` per token (geometric; off by default).

Defaults: one 4-GPU replica (tensor parallel) of an 8B model
============================================================
===========================  ===========  ==========================================================
knob                         default      why
===========================  ===========  ==========================================================
``max_num_seqs``             256          vLLM's default
``max_num_batched_tokens``   8192         vLLM V1's default for online serving on large GPUs
``kv_cache_tokens``          600,000      150k per GPU: Llama-3.1-8B holds 128 KiB of KV per token
                                          in bf16 (32 layers × 8 KV heads × 128 dims × K,V × 2 B),
                                          so ~75 GiB of cache over 4 GPUs
``block_size``               16           vLLM's default; ``num_gpu_blocks = kv_cache_tokens // 16``
``max_model_len``            32,768       a common serving limit (must fit the cache)
``prefill_tokens_per_s``     20,000       5k per GPU: a 1k-token prompt prefills in 50 ms
``decode_base_s``            0.012        12 ms per step at batch 1 (~80 tokens/s for one stream)
``decode_per_seq_s``         0.00008      +0.08 ms per sequence: batch 256 → 32 ms steps, ~7.9k tok/s
``cold_start_s``             60           weights, torch.compile and CUDA graphs before /health is 200
``wake_s``                   3            wake from sleep level 1 (weights back from host RAM)
===========================  ===========  ==========================================================

`EngineConfig.for_gpus` scales the KV cache and prefill throughput with the GPU count (tensor
parallelism adds memory and FLOPs) and leaves the decode step alone (bound by memory bandwidth and
communication). ``speedup`` K compresses time: every duration is divided by K (prefill throughput
multiplied), so the emulator behaves exactly like a K× faster machine; metrics and responses report
the compressed times that clients observe.

Lifecycle (`EngineState`): STARTING until ``cold_start_s`` has passed, then READY. ``sleep(level,
mode)`` takes vLLM's levels 0–2 and pause modes (vllm/entrypoints/serve/dev/sleep/api_router.py,
``PauseMode``): ``abort`` (the default) aborts every running and waiting request (finish reason
``abort``) and frees the KV cache; ``wait`` admits nothing new (DRAINING) and sleeps once the
in-flight requests have finished; ``keep`` keeps them: the running ones give their KV back and wait,
to be recomputed after the wake (not counted as preemptions). Asleep, the tags ``weights`` and
``kv_cache`` sleep; ``wake_up(tags)`` wakes the given ones (all by default): waking ``weights``
takes ``wake_s``, and the engine stays asleep (``is_sleeping``) until every tag is awake, then is
WAKING until the weights are back, then READY. Requests that arrive while the engine is draining,
asleep or waking are held, not refused (vLLM queues them while paused) and admitted once it is READY;
they count as waiting. Only a STARTING engine refuses requests (the server does not even listen
then).

Neighbours: `emulator.vllm_metrics_export` renders `EngineStats` and the gauges in vLLM's exposition
format; `emulator.server` drives the engine from an asyncio task and serves the OpenAI API.
Must not: do I/O, sleep, read the system clock, or import anything above `lowtide.domain`.
"""

from __future__ import annotations

import math
import random
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from enum import StrEnum
from itertools import count
from typing import Any, Literal

FinishReason = Literal["stop", "length", "abort"]
FINISH_REASONS: tuple[FinishReason, ...] = ("stop", "length", "abort")
SleepMode = Literal["abort", "wait", "keep"]
SLEEP_MODES: tuple[SleepMode, ...] = ("abort", "wait", "keep")
#: What sleeps (vLLM's CuMemAllocator tags): the weights and the KV cache.
SLEEP_TAGS = ("weights", "kv_cache")

# vLLM's bucket boundaries (vllm/v1/metrics/loggers.py; the last V0 engine, vllm/engine/metrics.py
# of 0.8–0.10, used the same lists for these families).
TTFT_BUCKETS: tuple[float, ...] = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                                   2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
ITL_BUCKETS: tuple[float, ...] = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
                                  5.0, 7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
REQUEST_LATENCY_BUCKETS: tuple[float, ...] = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
                                              40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0,
                                              7680.0)  # fmt: skip
ITERATION_TOKENS_BUCKETS: tuple[float, ...] = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


def build_1_2_5_buckets(max_value: int) -> tuple[float, ...]:
    """vLLM's token-count buckets: 1, 2, 5, 10, 20, 50, ... up to `max_value` inclusive."""
    buckets: list[float] = []
    exponent = 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > max_value:
                return tuple(buckets)
            buckets.append(value)
        exponent += 1


class EngineState(StrEnum):
    STARTING = "starting"  # cold start: loading weights, compiling; /health is 503
    READY = "ready"
    DRAINING = "draining"  # sleep(mode="wait") asked: in-flight requests finish, no new ones
    SLEEPING = "sleeping"  # KV cache freed, weights in host RAM
    WAKING = "waking"  # wake_up() asked: weights going back to the GPUs


class EngineUnavailable(Exception):
    """The engine cannot take requests now (starting, draining, sleeping or waking)."""

    def __init__(self, state: EngineState, message: str) -> None:
        super().__init__(message)
        self.state = state


class RequestRejected(ValueError):
    """A request the engine can never serve (too long for the model, nonsensical token counts)."""


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """The replica's capacity; see the module docstring for what each knob means and its default."""

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    kv_cache_tokens: int = 600_000
    block_size: int = 16
    max_model_len: int = 32_768
    prefill_tokens_per_s: float = 20_000.0
    decode_base_s: float = 0.012
    decode_per_seq_s: float = 0.00008
    cold_start_s: float = 60.0
    wake_s: float = 3.0
    eos_probability: float = 0.0
    speedup: float = 1.0
    gpus: int = 4

    def __post_init__(self) -> None:
        problems = []
        for name in ("max_num_seqs", "max_num_batched_tokens", "kv_cache_tokens", "block_size", "gpus"):
            if getattr(self, name) < 1:
                problems.append(f"{name} must be at least 1")
        for name in ("prefill_tokens_per_s", "speedup"):
            if not getattr(self, name) > 0:
                problems.append(f"{name} must be positive")
        for name in ("decode_base_s", "decode_per_seq_s", "cold_start_s", "wake_s"):
            if not getattr(self, name) >= 0:
                problems.append(f"{name} must not be negative")
        if not 0 <= self.eos_probability < 1:
            problems.append("eos_probability must be in [0, 1)")
        if self.decode_base_s + self.decode_per_seq_s <= 0:
            problems.append("a decode step must take some time (decode_base_s + decode_per_seq_s > 0)")
        has_blocks = self.block_size >= 1 and self.num_gpu_blocks >= 1
        if self.kv_cache_tokens >= 1 and self.block_size >= 1 and not has_blocks:
            problems.append(f"kv_cache_tokens must hold at least one block of {self.block_size} tokens")
        if self.max_model_len < 2:
            problems.append("max_model_len must be at least 2")
        elif has_blocks and self.max_model_len > self.kv_capacity_tokens:
            problems.append(
                f"max_model_len ({self.max_model_len}) must fit in the KV cache "
                f"({self.kv_capacity_tokens} tokens): vLLM refuses to start otherwise"
            )
        if problems:
            raise ValueError("; ".join(problems))

    @classmethod
    def for_gpus(cls, gpus: int, **overrides: Any) -> EngineConfig:
        """Defaults for a replica of `gpus` GPUs: KV cache and prefill rate scale per GPU; an override
        that is None keeps the default. ``max_model_len`` shrinks to the cache if it must."""
        base = cls()
        values: dict[str, Any] = {
            "gpus": gpus,
            "kv_cache_tokens": base.kv_cache_tokens // base.gpus * gpus,
            "prefill_tokens_per_s": base.prefill_tokens_per_s / base.gpus * gpus,
        }
        values.update({k: v for k, v in overrides.items() if v is not None})
        if overrides.get("max_model_len") is None:
            block = int(values.get("block_size", base.block_size))
            capacity = int(values["kv_cache_tokens"]) // block * block if block >= 1 else 0
            if capacity >= 2:
                values["max_model_len"] = min(base.max_model_len, capacity)
        return replace(base, **values)

    @property
    def num_gpu_blocks(self) -> int:
        return self.kv_cache_tokens // self.block_size

    @property
    def kv_capacity_tokens(self) -> int:
        """What vLLM reports: ``num_gpu_blocks × block_size``."""
        return self.num_gpu_blocks * self.block_size

    def decode_step_s(self, batch: int) -> float:
        """Model seconds of one decode step for `batch` sequences (before `speedup`)."""
        return self.decode_base_s + self.decode_per_seq_s * batch


class BucketHistogram:
    """A Prometheus-style histogram: upper bounds, cumulative counts on read, sum and count."""

    def __init__(self, bounds: Iterable[float]) -> None:
        self.bounds: tuple[float, ...] = tuple(float(b) for b in bounds)
        self._counts = [0] * (len(self.bounds) + 1)  # last: above every bound (+Inf only)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        index = len(self.bounds)
        for i, bound in enumerate(self.bounds):
            if value <= bound:
                index = i
                break
        self._counts[index] += 1
        self.sum += value
        self.count += 1

    def cumulative(self) -> list[tuple[float, int]]:
        """(upper bound, observations ≤ bound) for every bound, then (+Inf, count)."""
        out: list[tuple[float, int]] = []
        running = 0
        for bound, n in zip((*self.bounds, math.inf), self._counts, strict=True):
            running += n
            out.append((bound, running))
        return out


@dataclass
class EngineStats:
    """Everything vLLM's Prometheus logger accumulates, cumulative since the engine started."""

    max_model_len: int
    prompt_tokens: int = 0
    generation_tokens: int = 0
    preemptions: int = 0
    finished: dict[str, int] = field(default_factory=lambda: dict.fromkeys(FINISH_REASONS, 0))
    ttft: BucketHistogram = field(default_factory=lambda: BucketHistogram(TTFT_BUCKETS))
    itl: BucketHistogram = field(default_factory=lambda: BucketHistogram(ITL_BUCKETS))
    e2e: BucketHistogram = field(default_factory=lambda: BucketHistogram(REQUEST_LATENCY_BUCKETS))
    queue: BucketHistogram = field(default_factory=lambda: BucketHistogram(REQUEST_LATENCY_BUCKETS))
    inference: BucketHistogram = field(default_factory=lambda: BucketHistogram(REQUEST_LATENCY_BUCKETS))
    prefill: BucketHistogram = field(default_factory=lambda: BucketHistogram(REQUEST_LATENCY_BUCKETS))
    decode: BucketHistogram = field(default_factory=lambda: BucketHistogram(REQUEST_LATENCY_BUCKETS))
    iteration_tokens: BucketHistogram = field(
        default_factory=lambda: BucketHistogram(ITERATION_TOKENS_BUCKETS)
    )
    request_prompt_tokens: BucketHistogram = field(init=False)
    request_generation_tokens: BucketHistogram = field(init=False)
    request_max_tokens: BucketHistogram = field(init=False)

    def __post_init__(self) -> None:
        token_buckets = build_1_2_5_buckets(self.max_model_len)
        self.request_prompt_tokens = BucketHistogram(token_buckets)
        self.request_generation_tokens = BucketHistogram(token_buckets)
        self.request_max_tokens = BucketHistogram(token_buckets)


Listener = Callable[["EngineRequest"], None]


@dataclass(eq=False)
class EngineRequest:
    """One request inside the engine. Read it; only the engine changes it."""

    id: int
    prompt_tokens: int
    max_tokens: int
    output_target: int  # tokens it will produce (≤ max_tokens)
    arrival: float
    listener: Listener | None = None
    generated: int = 0
    computed: int = 0  # tokens whose KV is computed (and held)
    blocks: int = 0
    scheduled_at: float | None = None  # first admitted (end of queueing)
    first_token_at: float | None = None
    last_token_at: float | None = None
    finished_at: float | None = None
    finish_reason: FinishReason | None = None
    preemptions: int = 0
    running: bool = False  # in the running batch (else waiting, or finished)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens: what must be in the KV cache before the next token."""
        return self.prompt_tokens + self.generated


@dataclass(slots=True)
class _Step:
    start: float
    end: float
    items: list[tuple[EngineRequest, int]]  # (request, tokens computed in this step)


class Engine:
    """The capacity model; see the module docstring. All times are in the clock's seconds."""

    def __init__(
        self,
        config: EngineConfig,
        clock: Callable[[], float],
        *,
        rng: random.Random | None = None,
        on_state_change: Callable[[EngineState], None] | None = None,
    ) -> None:
        self.config = config
        self._clock = clock
        self._rng = rng or random.Random(0)
        self._on_state_change = on_state_change
        k = config.speedup
        self._base_s = config.decode_base_s / k
        self._per_seq_s = config.decode_per_seq_s / k
        self._prefill_tps = config.prefill_tokens_per_s * k
        self._wake_s = config.wake_s / k
        self.started_at = clock()
        self.ready_at = self.started_at + config.cold_start_s / k
        self.awake_at: float | None = None
        self.sleep_level: int | None = None  # the level of the current sleep (None: awake)
        self.sleeping_tags: set[str] = set()
        self._weights_at = 0.0  # when the weights woken last are back
        self._held: deque[EngineRequest] = deque()  # arrived while not READY
        self._state = EngineState.STARTING
        self._now = self.started_at
        self._waiting: deque[EngineRequest] = deque()
        self._running: list[EngineRequest] = []
        self._free_blocks = config.num_gpu_blocks
        self._step: _Step | None = None
        self._ids = count(1)
        self.stats = EngineStats(max_model_len=config.max_model_len)
        self._refresh(self._now)

    # -- views -----------------------------------------------------------------------------------

    @property
    def state(self) -> EngineState:
        self._refresh(max(self._now, self._clock()))
        return self._state

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting) + len(self._held)

    @property
    def used_blocks(self) -> int:
        return self.config.num_gpu_blocks - self._free_blocks

    @property
    def kv_usage(self) -> float:
        """Fraction of KV blocks in use, 0..1 (vLLM's ``kv_cache_usage_perc``)."""
        return self.used_blocks / self.config.num_gpu_blocks

    def next_event_at(self) -> float | None:
        """When the step in progress ends (its tokens come out), or a wake completes; None when
        the engine is idle."""
        if self._step is not None:
            return self._step.end
        return self.awake_at if self._state is EngineState.WAKING else None

    # -- requests --------------------------------------------------------------------------------

    def submit(
        self,
        prompt_tokens: int,
        max_tokens: int,
        *,
        output_tokens: int | None = None,
        listener: Listener | None = None,
    ) -> EngineRequest:
        """Queue a request now (held while the engine drains, sleeps or wakes). Raises
        `EngineUnavailable` while STARTING, `RequestRejected` if it can never be served (vLLM's 400:
        prompt + max_tokens above ``max_model_len``)."""
        now = self._clock()
        self.advance(now)
        if self._state is EngineState.STARTING:
            raise EngineUnavailable(self._state, f"the engine is {self._state.value}")
        if prompt_tokens < 1:
            raise RequestRejected("the prompt must have at least one token")
        if max_tokens < 1:
            raise RequestRejected("max_tokens must be at least 1")
        if output_tokens is not None and output_tokens < 1:
            raise RequestRejected("output_tokens must be at least 1")
        limit = self.config.max_model_len
        if prompt_tokens + max_tokens > limit:
            raise RequestRejected(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{prompt_tokens + max_tokens} tokens ({prompt_tokens} in the messages, {max_tokens} "
                "in the completion). Please reduce the length of the messages or completion."
            )
        target = max_tokens
        if output_tokens is not None:
            target = min(output_tokens, max_tokens)
        elif self.config.eos_probability > 0:
            target = min(self._sample_output_length(), max_tokens)
        request = EngineRequest(
            id=next(self._ids),
            prompt_tokens=prompt_tokens,
            max_tokens=max_tokens,
            output_target=target,
            arrival=now,
            listener=listener,
        )
        if self._state is not EngineState.READY:
            self._held.append(request)
            return request
        self._waiting.append(request)
        if self._step is None:
            self._start_step(now)
        return request

    def abort(self, request: EngineRequest) -> None:
        """Abort a request (its client went away): it finishes with reason ``abort``."""
        now = self._clock()
        self.advance(now)
        if request.finished:
            return
        if request.running:
            self._running.remove(request)
        elif request in self._held:
            self._held.remove(request)
        else:
            self._waiting.remove(request)
        self._finish(request, "abort", now)
        self._maybe_fall_asleep()

    def abort_all(self) -> int:
        """Abort every running and waiting request (sleep, shutdown); returns how many."""
        now = self._clock()
        self.advance(now)
        requests = [*self._running, *self._waiting, *self._held]
        self._running.clear()
        self._waiting.clear()
        self._held.clear()
        self._step = None
        for request in requests:
            self._finish(request, "abort", now)
        self._maybe_fall_asleep()
        return len(requests)

    # -- lifecycle -------------------------------------------------------------------------------

    def sleep(self, level: int = 1, mode: SleepMode = "abort") -> EngineState:
        """vLLM's ``/sleep``: free the KV cache (and the weights from the GPU). ``abort`` ends every
        request now; ``wait`` lets the in-flight ones finish first (DRAINING); ``keep`` keeps them
        for after the wake. Returns the state reached."""
        if level not in (0, 1, 2):
            raise ValueError(f"sleep level must be 0, 1 or 2, not {level}")
        if mode not in SLEEP_MODES:
            raise ValueError(f"sleep mode must be 'abort', 'wait' or 'keep', not {mode!r}")
        now = self._clock()
        self.advance(now)
        if self._state is EngineState.STARTING:
            raise EngineUnavailable(self._state, "the engine is still starting")
        self.sleep_level = level
        self.sleeping_tags = set(SLEEP_TAGS)
        if self._state in (EngineState.SLEEPING, EngineState.WAKING):
            self.awake_at = None
            self._set_state(EngineState.SLEEPING)
            return self._state
        if mode == "abort":
            self.abort_all()
            self._set_state(EngineState.SLEEPING)
        elif mode == "keep":
            self._step = None
            for request in reversed(self._running):
                request.running = False
                self._release(request)
                request.computed = 0  # its KV is gone: recomputed after the wake
                self._waiting.appendleft(request)
            self._running.clear()
            self._set_state(EngineState.SLEEPING)
        else:
            self._set_state(EngineState.DRAINING)
            self._maybe_fall_asleep()
        return self._state

    def wake_up(self, tags: Iterable[str] | None = None) -> float:
        """vLLM's ``/wake_up`` (`tags`: which to wake; None: all): returns when what this call woke
        is back (now if nothing was asleep). The engine stays asleep until every tag is awake."""
        now = self._clock()
        self.advance(now)
        if self._state is EngineState.STARTING:
            raise EngineUnavailable(self._state, "the engine is still starting")
        woken = set(self.sleeping_tags if tags is None else tags)
        unknown = woken - set(SLEEP_TAGS)
        if unknown:
            raise ValueError(f"unknown tags {sorted(unknown)}; known: {', '.join(SLEEP_TAGS)}")
        if self._state is EngineState.SLEEPING:
            back = now
            if "weights" in woken & self.sleeping_tags:
                self._weights_at = now + self._wake_s
                back = self._weights_at
            self.sleeping_tags -= woken
            if self.sleeping_tags:
                return back  # still asleep: another tag must wake first
            self.awake_at = max(now, self._weights_at)
            self._set_state(EngineState.WAKING)
            self._refresh(now)
        elif self._state is EngineState.DRAINING:
            self.sleeping_tags = set()
            self.sleep_level = None
            self._set_state(EngineState.READY)  # the sleep that was waiting is called off
            self._resume(now)
        if self._state is EngineState.WAKING and self.awake_at is not None:
            return self.awake_at
        return now

    @property
    def is_sleeping(self) -> bool:
        """vLLM's ``/is_sleeping``: true from the sleep until the wake-up completes."""
        return self.state in (EngineState.SLEEPING, EngineState.WAKING)

    # -- time ------------------------------------------------------------------------------------

    def advance(self, now: float | None = None) -> None:
        """Run every step that ends at or before `now` (default: the clock)."""
        now = self._clock() if now is None else now
        if now < self._now:
            return
        while self._step is not None and self._step.end <= now:
            step, self._step = self._step, None
            self._complete(step)
            self._start_step(step.end)
        self._now = now
        self._refresh(now)

    def _refresh(self, now: float) -> None:
        if self._state is EngineState.STARTING and now >= self.ready_at:
            self._set_state(EngineState.READY)
        if self._state is EngineState.WAKING and self.awake_at is not None and now >= self.awake_at:
            self.awake_at = None
            self.sleep_level = None
            self._set_state(EngineState.READY)
            self._resume(now)

    def _resume(self, now: float) -> None:
        """READY again: the requests held meanwhile join the queue and the engine runs."""
        if self._held:
            self._waiting.extend(self._held)
            self._held.clear()
        if self._step is None and self._waiting:
            self._start_step(now)

    def _set_state(self, state: EngineState) -> None:
        if state is self._state:
            return
        self._state = state
        if self._on_state_change is not None:
            self._on_state_change(state)

    def _maybe_fall_asleep(self) -> None:
        if self._state is EngineState.DRAINING and not self._running and not self._waiting:
            self._step = None
            self._set_state(EngineState.SLEEPING)

    # -- scheduling ------------------------------------------------------------------------------

    def _blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.config.block_size)

    def _start_step(self, at: float) -> None:
        if self._state not in (EngineState.READY, EngineState.DRAINING):
            return
        items: list[tuple[EngineRequest, int]] = []
        budget = self.config.max_num_batched_tokens
        preempted = False
        i = 0
        while i < len(self._running) and budget > 0:
            request = self._running[i]
            chunk = min(request.num_tokens - request.computed, budget)
            need = self._blocks_for(request.computed + chunk) - request.blocks
            while need > self._free_blocks and request.running:
                # The most recently admitted sequence gives way (vLLM's FCFS policy); it may be
                # `request` itself, which then waits too. One sequence alone always fits, since
                # max_model_len fits in the cache.
                self._preempt(self._running.pop())
                preempted = True
            if not request.running:
                break
            self._allocate(request, need)
            items.append((request, chunk))
            budget -= chunk
            i += 1
        if not preempted:
            while self._waiting and len(self._running) < self.config.max_num_seqs and budget > 0:
                request = self._waiting[0]
                chunk = min(request.num_tokens - request.computed, budget)
                need = self._blocks_for(request.computed + chunk) - request.blocks
                if need > self._free_blocks:
                    break
                self._waiting.popleft()
                self._allocate(request, need)
                self._running.append(request)
                request.running = True
                if request.scheduled_at is None:
                    request.scheduled_at = at
                items.append((request, chunk))
                budget -= chunk
        if not items:
            return
        prefill_tokens = sum(chunk for request, chunk in items if not self._is_decode(request, chunk))
        duration = self._base_s + self._per_seq_s * len(items) + prefill_tokens / self._prefill_tps
        self._step = _Step(start=at, end=at + duration, items=items)

    @staticmethod
    def _is_decode(request: EngineRequest, chunk: int) -> bool:
        return chunk == 1 and request.generated >= 1 and request.computed == request.num_tokens - 1

    def _allocate(self, request: EngineRequest, blocks: int) -> None:
        if blocks > 0:
            self._free_blocks -= blocks
            request.blocks += blocks

    def _release(self, request: EngineRequest) -> None:
        self._free_blocks += request.blocks
        request.blocks = 0

    def _preempt(self, request: EngineRequest) -> None:
        request.running = False
        self._release(request)
        request.computed = 0
        request.preemptions += 1
        self.stats.preemptions += 1
        self._waiting.appendleft(request)

    def _complete(self, step: _Step) -> None:
        now = step.end
        self.stats.iteration_tokens.observe(sum(chunk for _, chunk in step.items))
        for request, chunk in step.items:
            if not request.running:
                continue  # aborted or preempted since the step began
            request.computed += chunk
            if request.computed < request.num_tokens:
                continue  # a prefill chunk; more to come
            request.generated += 1
            self.stats.generation_tokens += 1
            if request.first_token_at is None:
                request.first_token_at = now
                self.stats.prompt_tokens += request.prompt_tokens
                self.stats.ttft.observe(now - request.arrival)
            elif request.last_token_at is not None:
                self.stats.itl.observe(now - request.last_token_at)
            request.last_token_at = now
            if request.generated >= request.output_target:
                self._running.remove(request)
                reason: FinishReason = "length" if request.generated >= request.max_tokens else "stop"
                self._finish(request, reason, now)
            elif request.listener is not None:
                request.listener(request)
        self._maybe_fall_asleep()

    def _finish(self, request: EngineRequest, reason: FinishReason, now: float) -> None:
        request.running = False
        self._release(request)
        request.finish_reason = reason
        request.finished_at = now
        stats = self.stats
        stats.finished[reason] += 1
        scheduled = request.scheduled_at if request.scheduled_at is not None else now
        first = request.first_token_at if request.first_token_at is not None else now
        last = request.last_token_at if request.last_token_at is not None else first
        stats.e2e.observe(now - request.arrival)
        stats.queue.observe(scheduled - request.arrival)
        stats.prefill.observe(max(0.0, first - scheduled))
        stats.decode.observe(max(0.0, last - first))
        stats.inference.observe(max(0.0, last - scheduled))
        stats.request_prompt_tokens.observe(request.prompt_tokens)
        stats.request_generation_tokens.observe(request.generated)
        stats.request_max_tokens.observe(request.max_tokens)
        if request.listener is not None:
            request.listener(request)

    def _sample_output_length(self) -> int:
        """Geometric: each token ends the answer with probability `eos_probability` (≥ 1 token)."""
        p = self.config.eos_probability
        u = 1.0 - self._rng.random()  # (0, 1]
        return max(1, math.ceil(math.log(u) / math.log(1.0 - p)))

    def owns(self, request: EngineRequest) -> bool:
        """Whether `request` is queued, held or running here (and not finished)."""
        if request.finished:
            return False
        return request.running or request in self._waiting or request in self._held


class EngineGroup:
    """vLLM's data parallelism (``--data-parallel-size N``): N engines behind one API server, each
    with its own batch and KV cache; a request goes to the least loaded one (running + waiting,
    lowest index on ties), as vLLM's DP coordinator balances; sleep and wake apply to all; the
    metrics show one series per engine (``engine="0".."N-1"``). Same interface as `Engine` for
    the server; `engines` for the exporter."""

    def __init__(
        self,
        config: EngineConfig,
        clock: Callable[[], float],
        size: int = 1,
        *,
        on_state_change: Callable[[EngineState], None] | None = None,
    ) -> None:
        if size < 1:
            raise ValueError(f"data parallel size must be at least 1, not {size}")
        self.config = config
        self.engines = tuple(
            Engine(config, clock, rng=random.Random(i), on_state_change=on_state_change) for i in range(size)
        )

    @property
    def state(self) -> EngineState:
        states = [e.state for e in self.engines]
        for busy in (EngineState.STARTING, EngineState.DRAINING, EngineState.WAKING):
            if busy in states:
                return busy
        return states[0]

    @property
    def ready_at(self) -> float:
        return max(e.ready_at for e in self.engines)

    @property
    def awake_at(self) -> float | None:
        times = [e.awake_at for e in self.engines if e.awake_at is not None]
        return max(times) if times else None

    @property
    def is_sleeping(self) -> bool:
        return any(e.is_sleeping for e in self.engines)

    @property
    def sleep_level(self) -> int | None:
        return self.engines[0].sleep_level

    @property
    def num_running(self) -> int:
        return sum(e.num_running for e in self.engines)

    @property
    def num_waiting(self) -> int:
        return sum(e.num_waiting for e in self.engines)

    @property
    def kv_usage(self) -> float:
        return sum(e.kv_usage for e in self.engines) / len(self.engines)

    def next_event_at(self) -> float | None:
        times = [t for e in self.engines if (t := e.next_event_at()) is not None]
        return min(times) if times else None

    def submit(
        self,
        prompt_tokens: int,
        max_tokens: int,
        *,
        output_tokens: int | None = None,
        listener: Listener | None = None,
    ) -> EngineRequest:
        target = min(self.engines, key=lambda e: e.num_running + e.num_waiting)
        return target.submit(prompt_tokens, max_tokens, output_tokens=output_tokens, listener=listener)

    def abort(self, request: EngineRequest) -> None:
        for e in self.engines:
            if e.owns(request):
                e.abort(request)
                return

    def abort_all(self) -> int:
        return sum(e.abort_all() for e in self.engines)

    def sleep(self, level: int = 1, mode: SleepMode = "abort") -> EngineState:
        for e in self.engines:
            e.sleep(level, mode)
        return self.state

    def wake_up(self, tags: Iterable[str] | None = None) -> float:
        woken = None if tags is None else tuple(tags)
        return max(e.wake_up(woken) for e in self.engines)

    def advance(self, now: float | None = None) -> None:
        for e in self.engines:
            e.advance(now)


#: What the server drives: one engine, or a data-parallel group of them.
EngineLike = Engine | EngineGroup
