"""Idempotent submits: the `Idempotency-Key` header and the digest of the request it names.

A client that sends ``Idempotency-Key`` (``lowtide submit`` sends a fresh uuid4 per invocation
and keeps it across its retries) gets the same job back when it repeats the request: the store
keeps the key and `request_digest` beside the job (unique per owner and key) and returns the
first job for the same digest, or refuses a different request under the same key (422). The
key is 1..128 printable ASCII characters (as the IETF draft "The Idempotency-Key HTTP Header
Field", draft-ietf-httpapi-idempotency-key-header-07, leaves the format to the server).
Must not: touch the store or decide anything about the job itself.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Annotated

from fastapi import Header

from lowtide.api.errors import ApiError

HEADER = "Idempotency-Key"
#: Set on a response that returns the job an earlier request with the same key created.
REPLAYED_HEADER = "Idempotent-Replayed"
MAX_KEY_LENGTH = 128


def idempotency_key(
    key: Annotated[
        str | None,
        Header(
            alias=HEADER,
            description="Any 1..128 printable ASCII characters (a uuid4): a repeat of the same "
            "request with the same key returns the job the first one made.",
        ),
    ] = None,
) -> str | None:
    """The request's key (None: none sent); 422 naming the header when it is malformed."""
    if key is None:
        return None
    if not 1 <= len(key) <= MAX_KEY_LENGTH or not all(" " <= c <= "~" for c in key):
        raise _invalid(f"must be 1 to {MAX_KEY_LENGTH} printable ASCII characters (a uuid4 will do)")
    return key


def request_digest(kind: str, parts: Sequence[bytes | str]) -> str:
    """sha256 over what makes two requests the same: the route (`kind`) and its inputs."""
    h = hashlib.sha256(kind.encode())
    for part in parts:
        data = part.encode() if isinstance(part, str) else part
        h.update(len(data).to_bytes(8, "big"))
        h.update(data)
    return h.hexdigest()


def conflict(key: str, job_id: str) -> ApiError:
    return ApiError(
        422,
        "idempotency_conflict",
        f"{HEADER} {key!r} was already used for a different request (it made job {job_id})",
        [(f"header.{HEADER}", "already used for a different request; use a new key for a new job")],
    )


def _invalid(why: str) -> ApiError:
    return ApiError(422, "invalid_request", f"invalid {HEADER} header", [(f"header.{HEADER}", why)])
