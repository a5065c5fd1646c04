"""OpenAI request and response shapes for the emulator: what a request asks for, what it gets back.

Role: validate `/v1/completions` and `/v1/chat/completions` bodies (pydantic; unknown OpenAI and
vLLM fields such as ``temperature`` or ``ignore_eos`` are accepted and ignored, as vLLM does), turn
them into token counts for the engine, and build the response bodies, stream chunks and error
bodies in OpenAI's (and vLLM's) layout.

Token counts. The emulator has no tokenizer, so a prompt's length is estimated: ``ceil(words ×
1.3)`` (at least 1) for a completion prompt, a list of token ids counts one token per id, and a chat
adds 4 tokens per message and 3 for the assistant's turn (what chat templates add). Two extension
fields, which real vLLM accepts and ignores, make a load generator exact: ``prompt_tokens`` (the
prompt's length in tokens) and ``output_tokens`` (how many tokens the "model" produces before it
stops; finish reason ``stop`` when that is below ``max_tokens``). ``max_tokens`` (or, for chat,
``max_completion_tokens``) defaults to 16, OpenAI's completions default, since an emulated model
does not stop on its own (unless the engine samples output lengths: ``--eos-prob``). The generated
text is ``" lorem ipsum ..."``, one word per token.
Unsupported: ``n`` > 1 and several prompts in one request (400).

Neighbours: `emulator.server` (the HTTP side). Must not: know about the engine's internals or HTTP.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

DEFAULT_MAX_TOKENS = 16
WORDS = ("lorem", "ipsum", "dolor", "sit", "amet", "consectetur", "adipiscing", "elit", "sed", "do",
         "eiusmod", "tempor", "incididunt", "ut", "labore", "et", "dolore", "magna", "aliqua")  # fmt: skip

PositiveInt = Annotated[int, Field(ge=1)]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: bool = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str | None = None
    max_tokens: PositiveInt | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Literal[1] = 1
    prompt_tokens: PositiveInt | None = None  # extension: the prompt's exact length in tokens
    output_tokens: PositiveInt | None = None  # extension: tokens before the model "stops"


class CompletionRequest(_Common):
    prompt: str | list[int] | list[str] | list[list[int]]


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(_Common):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: PositiveInt | None = None


class BadRequest(ValueError):
    """A request that is valid JSON of the right shape but that the emulator cannot serve."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def estimate_tokens(text: str) -> int:
    return max(1, math.ceil(len(text.split()) * 1.3))


def completion_prompt_tokens(request: CompletionRequest) -> int:
    if request.prompt_tokens is not None:
        return request.prompt_tokens
    prompt = request.prompt
    if isinstance(prompt, list):
        if not prompt:
            raise BadRequest("prompt must not be empty", "prompt")
        if isinstance(prompt[0], str | list):
            if len(prompt) > 1:
                raise BadRequest("the emulator serves one prompt per request", "prompt")
            prompt = prompt[0]
    if isinstance(prompt, str):
        return estimate_tokens(prompt)
    if not prompt:
        raise BadRequest("prompt must not be empty", "prompt")
    return len(prompt)


def chat_prompt_tokens(request: ChatCompletionRequest) -> int:
    if request.prompt_tokens is not None:
        return request.prompt_tokens
    total = 3
    for message in request.messages:
        content = message.content
        if isinstance(content, list):
            content = " ".join(str(part.get("text", "")) for part in content if part.get("type") == "text")
        total += 4 + (estimate_tokens(content) if content else 0)
    return total


def completion_max_tokens(request: _Common) -> int:
    chat_limit = request.max_completion_tokens if isinstance(request, ChatCompletionRequest) else None
    limit = request.max_tokens if request.max_tokens is not None else chat_limit
    return DEFAULT_MAX_TOKENS if limit is None else limit


def text_for(start: int, stop: int) -> str:
    """The emulated model's output tokens [start, stop): one word per token."""
    return "".join(" " + WORDS[i % len(WORDS)] for i in range(start, stop))


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def completion_body(
    rid: str, created: int, model: str, text: str, finish_reason: str, prompt_tokens: int, generated: int
) -> dict[str, Any]:
    return {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [
            {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason, "stop_reason": None}
        ],
        "usage": usage(prompt_tokens, generated),
    }


def chat_body(
    rid: str, created: int, model: str, text: str, finish_reason: str, prompt_tokens: int, generated: int
) -> dict[str, Any]:
    return {
        "id": rid,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": None,
                "finish_reason": finish_reason,
                "stop_reason": None,
            }
        ],
        "usage": usage(prompt_tokens, generated),
    }


def completion_chunk(
    rid: str, created: int, model: str, text: str, finish_reason: str | None
) -> dict[str, Any]:
    return {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [
            {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason, "stop_reason": None}
        ],
    }


def chat_chunk(
    rid: str, created: int, model: str, delta: dict[str, str], finish_reason: str | None
) -> dict[str, Any]:
    return {
        "id": rid,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}],
    }


def usage_chunk(
    rid: str, created: int, model: str, obj: str, prompt_tokens: int, generated: int
) -> dict[str, Any]:
    return {
        "id": rid,
        "object": obj,
        "created": created,
        "model": model,
        "choices": [],
        "usage": usage(prompt_tokens, generated),
    }


ERROR_TYPES = {
    400: "BadRequestError",
    404: "NotFoundError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


def error_body(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    """OpenAI's error object (vLLM puts the HTTP status in ``code``)."""
    return {
        "error": {
            "message": message,
            "type": ERROR_TYPES.get(status, "Error"),
            "param": param,
            "code": status,
        }
    }


def describe_validation_error(exc: ValidationError) -> tuple[str, str | None]:
    """The first problem as (message, param): ``"max_tokens: Input should be ..."``."""
    first = exc.errors(include_url=False)[0]
    location = ".".join(str(part) for part in first["loc"])
    param = str(first["loc"][0]) if first["loc"] else None
    message = f"{location}: {first['msg']}" if location else str(first["msg"])
    return message, param
