"""The SD3.5 / FLUX.1 benchmark's bookkeeping (arrivals and their size mix, the backlog, system d's calls,
system a's admission, rows per image, step counts, which models each section loads, targets, weights) and
one seconds-long run of every section (ours, and diffusers' StableDiffusion3Pipeline / FluxPipeline) on
tiny random SD3 and FLUX-dev: the GPU run must not be the first time any of its code runs."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("mmdit_bench", ROOT / "bench" / "mmdit.py")
mb = sys.modules["mmdit_bench"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(mb)

SIZES = ((512, 512), (512, 768), (768, 512))


def _card(family: str, **kw):
    mode = "cfg" if family == "sd3" else "embedded"
    return SimpleNamespace(family=family, guidance_mode=mode, max_tokens=kw.pop("max_tokens", 256), **kw)


def test_arrivals_follow_the_offered_load_the_request_mix_and_the_size_mix():
    runs = [mb.make_jobs(0.5, seed=s, sizes=SIZES, prompts=200, window_s=2000.0) for s in range(5)]
    assert np.mean([sum(j.n for j in jobs) / 2000.0 for jobs in runs]) == pytest.approx(0.5, rel=0.06)
    ns = np.array([j.n for jobs in runs for j in jobs])
    assert np.mean(ns == 1) == pytest.approx(0.70, abs=0.01)
    assert np.mean((ns >= 2) & (ns <= 4)) == pytest.approx(0.25, abs=0.01)
    assert np.mean(ns == 8) == pytest.approx(0.05, abs=0.005) and set(ns) <= {1, 2, 3, 4, 8}  # never > 8 in flight
    assert np.mean(ns) == pytest.approx(mb.MEAN_SIZE, rel=0.03)
    for run in runs:  # sizes in shuffled blocks of three: 1:1:1 by request, within one
        counts = Counter(j.size for j in run)
        assert set(counts) == set(SIZES) and max(counts.values()) - min(counts.values()) <= 1
        assert all(b.arrival >= a.arrival for a, b in zip(run, run[1:]))
    again = mb.make_jobs(0.5, seed=0, sizes=SIZES, prompts=200, window_s=2000.0)
    assert [(j.n, j.size, j.arrival, j.prompt) for j in again] == [(j.n, j.size, j.arrival, j.prompt) for j in runs[0]]
    assert [len(mb.make_jobs(x, seed=1, sizes=SIZES, prompts=200, window_s=10.0)) for x in mb.Setup().loads] == [
        2, 3]  # round(3 / 1.85), round(6 / 1.85): the GPU run's short window


def test_the_backlog_is_24_images_8_per_size_one_full_pipeline_call_each():
    jobs = mb.backlog(SIZES, prompts=200)
    per_size = Counter()
    for j in jobs:
        per_size[j.size] += j.n
    assert per_size == {s: 8 for s in SIZES} and len(jobs) == 15
    for size in SIZES:
        assert sorted(j.n for j in jobs if j.size == size) == [1, 1, 1, 2, 3]
    assert all(j.arrival == 0.0 for j in jobs) and len({j.id for j in jobs}) == 15
    assert [(j.n, j.size) for j in mb.backlog(SIZES, 200)] == [(j.n, j.size) for j in jobs]  # seeded
    calls = []  # d's calls over the backlog: the first queued request, then its size's: 8 images each
    pending = list(jobs)
    while pending:
        batch = mb.pb.static_batch(pending, 0.0, 8)
        calls.append((batch[0].size, sum(j.n for j in batch)))
        pending = [j for j in pending if j not in batch]
    assert sorted(calls) == sorted((s, 8) for s in SIZES)


def test_rows_guidance_and_the_diffusers_scheduler_config_follow_the_card():
    sd3 = SimpleNamespace(card=_card("sd3", scheduler={"shift": 3.0}))
    flux = SimpleNamespace(card=_card("flux", scheduler={"shift": 3.0, "use_dynamic_shifting": True,
                                                         "flow_grid": "flux"}))
    s = mb.Setup()
    assert (mb.rows_per_image(sd3), mb.guidance_of(sd3, s)) == (2, 4.5)
    assert (mb.rows_per_image(flux), mb.guidance_of(flux, s)) == (1, 3.5)
    assert mb.scheduler_config(flux) == {"shift": 3.0, "use_dynamic_shifting": True}  # flow_grid is ours
    assert s.steps == 28 and s.e2e_reps == 3 and s.engine_batch == 4 and s.max_batch == 8
    assert s.batches == {"sd35-medium-1024": (1, 2, 4), "flux-dev-512": (1, 2, 4, 8), "flux-dev-1024": (1, 2, 4)}


def test_large_steps_are_timed_fewer_times():
    s = mb.Setup()
    sd3 = SimpleNamespace(card=_card("sd3"), latent_shape=(16, 128, 128))
    flux512 = SimpleNamespace(card=_card("flux"), latent_shape=(16, 64, 64))
    flux1024 = SimpleNamespace(card=_card("flux"), latent_shape=(16, 128, 128))
    # work = images x rows per image x latent cells; small up to one row at 1024 (128 x 128 cells)
    assert [mb.iters_for(sd3, s, b) for b in (1, 2, 4)] == [5, 5, 5]  # CFG: 2 rows an image
    assert [mb.iters_for(flux512, s, b) for b in (1, 2, 4, 8)] == [8, 8, 8, 5]
    assert [mb.iters_for(flux1024, s, b) for b in (1, 2, 4)] == [8, 5, 5]


class _Pipe:
    """Stands in for the pipelines: records each call's prompts, size and keywords."""

    def __init__(self):
        self.calls = []

    def __call__(self, prompts, height, width, **kw):
        self.calls.append((list(prompts), (width, height), kw))
        return SimpleNamespace(images=np.zeros((len(prompts), height, width, 3)))


def test_pipeline_calls_pass_cfg_only_to_sd3_and_the_cards_token_limit():
    s = mb.Setup()
    sd3 = SimpleNamespace(card=_card("sd3", max_tokens=256))
    flux = SimpleNamespace(card=_card("flux", max_tokens=512))
    pipe = _Pipe()
    mb.call_pipeline(pipe, sd3, ["a"], (1024, 1024), s, seed=3)
    mb.call_pipeline(pipe, flux, ["b", "c"], (512, 768), s, seed=4)
    (p1, size1, kw1), (p2, size2, kw2) = pipe.calls
    assert (p1, size1, kw1["negative_prompt"], kw1["guidance_scale"], kw1["max_sequence_length"]) == (
        ["a"], (1024, 1024), "", 4.5, 256)
    assert (p2, size2, kw2["guidance_scale"], kw2["max_sequence_length"]) == (["b", "c"], (512, 768), 3.5, 512)
    assert "negative_prompt" not in kw2 and kw1["num_inference_steps"] == kw2["num_inference_steps"] == 28
    assert kw1["output_type"] == kw2["output_type"] == "np"


def test_system_d_calls_the_pipeline_once_per_size_batch_with_one_prompt_per_image():
    s = mb.Setup(wait_s=0.0)
    model = SimpleNamespace(card=_card("flux", max_tokens=512))
    prompts = [f"p{i}" for i in range(10)]
    jobs = [mb.pb.Job(0, 0.0, 2, (512, 512), 3), mb.pb.Job(1, 0.0, 1, (512, 768), 4),
            mb.pb.Job(2, 0.0, 4, (512, 512), 5), mb.pb.Job(3, 0.0, 3, (512, 512), 6)]
    pipe = _Pipe()
    mb.run_static(pipe, model, jobs, prompts, s, stop_s=60.0)
    # 2 + 4 = 6; 3 more would make 9 > 8: the next call
    assert [(c[0], c[1]) for c in pipe.calls] == [(["p3"] * 2 + ["p5"] * 4, (512, 512)), (["p4"], (512, 768)),
                                                  (["p6"] * 3, (512, 512))]
    assert all(j.finished is not None for j in jobs)


class _Engine:
    """Stands in for the engine: every image takes ``steps`` steps; records how many are in flight."""

    def __init__(self, steps=3):
        self.active, self.steps, self.in_flight, self.added, self.shapes = {}, steps, [], [], {}

    @property
    def num_active(self):
        return len(self.active)

    def add_many(self, specs):
        self.added += specs
        self.active.update({x.id: self.steps for x in specs})
        self.shapes.update({x.id: (x.model, x.width, x.height) for x in specs})

    def in_flight_shapes(self):
        return {self.shapes[k] for k in self.active}

    def progress(self):
        return dict(self.active)

    def cancel(self, rid):
        return self.active.pop(rid, None) is not None

    def step(self):
        self.in_flight.append(len(self.active))
        self.active = {k: v - 1 for k, v in self.active.items()}
        done = [k for k, v in self.active.items() if v == 0]
        for k in done:
            del self.active[k]
        return [SimpleNamespace(request=SimpleNamespace(id=k)) for k in done]


def test_system_a_admits_images_as_the_service_leases_up_to_8_at_their_size():
    """The queue's head, then images of its shape (and of those in flight) before the others, 8 in flight."""
    s = mb.Setup()
    model = SimpleNamespace(card=_card("flux"))
    jobs = [mb.pb.Job(0, 0.0, 4, (512, 512), 1), mb.pb.Job(1, 0.0, 2, (512, 768), 2),
            mb.pb.Job(2, 0.0, 4, (512, 512), 3), mb.pb.Job(3, 0.0, 1, (768, 512), 4)]
    engine = _Engine()
    mb.run_engine(engine, model, jobs, mb.pb.make_prompts(5), s, stop_s=60.0)
    assert all(j.finished is not None and j.done_images == j.n for j in jobs)
    assert max(engine.in_flight) == 8 and engine.in_flight[:3] == [8, 8, 8]
    assert [x.id for x in engine.added[:8]] == ["0:0", "0:1", "0:2", "0:3", "2:0", "2:1", "2:2", "2:3"]
    assert [x.id for x in engine.added[8:]] == ["1:0", "1:1", "3:0"]  # FCFS: 1:* ran with the 0:*
    first = engine.added[0]
    assert (first.sampler, first.steps, first.guidance, first.width, first.height) == ("flow_euler", 28, 3.5, 512, 512)
    assert first.prompt == mb.pb.make_prompts(5)[1] and len({x.seed for x in engine.added}) == 11
    assert (engine.added[8].width, engine.added[8].height) == (512, 768)


def test_the_models_each_section_loads_and_the_targets():
    assert mb.plan_models(list(mb.SECTIONS), list(mb.MODELS)) == [
        ("sd35-medium-1024", ["step", "memory", "e2e"]), ("flux-dev-512", ["step", "memory", "e2e", "mixed"]),
        ("flux-dev-1024", ["step", "memory", "e2e"])]
    assert mb.plan_models(["mixed", "e2e"], ["flux-dev-1024"]) == [("flux-dev-1024", ["e2e"]),
                                                                   ("flux-dev-512", ["mixed"])]
    assert mb.plan_models(["mixed"], ["sd35-medium-1024", "flux-dev-512"]) == [("flux-dev-512", ["mixed"])]
    assert mb.plan_models(["step"], ["flux-dev-512", "flux-dev-512"]) == [("flux-dev-512", ["step"])]
    result = {"e2e": {"sd35-medium-1024": {"ratio": 0.5}, "flux-dev-512": {"ratio": 0.55},
                      "flux-dev-1024": {"ratio": 1.02}}, "mixed": {"ratio_max": 1.2}}
    checks = {t["target"]: (t["value"], t["met"]) for t in mb.targets(result)}
    assert checks == {"e2e flux-dev-512: ours <= 0.6x diffusers": (0.55, True),
                      "e2e flux-dev-1024: ours <= 1.0x diffusers": (1.02, False),
                      "mixed: max sustained a >= 1.3x d": (1.2, False)}
    assert mb.targets({}) == []


def test_weights_are_parameter_bytes_per_component():
    model = SimpleNamespace(transformer=torch.nn.Linear(1024, 256, bias=False).to(torch.bfloat16),  # 0.5 MiB
                            text_encoder=torch.nn.Embedding(256, 1024), text_encoder_2=None,        # 1 MiB
                            vae=torch.nn.Conv2d(4, 4, 1))  # 20 floats
    got = mb.weights_gib(model)
    assert set(got) == {"transformer", "text_encoder", "vae", "total"}
    assert got["transformer"] == round(0.5 / 1024, 4) and got["text_encoder"] == round(1 / 1024, 4)
    assert got["total"] == round((1.5 * 2**20 + 80) / 2**30, 4)


def test_every_section_runs_end_to_end(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "mmdit.py"), "--smoke", "--out", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "mmdit_smoke.json").read_text())
    assert result["argv"] == ["--smoke", "--out", str(tmp_path)] and result["torch"] and result["diffusers"]
    assert result["gpu"] == "cpu" and result["transformers"]
    assert set(result["load_s"]) == set(mb.MODELS)
    for name in mb.MODELS:
        step = result["step"][name]
        assert {(r["batch"], r["backend"]) for r in step["rows"]} == {(b, k) for b in (1, 2, 4)
                                                                     for k in ("diffusers", *mb.BACKENDS)}
        assert all(r["ms"] > 0 for r in step["rows"]) and step["rows_per_image"] == (2 if "sd35" in name else 1)
        assert set(step["capture_s"]) == set(step["pool_mb"]) == set(step["totals"]) == set(mb.BACKENDS)
        assert all(t["backend"] == "eager" for t in step["totals"].values())  # no CUDA: eager fallback
        e2e = result["e2e"][name]
        assert set(e2e["ms"]) == {"ours", "diffusers"} and all(v > 0 for v in e2e["ms"].values())
        assert all(len(v) == 2 for v in e2e["runs_ms"].values()) and e2e["ratio"] > 0 and e2e["steps"] == 4
        assert 0 < e2e["host_loop_s"] < 10  # the host's Python speed, beside a host-bound baseline
        mem = result["memory"][name]
        assert mem["weights_gib"]["total"] > 0 and mem["peak_gib"] > 0 and mem["pool_mib"] >= 0
        assert "transformer" in mem["weights_gib"] and ("text_encoder_3" in mem["weights_gib"]) == ("sd35" in name)
    mixed = result["mixed"]
    assert set(mixed["max_images_per_s"]) == {"a", "d"} and all(v > 0 for v in mixed["max_images_per_s"].values())
    assert {r["system"] for r in mixed["rows"]} == {"a", "d"}
    assert all(r["images_per_s"] > 0 and r["unfinished"] == 0 for r in mixed["rows"])
    assert mixed["backlog_a"]["unfinished"] == mixed["backlog_d"]["unfinished"] == 0 and mixed["backlog_images"] == 24
    assert mixed["groups"] == 3 and mixed["pool_mb"] >= 0 and mixed["ratio_max"] > 0
    assert mixed["decode_graphs"] is False and mixed["decode"] == "eager"  # --decode-graphs auto, no --compile
    assert [t["target"] for t in result["targets"]] == ["e2e flux-dev-512: ours <= 0.6x diffusers",
                                                       "e2e flux-dev-1024: ours <= 1.0x diffusers",
                                                       "mixed: max sustained a >= 1.3x d"]
    text = (tmp_path / "mmdit_smoke.md").read_text()
    assert "## Targets" in text and "## Memory" in text and "## One step, flux-dev-1024" in text
