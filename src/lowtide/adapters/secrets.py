"""Secret values for the control loop: reads each configured secret from its source when an
attempt launches (the `control.secrets_port.SecretResolver` port).

Sources (config `secrets:`; `wiring` turns them into `SecretSource`s): `file` (the whole file,
one trailing newline removed, at most `MAX_SECRET_BYTES`, UTF-8) or `env` (a variable of
lowtide's own environment; `os.environ` as the process has it). Every failure is classified at
this edge as `ExecutorError(temporary=False)`: the attempt fails to launch with a message that
names the secret and why (a missing file, an unset variable), never the value. A value with a
NUL cannot go into an environment and is refused the same way (execve(2) takes NUL-terminated
strings). Neighbours: `control.loop` (calls `environment` in its launch request), `wiring`.
Must not: log, cache or return a value anywhere but `environment`'s result; decide which team
may use a secret (the API checks that at submit, `control.secrets_port.secret_issues`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from lowtide.control.executor_port import ExecutorError
from lowtide.domain.spec import SecretUse

#: The largest secret file read (a token or a key, not a data set).
MAX_SECRET_BYTES = 64 * 1024


@dataclass(frozen=True, slots=True)
class SecretSource:
    """Where one secret's value is read: its `env` variable by default, from a file or from a
    variable of lowtide's environment."""

    env: str
    kind: Literal["file", "env"]
    ref: str  # the file's path, or the variable's name


class ConfiguredSecrets:
    def __init__(self, sources: Mapping[str, SecretSource]) -> None:
        self._sources = dict(sources)

    def environment(self, uses: Sequence[SecretUse]) -> dict[str, str]:
        out: dict[str, str] = {}
        for use in uses:
            source = self._sources.get(use.name)
            if source is None:
                raise ExecutorError(
                    f"secret {use.name!r} is not configured (config secrets:)", temporary=False
                )
            out[use.env or source.env] = self._read(use.name, source)
        return out

    @staticmethod
    def _read(name: str, source: SecretSource) -> str:
        if source.kind == "env":
            value = os.environ.get(source.ref)
            if value is None:
                raise ExecutorError(
                    f"secret {name!r}: lowtide's environment has no {source.ref}", temporary=False
                )
        else:
            try:
                with Path(source.ref).open("rb") as fh:
                    data = fh.read(MAX_SECRET_BYTES + 1)
            except OSError as exc:
                reason = exc.strerror or type(exc).__name__
                raise ExecutorError(
                    f"secret {name!r}: cannot read its file {source.ref}: {reason}",
                    temporary=False,
                    infrastructure="secrets",
                ) from None
            if len(data) > MAX_SECRET_BYTES:
                raise ExecutorError(
                    f"secret {name!r}: its file {source.ref} is larger than {MAX_SECRET_BYTES} bytes",
                    temporary=False,
                )
            try:
                value = data.decode("utf-8")
            except UnicodeDecodeError:
                raise ExecutorError(
                    f"secret {name!r}: its file {source.ref} is not UTF-8 text", temporary=False
                ) from None
            value = value.removesuffix("\n").removesuffix("\r")
        if "\x00" in value:
            raise ExecutorError(
                f"secret {name!r}: its value contains a NUL character (not allowed in an environment)",
                temporary=False,
            )
        return value
