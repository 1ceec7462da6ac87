"""Bucket sizes, the batch splitter and graph keys: pure Python, no torch, no CUDA.

Contract
--------
* Graphs exist for the buckets ``bucket_sizes(max_batch) == (1, 2, 4, ..., max_batch)``.
* ``split_batch(n, buckets)`` says which bucket each replay uses, largest first. Every entry is one
  of ``buckets`` and the entries sum to at least ``n``; rows beyond ``n`` are padding that the runner
  computes and throws away (the step must be row-independent, pitfall 9).
* Without timings the plan is greedy (13 -> [8, 4, 1]): the fewest replays with no padding when 1 is
  a bucket, and less padding than the smallest bucket otherwise.
* With ``replay_ms`` (bucket -> measured milliseconds per replay) the plan is an exact minimum-cost
  cover: padding up to a larger bucket happens only where it is cheaper in total (7 -> [8] when one
  8-replay costs less than 4 + 2 + 1). Among plans of equal cost the one with less padding wins.
  The cost is a small dynamic programme over n, so callers that plan on every step memoise the plan
  by n (GraphRunner does).
* ``GraphKey`` is what makes one graph different from another; ``group_by_key`` groups queued work
  by it, keeping arrival order, before each group is split.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping, Sequence, TypeVar

__all__ = ["GraphKey", "bucket_sizes", "check_timings", "group_by_key", "split_batch"]

# Above this many rows, the plan takes whole largest buckets first and runs the exact DP on the
# rest only: the DP is O(n * len(buckets)) Python steps.
DP_LIMIT = 4096
# Costs closer than this (relative) count as equal, so float sums such as 0.1 + 0.2 tie with 0.3.
_REL_TOL = 1e-9

T = TypeVar("T")


def bucket_sizes(max_batch: int) -> tuple[int, ...]:
    """(1, 2, 4, ..., max_batch); max_batch must be a power of two >= 1."""
    if isinstance(max_batch, bool) or not isinstance(max_batch, int):
        raise ValueError(f"max_batch must be an int, got {max_batch!r}")
    if max_batch < 1 or max_batch & (max_batch - 1):
        raise ValueError(f"max_batch must be a power of two >= 1 (1, 2, 4, ...), got {max_batch}")
    return tuple(1 << i for i in range(max_batch.bit_length()))


def _check_buckets(buckets: Iterable[int]) -> tuple[int, ...]:
    """The distinct bucket sizes, largest first."""
    try:
        sizes = tuple(buckets)
    except TypeError:
        raise ValueError(f"buckets must be a sequence of ints, got {buckets!r}") from None
    if not sizes:
        raise ValueError("buckets must not be empty")
    bad = [b for b in sizes if isinstance(b, bool) or not isinstance(b, int) or b < 1]
    if bad:
        raise ValueError(f"every bucket must be an int >= 1, got {bad}")
    return tuple(sorted(set(sizes), reverse=True))


def check_timings(buckets: Iterable[int], replay_ms: Mapping[int, float]) -> dict[int, float]:
    """replay_ms restricted to buckets, as floats; ValueError if one is missing, negative or not finite."""
    sizes = _check_buckets(buckets)
    missing = [b for b in sizes if b not in replay_ms]
    if missing:
        raise ValueError(f"replay_ms has no timing for buckets {sorted(missing)}")
    cost = {b: float(replay_ms[b]) for b in sizes}
    bad = {b: c for b, c in cost.items() if not math.isfinite(c) or c < 0}
    if bad:
        raise ValueError(f"replay_ms must be finite and >= 0, got {bad}")
    return cost


def split_batch(
    n: int, buckets: Sequence[int], replay_ms: Mapping[int, float] | None = None
) -> list[int]:
    """The bucket of each replay that covers n rows, largest first (see the module docstring)."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"n must be an int >= 0, got {n!r}")
    sizes = _check_buckets(buckets)
    if n == 0:
        return []
    if replay_ms is None:
        return _greedy(n, sizes)
    return _cheapest(n, sizes, check_timings(sizes, replay_ms))


def _greedy(n: int, sizes: tuple[int, ...]) -> list[int]:
    """Largest bucket that fits, repeatedly; a remainder below the smallest bucket is padded to it."""
    plan, rest = [], n
    for b in sizes:  # sizes is sorted largest first
        count, rest = divmod(rest, b)
        plan += [b] * count
    if rest:
        plan.append(sizes[-1])
    return sorted(plan, reverse=True)


def _cheapest(n: int, sizes: tuple[int, ...], cost: dict[int, float]) -> list[int]:
    """Exact minimum-cost cover; beyond DP_LIMIT rows, whole largest buckets first."""
    largest = sizes[0]
    whole = -(-(n - DP_LIMIT) // largest) if n > DP_LIMIT else 0
    return sorted([largest] * whole + _dp_cover(n - whole * largest, sizes, cost), reverse=True)


def _dp_cover(n: int, sizes: tuple[int, ...], cost: dict[int, float]) -> list[int]:
    # best[m] = (cost, rows) of the cheapest plan covering at least m rows; rows - m is its
    # padding. Both parts add up along a plan, so the lexicographic minimum is exact.
    best: list[tuple[float, int]] = [(0.0, 0)] + [(math.inf, 0)] * n
    choice = [0] * (n + 1)
    for m in range(1, n + 1):
        for b in sizes:
            prev_cost, prev_rows = best[max(0, m - b)]
            candidate = (prev_cost + cost[b], prev_rows + b)
            if _better(candidate, best[m]):
                best[m], choice[m] = candidate, b
    plan, m = [], n
    while m > 0:
        plan.append(choice[m])
        m = max(0, m - choice[m])
    return plan


def _better(a: tuple[float, int], b: tuple[float, int]) -> bool:
    """Cheaper, or as cheap (within _REL_TOL) with fewer rows, i.e. less padding."""
    tol = _REL_TOL * max(1.0, abs(b[0])) if math.isfinite(b[0]) else 0.0
    if a[0] < b[0] - tol:
        return True
    return a[0] <= b[0] + tol and a[1] < b[1]


@dataclass(frozen=True)
class GraphKey:
    """What makes one captured graph different from another: small, hashable, cheap to compare."""

    model: str
    latent_shape: tuple[int, ...]
    dtype: str
    backend: str
    variant: str = ""  # which of the family's steps (workers.families.base.Family.step_variants)

    def __post_init__(self) -> None:
        # A list would make the key unhashable; normalise once here rather than at every lookup.
        object.__setattr__(self, "latent_shape", tuple(int(d) for d in self.latent_shape))


def group_by_key(items: Iterable[T], key_fn: Callable[[T], GraphKey]) -> dict[GraphKey, list[T]]:
    """Items grouped by key_fn(item): groups in order of first appearance, items in arrival order."""
    groups: dict[GraphKey, list[T]] = {}
    for item in items:
        groups.setdefault(key_fn(item), []).append(item)
    return groups
