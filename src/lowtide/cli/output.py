"""Consoles for the CLI: Rich falls back to 80 columns when output is not a terminal, which cuts
ids and wraps tables in pipes and logs; use the terminal's width, `$COLUMNS`, or 160."""

from __future__ import annotations

import os
import sys

from rich.console import Console


def console(*, stderr: bool = False) -> Console:
    stream = sys.stderr if stderr else sys.stdout
    width = None if stream.isatty() or os.environ.get("COLUMNS") else 160
    return Console(stderr=stderr, highlight=False, width=width)
