"""Which queued images to start next: shape-aware admission, pure Python (no torch), shared by the
service's lease (``dit_serve.server.store.Store.lease``) and the benchmarks' engine loops.

The engine steps every latent shape in flight as its own group, and each group as its own replays
(``graphs.splitter``). Eight images of one shape are one replay of 8; the same eight spread over three
shapes are about five replays of 1-2 (3 -> 2 + 1, 3 -> 2 + 1, 2), each at a smaller, less efficient
bucket. First-come-first-served admission spreads them whenever small requests of several sizes are
queued together, the normal case of mixed-size traffic. So, when more is queued than there is room:

1. the head of the queue (highest priority, then oldest) is started (at once, or under rule 4 once a
   little room is free): no item waits behind later ones for more than one admission per item ahead of
   it, so nothing starves;
2. the rest of the room goes first to items of a *preferred* shape, in queue order: the shapes in flight
   and the head's (they run as a group at the next step anyway), then to the others, in queue order;
3. priority is never overtaken: an item of a preferred shape is taken before an unpreferred one of the
   same priority only, never before one of higher priority;
4. given the ``capacity`` (most images in flight), no shape starts as a small group beside others: a new
   shape other than the head's that would get fewer than ``least = capacity // SMALL_GROUP`` of the room
   is not started, nor anything after it in the order (rule 3); and when the head's shape is not in
   flight (something else is), nothing is taken while the room is under ``least``: the room builds up
   until that many finish, and the head then starts with its shape's items, however few are queued.
   Under a backlog a small group is pure loss: its replay at a small bucket costs about what a few times
   its images cost inside a full one (PixArt-Σ 512 on an H200: one image 10.7 ms, 32 images 122.9 ms),
   while the images it would leave out cost the others nothing (31 images replay at the cost of 32).

With room for everything queued, everything is taken (the order changes nothing). A shape here is
whatever key the caller groups by (the service: model, width, height as stored).
"""

from __future__ import annotations

from collections import Counter
from typing import Callable, Collection, Hashable, Sequence, TypeVar

__all__ = ["SMALL_GROUP", "WINDOW", "choose", "shape_key", "spec_shape", "take"]

T = TypeVar("T")

# How far past the room a lease looks for items of a preferred shape: at most WINDOW x room candidates
# are read. Larger finds more same-shape items in a deep mixed queue, and reads more rows per lease.
WINDOW = 4
# Rule 4: a new shape starts beside the ones in flight with at least capacity // SMALL_GROUP images.
SMALL_GROUP = 4


def choose(candidates: Sequence[T], room: int, in_flight: Collection[Hashable], shape: Callable[[T], Hashable],
           priority: Callable[[T], int] | None = None, capacity: int | None = None) -> list[int]:
    """Indices (ascending) of at most ``room`` of ``candidates`` (queue order: priority desc, then age) to
    start, by the rules above. ``in_flight``: the shapes running now; ``shape(c)``, ``priority(c)``
    (default: all equal) describe a candidate; ``capacity``: the most images in flight (rule 4; None: no
    rule 4)."""
    if room <= 0 or not candidates:
        return []
    if room >= len(candidates):
        return list(range(len(candidates)))
    running = set(in_flight)
    preferred = running | {shape(candidates[0])}
    prio = priority or (lambda _: 0)
    order = sorted(range(len(candidates)),
                   key=lambda i: (-prio(candidates[i]), shape(candidates[i]) not in preferred, i))[:room]
    if capacity is not None:
        least, head = capacity // SMALL_GROUP, shape(candidates[0])
        if running and head not in running and room < least:
            return []
        order = order[:_before_small_group(order, candidates, shape, running | {head}, least)]
    return sorted(order)


def _before_small_group(order: list[int], candidates: Sequence[T], shape: Callable[[T], Hashable],
                        started: set, least: int) -> int:
    """How many of ``order`` (the picks, in admission order) come before the first item of a shape not in
    ``started`` that gets fewer than ``least`` of them (rule 4); all of them when there is none."""
    shapes = [shape(candidates[i]) for i in order]
    counts = Counter(shapes)
    return next((n for n, s in enumerate(shapes) if s not in started and counts[s] < least), len(shapes))


def shape_key(model: str, width: int, height: int) -> tuple[str, int, int]:
    """The shape an image runs under, as both the service's lease and the engine key it: (model, width,
    height) as asked (0, 0: the model's native size, which therefore counts apart from the same size asked
    for by number)."""
    return (model, width, height)


def spec_shape(spec) -> tuple[str, int, int]:
    """An ``ItemSpec``'s ``shape_key``."""
    return shape_key(spec.model, spec.width, spec.height)


def take(queue: list[T], room: int, in_flight: Collection[Hashable], shape: Callable[[T], Hashable] = spec_shape,
         window: int = WINDOW, capacity: int | None = None) -> list[T]:
    """What a lease of ``room`` items does to an in-memory ``queue`` (one priority): ``choose`` among its
    first ``window`` x ``room`` items; the chosen ones are removed from ``queue`` and returned in queue
    order (the benchmarks' engine loops admit through this, as the service leases)."""
    picked = choose(queue[:max(0, room) * window], room, in_flight, shape, capacity=capacity)
    chosen = [queue[i] for i in picked]
    for i in reversed(picked):
        del queue[i]
    return chosen
