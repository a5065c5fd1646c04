"""What of the inference decisions' memory survives a control-plane restart, as JSON values (pure).

Role: `encode_memory` turns the parts of `policy.inference_snapshot.InferenceMemory` that the
decisions depend on into a JSON document, and `decode_memory` turns one back into memory to start
from. Kept: per service the autoscaler's `ScaleState` (its window readings `history`, `recent`
and `steps`, the last `desired`/`needed`, the last scale-down `down_from`, the `flap_guard`,
`panic_at`, `unknown_since`, the burst guard's `window_s`/`window_at`/`burst_from`; a document
written before the burst guard existed reads as no lengthened window), the needed-replicas
history the growth slope reads, the surge times of open reclaims (`surge_at`) and the alert
texts. Not kept: the forecast profiles (saved on their own, `control.inference`) and `fresh_at`
(a restarted control plane must see fresh data before it trusts any: start-up freshness is
`policy.inference`'s rule).

Times are control time (`now`, seconds since the epoch), so a reading taken before the restart
keeps its place in the windows after it. A restored time later than the `now` it is restored at
(the clock went back while lowtide was down) is clamped to that `now`. Each sequence keeps at most
`MAX_READINGS` newest entries (the document stays small however long a window is), services no
longer configured are dropped, and anything malformed is ignored service by service (that
service starts afresh), never raised.

Neighbours: `control.inference` saves the document in the store's `control_state` and loads it in
`recover`. Must not: read the clock, do I/O, or decide anything.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from dataclasses import replace
from typing import Any

from lowtide.policy.autoscale import ScaleState
from lowtide.policy.inference_snapshot import InferenceMemory

#: The document's format; a document of another version is ignored.
VERSION = 1
#: The most entries kept of each sequence (the windows need far fewer at a tick a second).
MAX_READINGS = 2048


def encode_memory(memory: InferenceMemory, now: float) -> dict[str, Any]:
    """The JSON document of `memory` as of `now`."""
    services: dict[str, Any] = {}
    names = set(memory.scale_states) | set(memory.needed_history) | set(memory.surge_at) | set(memory.alerts)
    for name in sorted(names):
        entry: dict[str, Any] = {}
        state = memory.scale_states.get(name)
        if state is not None:
            entry["scale"] = {
                "history": _pairs(state.history),
                "desired": state.desired,
                "needed": state.needed,
                "down_from": list(state.down_from) if state.down_from is not None else None,
                "flap_guard": list(state.flap_guard) if state.flap_guard is not None else None,
                "recent": _pairs(state.recent),
                "steps": _pairs(state.steps),
                "panic_at": state.panic_at,
                "unknown_since": state.unknown_since,
                "window_s": state.window_s,
                "window_at": state.window_at,
                "burst_from": list(state.burst_from) if state.burst_from is not None else None,
            }
        if name in memory.needed_history:
            entry["needed_history"] = _pairs(memory.needed_history[name])
        if name in memory.surge_at:
            entry["surge_at"] = memory.surge_at[name]
        if memory.alerts.get(name):
            entry["alert"] = memory.alerts[name]
        services[name] = entry
    return {"version": VERSION, "saved_at": now, "services": services}


def decode_memory(
    document: Any, start: InferenceMemory, services: Collection[str], now: float
) -> InferenceMemory:
    """`start` (the memory before the first tick) with what `document` kept for each of
    `services`; a service whose part is missing or malformed keeps its part of `start`."""
    if not isinstance(document, Mapping) or document.get("version") != VERSION:
        return start
    saved = document.get("services")
    if not isinstance(saved, Mapping):
        return start
    scale_states = dict(start.scale_states)
    history = dict(start.needed_history)
    surge_at = dict(start.surge_at)
    alerts = dict(start.alerts)
    for name in services:
        entry = saved.get(name)
        if not isinstance(entry, Mapping):
            continue
        try:
            state = _scale_state(name, entry.get("scale"), now)
            needed = _read_pairs(entry.get("needed_history", []), now)
            surge = _time(entry.get("surge_at"), now)
            alert = entry.get("alert", "")
            if not isinstance(alert, str):
                raise TypeError("alert")
        except (TypeError, ValueError, KeyError):
            continue
        if state is not None:
            scale_states[name] = state
        history[name] = needed
        if surge is not None:
            surge_at[name] = surge
        if alert:
            alerts[name] = alert
    return replace(start, scale_states=scale_states, needed_history=history, surge_at=surge_at, alerts=alerts)


# -- helpers ------------------------------------------------------------------------------------


def _pairs(items: tuple[tuple[float, int], ...]) -> list[list[float]]:
    return [[t, n] for t, n in items[-MAX_READINGS:]]


def _number(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise TypeError(f"not a number: {value!r}")
    return float(value)


def _count(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise TypeError(f"not a count: {value!r}")
    return value


def _time(value: Any, now: float) -> float | None:
    return None if value is None else min(_number(value), now)


def _read_pairs(value: Any, now: float) -> tuple[tuple[float, int], ...]:
    if not isinstance(value, list):
        raise TypeError("not a list")
    out = [(min(_number(t), now), _count(n)) for t, n in value[-MAX_READINGS:]]
    return tuple(out)


def _scale_state(name: str, value: Any, now: float) -> ScaleState | None:
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise TypeError("scale")
    down = value.get("down_from")
    guard = value.get("flap_guard")
    window, burst = value.get("window_s"), value.get("burst_from")
    desired, needed = value.get("desired"), value.get("needed")
    return ScaleState(
        service=name,
        history=_read_pairs(value.get("history", []), now),
        desired=None if desired is None else _count(desired),
        needed=None if needed is None else _count(needed),
        down_from=None if down is None else (_count(down[0]), _number(down[1]), min(_number(down[2]), now)),
        flap_guard=None if guard is None else (_count(guard[0]), _number(guard[1])),
        recent=_read_pairs(value.get("recent", []), now),
        steps=_read_pairs(value.get("steps", []), now),
        panic_at=_time(value.get("panic_at"), now),
        unknown_since=_time(value.get("unknown_since"), now),
        window_s=None if window is None else _number(window),
        window_at=_time(value.get("window_at"), now),
        burst_from=None if burst is None else (_count(burst[0]), min(_number(burst[1]), now)),
    )
