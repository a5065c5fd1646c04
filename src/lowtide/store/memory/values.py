"""Immutable documents and cached indexes: what lets the in-memory store hand out its data without
copying it and answer the loop's per-tick reads without scanning its history.

`freeze` turns a JSON-like document (a spec, a resolved step, an attempt's record) into
`FrozenDict`s and `FrozenList`s: subclasses of dict and list, so they compare, serialise and
`isinstance`-check exactly like the fresh dicts and lists the SQL store reads back from its JSON
columns, but every mutating method raises TypeError, so a record can share them with the store
and with every other record. `copy.copy`/`deepcopy` and pickling give plain dicts and lists.
`SortedIndex` is a dict that also keeps its values as a tuple in key order, rebuilt only after a
change: the loop's reads return that tuple (or a list of it) as it is.
Neighbours: `store.memory.rows` and the store's parts use both. Must not: know about the store.
"""

from __future__ import annotations

import copy
from typing import Any, Generic, NoReturn, TypeVar

_READ_ONLY = "a stored document is read-only: copy it (dict(x), list(x)) to change it"


def _refuse(*_args: Any, **_kwargs: Any) -> NoReturn:
    raise TypeError(_READ_ONLY)


class FrozenDict(dict[str, Any]):
    """A dict that refuses every change (see the module docstring)."""

    __slots__ = ()

    def __setitem__(self, *args: Any, **kwargs: Any) -> NoReturn:
        _refuse()

    def __delitem__(self, *args: Any, **kwargs: Any) -> NoReturn:
        _refuse()

    def __ior__(self, *args: Any, **kwargs: Any) -> NoReturn:  # type: ignore[misc]
        _refuse()

    def clear(self, *args: Any, **kwargs: Any) -> NoReturn:
        _refuse()

    def pop(self, *args: Any, **kwargs: Any) -> NoReturn:
        _refuse()

    def popitem(self, *args: Any, **kwargs: Any) -> NoReturn:
        _refuse()

    def setdefault(self, *args: Any, **kwargs: Any) -> NoReturn:
        _refuse()

    def update(self, *args: Any, **kwargs: Any) -> NoReturn:
        _refuse()

    def copy(self) -> dict[str, Any]:
        return dict(self)

    def __copy__(self) -> dict[str, Any]:
        return dict(self)

    def __deepcopy__(self, memo: dict[int, Any]) -> dict[str, Any]:
        return {k: copy.deepcopy(v, memo) for k, v in self.items()}

    def __reduce__(self) -> tuple[Any, ...]:
        return (dict, (dict(self),))


class FrozenList(list[Any]):
    """A list that refuses every change (see the module docstring)."""

    __slots__ = ()

    def __setitem__(self, *args: Any, **kwargs: Any) -> NoReturn:
        _refuse()

    def __delitem__(self, *args: Any, **kwargs: Any) -> NoReturn:
        _refuse()

    def __iadd__(self, *args: Any, **kwargs: Any) -> NoReturn:  # type: ignore[misc]
        _refuse()

    def __imul__(self, *args: Any, **kwargs: Any) -> NoReturn:  # type: ignore[misc]
        _refuse()

    def append(self, *args: Any, **kwargs: Any) -> NoReturn:
        _refuse()

    def extend(self, *args: Any, **kwargs: Any) -> NoReturn:
        _refuse()

    def insert(self, *args: Any, **kwargs: Any) -> NoReturn:
        _refuse()

    def remove(self, *args: Any, **kwargs: Any) -> NoReturn:
        _refuse()

    def pop(self, *args: Any, **kwargs: Any) -> NoReturn:
        _refuse()

    def clear(self, *args: Any, **kwargs: Any) -> NoReturn:
        _refuse()

    def sort(self, *args: Any, **kwargs: Any) -> NoReturn:
        _refuse()

    def reverse(self, *args: Any, **kwargs: Any) -> NoReturn:
        _refuse()

    def copy(self) -> list[Any]:
        return list(self)

    def __copy__(self) -> list[Any]:
        return list(self)

    def __deepcopy__(self, memo: dict[int, Any]) -> list[Any]:
        return [copy.deepcopy(v, memo) for v in self]

    def __reduce__(self) -> tuple[Any, ...]:
        return (list, (list(self),))


def freeze(value: Any) -> Any:
    """A JSON-like value with every dict and list (and tuple) made read-only; already frozen parts
    are shared, not copied. Keys become strings, as a JSON column's would."""
    kind = type(value)
    if kind is str or kind is int or kind is float or kind is bool or value is None:
        return value  # the common leaf, tested first
    if isinstance(value, FrozenDict | FrozenList):
        return value
    if isinstance(value, dict):
        return FrozenDict({str(k): freeze(v) for k, v in value.items()})
    if isinstance(value, list | tuple):
        return FrozenList(freeze(v) for v in value)
    return value


def thaw(value: Any) -> Any:
    """A plain, mutable deep copy of a (frozen) JSON-like value."""
    if isinstance(value, dict):
        return {k: thaw(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [thaw(v) for v in value]
    return value


_ABSENT: Any = object()  # no value under a key (values may be anything, None too)
K = TypeVar("K", int, str, tuple[str, int, str])  # what the store indexes by: ids, or (service, slot, id)
V = TypeVar("V")


class SortedIndex(Generic[K, V]):
    """A dict whose values are also kept as a tuple in key order, rebuilt lazily after a change.

    `put` of a key already present keeps the key order and only rebuilds the tuple of values
    (O(n) on the next read), unless it is the very value already there (nothing changes);
    adding or dropping a key also re-sorts the keys (nearly sorted input: close to linear).
    Reads without a change in between cost O(1).
    """

    __slots__ = ("_items", "_keys", "_values")

    def __init__(self) -> None:
        self._items: dict[K, V] = {}
        self._keys: list[K] | None = []
        self._values: tuple[V, ...] | None = ()

    def put(self, key: K, value: V) -> None:
        old = self._items.get(key, _ABSENT)
        if old is value:
            return  # the very value it holds: nothing changes, the tuple of values stays
        if old is _ABSENT:
            self._keys = None
        self._items[key] = value
        self._values = None

    def drop(self, key: K) -> None:
        if key in self._items:
            del self._items[key]
            self._keys = None
            self._values = None

    def get(self, key: K) -> V | None:
        return self._items.get(key)

    def __contains__(self, key: object) -> bool:
        return key in self._items

    def __len__(self) -> int:
        return len(self._items)

    def values(self) -> tuple[V, ...]:
        if self._values is None:
            if self._keys is None:
                self._keys = sorted(self._items)
            self._values = tuple(map(self._items.__getitem__, self._keys))
        return self._values
