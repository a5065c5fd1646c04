"""One remembered answer of a pure function: the simulator ticks tens of thousands of times with
mostly the same inputs, and several per-tick computations keep their last inputs and answer.

Role: `Last` holds the last (inputs, answer) of one such function, replaced whole, never mutated.
The rules its users follow (each docstring says which applies): the inputs kept are immutable (frozen
dataclasses, tuples, frozensets, read-only mappings of frozensets, or frozen copies of mutable
arguments), and a hit is checked either by identity against the kept object itself (which, being
kept, cannot be freed and its id reused) or by value. So a hit gives exactly the answer the
function would compute, and a decision never depends on what was remembered.
Neighbours: `policy.inference`, `policy.replicas`, `policy.autoscale`, `policy.placement`,
`policy.reclaim_phases`, `policy.snapshot`. Must not: hold anything but the last entry, or be read
for anything but its user's own answer.
"""

from __future__ import annotations

from typing import Generic, TypeVar

T = TypeVar("T")


class Last(Generic[T]):
    """The last entry of one memo (None: nothing yet)."""

    __slots__ = ("entry",)

    def __init__(self) -> None:
        self.entry: T | None = None
