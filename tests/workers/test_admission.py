"""Shape-aware admission (workers/admission.py): the head first, then the shapes in flight, never past a
higher priority, and nothing starves."""

from __future__ import annotations

import random
from collections import Counter

from graphs.splitter import bucket_sizes, split_batch
from workers import admission
from workers.spec import ItemSpec


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
