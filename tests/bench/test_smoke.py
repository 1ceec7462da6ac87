"""Each benchmark script's --smoke mode on a CPU, at its smallest: the harness's report comes out."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import kernel_times  # noqa: E402
import quality  # noqa: E402
import step  # noqa: E402
import workload  # noqa: E402


def test_step_times_diffusers_and_the_default_engine_on_a_tiny_dit(tmp_path):
    assert step.main(["--smoke", "--text-encoder-device", "cpu", "--out", str(tmp_path)]) == 0
    r = json.loads((tmp_path / "step_tiny-dit.json").read_text())
    assert set(r["systems"]) == {"diffusers", "default"} and r["systems"]["default"]["ms"]["2"]["n"] == 3
    config = r["systems"]["default"]["config"]
    assert config["backend"] == "graphs" and config["text_encoder_device"] == "cpu"  # the worker's field, as given
    # each count's work, once, and the device's measured peak: the step as TFLOP/s against it
    assert 0 < r["flops"]["1"] < r["flops"]["2"] and r["peak"]["tflops"] > 0
    assert "Achieved TFLOP/s" in (tmp_path / "step_tiny-dit.md").read_text()


def test_workload_runs_one_image_end_to_end_and_a_tiny_mix(tmp_path):
    argv = ["--smoke", "--sections", "e2e", "mixed", "--systems", "default", "--loads", "--out", str(tmp_path)]
    assert workload.main(argv) == 0
    r = json.loads((tmp_path / "workload_tiny-dit.json").read_text())
    assert list(r["e2e"]) == ["16x16"]  # no --sizes: the card's native size only
    assert r["e2e"]["16x16"]["default"]["n"] == 2 and r["mixed"]["default"]["backlog"]["unfinished"] == 0
    assert "One image end to end at 16x16" in (tmp_path / "workload_tiny-dit.md").read_text()


def test_workload_e2e_makes_each_size_asked_with_the_text_encoders_on_the_host(tmp_path):
    argv = ["--smoke", "--family", "flux", "--sections", "e2e", "--sizes", "96x64", "64x64",
            "--text-encoder-device", "cpu", "--out", str(tmp_path)]
    assert workload.main(argv) == 0
    r = json.loads((tmp_path / "workload_tiny-flux.json").read_text())
    assert set(r["e2e"]) == {"96x64", "64x64"}  # one row set per size, ours and diffusers' pipeline at it
    for rows in r["e2e"].values():
        ours, theirs = rows["default"], rows["diffusers"]
        assert ours["n"] == theirs["n"] == 2 and ours["text_encoder"] == theirs["text_encoder"] == "cpu"
        assert ours["config"]["text_encoder_device"] == "cpu"  # the option reached the engine's WorkerConfig
        assert 0 < ours["encode_ms"]["median"] <= ours["median"] and theirs["encode_ms"]["n"] == 2
    md = (tmp_path / "workload_tiny-flux.md").read_text()
    assert "One image end to end at 96x64" in md and "| encode share |" in md


def test_workload_refuses_host_text_encoders_for_the_lora_sections():
    with pytest.raises(SystemExit):
        workload.parse(["--sections", "lora-step", "--text-encoder-device", "cpu"])
    [(_, args)] = workload.parse(["--sections", "e2e"])
    assert args.text_encoder_device == "gpu" and args.sizes == []


def test_kernels_times_each_section_on_small_shapes(tmp_path):
    kernel_times.main(["--smoke", "--sections", "quant", "gelu", "lora", "--out", str(tmp_path)])
    r = json.loads((tmp_path / "kernels.json").read_text())
    assert len(r["quant"]) == 2 and set(r["gelu"][0]["us"]) == {"separate", "epilogue"}
    assert {"linear", "y += z", "bmm"} <= set(r["lora"][0]["us"])  # no Triton on a CPU: no tile candidates


def test_quality_compares_fastest_with_default(tmp_path):
    assert quality.main(["--smoke", "--models", "digits", "--images", "1", "--steps", "2", "--out", str(tmp_path)]) == 0
    q = json.loads((tmp_path / "quality.json").read_text())["models"]["digits"]["presets"]["fastest"]
    assert q["settings"]["precision"] == "fp8" and q["median_psnr_db"] > 20


def test_the_autoscaling_simulation_replays_a_trace_through_the_policy_beside_a_fixed_fleet(tmp_path):
    import autoscale_sim

    assert autoscale_sim.main(["--smoke", "--out", str(tmp_path)]) == 0
    r = json.loads((tmp_path / "autoscale_sim.json").read_text())
    fixed, *auto = r["rows"]
    assert fixed["system"].startswith("fixed") and [a["models_per_worker"] for a in auto] == ["one", "all"]
    assert all(a["gpu_hours"] < fixed["gpu_hours"] and a["node_starts"] > 0 and a["day_p95_s"] > 0 for a in auto)
    assert auto[0]["switches"] > 0 and fixed["switches"] == 0 and fixed["gpu_hours"] == 8 * 10.0
    assert "| fixed: 8 workers, always on |" in (tmp_path / "autoscale_sim.md").read_text()
    import xml.etree.ElementTree as ET

    svg = ET.parse(tmp_path / "autoscale_sim.svg").getroot()  # the plot: well-formed, one point per row
    assert len(svg.findall("{http://www.w3.org/2000/svg}circle")) == len(r["rows"])
    from workers.families.rates import MEASURED  # the rates autoscaling starts from, each with its report

    for name, figures in r["params"]["figures"].items():
        assert figures["rate"] == MEASURED[name].rate and "docs/benchmarks/" in figures["source"]


def test_lora_times_a_step_across_adapters_and_a_load_between_steps(tmp_path):
    argv = ["--smoke", "--family", "sd3", "--sections", "lora-step", "lora-load", "--out", str(tmp_path)]
    assert workload.main(argv) == 0
    r = json.loads((tmp_path / "lora_tiny-sd3.json").read_text())
    s, ld = r["step"]["default"], r["load"]["default"]
    assert set(s["kernels"]) == {"bmm", "triton"} and s["bank_mib"] > 0
    for k in s["kernels"].values():
        assert s["without_adapters"]["n"] == k["across_adapters"]["n"] == 3 and k["ratio"] > 0
    assert ld["load_call_ms"]["n"] >= 3 and ld["load_alone_ms"]["median"] > 0
    assert ld["lora_kernel"] == "bmm"  # the first asked, triton, as recorded: it does not run on a CPU
    assert "One step of 4 images" in (tmp_path / "lora_tiny-sd3.md").read_text()


def test_the_lora_sections_but_lora_step_run_the_kernel_a_worker_runs_by_default():
    from workers.config import WorkerConfig

    [(_, args)] = workload.parse(["--sections", "lora-mix"])
    assert args.lora_kernels[0] == WorkerConfig.model_fields["lora_kernel"].default == "triton"


def test_edits_times_image_to_image_against_its_pipeline_and_the_inpainting_blend(tmp_path):
    argv = ["--smoke", "--sections", "img2img", "blend", "--out", str(tmp_path)]
    assert workload.main(argv) == 0
    r = json.loads((tmp_path / "edits_tiny-flux.json").read_text())
    e2e = r["e2e"]["64x64"]
    assert e2e["diffusers"]["n"] == e2e["default"]["n"] == 2  # --smoke: two runs each
    assert set(r["blend"]["default"]) == {"1", "2"} and r["blend"]["default"]["2"]["inpaint_step_ms"]["median"] > 0


def test_bench_holds_at_most_eight_scripts():
    bench = Path(__file__).resolve().parents[2] / "bench"
    scripts = sorted(p.name for p in bench.glob("*.py") if p.name != "harness.py")
    assert len(scripts) <= 8, scripts
