"""Shape-aware admission (workers/request/admission.py): the head first, then the shapes in flight, never past a
higher priority, and nothing starves."""

from __future__ import annotations

import random
from collections import Counter

from graphs.splitter import bucket_sizes, split_batch
from workers.request import admission
from workers.request.spec import ItemSpec


def _shape(c):
    return c[0]


def _prio(c):
    return c[1]


def test_the_head_then_its_shape_and_the_shapes_in_flight_in_queue_order():
    q = [("a", 0), ("b", 0), ("c", 0), ("a", 0), ("b", 0), ("a", 0), ("c", 0)]
    assert admission.choose(q, 3, (), _shape) == [0, 3, 5]             # the head's shape fills the room
    assert admission.choose(q, 4, ("c",), _shape) == [0, 2, 3, 5]      # ... and the shapes in flight
    assert admission.choose(q, 2, ("c",), _shape) == [0, 2]            # queue order among the preferred
    assert admission.choose(q, 5, (), _shape) == [0, 1, 2, 3, 5]       # then the others, in queue order
    assert admission.choose(q, 7, (), _shape) == list(range(7))        # room for all: all
    assert admission.choose(q, 9, ("z",), _shape) == list(range(7))
    assert admission.choose(q, 0, (), _shape) == [] and admission.choose([], 3, (), _shape) == []


def test_a_higher_priority_is_never_overtaken():
    q = [("a", 5), ("b", 5), ("b", 5), ("a", 1), ("a", 1)]  # queue order: priority desc
    # the head's shape "a" is preferred, but the priority-1 "a"s wait behind the priority-5 "b"s
    assert admission.choose(q, 3, (), _shape, _prio) == [0, 1, 2]
    assert admission.choose(q, 4, ("b",), _shape, _prio) == [0, 1, 2, 3]
    # without priorities the same queue would take the "a"s first
    assert admission.choose(q, 3, (), _shape) == [0, 3, 4]


def test_nothing_starves_under_a_stream_of_in_flight_shapes():
    """A lone "z" behind a stream of "a" that keeps the room busy: each admission takes the head, so the
    "z" starts after at most as many admissions as items were ahead of it."""
    queue = [("a", 0)] * 3 + [("z", 0)] + [("a", 0)] * 20
    in_flight = {"a"}
    for rounds in range(1, 10):
        taken = admission.take(queue, 1, in_flight, _shape)
        if taken == [("z", 0)]:
            break
        assert taken == [("a", 0)]
        queue.append(("a", 0))  # a new arrival of the in-flight shape each time
    assert rounds == 4


def test_take_removes_what_it_returns_and_reads_only_the_window():
    queue = [("a", 0)] + [("b", 0)] * 8 + [("a", 0)] * 3
    taken = admission.take(queue, 2, (), _shape)  # window 8: the "a"s after it are not seen
    assert taken == [("a", 0), ("b", 0)] and len(queue) == 10
    queue = [("a", 0)] + [("b", 0)] * 6 + [("a", 0)] * 3
    assert admission.take(queue, 2, (), _shape) == [("a", 0), ("a", 0)]
    assert queue == [("b", 0)] * 6 + [("a", 0)] * 2


def _replays(active: Counter) -> int:
    return sum(len(split_batch(n, bucket_sizes(8))) for n in active.values() if n)


def test_a_mixed_backlog_runs_in_fewer_replays_than_first_come_first_served():
    """The FLUX benchmark's backlog: 24 images of three sizes interleaved, 8 in flight, all finishing
    together: FCFS runs each round as about five replays, shape-aware admission as one."""
    specs = [ItemSpec(id=f"{i}", seed=i, sampler="ddim", steps=4, guidance=1.0, model="m", width=w,
                      height=h)
             for i, (w, h) in enumerate([(512, 512), (416, 624), (624, 416)] * 8)]
    fcfs, aware = list(specs), list(specs)
    replays = {"fcfs": [], "aware": []}
    while fcfs:
        replays["fcfs"].append(_replays(Counter(admission.spec_shape(s) for s in fcfs[:8])))
        del fcfs[:8]
        batch = admission.take(aware, 8, set())
        assert len(batch) == 8 and len({admission.spec_shape(s) for s in batch}) == 1
        replays["aware"].append(_replays(Counter(admission.spec_shape(s) for s in batch)))
    assert replays == {"fcfs": [5, 5, 5], "aware": [1, 1, 1]}


def test_random_queues_keep_the_rules():
    rng = random.Random(3)
    for _ in range(500):
        q = sorted([(rng.choice("abcd"), rng.choice((0, 0, 1, 2))) for _ in range(rng.randint(1, 12))],
                   key=lambda c: -c[1])
        room, flying = rng.randint(1, 12), set(rng.sample("abcd", rng.randint(0, 2)))
        got = admission.choose(q, room, flying, _shape, _prio)
        assert got == sorted(set(got)) and len(got) == min(room, len(q))
        assert 0 in got  # the head
        left = [i for i in range(len(q)) if i not in got]
        for i in got:  # nothing taken over a higher priority left behind
            assert all(q[j][1] <= q[i][1] for j in left)
        preferred = flying | {q[0][0]}
        for i in got:  # an unpreferred item only when no preferred one of its priority is left
            if q[i][0] not in preferred:
                assert not any(q[j][0] in preferred and q[j][1] == q[i][1] for j in left)


def test_with_the_capacity_no_shape_starts_as_a_small_group_beside_the_ones_in_flight():
    a, b = ("a", 0), ("b", 0)
    # the mixed benchmark's fourth round: 31 "a" left, "b"s behind; 32 in flight at most (least 8)
    q = [a] * 31 + [b] * 40
    assert admission.choose(q, 32, (), _shape, capacity=32) == list(range(31))  # one "b" would replay alone
    assert admission.choose(q, 32, ("z",), _shape, capacity=32) == list(range(31))  # beside a shape in flight too
    assert admission.choose(q, 32, ("z",), _shape) == list(range(32))  # without the capacity: rules 1-3 only
    q = [a] * 20 + [b] * 40
    assert admission.choose(q, 32, ("z",), _shape, capacity=32) == list(range(32))  # 12 "b": a group worth it
    # the head's shape not in flight: nothing while the room is under 8, then the head and its shape
    q = [b] * 40
    assert admission.choose(q, 7, ("a",), _shape, capacity=32) == []
    assert admission.choose(q, 8, ("a",), _shape, capacity=32) == list(range(8))
    assert admission.choose([b, a, a], 2, ("a",), _shape, capacity=32) == []
    assert admission.choose([a, b, a], 2, ("a",), _shape, capacity=32) == [0, 2]  # in flight: joins its group


def test_a_small_new_group_is_cut_with_everything_after_it_never_overtaking_a_priority():
    q = [("a", 5)] * 4 + [("b", 5)] + [("a", 1)] * 4
    # the lone priority-5 "b" would start a group of one: it waits, and so do the priority-1 "a"s after it
    assert admission.choose(q, 8, ("a",), _shape, _prio, capacity=16) == [0, 1, 2, 3]
    assert admission.choose(q, 8, ("a",), _shape, _prio) == [0, 1, 2, 3, 4, 5, 6, 7]


def test_a_held_head_starts_once_enough_of_what_is_in_flight_finished():
    """8 in flight at most (least 2): a lone "z" at the head behind a stream of "a"s in flight waits one
    admission while the room is 1, then starts; nothing is taken past it meanwhile."""
    queue = [("z", 0)] + [("a", 0)] * 20
    assert admission.take(queue, 1, {"a"}, _shape, capacity=8) == [] and len(queue) == 21
    assert admission.take(queue, 2, {"a"}, _shape, capacity=8) == [("z", 0), ("a", 0)]


def test_a_mixed_backlog_drains_without_small_groups():
    """189 images of three shapes (63 each, interleaved) through 32 in flight, every round finishing
    together: with the capacity no round starts a second shape beside the first for a handful of images,
    and the rounds' replays at the splitter's greedy plan are fewer."""
    def rounds(capacity):
        queue, replays, counts = [("a", "b", "c")[i % 3] for i in range(189)], 0, []
        while queue:
            batch = admission.take(queue, 32, set(), lambda s: s, capacity=capacity)
            flying = Counter(batch)
            while len(batch) < 32 and queue:  # later admissions of the same round, as the loop makes them
                more = admission.take(queue, 32 - len(batch), set(flying), lambda s: s, capacity=capacity)
                if not more:
                    break
                batch += more
                flying = Counter(batch)
            counts.append(sorted(flying.values(), reverse=True))
            replays += sum(len(split_batch(n, bucket_sizes(32))) for n in flying.values())
        return counts, replays

    held, with_small = rounds(32), rounds(None)
    assert all(len(c) == 1 for c in held[0])  # every round one shape
    assert any(min(c) < 8 for c in with_small[0] if len(c) > 1)  # rules 1-3 alone start groups of 1-2
    assert held[1] < with_small[1]
