"""`dataclasses.replace` without its per-call walk over the fields: the hot paths of a tick (the
replica moves of the inference decision and of the in-memory store) copy frozen records often.

Role: `evolve(obj, **changes)` is `dataclasses.replace(obj, **changes)` for a dataclass whose
fields are all plain positional init fields (no `init=False`, `kw_only` or `InitVar`): its
values are read in C (`operator.attrgetter`), the changes put in place, and the class called
with them in field order, so `__post_init__` and every check of the class run as with
`replace`. Any other dataclass, or a change naming no field, goes to `dataclasses.replace`
itself (which raises as usual).
Neighbours: `policy.inference`, `store.memory`. Must not: hold anything but each class's shape,
or be used on anything but dataclass instances.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from operator import attrgetter
from typing import Any, TypeVar

T = TypeVar("T")

#: Per class: a getter of every field's value (a tuple, in field order) and each field's position;
#: None for a class `evolve` leaves to `dataclasses.replace`.
_SHAPES: dict[type, tuple[Callable[[Any], tuple[Any, ...]], dict[str, int]] | None] = {}


def evolve(obj: T, **changes: Any) -> T:
    """`dataclasses.replace(obj, **changes)` (see the module docstring)."""
    cls = type(obj)
    shape = _SHAPES.get(cls, _UNKNOWN)
    if shape is _UNKNOWN:
        shape = _SHAPES[cls] = _shape(cls)
    if shape is None:
        return dataclasses.replace(obj, **changes)  # type: ignore[type-var]
    getter, index = shape
    values = list(getter(obj))
    for name, value in changes.items():
        position = index.get(name)
        if position is None:
            return dataclasses.replace(obj, **changes)  # type: ignore[type-var]
        values[position] = value
    return cls(*values)


_UNKNOWN: Any = object()


def _shape(cls: type) -> tuple[Callable[[Any], tuple[Any, ...]], dict[str, int]] | None:
    if not dataclasses.is_dataclass(cls):
        return None
    names = []
    for f in dataclasses.fields(cls):
        if not f.init or f.kw_only:
            return None
        names.append(f.name)
    if len(names) != len(cls.__dataclass_fields__):  # an InitVar or ClassVar
        return None
    if len(names) < 2:
        return None  # attrgetter of one name gives the value, not a tuple
    return attrgetter(*names), {name: i for i, name in enumerate(names)}
