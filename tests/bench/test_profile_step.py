"""bench/profile_step.py's grouping of kernel names and its per-step summary (pure functions), and its
smoke run on a CPU."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture(scope="module")
def prof():
    spec = importlib.util.spec_from_file_location("profile_step", BENCH / "profile_step.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["profile_step"] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("name, group", [
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "matrix products"),
    ("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NTT", "matrix products"),
    ("void cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm>", "matrix products"),
    ("flash_fwd_kernel<Flash_fwd_kernel_traits<72, 128, 64, 4>>", "attention"),
    ("fmha_cutlassF_bf16_aligned_64x64_rf_sm80", "attention"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop", "attention"),
    ("triton_per_fused_native_layer_norm_0", "normalisation"),
    ("triton_poi_fused_add_mul_1", "fused / elementwise"),
    ("triton_red_fused__scaled_mm__to_copy_abs_amax_clamp_div_gelu_t_view_8", "fused / elementwise"),
    ("triton_red_fused__scaled_mm__to_copy_abs_add_amax_clamp_div_mul_native_layer_norm_split_t_", "normalisation"),
    ("triton_tem_fused_mm_0", "matrix products"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::GeluCUDAKernelImpl>", "fused / elementwise"),
    ("Memcpy DtoD (Device -> Device)", "copies"),
    ("void at::native::(anonymous namespace)::CatArrayBatchedCopy<float>", "copies"),
    ("void at::native::im2col_kernel<float>", "other"),
])
def test_kernel_names_fall_into_their_groups(prof, name, group):
    assert prof.group_of(name) == group


def test_a_summary_is_per_step_sorted_and_shares_add_up(prof):
    s = prof.summarise({"sm90_gemm": 30.0, "flash_fwd_kernel": 10.0, "triton_poi_fused_add_0": 8.0,
                        "Memcpy DtoD": 2.0}, steps=2)
    assert s["total_ms"] == 25.0 and list(s["groups"]) == ["matrix products", "attention", "fused / elementwise", "copies"]
    assert s["groups"]["matrix products"] == {"ms": 15.0, "share": 0.6}
    assert sum(g["share"] for g in s["groups"].values()) == pytest.approx(1.0)
    assert [t["kernel"] for t in s["top"]][:2] == ["sm90_gemm", "flash_fwd_kernel"] and s["top"][0]["ms"] == 15.0


def test_the_smoke_run_profiles_digits_plain_and_fp8_on_a_cpu(prof, tmp_path):
    prof.main(["--smoke", "--out", str(tmp_path)])
    report = json.loads((tmp_path / "profile_digits_smoke.json").read_text())
    assert set(report["systems"]) == {"plain", "fp8"} and report["errors"] == {}
    for block in report["systems"].values():
        for n in ("1", "4"):
            assert block[n]["total_ms"] > 0 and "matrix products" in block[n]["groups"]
    assert "## fp8 (breakable), 4 images" in (tmp_path / "profile_digits_smoke.md").read_text()


def test_the_heaviest_inductor_kernels_sources_are_found_by_name_and_saved(prof, tmp_path):
    """``--kernel-source N``: each row's N heaviest Inductor kernels (by name, ``triton_``), their defining
    files found in Inductor's cache directory and copied next to the report; library kernels are not
    looked for, and a name no file defines is left out."""
    cache = tmp_path / "cache"
    (cache / "ab").mkdir(parents=True)
    (cache / "ab" / "cab1.py").write_text("import triton\n@triton.jit\ndef triton_red_fused_gelu_8(in_ptr0):\n    pass\n")
    (cache / "cd").mkdir()
    (cache / "cd" / "ccd2.py").write_text("def triton_poi_fused_add_1(in_ptr0):\n    pass\n")
    top = lambda *names: {"top": [{"kernel": n, "group": "x", "ms": 1.0} for n in names]}
    result = {"systems": {"fused+fp8": {"backend": "full",
                                         64: top("nvjet_sm90_qqtst", "triton_red_fused_gelu_8", "triton_missing_3",
                                                 "triton_poi_fused_add_1")}}}
    found = prof.save_kernel_sources(result, 2, tmp_path / "out", cache)
    assert found == ["triton_red_fused_gelu_8"]  # of the two heaviest triton_ kernels, the one a file defines
    assert (tmp_path / "out" / "triton_red_fused_gelu_8.py").read_text().startswith("import triton")
    assert prof.save_kernel_sources(result, 3, tmp_path / "out3", cache) == ["triton_poi_fused_add_1",
                                                                              "triton_red_fused_gelu_8"]


def test_by_shape_lists_each_products_operands_and_calls_per_step(prof, tmp_path):
    """``--by-shape``: the step's matrix products grouped by operator and operand shapes, from the step run
    uncaptured. digits at 4 images: 8 CFG rows, so the conditioning products take 8 rows and the blocks'
    products 8 rows x 16 tokens = 128; each count is whole (calls per step)."""
    prof.main(["--smoke", "--by-shape", "--out", str(tmp_path)])
    report = json.loads((tmp_path / "profile_digits_smoke.json").read_text())
    for name, block in report["systems"].items():
        products = block["4"]["products"]
        assert products and all(r["op"] in {op.removeprefix("aten::") for op in prof.PRODUCT_OPS} for r in products)
        assert [r["ms"] for r in products] == sorted((r["ms"] for r in products), reverse=True)
        first_sizes = {r["shapes"][0 if r["op"] in ("mm", "_scaled_mm") else 1][0] for r in products if r["op"] != "baddbmm"}
        assert {8, 128} <= first_sizes
        assert all(r["calls"] >= 1 and float(r["calls"]).is_integer() for r in products)
    assert "| matrix product (step uncaptured) |" in (tmp_path / "profile_digits_smoke.md").read_text()


def test_product_layouts_record_strides_and_alignment_eager_and_compiled(prof):
    """``product_layouts``: an uncompiled step's products through a dispatch mode, a compiled step's through
    Inductor's extern kernel calls (wrapped for one step, then restored), each with its operands' strides and
    address alignments, keyed as the by-shape rows are."""
    import torch
    from torch._inductor.select_algorithm import extern_kernels

    lin = torch.nn.Linear(16, 32)
    x = torch.randn(8, 16)

    class Runner:
        def __init__(self, fn):
            self.fn = fn

        def _step(self, bucket):
            self.fn(x)

    key = ("addmm", ((32,), (8, 16), (16, 32)))
    eager = prof.product_layouts(Runner(lambda t: torch.nn.functional.gelu(lin(t))), 8, compiled=False)
    assert list(eager) == [key] and len(eager[key]) == 1
    entry = eager[key][0]
    assert entry["strides"][:3] == [[1], [16, 1], [1, 16]] and entry["calls"] == 1
    assert all(a in (1, 2, 4, 8, 16, 32, 64, 128, 256) for a in entry["alignment"])
    compiled = torch.compile(lambda t: torch.nn.functional.gelu(lin(t)))
    with torch.no_grad():
        compiled(x)
    before = extern_kernels.addmm
    found = prof.product_layouts(Runner(compiled), 8, compiled=True)
    assert extern_kernels.addmm is before  # the wrapper is gone
    assert key in found and found[key][0]["calls"] == 1
    assert len(found[key][0]["strides"]) == 4  # Inductor passes its output buffer: out=
