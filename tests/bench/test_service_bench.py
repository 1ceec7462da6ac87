"""The service benchmark's pure parts: its settings from the command line and the model card, medians and
comparisons of made-up samples, the targets (each one failing when it should), the table and the markdown
report, and which GPUs a service sees. One slow test runs the whole benchmark at a tiny size on a CPU:
the GPU run must not be the first time any of its code runs."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("service_bench", ROOT / "bench" / "service.py")
sb = sys.modules["service_bench"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sb)


def _raw(two=None):
    """Made-up samples: engine 100 ms, service 110 ms until done (+10 ms) and 118 ms to the PNG; engine
    40 images/s, service 39 (97.5%) on the server clock and 36 (90%) on the client's; previews 20 -> 20.4
    ms/step at 1 image (+2%), 50 -> 52 at 64 (+4%); the service's worker steps in 20.5 ms (+0.5); the
    engine's paired images just before the service's 98, 101, 97 ms (pairs +12, +11, +11: +11)."""
    return {"engine": {"single_ms": [101.0, 100.0, 99.0], "images_per_s": [40.0, 40.0],
                       "step_ms": {"1": {"off": [20.0, 20.0], "on": [20.4, 20.4]},
                                   "64": {"off": [50.0, 50.0], "on": [52.0, 52.0]}}},
            "service": {"1": {"single_done_ms": [110.0, 112.0, 108.0], "single_png_ms": [118.0, 117.0, 119.0],
                              "images_per_s": [38.0, 40.0], "client_images_per_s": [36.0, 36.0],
                              "worker_step_ms": 20.5, "paired_engine_ms": [98.0, 101.0, 97.0]},
                        "2": two or {"not_run": "--gpus 1"}}}


def _report(raw):
    s = sb.parse(["--model", "digits", "--images", "256"])[1]
    hw = {"cpu": "test", "torch": "2.x", "diffusers": "0.x", "ray": "2.x", "gpus": 2, "gpu": "H200"}
    return sb.build_report(raw, s, hw, "python bench/service.py --model digits --images 256")


def test_medians_and_comparisons_of_made_up_samples():
    m = sb.medians(_raw())
    assert (m["engine_single_ms"], m["service_single_done_ms"], m["service_single_png_ms"]) == (100.0, 110.0, 118.0)
    assert (m["engine_images_per_s"], m["service_images_per_s"], m["service_2gpu_images_per_s"]) == (40.0, 39.0, None)
    assert (m["step_ms_1_off"], m["step_ms_1_on"], m["step_ms_64_on"]) == (20.0, 20.4, 52.0)
    c = sb.comparisons(m)
    assert c == {"single_added_ms": 10.0, "single_added_paired_ms": 11.0, "png_added_ms": 18.0, "throughput_ratio": 0.975,
                 "client_throughput_ratio": 0.9, "scaling": None, "preview_added_pct_1": 2.0,
                 "preview_added_pct_64": 4.0, "worker_step_added_ms": 0.5}


def test_each_target_is_met_missed_or_not_run():
    met = {t["key"]: t["met"] for t in sb.targets(sb.comparisons(sb.medians(_raw())))}
    assert met == {"single_added_ms": True, "single_added_paired_ms": True, "throughput_ratio": True, "scaling": None,
                   "preview_added_pct_1": True, "preview_added_pct_64": False}
    missed = {"single_added_ms": 15.01, "single_added_paired_ms": 15.01, "throughput_ratio": 0.949, "scaling": 1.89,
              "preview_added_pct_1": 3.01, "preview_added_pct_64": -1.0}
    assert [t["met"] for t in sb.targets(missed)] == [False, False, False, False, False, True]
    at_the_limits = {"single_added_ms": 15.0, "single_added_paired_ms": 15.0, "throughput_ratio": 0.95, "scaling": 1.9,
                     "preview_added_pct_1": 3.0, "preview_added_pct_64": 3.0}
    assert all(t["met"] for t in sb.targets(at_the_limits))


def test_two_gpus_give_the_scaling_against_the_one_gpu_service():
    report = _report(_raw(two={"images_per_s": [76.0, 78.0], "client_images_per_s": [70.0, 70.0]}))
    assert report["comparisons"]["scaling"] == pytest.approx(77.0 / 39.0, abs=1e-4)  # 1.974
    assert {t["key"]: t["met"] for t in report["targets"]}["scaling"] is True
    assert "not run" not in sb.table(report)


def test_the_table_shows_every_row_with_its_target_status():
    report = _report(_raw())
    assert sb.rows(report) == [
        ["1 image ms: engine -> service, until done", "100", "110", "+10.0 ms", "<= +15 ms", "ok"],
        ["1 image ms: the same, paired (engine just before)", "98", "110", "+11.0 ms", "<= +15 ms", "ok"],
        ["1 image ms: engine -> service, PNG in hand", "100", "118", "+18.0 ms", "", ""],
        ["ms/step at 1 image: engine -> service's worker", "20", "20.5", "+0.50 ms", "", ""],
        ["images/s: engine -> service (server clock)", "40", "39", "97.5%", ">= 95%", "ok"],
        ["images/s: engine -> service (client clock)", "40", "36", "90.0%", "", ""],
        ["images/s: service 1 GPU -> 2 GPUs", "39", "-", "-", ">= 1.9x", "not run"],
        ["ms/step at 1 image: previews off -> on", "20", "20.4", "+2.0%", "<= +3%", "ok"],
        ["ms/step at 64 images: previews off -> on", "50", "52", "+4.0%", "<= +3%", "MISSED"]]
    lines = sb.table(report).splitlines()
    assert lines[0].split() == sb.HEADER and set(lines[1]) == {"-", " "}
    status_column = lines[0].index("status")  # every cell starts under its heading
    assert [ln[status_column:] for ln in lines[2:11]] == ["ok", "ok", "", "", "ok", "", "not run", "ok", "MISSED"]
    assert lines[11:] == ["2 GPUs: not run (--gpus 1)"]


def test_the_markdown_report_has_the_command_the_table_and_the_targets():
    md = sb.markdown(_report(_raw()))
    assert md.startswith("# The service against its engine: digits on H200\n")
    assert "`python bench/service.py --model digits --images 256`" in md
    assert "| measure | baseline | measured | change | target | status |" in md
    assert "| images/s: engine -> service (server clock) | 40 | 39 | 97.5% | >= 95% | ok |" in md
    assert "- previews add <= 3% to the step time at 64 images: 4.0 (MISSED)" in md
    assert "- service images/s on 2 GPUs >= 1.9x on 1 GPU: - (not run)" in md and "2 GPUs: not run (--gpus 1)." in md


def test_reports_are_written_json_always_markdown_unless_smoke(tmp_path):
    report = _report(_raw())
    assert [p.name for p in sb.write(report, tmp_path)] == ["service.json", "service.md"]
    assert json.loads((tmp_path / "service.json").read_text())["targets"] == report["targets"]
    report["smoke"] = True
    assert [p.name for p in sb.write(report, tmp_path / "s")] == ["service_smoke.json"]


def test_settings_come_from_the_command_line_then_smoke_or_full_sizes_then_the_model_card():
    s = sb.parse([])[1]
    assert {k: s[k] for k in sb.FULL} == sb.FULL and not s["smoke"]
    assert (s["sampler"], s["steps"], s["guidance"], s["classes"], s["max_batch"]) == ("ddim", 50, 4.0, 10, 64)
    s = sb.parse(["--smoke", "--images", "8", "--steps", "5", "--sampler", "euler"])[1]
    assert (s["model"], s["images"], s["single"], s["repeats"], s["gpus"]) == ("digits", 8, 3, 1, 1)
    assert (s["sampler"], s["steps"], s["guidance"], s["smoke"]) == ("euler", 5, 2.0, True)  # digits' guidance
    args, s = sb.parse(["--gpus", "2", "--out", "/tmp/x"])
    assert s["gpus"] == 2 and args.out == Path("/tmp/x") and "out" not in s


@pytest.mark.parametrize("argv", [["--images", "0"], ["--gpus", "3"], ["--sampler", "plms"], ["--model", "nope"],
                                  ["--model", "digits-text"], ["--model", "digits", "--steps", "5000"]])
def test_bad_arguments_exit_2_with_a_message(argv, capsys):
    with pytest.raises(SystemExit) as e:
        sb.parse(argv)
    assert e.value.code == 2 and "error:" in capsys.readouterr().err


def test_a_service_sees_the_first_gpus_of_this_process():
    assert sb.visible_devices(1, {}) == "0" and sb.visible_devices(2, {}) == "0,1"
    assert sb.visible_devices(2, {"CUDA_VISIBLE_DEVICES": "3,5,7"}) == "3,5"
    assert sb.scaling_skipped(1, 8) == "--gpus 1"
    assert sb.scaling_skipped(2, 1) == "needs 2 GPUs, found 1" and sb.scaling_skipped(2, 2) is None


def test_the_engine_gets_the_worker_actors_threads():
    assert sb.worker_threads({}) == 1  # Ray's OMP_NUM_THREADS for an actor of num_cpus 1
    assert sb.worker_threads({"OMP_NUM_THREADS": "4"}) == 4  # inherited by the service: Ray leaves it


@pytest.mark.slow
def test_the_smoke_run_completes_on_a_cpu(tmp_path):
    cmd = [sys.executable, "bench/service.py", "--smoke", "--images", "8", "--single", "1", "--steps", "4",
           "--out", str(tmp_path)]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    report = json.loads((tmp_path / "service_smoke.json").read_text())
    raw = report["raw"]
    assert len(raw["engine"]["single_ms"]) == len(raw["service"]["1"]["single_done_ms"]) == 1
    assert len(raw["engine"]["images_per_s"]) == len(raw["service"]["1"]["images_per_s"]) == 1
    assert raw["service"]["1"]["after_stop"]["exit_code"] == 0
    # times and rates are positive; a difference of two (paired_added_ms) may be either sign on a busy machine
    assert all(v > 0 for k, v in report["medians"].items() if k not in ("service_2gpu_images_per_s", "paired_added_ms"))
    assert math.isfinite(report["medians"]["paired_added_ms"])
    assert [t["met"] is None for t in report["targets"]] == [False, False, False, True, False, False]
    assert len(raw["service"]["1"]["paired_engine_ms"]) == 1  # the engine's image just before the service's
    assert "images/s: engine -> service (server clock)" in out.stdout and not (tmp_path / "service.md").exists()


def test_the_phases_of_one_image_and_what_is_left_to_the_client():
    raw = _raw()
    raw["service"]["1"]["phases_ms"] = {"wait": 2.0, "dispatch": 1.5, "run": 100.0, "handoff": 1.0, "commit": 2.5}
    note = sb.notes(_report(raw))[-1]
    assert note.startswith("one image in the service, mean ms per phase: wait 2.00, dispatch 1.50, run 100.00")
    assert note.endswith("outside them (HTTP, events, the client): 3.00")  # 110 - 107
    before = {"run": (1.0, 2.0), "wait": (0.5, 2.0)}
    after = {"run": (1.3, 5.0), "wait": (0.5, 2.0), "commit": (0.01, 1.0)}
    assert sb.phase_means(before, after) == {"run": 100.0, "commit": 10.0}  # wait: no new image


@pytest.mark.parametrize("final, encoded", [("latest", 3), ("all", 15)])
def test_the_preview_harness_encodes_each_items_latest_at_the_end(monkeypatch, final, encoded):
    """What the timed run encodes once the last previews arrive: each item's latest, as a worker's next
    poll does (3 items: 3 PNGs), or, as the harness did before, every preview still on its way (5 each)."""
    import numpy as np

    import workers.actor
    from workers.decode import Preview

    class Engine:
        def add_many(self, items):
            self.items = items

        def step(self):
            pass

        def take_previews(self, wait=False):  # the host ran ahead: every preview arrives at the end
            return [Preview(it.id, k, np.zeros((4, 4, 3), np.uint8)) for k in range(5) for it in self.items] if wait else []

    calls = []
    monkeypatch.setattr(workers.actor, "_png", lambda image, level=1: calls.append(image) or b"")
    s = {"steps": 4, "sampler": "ddim", "guidance": 4.0, "classes": 10}
    assert sb.step_ms(Engine(), s, 3, 1, poll_s=10.0, final=final) > 0
    assert len(calls) == encoded
