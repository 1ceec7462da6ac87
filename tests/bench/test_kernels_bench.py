"""bench/step_kernels.py and bench/row_kernels.py run on a CPU: the kernel benchmark on a tiny FLUX.1-dev (one
row an image: guidance embedded) with the diffusers loop body as its baseline, and the row-kernel
benchmark's PyTorch systems and plan list."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def test_the_kernel_benchmark_runs_an_mmdit_family_with_its_own_rows(tmp_path):
    from workers.models.tiny_flux import make_tiny_flux

    kernels = _load("step_kernels")
    model_dir = make_tiny_flux(tmp_path / "tiny-flux")
    kernels.main(["--smoke", "--model", str(model_dir), "--images", "1", "2", "--max-batch", "2", "--no-start",
                  "--systems", "diffusers", "breakable", "breakable+fp8", "--out", str(tmp_path / "out")])
    report = json.loads((tmp_path / "out" / "kernels_smoke.json").read_text())
    assert report["errors"] == {} and report["rows_per_image"] == 1
    systems = report["systems"]
    assert set(systems["diffusers"]["ms"]) == set(systems["breakable"]["ms"]) == {"1", "2"}
    assert 0 < systems["breakable+fp8"]["rel_diff"]["2"] < 1e-2  # FP8 changes the step, a little
    text = (tmp_path / "out" / "kernels_smoke.md").read_text()
    assert "one step (guidance embedded)" in text and "| 1 image (1 row) | 2 images (2 rows) |" in text


def test_row_kernel_plans_cover_each_row_and_start_with_the_first_kernel():
    from workers import quant_kernel

    rk = _load("row_kernels")
    for k in (1152, 4608, 15360):
        for gelu in ("none", "tanh"):
            plans = rk.plans(k, gelu)
            assert plans[0] == quant_kernel.whole_plan(k) and len(set(plans)) == len(plans)
            assert {p.kind for p in plans} == {"whole", "split", "chunked"}
            assert any(p.fast for p in plans) == (gelu == "tanh")  # the fast tanh only where there is one
            for p in plans:  # a whole row fits its lanes, a split row its parts; a chunk is no wider than the row
                fits = {"whole": p.block >= k, "split": sum(p.parts) >= k, "chunked": p.block <= k and p.rows == 1}
                assert fits[p.kind] and p.block & (p.block - 1) == 0 and p.warps in (1, 2, 4, 8, 16, 32)


@pytest.mark.parametrize("k, parts", [(1152, (1024, 128)), (4608, (4096, 512)), (6144, (4096, 2048)),
                                      (15360, (8192, 4096, 2048, 1024)), (15000, (8192, 4096, 2048, 1024)),
                                      (100, (128,)), (8, (16,))])
def test_a_split_row_is_few_powers_of_two_covering_it(k, parts):
    from workers import quant_kernel

    got = quant_kernel.split_parts(k)
    assert got == parts and sum(got) >= k and len(got) <= quant_kernel.MAX_PARTS
    assert sum(got) - k < max(128, got[-1])  # lanes past K: less than the last part (at most one granule)


def test_row_kernel_smoke_times_the_pytorch_systems_on_a_cpu(tmp_path):
    rk = _load("row_kernels")
    result = rk.main(["--smoke", "--out", str(tmp_path)])
    assert [r["K"] for r in result["quant"]] == [1152, 4608]
    for r in result["quant"]:
        assert set(r["us"]) == {"copy", "torch"} and all(v > 0 for v in r["us"].values()) and "best" not in r
    (attn,) = result["attention"]
    assert set(attn["us"]) == {"math/d72", "math/d80", "math/d96", "math/d128"} and attn["errors"] == {}
    assert "## Row quantization" in (tmp_path / "row_kernels_smoke.md").read_text()


@pytest.mark.parametrize("d, pad", [(72, 80), (72, 128)])
def test_zero_padded_heads_compute_the_same_attention(d, pad):
    """The padding the attention rows rely on: zero columns in q and k keep every score, zero columns in v
    give zero output columns, with the scale of the real head dim."""
    import math

    import torch
    import torch.nn.functional as F

    rk = _load("row_kernels")
    q, k, v = (torch.randn(2, 9, 3, d) for _ in range(3))
    want = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)))
    got = F.scaled_dot_product_attention(*(rk.padded(t, pad).transpose(1, 2) for t in (q, k, v)), scale=1 / math.sqrt(d))
    torch.testing.assert_close(got[..., :d], want, rtol=1e-5, atol=1e-6)
    assert torch.equal(got[..., d:], torch.zeros_like(got[..., d:]))


@pytest.mark.parametrize("d, parts", [(72, (64, 32)), (128, (128, 0)), (64, (64, 0)), (100, (128, 0)), (40, (64, 0)),
                                      (16, (32, 0))])
def test_fp8_attention_holds_a_head_as_at_most_two_tiles_of_32_or_more(d, parts):
    fa = _load("fp8_attention")
    got = fa.head_parts(d)
    assert got == parts and sum(got) >= d and min(p for p in got if p) >= 32
    assert all(p & (p - 1) == 0 for p in got if p)


def test_fp8_attention_quantizes_each_head_by_its_own_largest_value():
    """quantize_qkv: e4m3 codes scaled per (batch, head), zero-padded past d, v transposed; dequantized they
    give the inputs back within e4m3's step (2^-3 relative), and the largest value of each head maps to 448."""
    import torch

    fa = _load("fp8_attention")
    q, k, v = (torch.randn(2, 3, 10, 72) * torch.tensor([1.0, 10.0, 0.1])[None, :, None, None] for _ in range(3))
    q8, k8, v8t, s = fa.quantize_qkv(q, k, v)
    assert q8.shape == k8.shape == (2, 3, 10, 96) and v8t.shape == (2, 3, 96, 10) and s.shape == (6, 3)
    assert q8.dtype == k8.dtype == v8t.dtype == torch.float8_e4m3fn
    for i, (t, c) in enumerate(((q, q8), (k, k8), (v, v8t.transpose(-1, -2)))):
        scale = s[:, i].view(2, 3, 1, 1)
        assert torch.equal(c[..., 72:].float(), torch.zeros(2, 3, 10, 24))
        back = c[..., :72].float() * scale
        assert ((back - t).abs() <= t.abs() * 2 ** -3 + scale * 2 ** -9).all()
        assert torch.allclose(c[..., :72].float().abs().amax(dim=(-2, -1)), torch.full((2, 3), 448.0))


def test_a_nofa4_system_measures_pytorchs_kernels_only(tmp_path, monkeypatch):
    """``+nofa4`` leaves FlashAttention-4 out of the kernels measured per shape, and each system measures its
    own: the chooser is let measure on the CPU here, with a FlashAttention-4 stand-in offered as a candidate."""
    from workers import sdpa

    kernels = _load("step_kernels")
    offered = []

    def with_fa4(q, k=None):
        offered.append(True)
        return (*sdpa.CANDIDATES, "fa4")

    monkeypatch.setattr(sdpa, "candidates", with_fa4)
    monkeypatch.setattr(sdpa, "_fa4_forward", lambda q, k, v, out, **tiles: out.copy_(
        sdpa.F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)))
    monkeypatch.setattr(sdpa.CHOOSER, "devices", ("cpu",))
    monkeypatch.setattr(sdpa.CHOOSER, "timer", lambda fn: 1.0)
    kernels.main(["--smoke", "--images", "1", "--no-start", "--systems", "breakable", "breakable+nofa4",
                  "--out", str(tmp_path / "out")])
    systems = json.loads((tmp_path / "out" / "kernels_smoke.json").read_text())["systems"]
    assert offered and all("fa4" in line for line in systems["breakable"]["attention_kernels"])
    assert systems["breakable+nofa4"]["attention_kernels"]  # measured again, for this system
    assert not any("fa4" in line for line in systems["breakable+nofa4"]["attention_kernels"])


def test_nonorms_systems_run_pixarts_fp8_blocks_without_the_fused_norms(tmp_path):
    """``+nonorms`` restores diffusers' PixArt blocks that an earlier system's engine patched on the shared
    model, and the two systems compute the same step (float32 on a CPU); ``+rawbreaks`` (the attention breaks
    write their output, the projections quantize it) computes exactly what the quantized breaks do."""
    from workers.models.tiny_pixart import make_tiny_pixart

    kernels = _load("step_kernels")
    model_dir = make_tiny_pixart(tmp_path / "tiny-pixart")
    kernels.main(["--smoke", "--model", str(model_dir), "--images", "1", "--max-batch", "1", "--no-start",
                  "--systems", "breakable", "breakable+fp8", "breakable+fp8+nonorms", "breakable+fp8+rawbreaks",
                  "breakable+fp8+promoted", "--out", str(tmp_path / "out")])
    report = json.loads((tmp_path / "out" / "kernels_smoke.json").read_text())
    assert report["errors"] == {}, report["errors"]
    systems = report["systems"]
    assert systems["breakable+fp8"]["fused_norm_blocks"] == 2 and systems["breakable+fp8+nonorms"]["fused_norm_blocks"] == 0
    assert systems["breakable"]["fused_norm_blocks"] == 0  # bf16 (here float32) linears: nothing to fuse
    fused, plain = (systems[n]["rel_diff"]["1"] for n in ("breakable+fp8", "breakable+fp8+nonorms"))
    assert 0 < fused < 5e-2 and abs(fused - plain) < 1e-3, (fused, plain)
    assert systems["breakable+fp8+rawbreaks"]["max_abs_diff"] == systems["breakable+fp8"]["max_abs_diff"]
    # a CPU's scaled product has one accumulation: the flag reaches it (test_fp8.py) and changes nothing here
    assert systems["breakable+fp8+promoted"]["max_abs_diff"] == systems["breakable+fp8"]["max_abs_diff"]
