"""Bucket sizes, the splitter and graph keys: pure Python, no GPU."""

import dataclasses
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from graphs import GraphKey, bucket_sizes, group_by_key, split_batch
from graphs.splitter import DP_LIMIT


def cost(plan, ms):
    return sum(ms[b] for b in plan)


# ----- bucket_sizes ---------------------------------------------------------------------------
def test_bucket_sizes_are_powers_of_two_up_to_max():
    assert bucket_sizes(1) == (1,)
    assert bucket_sizes(8) == (1, 2, 4, 8)
    assert bucket_sizes(64) == (1, 2, 4, 8, 16, 32, 64)


@pytest.mark.parametrize("bad", [0, -4, 3, 12, 65, 2.0, True, "8"])
def test_bucket_sizes_rejects_non_powers_of_two(bad):
    with pytest.raises(ValueError, match="power of two|must be an int"):
        bucket_sizes(bad)


# ----- greedy plans ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    "n, max_batch, plan",
    [(13, 8, [8, 4, 1]), (200, 64, [64, 64, 64, 8]), (0, 8, []), (1, 8, [1]), (64, 64, [64]),
     (65, 64, [64, 1]), (7, 8, [4, 2, 1]), (17, 8, [8, 8, 1])],
)
def test_greedy_examples(n, max_batch, plan):
    assert split_batch(n, bucket_sizes(max_batch)) == plan


def test_greedy_without_bucket_one_pads_with_the_smallest_bucket():
    assert split_batch(13, [2, 4, 8]) == [8, 4, 2]  # 13 = 8 + 4 + 1, the 1 padded to 2
    assert split_batch(1, [8, 4]) == [4]


def test_unsorted_and_duplicate_buckets_are_accepted():
    assert split_batch(13, [4, 1, 8, 2, 2]) == [8, 4, 1]


# ----- timed plans ----------------------------------------------------------------------------
def test_padding_wins_when_one_big_replay_is_cheaper():
    ms = {1: 1.0, 2: 1.1, 4: 1.2, 8: 1.5}  # one 8-replay (1.5) < 4 + 2 + 1 (3.3) and < 4 + 4 (2.4)
    assert split_batch(7, bucket_sizes(8), ms) == [8]


def test_no_padding_when_cost_is_proportional_to_rows():
    ms = {b: float(b) for b in bucket_sizes(8)}
    for n in range(40):
        assert sum(split_batch(n, bucket_sizes(8), ms)) == n


def test_equal_cost_prefers_less_padding():
    ms = {1: 1.0, 2: 1.0, 4: 2.0}  # n = 3: [4] costs 2 (1 row padding), [2, 1] costs 2 (none)
    assert split_batch(3, [1, 2, 4], ms) == [2, 1]


def test_float_sums_that_differ_in_the_last_bit_count_as_equal():
    ms = {1: 0.1, 2: 0.2, 4: 0.3}  # 0.2 + 0.1 == 0.30000000000000004, a tie with 0.3
    assert split_batch(3, [1, 2, 4], ms) == [2, 1]


def test_large_n_uses_whole_largest_buckets_then_the_dp():
    buckets = bucket_sizes(64)
    ms = {1: 1.0, 2: 1.2, 4: 1.3, 8: 1.5, 16: 2.0, 32: 3.0, 64: 5.0}
    n = 3 * DP_LIMIT + 5
    plan = split_batch(n, buckets, ms)
    assert sum(plan) >= n and set(plan) <= set(buckets)
    assert plan == sorted(plan, reverse=True)
    assert cost(plan, ms) <= cost(split_batch(n, buckets), ms)


@pytest.mark.parametrize(
    "args, match",
    [((-1, [1, 2]), "n must be"), ((1.5, [1, 2]), "n must be"), ((3, []), "must not be empty"),
     ((3, [0, 2]), "int >= 1"), ((3, [2, -1]), "int >= 1"), ((3, [1.0, 2]), "int >= 1"),
     ((3, 8), "sequence of ints"),
     ((3, [1, 2], {1: 1.0}), "no timing for buckets \\[2\\]"),
     ((3, [1, 2], {1: 1.0, 2: -1.0}), "finite and >= 0"),
     ((3, [1, 2], {1: 1.0, 2: math.nan}), "finite and >= 0")],
)
def test_bad_arguments_raise_clear_errors(args, match):
    with pytest.raises(ValueError, match=match):
        split_batch(*args)


# ----- properties -----------------------------------------------------------------------------
buckets_st = st.lists(st.integers(1, 64), min_size=1, max_size=6)


@settings(max_examples=200, deadline=None)
@given(n=st.integers(0, 600), buckets=buckets_st)
def test_greedy_properties(n, buckets):
    plan = split_batch(n, buckets)
    assert set(plan) <= set(buckets)
    assert sum(plan) >= n
    assert sum(plan) - n < min(buckets)  # padding below the smallest bucket
    if 1 in buckets:
        assert sum(plan) == n
    assert plan == sorted(plan, reverse=True)
    assert plan == split_batch(n, buckets)  # deterministic


def exact_optimum(n, ms):
    """(cost, padding) of the best plan, by a different method: exact-total unbounded knapsack."""
    top = n + max(ms)
    best = [0.0] + [math.inf] * top
    for total in range(1, top + 1):
        best[total] = min((best[total - b] + c for b, c in ms.items() if b <= total), default=math.inf)
    lowest = min(best[n:])
    tol = 1e-9 * max(1.0, lowest)
    return lowest, min(t - n for t in range(n, top + 1) if best[t] <= lowest + tol)


@settings(max_examples=200, deadline=None)
@given(
    n=st.integers(0, 80),
    timings=st.dictionaries(st.integers(1, 32), st.floats(0.01, 100.0), min_size=1, max_size=6),
)
def test_timed_plan_is_an_exact_minimum_cost_cover(n, timings):
    buckets = sorted(timings)
    plan = split_batch(n, buckets, timings)
    assert set(plan) <= set(buckets)
    assert sum(plan) >= n
    assert plan == sorted(plan, reverse=True)
    assert plan == split_batch(n, buckets, timings)  # deterministic
    greedy = split_batch(n, buckets)
    assert cost(plan, timings) <= cost(greedy, timings) * (1 + 1e-9) + 1e-12
    if n:
        optimum, least_padding = exact_optimum(n, timings)
        assert cost(plan, timings) == pytest.approx(optimum, rel=1e-9)
        assert sum(plan) - n == least_padding


# ----- keys and grouping ----------------------------------------------------------------------
def test_graph_key_is_small_frozen_and_hashable():
    key = GraphKey("dit-xl-2", [4, 32, 32], "bfloat16", "breakable")
    assert key.latent_shape == (4, 32, 32)
    assert key == GraphKey("dit-xl-2", (4, 32, 32), "bfloat16", "breakable")
    assert len({key, GraphKey("dit-xl-2", (4, 32, 32), "bfloat16", "breakable")}) == 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        key.backend = "full"


def test_group_by_key_keeps_first_appearance_and_arrival_order():
    a = GraphKey("m", (4, 32, 32), "bfloat16", "full")
    b = GraphKey("m", (4, 64, 64), "bfloat16", "full")
    items = [("x1", a), ("y1", b), ("x2", a), ("y2", b), ("x3", a)]
    groups = group_by_key(items, key_fn=lambda item: item[1])
    assert list(groups) == [a, b]
    assert [name for name, _ in groups[a]] == ["x1", "x2", "x3"]
    assert [name for name, _ in groups[b]] == ["y1", "y2"]
    assert group_by_key([], key_fn=lambda item: item) == {}
