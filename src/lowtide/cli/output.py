"""Consoles and safe text for the CLI: how anything reaches the user's terminal.

Role: `console()` makes the Rich consoles every command prints through. Rich falls back to 80
columns when output is not a terminal, which cuts ids and wraps tables in pipes and logs; use
the terminal's width, `$COLUMNS`, or 160. Emoji codes (`:smile:`) are never replaced.

`safe(value)` is the one way a user-controlled string (job, step, team and owner names,
messages, reasons, checkpoint labels, parameters, errors from the API, file names) goes into
text that Rich renders as markup: control characters are made visible (`clean`) and markup is
escaped, so `[/bold]ckpt` prints as written and `\\x1b[2J` cannot clear the viewer's screen.
`clean(text)` is the first half alone, for text printed without Rich (log lines). `HELP_MARKUP`
is the Typer `rich_markup_mode` of every command group: None, so help texts print literally
(bracketed examples such as `[a, b]` are not taken for markup). Typer 0.29.2 (pinned): the default
is "rich" whenever Rich is installed, and with None it formats help with Click's plain formatter
(`typer/core.py`: `if not HAS_RICH or self.rich_markup_mode is None`). Markup is escaped with
`rich.markup.escape` (Rich 15), which also protects a trailing backslash.

Neighbours: every `cli` module. Must not: call the API, read files or exit.
"""

from __future__ import annotations

import os
import re
import sys
from typing import Any, Literal

from rich.console import Console
from rich.markup import escape

__all__ = ["HELP_MARKUP", "clean", "console", "safe"]

HELP_MARKUP: Literal["rich", "markdown"] | None = None

#: C0 controls but tab and newline, DEL, C1 controls (0x9b is a one-byte CSI), and the Unicode
#: bidirectional overrides and isolates (they reorder what the viewer sees, "Trojan Source").
_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]")


def _visible(match: re.Match[str]) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def clean(value: Any) -> str:
    """`value` as text with every control character shown as an escape (ESC -> `\\x1b`);
    newlines and tabs are kept."""
    return _CONTROL.sub(_visible, value if isinstance(value, str) else str(value))


def safe(value: Any) -> str:
    """`value` as text for a Rich markup string: `clean`, then markup escaped (`[` -> `\\[`)."""
    return escape(clean(value))


def console(*, stderr: bool = False) -> Console:
    stream = sys.stderr if stderr else sys.stdout
    width = None if stream.isatty() or os.environ.get("COLUMNS") else 160
    return Console(stderr=stderr, highlight=False, width=width, emoji=False)
