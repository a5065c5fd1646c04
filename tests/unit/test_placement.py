"""Stories for policy.placement.FreeGpus: best fit on one node, lowest indices first."""

from __future__ import annotations

import pytest
from builders import running, snapshot
from hypothesis import given
from hypothesis import strategies as st

from lowtide.policy.placement import FreeGpus


def test_free_gpus_exclude_running_steps_and_unavailable_gpus() -> None:
    free = FreeGpus.from_snapshot(
        snapshot(
            nodes={"n1": 4, "n2": 2},
            running=[running("n1", [0, 2])],
            unavailable=["n1:3", "n2:0"],
        )
    )
    assert free.free_indices("n1") == (1,)
    assert free.free_indices("n2") == (1,)
    assert free.capacity("n1") == 3
    assert free.capacity("n2") == 1
    assert free.largest_capacity() == 3


def test_best_fit_is_the_smallest_block_that_is_big_enough() -> None:
    free = FreeGpus({"big": range(8), "mid": range(4), "tiny": [0]}, {"big": 8, "mid": 4, "tiny": 1})
    assert free.best_fit(1) == "tiny"
    assert free.best_fit(2) == "mid"
    assert free.best_fit(5) == "big"
    assert free.best_fit(9) is None


def test_ties_go_to_the_first_name_and_excluded_nodes_are_skipped() -> None:
    free = FreeGpus({"b": range(2), "a": range(2), "c": range(4)}, {"a": 2, "b": 2, "c": 4})
    assert free.best_fit(2) == "a"
    assert free.best_fit(2, excluded_nodes={"a"}) == "b"
    assert free.best_fit(2, excluded_nodes={"a", "b"}) == "c"
    assert free.best_fit(2, excluded_nodes={"a", "b", "c"}) is None


def test_take_hands_out_the_lowest_indices_and_moves_the_node_between_buckets() -> None:
    free = FreeGpus({"n1": [3, 1, 0, 6], "n2": [0, 1, 2]}, {"n1": 8, "n2": 3})
    assert free.take("n1", 2) == (0, 1)
    assert free.free_indices("n1") == (3, 6)
    assert free.best_fit(2) == "n1"
    assert free.take("n1", 2) == (3, 6)
    assert free.best_fit(1) == "n2"
    assert free.largest_free_block() == 3


def test_taking_more_than_is_free_is_refused() -> None:
    free = FreeGpus({"n1": [0]}, {"n1": 1})
    with pytest.raises(ValueError, match="cannot take 2 GPUs on n1: 1 free"):
        free.take("n1", 2)
    with pytest.raises(ValueError, match="at least 1 GPU"):
        free.best_fit(0)


def test_the_largest_free_block_ignores_excluded_nodes() -> None:
    free = FreeGpus({"n1": range(4), "n2": range(2), "n3": []}, {"n1": 4, "n2": 2, "n3": 4})
    assert free.largest_free_block() == 4
    assert free.largest_free_block(excluded_nodes={"n1"}) == 2
    assert free.largest_free_block(excluded_nodes={"n1", "n2"}) == 0


def test_a_reservation_goes_to_the_node_with_most_free_among_those_big_enough() -> None:
    # n1 has the most free GPUs, but only 3 of its GPUs can ever be lent.
    free = FreeGpus({"n1": range(3), "n2": [0, 1], "n3": [0, 1]}, {"n1": 3, "n2": 4, "n3": 4})
    assert free.most_free_with_capacity(4) == "n2"
    assert free.most_free_with_capacity(4, excluded_nodes={"n2"}) == "n3"
    assert free.most_free_with_capacity(3) == "n1"
    assert free.most_free_with_capacity(5) is None


@given(
    st.dictionaries(st.sampled_from(["a", "b", "c", "d", "e"]), st.integers(0, 8), min_size=1),
    st.lists(st.tuples(st.integers(1, 8), st.sets(st.sampled_from(["a", "b", "c", "d", "e"]), max_size=2))),
)
def test_best_fit_agrees_with_a_brute_force_search(
    sizes: dict[str, int], requests: list[tuple[int, set[str]]]
) -> None:
    free = FreeGpus({n: range(k) for n, k in sizes.items()}, sizes)
    left = dict(sizes)
    for need, excluded in requests:
        fits = sorted((k, n) for n, k in left.items() if k >= need and n not in excluded)
        expected = fits[0][1] if fits else None
        assert free.best_fit(need, excluded) == expected
        open_blocks = [k for n, k in left.items() if n not in excluded]
        assert free.largest_free_block(excluded) == max(open_blocks, default=0)
        if expected is not None:
            free.take(expected, need)
            left[expected] -= need
