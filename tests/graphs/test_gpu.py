"""CUDA graph capture, breaks and the runner on a GPU (skipped without CUDA by tests/conftest.py).

Tiny tensors with the arithmetic in comments. Integer-valued floats keep elementwise results
exact, so most comparisons are bit for bit; where rows are computed at a different GEMM shape
than the reference, the tolerance is stated.
"""

import gc
import logging
import threading

import pytest
import torch

from graphs import BreakableCUDAGraph, GraphRunner, TensorSpec, eager_on_graph

pytestmark = pytest.mark.gpu

DEV = "cuda"
INPUTS = {"x": TensorSpec((16,), torch.float32), "t": TensorSpec((), torch.float32)}
OUTPUTS = {"y": TensorSpec((16,), torch.float32), "m": TensorSpec((), torch.float32)}


def sync():
    torch.cuda.synchronize()


def warm(body):
    """Run body eagerly once on a side stream, as a capture's warm-up would."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        body()
    torch.cuda.current_stream().wait_stream(side)
    sync()


def make_live(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"x": torch.randint(-8, 8, (n, 16), generator=g).float().to(DEV),
            "t": torch.randint(-8, 8, (n,), generator=g).float().to(DEV)}


def make_mlp(seed=0):
    """A small row-wise step: gelu MLP with a row norm marked eager (a stand-in for attention)."""
    g = torch.Generator().manual_seed(seed)
    w1 = (torch.randn(16, 32, generator=g) / 4).to(DEV)
    b1 = torch.randn(32, generator=g).to(DEV)
    w2 = (torch.randn(32, 16, generator=g) / 6).to(DEV)

    @eager_on_graph
    def rownorm(h):  # a break in `breakable`, captured inline in `full`
        return h / (h.norm(dim=-1, keepdim=True) + 1.0)

    def step(x, t):
        h = torch.nn.functional.gelu(x @ w1 + b1 + t[:, None])  # (b, 32)
        h = rownorm(h)  # (b, 32)
        return {"y": x + h @ w2, "m": h.mean(dim=-1)}  # (b, 16), (b,)

    return step


def assert_equal(got, want):
    for name in want:
        assert torch.equal(got[name], want[name]), name


# ----- BreakableCUDAGraph ---------------------------------------------------------------------
def test_break_splits_capture_into_two_segments():
    calls = []

    @eager_on_graph
    def double(t):
        calls.append(1)
        return t * 2  # a new tensor every call

    x = torch.full((4,), 10.0, device=DEV)  # static input
    out = torch.empty(4, device=DEV)  # static output
    warm(lambda: out.copy_(double(x + 1) + 3))
    calls.clear()
    graph = BreakableCUDAGraph()
    with graph.capture():
        out.copy_(double(x + 1) + 3)  # x = 10 -> +1 = 11 -> break: x2 = 22 -> +3 = 25
    assert (graph.num_segments, graph.num_breaks) == (2, 1)
    assert len(calls) == 1  # ran once, eagerly, during capture
    graph.replay()
    sync()
    assert out.tolist() == [25.0] * 4
    x.fill_(0.0)  # 0 -> 1 -> 2 -> 5: a new input changes the output
    graph.replay()
    sync()
    assert out.tolist() == [5.0] * 4
    assert graph.replays == 2 and len(calls) == 3  # the break ran eagerly at each replay


def test_full_capture_runs_marked_functions_inline():
    calls = []

    @eager_on_graph
    def double(t):
        calls.append(1)
        return t * 2

    x = torch.full((4,), 10.0, device=DEV)
    out = torch.empty(4, device=DEV)
    warm(lambda: out.copy_(double(x + 1) + 3))
    calls.clear()
    graph = BreakableCUDAGraph()
    with graph.capture(breakable=False):
        out.copy_(double(x + 1) + 3)  # 10 -> 11 -> 22 -> 25, all captured in one graph
    assert (graph.num_segments, graph.num_breaks) == (1, 0)
    x.fill_(0.0)  # 0 -> 1 -> 2 -> 5
    graph.replay()
    sync()
    assert out.tolist() == [5.0] * 4
    assert len(calls) == 1  # Python ran only at capture: the doubling was captured


def test_break_with_kwargs_and_a_tuple_result():
    @eager_on_graph
    def pair(t, *, scale):
        return t * scale, t + scale

    x = torch.full((3,), 1.0, device=DEV)
    scale = torch.tensor(10.0, device=DEV)  # a break input at a fixed address
    out = torch.empty(3, device=DEV)

    def body():
        a, b = pair(x * 2, scale=scale)
        out.copy_(a - b)

    warm(body)
    graph = BreakableCUDAGraph()
    with graph.capture():
        body()  # x = 1 -> 2 -> (2 * 10, 2 + 10) = (20, 12) -> 8
    graph.replay()
    sync()
    assert out.tolist() == [8.0] * 3
    scale.fill_(3.0)  # 2 -> (6, 5) -> 1: the break reads its recorded inputs afresh
    graph.replay()
    sync()
    assert out.tolist() == [1.0] * 3
    x.fill_(2.0)  # 4 -> (12, 7) -> 5
    graph.replay()
    sync()
    assert out.tolist() == [5.0] * 3


def test_break_that_writes_into_a_given_buffer_and_nested_marked_calls():
    @eager_on_graph
    def inner(t):
        return t + 1

    @eager_on_graph
    def fill_into(src, dst):  # returns None: the result travels in dst, as attention does
        dst.copy_(inner(src) * 10)  # inner() inside a break is a plain call

    x = torch.full((4,), 1.0, device=DEV)
    buf = torch.empty(4, device=DEV)
    out = torch.empty(4, device=DEV)

    def body():
        fill_into(x + 1, buf)
        out.copy_(buf + 1)

    warm(body)
    graph = BreakableCUDAGraph()
    with graph.capture():
        body()  # x = 1 -> 2 -> break: (2 + 1) * 10 = 30 -> 31
    assert (graph.num_segments, graph.num_breaks) == (2, 1)
    x.fill_(4.0)  # 4 -> 5 -> 60 -> 61
    graph.replay()
    sync()
    assert out.tolist() == [61.0] * 4


def _capture_chain(x, out):
    """Capture x -> +1 -> break (x2) -> +3 into out; nothing but the graph keeps the break output."""

    @eager_on_graph
    def double(t):
        return t * 2

    warm(lambda: out.copy_(double(x + 1) + 3))
    graph = BreakableCUDAGraph()
    with graph.capture():
        out.copy_(double(x + 1) + 3)
    return graph


def test_pitfall1_break_output_stays_alive_when_all_other_references_are_gone():
    x = torch.full((4096,), 10.0, device=DEV)
    out = torch.empty(4096, device=DEV)
    graph = _capture_chain(x, out)
    gc.collect()
    torch.cuda.empty_cache()  # a dropped boundary buffer would be released here ...
    garbage = [torch.full((4096,), -7.0, device=DEV) for _ in range(256)]  # ... and reused here
    sync()
    graph.replay()
    sync()
    assert (out == 25).all()  # 10 -> 11 -> 22 -> 25
    x.fill_(0.0)
    graph.replay()
    sync()
    assert (out == 5).all()  # 0 -> 1 -> 2 -> 5
    del garbage


def test_pitfall2_graphs_of_two_buckets_in_one_pool_replay_alternately():
    pool = torch.cuda.graph_pool_handle()
    stream = torch.cuda.Stream()
    x = torch.zeros(8, 16, device=DEV)  # static input, leading rows per bucket
    out = torch.zeros(8, 16, device=DEV)

    @eager_on_graph
    def twice(h):  # reads h, a pool tensor written by the segment before it
        return h * 2

    def body(b):
        h = x[:b] * 3 + 1  # pool intermediate: the break's input, also read by segment 1
        out[:b].copy_(twice(h) + h)  # 2(3x + 1) + (3x + 1) = 9x + 3

    graphs = {}
    for b in (8, 4):  # largest first, like the runner; the 4-capture may reuse 8's freed blocks
        warm(lambda: body(b))
        graphs[b] = BreakableCUDAGraph()
        with graphs[b].capture(pool=pool, stream=stream):
            body(b)
    gc.collect()
    for i in range(6):
        b = (8, 4)[i % 2]
        vals = torch.randint(-5, 5, (b, 16), device=DEV).float()
        x[:b].copy_(vals)
        out.zero_()
        graphs[b].replay()
        sync()
        assert torch.equal(out[:b], 9 * vals + 3)


def test_pitfall3_fresh_break_results_reach_the_next_segment():
    @eager_on_graph
    def fresh(t):
        r = torch.empty_like(t)  # a new allocation at every call, never the boundary buffer
        return r.copy_(t * 2)

    x = torch.zeros(64, device=DEV)
    out = torch.empty(64, device=DEV)
    warm(lambda: out.copy_(fresh(x + 1) + 3))
    graph = BreakableCUDAGraph()
    with graph.capture():
        out.copy_(fresh(x + 1) + 3)  # 2(x + 1) + 3 = 2x + 5
    for v in (1.0, -4.0, 7.0):
        junk = [torch.full((64,), 99.0, device=DEV) for _ in range(8)]
        x.fill_(v)
        graph.replay()
        sync()
        assert (out == 2 * v + 5).all()
        del junk


@pytest.mark.filterwarnings("ignore:The CUDA Graph is empty")
def test_break_result_of_another_shape_at_replay_is_an_error():
    rows = [4]

    @eager_on_graph
    def head(t):
        return t[: rows[0]] * 1

    x = torch.ones(8, device=DEV)
    out = torch.empty(4, device=DEV)
    warm(lambda: out.copy_(head(x)))
    graph = BreakableCUDAGraph()
    with graph.capture():
        out.copy_(head(x))  # segment 0 is empty (the body starts with a break): that is fine
    graph.replay()
    sync()
    assert out.tolist() == [1.0] * 4
    rows[0] = 2  # a Python value changes: the boundary buffer cannot follow
    with pytest.raises(RuntimeError, match="fixed-shape boundary buffer"):
        graph.replay()


def test_failed_capture_is_cleaned_up_and_reraised():
    x = torch.ones(4, device=DEV)
    out = torch.empty(4, device=DEV)
    stream = torch.cuda.Stream()
    warm(lambda: out.copy_(x * 2))
    graph = BreakableCUDAGraph()
    with pytest.raises(RuntimeError):
        with graph.capture(stream=stream):
            out.copy_(x * 2)
            x.sum().item()  # a host sync invalidates the capture
    assert graph.num_segments == 0 and graph.pool_poisoned
    with pytest.raises(RuntimeError, match="successful capture"):
        graph.replay()
    with torch.cuda.stream(stream):
        assert not torch.cuda.is_current_stream_capturing()
    again = BreakableCUDAGraph()  # a fresh pool on the same stream captures fine
    with again.capture(stream=stream):
        out.copy_(x * 3)  # 1 -> 3
    again.replay()
    sync()
    assert out.tolist() == [3.0] * 4
    python_error = BreakableCUDAGraph()
    with pytest.raises(ValueError, match="not a CUDA error"):
        with python_error.capture(stream=stream):
            out.copy_(x * 4)
            raise ValueError("not a CUDA error")
    assert not python_error.pool_poisoned  # the capture itself ended cleanly


def test_capture_state_is_thread_local():
    @eager_on_graph
    def plus_one(t):
        return t + 1

    x = torch.full((4,), 1.0, device=DEV)
    y = torch.full((4,), 5.0, device=DEV)
    out = torch.empty(4, device=DEV)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        plus_one(y)
    sync()
    seen = {}

    def other_thread():  # no capture on this thread: a plain call, allowed in thread_local mode
        with torch.cuda.stream(side):
            seen["v"] = plus_one(y).tolist()

    warm(lambda: out.copy_(x * 2 + 1))
    graph = BreakableCUDAGraph()
    with graph.capture():
        h = x * 2
        worker = threading.Thread(target=other_thread)
        worker.start()
        worker.join()
        out.copy_(h + 1)  # 1 -> 2 -> 3
    assert (graph.num_segments, graph.num_breaks) == (1, 0)
    assert seen["v"] == [6.0] * 4
    graph.replay()
    sync()
    assert out.tolist() == [3.0] * 4


# ----- GraphRunner ----------------------------------------------------------------------------
@pytest.mark.parametrize("backend, segments, breaks", [("full", 1, 0), ("breakable", 2, 1)])
def test_every_bucket_replay_matches_eager(backend, segments, breaks):
    step = make_mlp()
    runner = GraphRunner(step, INPUTS, OUTPUTS, max_batch=8, backend=backend, device=DEV)
    stats = runner.warmup()
    assert stats["totals"]["captures"] == 4 and stats["totals"]["capture_failures"] == 0
    assert sorted(stats["replay_ms"]) == [1, 2, 4, 8]
    assert all(ms > 0 for ms in stats["replay_ms"].values())
    for b in runner.buckets:
        assert (stats["buckets"][b]["segments"], stats["buckets"][b]["breaks"]) == (segments, breaks)
    runner.replay_ms = {}  # greedy plans: n == b is exactly one replay of bucket b
    with torch.no_grad():
        for b in runner.buckets:
            live = make_live(b, seed=b)
            assert_equal(runner.run(**live), step(**live))  # same shapes, same kernels: bit for bit
        live = make_live(13, seed=13)  # 13 = 8 + 4 + 1: rows computed at other GEMM shapes
        got, want = runner.run(**live), step(**live)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-5)
    stats = runner.stats()
    assert [stats["buckets"][b]["replays"] for b in (1, 2, 4, 8)] == [2, 1, 2, 2]
    assert stats["totals"]["eager_fallbacks"] == 0


def test_bucket_whose_capture_fails_is_served_eagerly_and_counted(caplog):
    def step(x, t):
        scale = 1.0
        if x.shape[0] == 4:  # only bucket 4 syncs with the host: illegal while capturing
            scale = float(x.abs().max().item() >= 0)  # always 1.0
        return {"y": x * 2 * scale + 1, "m": t * 3}

    runner = GraphRunner(step, INPUTS, OUTPUTS, max_batch=8, backend="breakable", device=DEV)
    with caplog.at_level(logging.WARNING, logger="graphs.runner"):
        stats = runner.warmup()
    b4 = stats["buckets"][4]
    assert (b4["captures"], b4["capture_failures"]) == (0, 1) and b4["fallback_reason"]
    assert "bucket 4" in caplog.text
    # 8 was captured before the failure, 2 and 1 after it: the stream and pool still work.
    assert [stats["buckets"][b]["captures"] for b in (1, 2, 8)] == [1, 1, 1]
    runner.replay_ms = {}
    for n in (4, 7, 8, 13):  # [4], [4, 2, 1], [8], [8, 4, 1]
        live = make_live(n, seed=n)
        assert_equal(runner.run(**live), step(**live))
    stats = runner.stats()["buckets"]
    assert stats[4]["eager_fallbacks"] == 3 and stats[4]["replays"] == 0
    assert (stats[8]["replays"], stats[2]["replays"], stats[1]["replays"]) == (2, 1, 2)


def test_padding_rows_do_not_change_real_rows():
    step = make_mlp()
    runner = GraphRunner(step, INPUTS, OUTPUTS, max_batch=8, backend="breakable", device=DEV)
    runner.warmup()
    runner.replay_ms = {1: 10.0, 2: 10.0, 4: 10.0, 8: 1.0}  # every n <= 8 is one 8-replay
    assert runner.plan(3) == (8,)
    runner.run(x=torch.full((8, 16), float("nan"), device=DEV), t=torch.full((8,), 1e30, device=DEV))
    live = make_live(3, seed=3)
    got = runner.run(**live)  # rows 3..7 of the static input still hold NaN and 1e30
    padded = {k: torch.cat([v, torch.zeros((5, *v.shape[1:]), device=DEV)]) for k, v in live.items()}
    with torch.no_grad():
        want = {k: v[:3] for k, v in step(**padded).items()}  # the same 8-row shape: exact
    assert_equal(got, want)
    assert not got["y"].isnan().any()


def test_two_threads_run_one_runner_concurrently():
    @eager_on_graph
    def shift(h):
        return h + 1

    def step(x, t):
        return {"y": shift(x * 3) * 2, "m": t - 1}  # y = (3x + 1) * 2 = 6x + 2

    runner = GraphRunner(step, INPUTS, OUTPUTS, max_batch=8, backend="breakable", device=DEV)
    runner.warmup()
    errors, ns = [], []

    def worker(seed, own_stream):
        stream = torch.cuda.Stream() if own_stream else torch.cuda.current_stream()
        with torch.cuda.stream(stream):
            for i in range(40):
                n = 1 + (seed * 7 + i) % 20
                ns.append(n)
                live = make_live(n, seed=seed * 1000 + i)
                out = runner.run(**live)
                if not (torch.equal(out["y"], 6 * live["x"] + 2)
                        and torch.equal(out["m"], live["t"] - 1)):
                    errors.append((seed, i, n))

    threads = [threading.Thread(target=worker, args=(1, False)),
               threading.Thread(target=worker, args=(2, True))]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors
    totals = runner.stats()["totals"]
    assert totals["replays"] == sum(len(runner.plan(n)) for n in ns)
    assert totals["eager_fallbacks"] == 0


def test_shared_pool_takes_less_memory_than_one_pool_per_bucket():
    step = make_mlp()
    shared = GraphRunner(step, INPUTS, OUTPUTS, max_batch=8, backend="full", device=DEV).warmup()
    separate = GraphRunner(step, INPUTS, OUTPUTS, max_batch=8, backend="full", device=DEV,
                           separate_pools=True).warmup()
    assert 0 < shared["pool_reserved_bytes"] < separate["pool_reserved_bytes"]
    assert shared["arena_bytes"] == separate["arena_bytes"] > 0


def test_eager_backend_and_run_before_warmup_use_the_same_buffers(caplog):
    step = make_mlp()
    live = make_live(4, seed=4)  # one chunk of bucket 4: the same shapes as the plain call
    with torch.no_grad():
        want = step(**live)
    eager = GraphRunner(step, INPUTS, OUTPUTS, max_batch=8, backend="eager", device=DEV)
    eager.warmup()
    assert eager.plan(4) == (4,)
    assert_equal(eager.run(**live), want)  # the same ops at the same shapes: exact
    assert eager.stats()["totals"]["captures"] == 0
    cold = GraphRunner(step, INPUTS, OUTPUTS, max_batch=8, backend="breakable", device=DEV)
    with caplog.at_level(logging.WARNING, logger="graphs.runner"):
        assert_equal(cold.run(**live), want)
    assert "before warmup" in caplog.text
    assert cold.stats()["totals"]["eager_fallbacks"] == 1
