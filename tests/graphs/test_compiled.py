"""graphs.compiled on a CPU (Inductor's C++ backend): one compile serves every bucket, an eager break
stays a call in the compiled code, a step that cannot compile runs uncompiled, and a second process
with the same cache directory hits Inductor's cache. Then the same on the shipped digits model through
the engine.

A CPU cannot capture CUDA graphs, so the breaks are checked with a stand-in for the breakable capture
on this thread (``recording``): what calls reach it is what a real capture would cut segments at. The
GPU file (test_compiled_gpu.py) captures for real. Compiles take seconds each here: marked slow.
"""

import contextlib
import json
import logging
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from workers.config import WorkerConfig
from workers.speed import SpeedConfig
from graphs import GraphRunner, TensorSpec, breakable, eager_on_graph
from graphs.compiled import CompiledStep, opaque_break

pytestmark = pytest.mark.slow

INPUTS = {"x": TensorSpec((16,), torch.float32), "t": TensorSpec((), torch.float32)}
OUTPUTS = {"y": TensorSpec((16,), torch.float32), "m": TensorSpec((), torch.float32)}
TOL = 1e-5  # float32, Inductor's fused kernels against eager's: rounding only (absolute and relative: it grows with
            # the value; the vectorised CPU kernels of one machine differed by 1.05e-5 at |y| ~ 0.35)


@eager_on_graph
def rownorm_into(h, out):
    """A stand-in for attention: a row-wise kernel that a breakable capture runs eagerly."""
    out.copy_(h / (h.norm(dim=-1, keepdim=True) + 1.0))


@eager_on_graph
def rownorm_unregistered_into(h, out):
    """The same, never passed to opaque_break: dynamo traces into it."""
    out.copy_(h / (h.norm(dim=-1, keepdim=True) + 1.0))


def make_step(norm=rownorm_into, seed=0):
    """A row-wise step: gelu MLP around one break."""
    g = torch.Generator().manual_seed(seed)
    w1, b1, w2 = torch.randn(16, 32, generator=g) / 4, torch.randn(32, generator=g), torch.randn(32, 16, generator=g) / 6

    def step(x, t):
        h = F.gelu(x @ w1 + b1 + t[:, None])  # (b, 32)
        out = torch.empty_like(h)
        norm(h, out)                          # (b, 32), a break under a breakable capture
        return {"y": x + out @ w2, "m": out.mean(dim=-1)}  # (b, 16), (b,)

    return step


def make_inputs(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"x": torch.randn(n, 16, generator=g), "t": torch.randn(n, generator=g)}


def assert_close(got, want):
    assert set(got) == set(want)
    for k in want:
        torch.testing.assert_close(got[k], want[k], atol=TOL, rtol=TOL)


@pytest.fixture(scope="module", autouse=True)
def registered():
    opaque_break(rownorm_into)


class Recording:
    """Stands in for breakable's capture on this thread: each marked call reaches break_on, as in a capture."""

    def __init__(self):
        self.breaks = []

    def break_on(self, fn, args, kwargs):
        self.breaks.append(fn)
        return fn(*args, **kwargs)


@contextlib.contextmanager
def recording():
    rec = breakable._local.capture = Recording()
    try:
        yield rec
    finally:
        breakable._local.capture = None


def test_one_compile_at_warmup_serves_every_bucket():
    from torch._dynamo.utils import counters

    plain, graphs0 = make_step(), counters["stats"]["unique_graphs"]
    step = CompiledStep(plain, "mlp")
    runner = GraphRunner(step, INPUTS, OUTPUTS, max_batch=8, device="cpu")
    runner.warmup()  # eager backend: still calls the compiled step once per bucket, largest first
    assert step.graphs == 1 and step.compile_s > 0
    assert step.one_row_graphs == 1  # the one-row bucket: a graph of its own (dynamo specialises size 1)
    for n in range(10):  # 9 = 8 + 1
        live = make_inputs(n, seed=n)
        assert_close(runner.run(**live), plain(**live))
    assert step.stats() == {**step.stats(), "compiled": True, "graphs": 1, "fallback_reason": None}
    assert step.one_row_graphs == 1  # no bucket compiled again when it ran
    assert counters["stats"]["unique_graphs"] - graphs0 == 2  # dynamo's own count agrees: no recompile


def test_a_one_row_call_computes_one_row_in_a_graph_of_its_own():
    """Not two rows with one dropped: the break inside the compiled step sees one row, and the one-row
    graph is compiled once, beside the batch's (which later calls of any other size reuse)."""
    plain = make_step()
    step = CompiledStep(plain, "mlp")
    step(**make_inputs(8))
    rows_seen = []

    class Rows(Recording):
        def break_on(self, fn, args, kwargs):
            rows_seen.append(args[0].shape[0])
            return super().break_on(fn, args, kwargs)

    wants = {n: plain(**make_inputs(n, seed=n)) for n in (1, 3)}
    rec = breakable._local.capture = Rows()
    try:
        for n in (1, 1, 3, 1):
            assert_close(step(**make_inputs(n, seed=n)), wants[n])
    finally:
        breakable._local.capture = None
    assert rows_seen == [1, 1, 3, 1] and len(rec.breaks) == 4
    assert (step.graphs, step.one_row_graphs) == (1, 1)
    assert step.stats()["one_row_graphs"] == 1


def test_a_break_stays_a_call_in_the_compiled_step():
    plain = make_step()
    step = CompiledStep(plain, "mlp")
    live = make_inputs(4)
    step(**live)  # compiles outside any capture, as warm-up does
    with recording() as eager_run:
        want = plain(**live)
    with recording() as compiled_run:
        got = step(**live)
    assert_close(got, want)
    assert eager_run.breaks == compiled_run.breaks == [rownorm_into.__wrapped__]
    assert step.graphs == 1  # the code compiled outside the capture is the code that runs inside it


@eager_on_graph
def rownorm_and_mean_into(h, out, mean):
    """A break with two results (as an attention break writing FP8 codes and their scales)."""
    out.copy_(h / (h.norm(dim=-1, keepdim=True) + 1.0))
    mean.copy_(out.mean(dim=-1))


def test_a_break_writing_two_tensors_is_one_opaque_call_that_writes_both():
    opaque_break(rownorm_and_mean_into, out=("out", "mean"))

    def plain(x, t):
        h = F.gelu(x + t[:, None])                       # (b, 16)
        out, mean = torch.empty_like(h), torch.empty(h.shape[0])
        rownorm_and_mean_into(h, out, mean)
        return {"y": x + 2 * out, "m": mean * 3}

    step = CompiledStep(plain, "two outputs")
    live = make_inputs(4)
    step(**live)
    with recording() as compiled_run:  # under a capture: the op's body on aliases or staged copies
        got = step(**live)
    assert_close(got, plain(**live))
    assert compiled_run.breaks == [rownorm_and_mean_into.__wrapped__]  # still a break, once
    assert step.graphs == 1  # the code compiled outside the capture is the code that ran inside it
    with pytest.raises(ValueError, match="no parameter 'scales'"):
        opaque_break(rownorm_into.__wrapped__, out=("out", "scales"))


def test_an_unregistered_break_recompiles_when_a_capture_starts():
    """Why opaque_break exists: dynamo traces into a marked function, whose code reads the thread's
    capture state; the compiled step holds for "no capture" only, and inside a capture dynamo compiles
    again, tracing the capture's bookkeeping (with a real capture: CUDA graph calls, during capture)."""
    step = CompiledStep(make_step(rownorm_unregistered_into), "mlp")
    live = make_inputs(4)
    step(**live)
    assert step.graphs == 1
    with recording():
        step(**live)
    assert step.graphs == 2


def _graph_break(x, t):
    y = x * 2
    torch._dynamo.graph_break()  # fullgraph=True refuses this
    return {"y": y, "m": t}


def _batch_of_eight_only(x, t):
    scale = 2.0 if x.shape[0] == 8 else 3.0  # specialises the dynamic batch: strict marking refuses
    return {"y": x * scale, "m": t}


@pytest.mark.parametrize("fn", [_graph_break, _batch_of_eight_only])
def test_a_step_that_cannot_compile_runs_uncompiled_with_one_warning(fn, caplog):
    step = CompiledStep(fn, "bad")
    with caplog.at_level(logging.WARNING, logger="graphs.compiled"):
        for n in (8, 4, 8):
            live = make_inputs(n, seed=n)
            assert_close(step(**live), fn(**live))
    assert not step.compiled and step.fallback_reason
    assert sum("running it uncompiled" in r.getMessage() for r in caplog.records) == 1
    assert step.stats()["compiled"] is False


# -- regions: the blocks compiled, the step around them not ------------------------------------------------
class Block(torch.nn.Module):
    """A stand-in for a transformer block: gelu MLP around one break, residual."""

    def __init__(self, g: torch.Generator) -> None:
        super().__init__()
        self.w1 = torch.nn.Parameter(torch.randn(16, 32, generator=g) / 4)
        self.w2 = torch.nn.Parameter(torch.randn(32, 16, generator=g) / 6)

    def forward(self, x, t):
        h = F.gelu(x @ self.w1 + t[:, None])
        out = torch.empty_like(h)
        rownorm_into(h, out)
        return x + out @ self.w2


def make_stack(blocks=6, seed=0, kind=None, strided=True):
    """(the blocks, a step through them); ``kind`` is the block class (Block)."""
    g = torch.Generator().manual_seed(seed)
    stack = torch.nn.ModuleList([(kind or Block)(g) for _ in range(blocks)])

    def step(x, t):
        h = (x.t() * 2).t() if strided else x  # the first block's input: other strides than the blocks' outputs
        for block in stack:
            h = block(h, t)
        return {"y": h, "m": h.mean(dim=-1)}

    return stack, step


def test_regions_compile_one_graph_for_every_block_and_bucket():
    stack, plain = make_stack()
    wants = {n: plain(**make_inputs(n, seed=n)) for n in range(10)}  # before any forward is replaced
    step = CompiledStep(plain, "stack", regions=list(stack))
    assert step.scope == "blocks"
    runner = GraphRunner(step, INPUTS, OUTPUTS, max_batch=8, device="cpu")
    runner.warmup()
    for n in range(10):
        with recording() as run:
            got = runner.run(**make_inputs(n, seed=n))
        assert_close(got, wants[n])
        # each bucket's call passes the six blocks' breaks, kept as calls inside the compiled blocks
        assert set(run.breaks) <= {rownorm_into.__wrapped__} and len(run.breaks) % 6 == 0
        assert (len(run.breaks) > 0) == (n > 0)
    # six blocks, every bucket: one batch-dynamic graph and one for one row, no stride or block recompile
    stats = step.stats()
    assert (stats["graphs"], stats["one_row_graphs"], stats["region_graphs"]) == (1, 1, 2), stats
    assert stats["compiled"] and stats["scope"] == "blocks"


def test_a_region_called_outside_its_step_runs_its_own_forward():
    stack, plain = make_stack(blocks=2)
    step = CompiledStep(plain, "stack", regions=list(stack))
    step(**make_inputs(4))
    made = step.region_graphs
    live = make_inputs(3, seed=3)
    with recording() as run:
        got = stack[0](live["x"], live["t"])  # not inside step: a plain call, nothing compiled
    torch.testing.assert_close(got, Block.forward(stack[0], live["x"], live["t"]), atol=0, rtol=0)
    assert step.region_graphs == made and run.breaks == [rownorm_into.__wrapped__]
    with recording() as run:
        step(**live)
    assert run.breaks == [rownorm_into.__wrapped__] * 2  # the breaks stay calls inside compiled blocks


class SplitBlock(torch.nn.Module):
    """A block that hands on one of two halves of one buffer, as FLUX.1's single blocks do (the text's and the
    image's rows): its output is a view with the buffer's strides."""

    def __init__(self, g: torch.Generator) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(16, 16, generator=g) / 4)

    def forward(self, x, t):
        both = torch.cat([x[:, :2] * 0.5, x + torch.tanh(x @ self.w) * t[:, None, None]], dim=1)
        return both[:, 2:]                                                   # rows 2.. of a wider buffer


def test_one_row_handed_on_as_a_view_of_a_wider_buffer_compiles_once():
    g = torch.Generator().manual_seed(0)
    stack = torch.nn.ModuleList([SplitBlock(g) for _ in range(4)])

    def plain(x, t):
        h = x
        for block in stack:
            h = block(h, t)
        return {"y": h}

    live = {"x": torch.randn(1, 6, 16, generator=g), "t": torch.randn(1, generator=g)}
    step = CompiledStep(plain, "split", regions=list(stack))
    with torch.no_grad():
        want = plain(**live)["y"]
        for _ in range(2):
            torch.testing.assert_close(step(**live)["y"], want)
    assert step.region_graphs == 1, step.stats()  # no second graph for the views' strides


class OtherBlock(Block):
    """Block's arithmetic under a code object no other test compiled (dynamo keeps sizes and strides it saw
    per code object: the runner's static inputs in another test would add guards here)."""

    def forward(self, x, t):
        return Block.forward(self, x, t)


def test_a_second_step_over_the_same_blocks_compiles_its_own_and_both_run():
    """Two latent shapes of one model: two CompiledSteps over the same modules, each with its graphs."""
    stack, plain = make_stack(blocks=2, kind=OtherBlock, strided=False)
    a = CompiledStep(plain, "a", regions=list(stack))
    b = CompiledStep(plain, "b", regions=list(stack))
    live = make_inputs(4, seed=1)
    with torch.no_grad():  # as the engine's steps run (block outputs that need grad would be guarded)
        want = {k: v.clone() for k, v in a(**live).items()}
        assert_close(b(**live), want)
    assert a.region_graphs == 1 and b.region_graphs == 1


class GraphBreakBlock(Block):
    def forward(self, x, t):
        torch._dynamo.graph_break()  # fullgraph=True refuses this
        return super().forward(x, t)


def test_a_region_that_cannot_compile_falls_back_with_its_step(caplog):
    stack, plain = make_stack(blocks=3, kind=GraphBreakBlock)
    live = make_inputs(4, seed=2)
    want = plain(**live)
    step = CompiledStep(plain, "bad", regions=list(stack))
    with caplog.at_level(logging.WARNING, logger="graphs.compiled"):
        assert_close(step(**live), want)
        assert_close(step(**live), want)
    assert not step.compiled and step.fallback_reason
    assert sum("running it uncompiled" in r.getMessage() for r in caplog.records) == 1


def test_a_module_with_a_forward_of_its_own_is_not_a_region():
    stack, plain = make_stack(blocks=1)
    stack[0].forward = lambda x, t: x
    with pytest.raises(ValueError, match="forward of its own"):
        CompiledStep(plain, "stack", regions=list(stack))


CHILD = textwrap.dedent("""
    import json, sys, torch
    sys.path.insert(0, {tests!r})
    from graphs.compiled import CompiledStep, opaque_break, use_cache_dir
    from test_compiled import make_inputs, make_step, rownorm_into
    use_cache_dir(sys.argv[1])
    opaque_break(rownorm_into)
    step = CompiledStep(make_step(), "mlp")
    with torch.no_grad():
        step(**make_inputs(8))
    print(json.dumps(step.stats()))
""")


def test_a_second_process_with_the_same_cache_dir_hits_the_cache(tmp_path):
    script = tmp_path / "child.py"
    script.write_text(CHILD.format(tests=str(Path(__file__).parent)))
    cache = tmp_path / "cache"
    runs = []
    for _ in range(2):
        proc = subprocess.run([sys.executable, str(script), str(cache)], capture_output=True, text=True,
                              timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    cold, warm = runs
    assert cold["graphs"] == warm["graphs"] == 1
    assert (cold["fx_cache_hits"], cold["fx_cache_misses"]) == (0, 1)
    assert (warm["fx_cache_hits"], warm["fx_cache_misses"]) == (1, 0)
    assert (cache / "fxgraph").is_dir()  # Inductor wrote where it was told
    print(f"compile: cold {cold['compile_s']} s, warm {warm['compile_s']} s")


# -- the digits model through the engine ------------------------------------------------------------------
@pytest.fixture(scope="module")
def digits():
    from workers.loading import load_model

    return load_model("digits")


def _req(i):
    from workers.request.spec import ItemSpec

    return ItemSpec(id=f"r{i}", label=i % 10, seed=100 + i, sampler="ddim", steps=4, guidance=2.0)


def test_compiled_digits_engine_matches_uncompiled_with_one_graph_and_the_same_breaks(digits):
    from workers.engine import Engine
    from workers.loading import load_model
    from workers.speed.patches import attention_into

    compiled = Engine(digits, WorkerConfig(backend="breakable", max_batch=8), speed=SpeedConfig(compile="inductor"))
    compiled.warmup()  # the compile happens here, on a CPU too
    assert next(iter(compiled.groups.values())).compiled.graphs == 1
    plain = Engine(load_model("digits"), WorkerConfig(backend="breakable", max_batch=8))
    reqs = [_req(i) for i in range(13)]  # 8 + 4 + 1 per step
    for a, b in zip(compiled.generate(reqs), plain.generate(reqs)):
        assert (a.latents - b.latents).abs().max().item() <= 1e-4 * max(1.0, b.latents.abs().max().item())
    stats = next(iter(compiled.stats()["groups"].values()))["compile"]
    assert stats["compiled"] and stats["graphs"] == 1 and stats["compile_s"] > 0

    live = _step_inputs(digits, 4)  # one bucket of 4: one call of the step
    runs = []
    for engine in (compiled, plain):
        with recording() as run:
            next(iter(engine.groups.values())).runner.run(**live)
        runs.append(run.breaks)
    layers = len(digits.transformer.transformer_blocks)
    assert runs[0] == runs[1] == [attention_into.__wrapped__] * layers
    assert next(iter(compiled.stats()["groups"].values()))["compile"]["graphs"] == 1


def _step_inputs(model, n):
    from samplers import gather_rows, make_plan

    g = torch.Generator().manual_seed(n)
    t, coeffs = gather_rows([make_plan("ddim", 10, model.schedule)] * n, [3] * n)
    x = torch.randn(n, *model.latent_shape, generator=g)
    return dict(x=x, t=t, coeffs=coeffs, labels=torch.randint(0, model.num_classes, (n,), generator=g),
                guidance=torch.full((n,), 2.0), hist=torch.zeros_like(x), noise=torch.zeros_like(x))


def test_unknown_compile_mode_is_refused():
    
    with pytest.raises(ValueError, match="compile must be one of"):
        SpeedConfig(compile="max-autotune")
    with pytest.raises(ValueError, match="compile_scope must be one of"):
        SpeedConfig(compile="inductor", compile_scope="layers")


def test_a_text_engine_compiled_by_blocks_matches_uncompiled_from_one_block_graph(digits):
    """digits-text (PixArt's transformer, 4 blocks) with ``compile_scope="blocks"``: one graph for its
    block class serves every bucket (CFG makes two rows of one image: no one-row graph), the images are
    the uncompiled engine's; DiT keeps its whole step (its blocks read the hoisted modulation by index)."""
    from workers.engine import Engine
    from workers.families import compile_regions
    from workers.loading import load_model
    from workers.request.spec import ItemSpec

    assert compile_regions(digits) == []
    model = load_model("digits-text")
    assert len(compile_regions(model)) == len(model.transformer.transformer_blocks)
    reqs = [ItemSpec(id=f"t{i}", prompt=f"the number {i % 10}", seed=7 + i, sampler="ddim", steps=3, guidance=3.0)
            for i in range(5)]  # 4 + 1
    padded = SpeedConfig(cross_attention="padded")  # its (rows x heads, 1, L) key bias crosses every block
    plain = Engine(model, WorkerConfig(backend="breakable", max_batch=4), speed=padded).generate(reqs)
    alone = Engine(model, WorkerConfig(backend="breakable", max_batch=4), speed=padded).generate(reqs[:1])
    compiled = SpeedConfig(cross_attention="padded", compile="inductor", compile_scope="blocks")
    engine = Engine(model, WorkerConfig(backend="breakable", max_batch=4), speed=compiled)
    engine.warmup()
    for a, b in zip(engine.generate(reqs), plain):
        assert (a.latents - b.latents).abs().max().item() <= 1e-4 * max(1.0, b.latents.abs().max().item())
    stats = next(iter(engine.stats()["groups"].values()))["compile"]
    assert stats["scope"] == "blocks" and stats["compiled"], stats
    assert (stats["graphs"], stats["one_row_graphs"], stats["region_graphs"]) == (1, 0, 1), stats
    again = Engine(model, WorkerConfig(backend="breakable", max_batch=4), speed=padded).generate(reqs[:1])  # plain again
    assert torch.equal(again[0].latents, alone[0].latents)


class PointerRecording(Recording):
    """Also records the addresses of each break's tensor arguments (what a real capture keeps alive)."""

    def __init__(self):
        super().__init__()
        self.pointers = []

    def break_on(self, fn, args, kwargs):
        self.pointers.append(tuple(a.data_ptr() for a in args if isinstance(a, torch.Tensor)))
        return super().break_on(fn, args, kwargs)


def _under_recorded_capture(engine, live: dict):
    """The engine's runner on ``live`` as a breakable capture runs it (breaks recorded with their tensors'
    addresses); (outputs, the recording)."""
    rec = PointerRecording()
    breakable._local.capture = rec
    try:
        return next(iter(engine.groups.values())).runner.run(**live), rec
    finally:
        breakable._local.capture = None


def test_aliased_break_args_are_inductors_own_memory_without_owning_it(digits, monkeypatch):
    """Under capture each break gets non-owning aliases of the compiled step's own buffers, and the step
    still computes what the uncompiled one does."""
    from graphs import compiled as comp
    from workers.engine import Engine
    from workers.loading import load_model

    aliases = []
    real_alias = comp._alias
    monkeypatch.setattr(comp, "_alias", lambda t: aliases.append((t, real_alias(t))) or aliases[-1][1])
    engine = Engine(digits, WorkerConfig(backend="breakable", max_batch=8), speed=SpeedConfig(compile="inductor"))
    engine.warmup()
    plain = Engine(load_model("digits"), WorkerConfig(backend="breakable", max_batch=8))
    live = _step_inputs(digits, 8)
    got, rec = _under_recorded_capture(engine, live)
    assert_close(got, next(iter(plain.groups.values())).runner.run(**live))
    layers = len(digits.transformer.transformer_blocks)
    assert len(rec.pointers) == layers
    assert len(aliases) == 4 * layers  # q, k, v and the output of each layer
    for owner, alias in aliases:
        assert alias.data_ptr() == owner.data_ptr() and alias.stride() == owner.stride()
        assert alias.untyped_storage()._cdata != owner.untyped_storage()._cdata  # a storage of its own ...
        assert torch.equal(alias, owner)  # ... on the same memory
