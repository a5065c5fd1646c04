"""`control_state` (what the controllers remember across a restart): the same on every backend."""

from __future__ import annotations

import pytest

from lowtide.store.repo import Store

T0 = 1_790_000_000.0


def test_documents_are_kept_replaced_and_read_back_as_plain_values(store: Store) -> None:
    assert store.get_state("inference.memory") is None
    assert store.state_updated_at("inference.memory") is None
    doc = {"version": 1, "services": {"chat": {"scale": {"history": [[T0, 2]], "desired": 2}}}}
    store.put_state("inference.memory", doc, now=T0)
    assert store.get_state("inference.memory") == doc
    store.put_state("inference.memory", {"version": 1, "services": {}}, now=T0 + 5)
    assert store.get_state("inference.memory") == {"version": 1, "services": {}}
    assert store.state_updated_at("inference.memory") == T0 + 5
    read = store.get_state("inference.memory")
    read["services"]["x"] = 1  # a caller's copy: the store keeps what was written
    assert store.get_state("inference.memory") == {"version": 1, "services": {}}


def test_bad_keys_and_values_are_refused(store: Store) -> None:
    with pytest.raises(ValueError, match="control_state key"):
        store.put_state("", {}, now=T0)
    with pytest.raises(ValueError, match="control_state key"):
        store.put_state("k" * 129, {}, now=T0)
    with pytest.raises((TypeError, ValueError)):
        store.put_state("k", {"not json": object()}, now=T0)
    assert store.get_state("k") is None
