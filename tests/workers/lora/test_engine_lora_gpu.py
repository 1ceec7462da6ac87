"""Per-request LoRA inside the graphs (GPU): tiny FLUX.1 and SD3 on CUDA, float32.

The adapters target every linear of the transformer: the norms' modulation linears (which the graph backends hoist
into one product, read from each request's table), q, k and v (fused into one product where a rewrite fuses them),
the step's embedding (which the graph backends compute once per request for the modulation table, with the
request's adapters) and the rest.

- ``full`` and ``breakable`` graphs (and ``fast``: the step compiled inside them) give rows with adapters A, B,
  A + B and none, mixed in each bucket, the latents eager gives (1e-5 of the largest value uncompiled, 1e-4
  compiled), with no capture failure and no fallback; their bank holds every linear;
- ``fastest``'s rewrites (FP8 linears, FLUX.1's q, k and v fused into FP8 products of the norms' codes) under
  ``full`` graphs, compiled or not: each row's adapters change it as they change the eager FP8 engine's row (the
  effect, the row minus the same request without adapters, within 10% of eager's: the fused kernels round a norm
  once where eager rounds after each operation, so a code may differ by one e4m3 step; on a CPU the same
  comparison reads 0.6%. Not yet run on a GPU);
- the Triton kernel of the rows' terms (``lora_kernel = "triton"``) replays what eager's gathered products give;
- loading an adapter into a slot between steps (on the side stream) changes no running row and makes no capture
  and no compile: the groups' capture and compile counters are what they were before it.
"""

from __future__ import annotations

import pytest
import torch

from workers.config import WorkerConfig
from workers.engine import Engine
from workers.loading import load_model

from ..families.gpu_stats import fallbacks, pooled
from .test_engine_lora import _make, adapter_file, req

pytestmark = pytest.mark.gpu  # skipped without CUDA (tests/conftest.py)

LORA = dict(max_batch=4, lora_slots=2, lora_max_rank=4, lora_per_request=2)
ROWS = [[("a", 0.8)], [("b", -0.6)], [("a", 0.5), ("b", 1.2)], [], [("a", 1.0)], [], [("b", 0.3)]]


@pytest.fixture(scope="module", params=["flux", "sd3"])
def model_dir(request, tmp_path_factory):
    return _make(request.param, tmp_path_factory.mktemp(request.param))


def _engine(model_dir, backend: str, lora_kernel: str = "bmm", **speed):
    from workers.speed import SpeedConfig

    engine = Engine(load_model(model_dir, device="cuda", dtype=torch.float32),
                    WorkerConfig(backend=backend, lora_kernel=lora_kernel, **LORA),
                    **({"speed": SpeedConfig(**speed)} if speed else {}))
    engine.warmup()
    transformer = engine.models[next(iter(engine.models))].transformer
    for name, seed in (("a", 1), ("b", 2)):
        engine.add_lora(name, adapter_file(transformer, seed, every=1, skip=())[0])
    return engine


def _left_out(engine) -> list[str]:
    """The linears of the engine's model that its adapter bank does not hold."""
    from workers.lora.validate import linear_shapes

    model = engine.models[next(iter(engine.models))]
    return [n for n in linear_shapes(model.transformer) if n not in engine.lora.banks[model.name].targets]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("backend, compile_mode, tol", [("full", "off", 1e-5), ("breakable", "off", 1e-5),
                                                        ("full", "inductor", 1e-4)])
def test_rows_with_adapters_replay_what_eager_computes(model_dir, backend, compile_mode, tol):
    graphs = _engine(model_dir, backend, **({"compile": compile_mode} if compile_mode != "off" else {}))
    eager = _engine(model_dir, "eager")
    specs = [req(i, r) for i, r in enumerate(ROWS)] + [req(3, [("a", 1.0)], id="r3-with-a")]  # row 3, adapted
    got, want = graphs.generate(specs), eager.generate(specs)
    for g, w in zip(got, want):
        assert _rel(g.latents, w.latents) <= tol, g.request.id
    assert _rel(got[-1].latents, got[3].latents) > 1e-3  # the adapter changes the image
    stats = pooled(graphs.stats()["groups"].values())
    assert fallbacks(stats) == 0 and sum(s["replays"] for s in stats["buckets"].values()) > 0
    assert _left_out(graphs) == [] and _left_out(eager) == []  # the hoisted, fused and table's linears reached


@pytest.mark.parametrize("compile_mode", ["off", "inductor"])
def test_the_triton_kernel_replays_what_the_gathered_products_compute(model_dir, compile_mode):
    """``lora_kernel = "triton"`` (``workers.kernels.lora``: adapters read in place, empty places skipped) in full
    graphs, compiled or not, against the eager engine's gathered products: the same rows within float32's rounding."""
    graphs = _engine(model_dir, "full", "triton", **({"compile": compile_mode} if compile_mode != "off" else {}))
    eager = _engine(model_dir, "eager")
    specs = [req(i, r) for i, r in enumerate(ROWS)]
    for g, w in zip(graphs.generate(specs), eager.generate(specs)):
        assert _rel(g.latents, w.latents) <= 1e-4, g.request.id
    assert fallbacks(pooled(graphs.stats()["groups"].values())) == 0


@pytest.mark.parametrize("compile_mode", ["off", "inductor"])
def test_fp8_rows_get_their_adapters_on_the_fused_linears(model_dir, compile_mode):
    from workers.families.flux import fast
    from workers.speed.fp8 import unsupported_reason

    if (why := unsupported_reason("cuda")) is not None:
        pytest.skip(why)
    speed = {"precision": "fp8", **({"compile": compile_mode} if compile_mode != "off" else {})}
    graphs, eager = _engine(model_dir, "full", **speed), _engine(model_dir, "eager", precision="fp8")
    model = graphs.models[next(iter(graphs.models))]
    if model.card.family == "flux":
        assert fast.fused_blocks(model.transformer) > 0
    assert _left_out(graphs) == []
    specs, bare = [req(i, r) for i, r in enumerate(ROWS)], [req(i) for i in range(len(ROWS))]
    got, got_bare = graphs.generate(specs), graphs.generate(bare)
    want, want_bare = eager.generate(specs), eager.generate(bare)
    for i, row in enumerate(ROWS):
        if not row:
            continue
        effect = want[i].latents - want_bare[i].latents
        assert effect.norm() > 1e-2 * want_bare[i].latents.norm(), i  # the adapters change the row
        assert (got[i].latents - got_bare[i].latents - effect).norm() <= 0.1 * effect.norm(), i
    assert fallbacks(pooled(graphs.stats()["groups"].values())) == 0


def test_loading_between_steps_changes_no_running_row_and_captures_nothing(model_dir):
    engine = _engine(model_dir, "full", compile="inductor")
    transformer = engine.models[next(iter(engine.models))].transformer
    # registered, not resident: two slots, a and b in them
    engine.add_lora("c", adapter_file(transformer, 3, every=1, skip=())[0])
    want = engine.generate([req(0, [("a", 0.7)]), req(1)])
    before = {k: (sum(s["captures"] for s in g["buckets"].values()), g.get("compile", {}).get("region_graphs"))
              for k, g in engine.stats()["groups"].items()}
    engine.add_many([req(0, [("a", 0.7)]), req(1)])
    engine.step()
    engine.add(req(2, [("c", 1.0)]))  # loaded into b's slot between steps, beside the running rows
    done = {}
    while engine.num_active:
        done |= {r.request.id: r for r in engine.step()}
    assert engine.loras()["c"]["resident"] is True
    for i in (0, 1):
        assert _rel(done[f"r{i}"].latents, want[i].latents) <= 1e-5
    after = {k: (sum(s["captures"] for s in g["buckets"].values()), g.get("compile", {}).get("region_graphs"))
             for k, g in engine.stats()["groups"].items()}
    assert after == before
