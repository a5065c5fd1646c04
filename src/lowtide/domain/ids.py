"""Identifiers. Job ids are short, URL- and DNS-safe, and random (never derived from the clock)."""

from __future__ import annotations

import re
import secrets

JOB_ID_RE = re.compile(r"^job-[0-9a-f]{12}$")


def new_job_id() -> str:
    return f"job-{secrets.token_hex(6)}"
