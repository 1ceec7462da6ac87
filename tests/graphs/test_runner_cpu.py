"""GraphRunner in eager mode on a CPU, plus the CPU-side behaviour of breakable graphs."""

import logging
import threading

import pytest
import torch

from graphs import BreakableCUDAGraph, GraphRunner, TensorSpec, eager_on_graph

MAX_BATCH = 4
INPUTS = {"x": TensorSpec((3,), torch.float32), "t": TensorSpec((), torch.float32)}
OUTPUTS = {"y": TensorSpec((3,), torch.float32), "s": TensorSpec((), torch.float32)}


def rowwise(x, t):
    """Row-independent: y = 2x + t, s = sum(x). Integer-valued floats keep every result exact."""
    return {"y": x * 2 + t[:, None], "s": x.sum(dim=-1)}


def make_inputs(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"x": torch.randint(-50, 50, (n, 3), generator=g).float(),
            "t": torch.randint(-50, 50, (n,), generator=g).float()}


def make_runner(**kwargs):
    runner = GraphRunner(rowwise, INPUTS, OUTPUTS, max_batch=MAX_BATCH, device="cpu", **kwargs)
    runner.warmup()
    return runner


def assert_same(got, want):
    assert set(got) == set(want)
    for name in want:
        assert got[name].shape == want[name].shape
        assert torch.equal(got[name], want[name]), name


def test_every_n_up_to_twice_max_batch_matches_the_plain_call():
    runner = make_runner()
    chunks = {b: 0 for b in runner.buckets}
    for n in range(2 * MAX_BATCH + 4):
        live = make_inputs(n, seed=n)
        assert_same(runner.run(**live), rowwise(**live))
        for b in runner.plan(n):
            chunks[b] += 1
    stats = runner.stats()
    assert stats["backend"] == "eager" and stats["device"] == "cpu"
    for b, count in chunks.items():
        assert stats["buckets"][b]["eager_fallbacks"] == count
        assert stats["buckets"][b]["replays"] == stats["buckets"][b]["captures"] == 0
    assert stats["totals"]["eager_fallbacks"] == sum(chunks.values())
    assert stats["arena_bytes"] == runner.arena.nbytes > 0
    assert stats["replay_ms"] == {}  # eager: greedy plans
    assert runner.plan(7) == (4, 2, 1)


def test_cpu_runner_falls_back_to_eager_with_one_log_line(caplog):
    with caplog.at_level(logging.INFO, logger="graphs.runner"):
        runner = GraphRunner(rowwise, INPUTS, OUTPUTS, max_batch=4, backend="full", device="cpu")
    assert runner.backend == "eager" and runner.requested_backend == "full"
    assert sum("runs as 'eager'" in r.getMessage() for r in caplog.records) == 1


def test_padding_rows_do_not_change_real_rows():
    runner = make_runner()
    runner.replay_ms = {1: 10.0, 2: 10.0, 4: 1.0}  # one 4-replay is cheapest for any n <= 4
    assert runner.plan(3) == (4,) and runner.plan(5) == (4, 4)
    garbage = {"x": torch.full((4, 3), float("nan")), "t": torch.full((4,), 1e30)}
    runner.run(**garbage)  # the static buffers now hold NaN and 1e30 in every row
    for n in (1, 3, 5):
        live = make_inputs(n, seed=10 + n)
        assert_same(runner.run(**live), rowwise(**live))
    assert runner.stats()["buckets"][4]["eager_fallbacks"] == 1 + 1 + 1 + 2


def test_an_input_with_a_pad_value_sets_the_padding_rows_to_it():
    seen = []

    def step(x, t, slot):
        seen.append(slot.clone())
        return rowwise(x, t)

    runner = GraphRunner(step, {**INPUTS, "slot": TensorSpec((2,), torch.int64, pad=0)}, OUTPUTS, max_batch=4,
                         device="cpu")
    runner.replay_ms = {1: 10.0, 2: 10.0, 4: 1.0}
    runner.run(**make_inputs(4), slot=torch.full((4, 2), 7))
    live = make_inputs(3, seed=3)
    assert_same(runner.run(**live, slot=torch.full((3, 2), 5)), rowwise(**live))
    assert seen[-1].tolist() == [[5, 5]] * 3 + [[0, 0]]  # the padding row: the pad, not the stale 7s
    runner.run(**make_inputs(4), slot=torch.full((4, 2), 6))
    assert seen[-1].tolist() == [[6, 6]] * 4


def test_results_are_fresh_tensors_not_static_views():
    runner = make_runner()
    first_in = make_inputs(4, seed=1)
    first = runner.run(**first_in)
    runner.run(**make_inputs(4, seed=2))  # would overwrite a static view (pitfall 4)
    assert_same(first, rowwise(**first_in))
    assert first["y"].data_ptr() != runner.arena.tensor("out:y").data_ptr()


def test_example_inputs_are_tiled_into_the_static_buffers():
    runner = GraphRunner(rowwise, INPUTS, OUTPUTS, max_batch=4, device="cpu")
    runner.warmup(example={"x": torch.tensor([[1.0, 2, 3], [4, 5, 6]]), "t": torch.tensor([7.0, 8])})
    assert runner.arena.tensor("in:t").tolist() == [7.0, 8.0, 7.0, 8.0]
    assert runner.arena.tensor("in:x")[3].tolist() == [4.0, 5.0, 6.0]


def test_two_threads_share_one_runner():
    runner = make_runner()
    errors = []

    def worker(seed):
        try:
            for i in range(30):
                live = make_inputs(1 + (seed + i) % 9, seed=seed * 100 + i)
                assert_same(runner.run(**live), rowwise(**live))
        except Exception as exc:  # surfaced in the main thread below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(s,)) for s in (1, 2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors


@pytest.mark.parametrize(
    "live, match",
    [({"x": torch.zeros(2, 3)}, "inputs must be exactly"),
     ({"x": torch.zeros(2, 4), "t": torch.zeros(2)}, "input 'x' must have shape"),
     ({"x": torch.zeros(2, 3), "t": torch.zeros(2, 1)}, "input 't' must have shape"),
     ({"x": torch.zeros(2, 3, dtype=torch.float64), "t": torch.zeros(2)}, "must be torch.float32"),
     ({"x": torch.zeros(2, 3), "t": torch.zeros(3)}, "disagree on n")],
)
def test_bad_live_inputs(live, match):
    with pytest.raises(ValueError, match=match):
        make_runner().run(**live)


def test_bad_fn_outputs():
    runner = GraphRunner(lambda x, t: {"y": x}, INPUTS, OUTPUTS, max_batch=4, device="cpu")
    with pytest.raises(ValueError, match="keys \\['s', 'y'\\]"):
        runner.run(**make_inputs(2))
    runner = GraphRunner(lambda x, t: {"y": x[:, :2], "s": t}, INPUTS, OUTPUTS, max_batch=4,
                         device="cpu")
    with pytest.raises(ValueError, match="'y' must have shape \\(2, 3\\)"):
        runner.run(**make_inputs(2))


def test_bad_construction_and_warmup_twice():
    with pytest.raises(ValueError, match="backend must be one of"):
        GraphRunner(rowwise, INPUTS, OUTPUTS, backend="cudagraph", device="cpu")
    with pytest.raises(ValueError, match="power of two"):
        GraphRunner(rowwise, INPUTS, OUTPUTS, max_batch=48, device="cpu")
    with pytest.raises(ValueError, match="non-empty dict"):
        GraphRunner(rowwise, {}, OUTPUTS, device="cpu")
    with pytest.raises(ValueError, match="must be TensorSpec"):
        GraphRunner(rowwise, {"x": (3,)}, OUTPUTS, device="cpu")
    runner = make_runner()
    with pytest.raises(RuntimeError, match="already ran"):
        runner.warmup()
    with pytest.raises(ValueError, match="no timing for buckets"):
        runner.replay_ms = {1: 1.0}


def test_zero_rows_give_empty_outputs():
    out = make_runner().run(**make_inputs(0))
    assert out["y"].shape == (0, 3) and out["s"].shape == (0,)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the errors without CUDA")
def test_capture_without_cuda_raises_a_clear_error():
    graph = BreakableCUDAGraph()
    with pytest.raises(RuntimeError, match="needs CUDA"):
        with graph.capture():
            pass
    with pytest.raises(RuntimeError, match="needs CUDA"):
        GraphRunner(rowwise, INPUTS, OUTPUTS, device="cuda")


def test_replay_before_capture_raises():
    with pytest.raises(RuntimeError, match="successful capture"):
        BreakableCUDAGraph().replay()


def test_eager_on_graph_without_capture_is_a_plain_call():
    calls = []

    @eager_on_graph
    def double(t, *, k=2):
        """Doubles."""
        calls.append(1)
        return t * k

    assert torch.equal(double(torch.tensor([1.0, 2.0]), k=3), torch.tensor([3.0, 6.0]))
    assert double.__name__ == "double" and double.__doc__ == "Doubles."
    assert len(calls) == 1
