"""The lending policies a simulation can run, by name (importable without the simulator itself).

`cli.simulate_cmd` checks its options against these without loading the simulator, so that the
`lowtide` command starts fast; `sim.scenario` turns a name into a scenario variant.
Must not: import anything heavier than the standard library.
"""

from __future__ import annotations

from typing import Literal

PolicyName = Literal["none", "window", "continuous", "forecast", "oracle"]
POLICIES: tuple[PolicyName, ...] = ("none", "window", "continuous", "forecast", "oracle")
