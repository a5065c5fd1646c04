"""The JSON Schema of a job spec document (docs/architecture.md §6.1), as the API publishes it.

Role: `job_spec_schema()` describes, in JSON Schema (the dialect of OpenAPI 3.1), the document
that `spec_parse.build_job_spec` accepts: every top-level and step key, their types and the
bounds the parser enforces (names, priority, retry counts, seconds, 64-bit integers). The API
puts it in its OpenAPI description as the `application/json` body of `POST /v1/jobs` and
`/v1/jobs/validate`, so clients and fuzzers (schemathesis) can build real jobs.

The parser stays the one source of truth: the schema is built from the parser's own constants,
and a test checks that its keys are exactly the parser's (`spec_parse._TOP_KEYS`,
`spec_steps._STEP_KEYS`) and that every `JobSpec.to_document()` is valid against it. What a
schema cannot say (placeholders, dependency cycles, the largest node, whether a template or a
secret exists) is still checked only by the parser: a document valid here may still be refused
with located errors, never the other way round for the documents `to_document` writes.

Neighbours: `spec_issues`, `spec`, `spec_document` and `spec_steps` (the constants), `api.app`
(publishes it).
Must not: validate documents (that is `spec_parse`), import the other spec modules' private
state, do I/O, or read the clock.
"""

from __future__ import annotations

from typing import Any

from lowtide.domain.spec import PRIORITY_NAMES, PRIORITY_RANGE
from lowtide.domain.spec_document import MAX_INT, MIN_INT
from lowtide.domain.spec_issues import MAX_RETRIES, MAX_SPEC_SECONDS
from lowtide.domain.spec_steps import MAX_GPU_MEMORY_GIB, MAX_TIMEOUT_SECONDS

__all__ = ["job_spec_schema"]

_NAME = {
    "type": "string",
    "pattern": "^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$",
    "description": "1 to 63 lowercase letters, digits or '-', starting and ending with a letter or digit",
}
_IDENT = "^[A-Za-z_][A-Za-z0-9_]*$"
#: Set by lowtide (the step contract): LOWTIDE_* in any case, and CUDA_VISIBLE_DEVICES.
_RESERVED_ENV = "^([Ll][Oo][Ww][Tt][Ii][Dd][Ee]_|CUDA_VISIBLE_DEVICES$)"
_COUNT = {"type": "integer", "minimum": 0, "maximum": MAX_RETRIES}
_SECONDS = {"type": "number", "minimum": 0, "maximum": MAX_SPEC_SECONDS}
_INT64 = {"type": "integer", "minimum": MIN_INT, "maximum": MAX_INT}
_SECRET_ENV = {"type": "string", "pattern": _IDENT}
_SECRETS = {
    "description": "secrets by reference: names, {ENV_VAR: name} items, or a mapping ENV_VAR: name",
    "anyOf": [
        {
            "type": "array",
            "items": {
                "anyOf": [
                    _NAME,
                    {
                        "type": "object",
                        "minProperties": 1,
                        "maxProperties": 1,
                        "propertyNames": _SECRET_ENV,
                        "additionalProperties": _NAME,
                    },
                ]
            },
        },
        {"type": "object", "propertyNames": _SECRET_ENV, "additionalProperties": _NAME},
    ],
}
_TIMEOUT = {
    "description": "walltime of a step: seconds, or a duration such as '90m', '2h', '1h30m' or '3d'",
    "anyOf": [
        {"type": "number", "exclusiveMinimum": 0, "maximum": MAX_TIMEOUT_SECONDS},
        {"type": "string", "maxLength": 64, "pattern": r"^(\d+(\.\d+)?|(\d+(\.\d+)?\s*[dhms]\s*)+)$"},
    ],
}


def _step_schema() -> dict[str, Any]:
    return {
        "type": "object",
        "additionalProperties": False,
        "required": ["name", "command"],
        "properties": {
            "name": _NAME,
            "command": {
                "type": "array",
                "minItems": 1,
                "items": {"anyOf": [{"type": "string"}, _INT64]},
                "description": "the program and its arguments; {{...}} placeholders are filled",
            },
            "image": {"type": "string", "minLength": 1},
            "gpus": {"type": "integer", "minimum": 0, "maximum": MAX_INT},
            "gpu_memory_gib": {
                "type": "number",
                "exclusiveMinimum": 0,
                "maximum": MAX_GPU_MEMORY_GIB,
                "description": "GiB each of the step's GPUs must have free (only with gpus of 1 or more)",
            },
            "depends": {"type": "array", "items": _NAME, "uniqueItems": True},
            "checkpoint": {"type": "boolean"},
            "max_retries": _COUNT,
            "env": {
                "type": "object",
                "propertyNames": {"pattern": _IDENT, "not": {"pattern": _RESERVED_ENV}},
                "additionalProperties": {"anyOf": [{"type": "string"}, _INT64]},
            },
            "min_runtime": _SECONDS,
            "max_preemptions": _COUNT,
            "restart_seconds": _SECONDS,
            "timeout": _TIMEOUT,
            "secrets": _SECRETS,
        },
    }


def job_spec_schema() -> dict[str, Any]:
    """The JSON Schema of a job spec document (a fresh dict each call; see the module doc)."""
    low, high = PRIORITY_RANGE
    return {
        "title": "JobSpec",
        "description": "A job spec (docs/architecture.md §6.1): steps, or `use: TEMPLATE`.",
        "type": "object",
        "additionalProperties": False,
        "anyOf": [{"required": ["name", "steps"]}, {"required": ["use"]}],
        "properties": {
            "name": _NAME,
            "team": _NAME,
            "priority": {
                "anyOf": [
                    {"type": "string", "enum": list(PRIORITY_NAMES)},
                    {"type": "integer", "minimum": low, "maximum": high},
                ]
            },
            "grace_seconds": _SECONDS,
            "max_retries": _COUNT,
            "params": {
                "type": "object",
                "propertyNames": {"pattern": _IDENT},
                "additionalProperties": {"not": {"type": "null"}},
                "description": "parameters, filled into {{params.NAME}} and LOWTIDE_PARAM_<NAME>",
            },
            "steps": {"type": "array", "minItems": 1, "items": _step_schema()},
            "use": _NAME,
            "timeout": _TIMEOUT,
            "secrets": _SECRETS,
        },
    }
