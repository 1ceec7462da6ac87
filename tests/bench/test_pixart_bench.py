"""The PixArt-Σ benchmark's bookkeeping (prompts, arrivals and their size mix, the backlog, system d's
static batches by size, system a's admission, size binning, targets, merging of reports) and one
seconds-long run of every section (ours, and diffusers' PixArtSigmaPipeline) on a tiny random PixArt:
the GPU run must not be the first time any of its code runs."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
import pytest

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("pixart_bench", ROOT / "bench" / "pixart.py")
pb = sys.modules["pixart_bench"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(pb)

SIZES = ((512, 512), (512, 768), (768, 512))


def test_prompts_are_distinct_seeded_and_short():
    from workers.builtins import t5_tokenizer

    prompts = pb.make_prompts()
    assert len(prompts) == len(set(prompts)) == 200 and pb.make_prompts() == prompts
    tok = t5_tokenizer()
    lengths = [sum(tok(p).attention_mask) for p in prompts]  # </s> included
    assert 10 <= min(lengths) and max(lengths) <= 35 and 15 <= np.median(lengths) <= 30


def test_arrivals_follow_the_offered_load_the_request_mix_and_the_size_mix():
    runs = [pb.make_jobs(6.0, seed=s, sizes=SIZES, prompts=200, window_s=200.0) for s in range(10)]
    assert np.mean([sum(j.n for j in jobs) / 200.0 for jobs in runs]) == pytest.approx(6.0, rel=0.06)
    jobs = [j for jobs in runs for j in jobs]
    ns = np.array([j.n for j in jobs])
    assert np.mean(ns == 1) == pytest.approx(0.70, abs=0.01)
    assert np.mean((ns >= 2) & (ns <= 8)) == pytest.approx(0.25, abs=0.01)
    assert np.mean(ns >= 16) == pytest.approx(0.05, abs=0.005) and ns.max() <= 32
    for run in runs:  # sizes in shuffled blocks of three: 1:1:1 by request, within one
        counts = Counter(j.size for j in run)
        assert set(counts) == set(SIZES) and max(counts.values()) - min(counts.values()) <= 1
        assert all(b.arrival >= a.arrival for a, b in zip(run, run[1:]))
    assert {j.prompt for j in jobs} <= set(range(200)) and len({j.prompt for j in jobs}) > 150
    again = pb.make_jobs(6.0, seed=0, sizes=SIZES, prompts=200, window_s=200.0)
    assert [(j.n, j.size, j.arrival, j.prompt) for j in again] == [(j.n, j.size, j.arrival, j.prompt) for j in runs[0]]


def test_the_backlog_has_the_mix_exactly_at_every_size():
    jobs = pb.backlog(SIZES, prompts=200)
    assert sorted(j.n for j in jobs) == sorted([1] * 14 * 3 + [2, 4, 5, 6, 8, 24] * 3)
    per_size = Counter()
    for j in jobs:
        per_size[j.size] += j.n
    assert per_size == {s: 63 for s in SIZES} and sum(per_size.values()) == 189
    for size in SIZES:  # every request size once per image size
        assert sorted(j.n for j in jobs if j.size == size) == sorted([1] * 14 + [2, 4, 5, 6, 8, 24])
    assert all(j.arrival == 0.0 for j in jobs) and len({j.id for j in jobs}) == 60
    assert [j.n for j in pb.backlog(SIZES, 200)] == [j.n for j in jobs]  # seeded


def _job(i, n, size, arrival=0.0):
    return pb.Job(i, arrival, n, size, i)


def test_static_batches_take_the_first_request_then_queued_ones_of_its_size_that_fit():
    sq, tall = (512, 512), (512, 768)
    pending = [_job(0, 1, sq), _job(1, 2, tall), _job(2, 30, sq), _job(3, 5, sq), _job(4, 1, sq),
               _job(5, 1, sq, arrival=2.0)]
    # 1 + 30 = 31; 5 would make 36 > 32 (skipped); 1 more makes 32; job 5 has not arrived; tall waits
    assert [j.id for j in pb.static_batch(pending, 1.0, 32)] == [0, 2, 4]
    assert [j.id for j in pb.static_batch(pending[1:], 1.0, 32)] == [1]  # first come first served across sizes
    assert [j.id for j in pb.static_batch([_job(7, 40, sq), _job(8, 1, sq)], 0.0, 32)] == [7]  # too big: alone
    assert pb.static_batch([_job(9, 1, sq, arrival=3.0)], 1.0, 32) == []


class _Pipe:
    """Stands in for PixArtSigmaPipeline: records each call's prompts and size."""

    def __init__(self):
        self.calls = []

    def __call__(self, prompts, height, width, **kw):
        self.calls.append((list(prompts), (width, height), kw["max_sequence_length"], kw["use_resolution_binning"]))
        return SimpleNamespace(images=np.zeros((len(prompts), height, width, 3)))


def test_system_d_calls_the_pipeline_once_per_size_batch_with_one_prompt_per_image():
    s = pb.Setup(max_batch=8, wait_s=0.0)
    model = SimpleNamespace(card=SimpleNamespace(max_tokens=300))
    prompts = [f"p{i}" for i in range(10)]
    jobs = [pb.Job(0, 0.0, 2, (512, 512), 3), pb.Job(1, 0.0, 1, (512, 768), 4), pb.Job(2, 0.0, 6, (512, 512), 5),
            pb.Job(3, 0.0, 1, (512, 512), 6)]
    pipe = _Pipe()
    pb.run_static(pipe, model, jobs, prompts, s, stop_s=60.0)
    assert [(c[0], c[1]) for c in pipe.calls] == [(["p3"] * 2 + ["p5"] * 6, (512, 512)), (["p4"], (512, 768)),
                                                  (["p6"], (512, 512))]
    assert all(c[2:] == (300, True) for c in pipe.calls) and all(j.finished is not None for j in jobs)


class _Engine:
    """Stands in for the engine: every image takes ``steps`` steps; records how many are in flight."""

    def __init__(self, steps=3):
        self.active, self.steps, self.in_flight, self.added, self.shapes = {}, steps, [], [], {}

    num_finishing = 0  # results are handed out by the step that finishes them

    @property
    def num_active(self):
        return len(self.active)

    def add_many(self, specs):
        self.added.append([x.id for x in specs])
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


def test_system_a_admits_images_as_the_service_leases_up_to_max_batch():
    """The queue's head, then images of the shapes it and those in flight have; no other shape is started for
    fewer than a quarter of the room (admission rule 4: 2 of 8 here)."""
    from workers.cards import read_card

    s = pb.Setup(max_batch=8)
    model = SimpleNamespace(card=read_card("pixart-sigma-512"))
    jobs = [pb.Job(0, 0.0, 5, (512, 512), 1), pb.Job(1, 0.0, 6, (512, 768), 2), pb.Job(2, 0.0, 1, (768, 512), 3),
            pb.Job(3, 0.0, 2, (512, 512), 4)]
    engine = _Engine()
    pb.run_engine(engine, model, jobs, pb.make_prompts(5), s, stop_s=60.0)
    assert all(j.finished is not None and j.done_images == j.n for j in jobs)
    assert engine.in_flight[:3] == [7, 7, 7]  # the eighth place would have started a 512x768 group of one
    # the 512 px images (jobs 0 and 3) first, the head's shape; FCFS would have run 1:0 beside them
    assert engine.added[0] == ["0:0", "0:1", "0:2", "0:3", "0:4", "3:0", "3:1"]
    assert engine.added[1] == ["1:0", "1:1", "1:2", "1:3", "1:4", "1:5", "2:0"]  # room for all that is left
    assert len(engine.added) == 2


def test_our_images_are_made_at_the_bin_and_resized_back_as_the_pipeline_does():
    from workers.cards import read_card

    model = SimpleNamespace(card=read_card("pixart-sigma-512"))
    s, prompts = pb.Setup(), pb.make_prompts(3)
    tall, = pb.item_specs(model, pb.Job(4, 0.0, 1, (512, 768), 2), prompts, s)
    assert (tall.width, tall.height, tall.out_width, tall.out_height) == (416, 608, 512, 768)
    assert tall.prompt == prompts[2] and tall.id == "4:0"
    assert (tall.sampler, tall.steps, tall.guidance) == ("dpmpp_2m", 20, 4.5)
    wide = pb.item_specs(model, pb.Job(5, 0.0, 2, (768, 512), 0), prompts, s)
    assert [(x.width, x.height, x.out_width, x.out_height) for x in wide] == [(608, 416, 768, 512)] * 2
    assert len({x.seed for x in wide}) == 2
    square, = pb.item_specs(model, pb.Job(6, 0.0, 1, (512, 512), 0), prompts, s)
    assert (square.width, square.height, square.out_width, square.out_height) == (512, 512, 0, 0)


def test_targets_and_the_models_each_section_loads():
    result = {"e2e": {"512": {"ratio": {"padded": 0.25, "varlen": 0.35}}, "1024": {"ratio": {"padded": 0.95,
              "varlen": 0.8}}}, "mixed": {"ratio_max": 2.5}}
    checks = {t["target"]: (t["value"], t["met"]) for t in pb.targets(result)}
    assert checks == {"e2e 512: ours (padded) <= 0.3x diffusers": (0.25, True),
                      "e2e 512: ours (varlen) <= 0.3x diffusers": (0.35, False),
                      "e2e 1024: ours (padded) <= 0.9x diffusers": (0.95, False),
                      "e2e 1024: ours (varlen) <= 0.9x diffusers": (0.8, True),
                      "mixed: max sustained a >= 2.0x d": (2.5, True)}
    assert pb.plan_models(["step", "e2e", "mixed"], [1024, 512], 512) == [(512, ["step", "e2e", "mixed"]),
                                                                           (1024, ["step", "e2e"])]
    assert pb.plan_models(["mixed", "step"], [1024], 512) == [(1024, ["step"]), (512, ["mixed"])]
    assert pb.plan_models(["e2e"], [512], 512) == [(512, ["e2e"])]


def test_a_report_from_the_same_machine_is_merged_and_others_are_not(tmp_path):
    head = {"gpu": "H", "torch": "t", "diffusers": "d", "argv": ["--sections", "e2e"]}
    path = tmp_path / "pixart.json"
    path.write_text(json.dumps({**head, "argv": ["--sections", "step"], "step": {"512": {"rows": []}}}))
    merged = pb.previous(path, head, fresh=False)
    assert merged["step"] == {"512": {"rows": []}} and merged["argv"] == ["--sections", "e2e"]
    assert "step" not in pb.previous(path, {**head, "gpu": "other"}, fresh=False)
    assert "step" not in pb.previous(path, head, fresh=True)


@pytest.mark.parametrize("flag, compile_mode, graphs, kind", [
    ("auto", "off", False, "eager"), ("auto", "inductor-blocks", True, "compiled and captured"),
    ("on", "off", True, "captured"), ("on", "inductor", True, "compiled and captured"),
    ("off", "inductor", False, "eager")])
def test_the_mixed_runs_decode_follows_its_flag_and_the_compile(flag, compile_mode, graphs, kind):
    """``--decode-graphs``: "auto" captures system a's decode when its step is compiled (and the engine then
    compiles the decode too), "on" and "off" say so whatever the compile; the report names what ran."""
    s = pb.Setup(compile=compile_mode, decode_graphs=flag)
    assert pb.mixed_decode_graphs(s) is graphs and pb.decode_kind(s) == kind
    note = pb.decode_note({"decode": kind})
    assert note == ("" if kind == "eager" else f", decode {kind}")
    assert pb.decode_note({}) == ""  # a report from before the field


def test_every_section_runs_end_to_end(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "pixart.py"), "--smoke", "--out", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "pixart_smoke.json").read_text())
    assert result["argv"] == ["--smoke", "--out", str(tmp_path)] and result["torch"] and result["diffusers"]
    step = result["step"]["16"]
    columns = {(r["backend"], r["cross_attention"]) for r in step["rows"]}
    assert columns == {("diffusers", "padded")} | {(b, m) for b in pb.BACKENDS for m in pb.CROSS_ATTENTION}
    assert {r["batch"] for r in step["rows"]} == {1, 2, 4} and all(r["ms"] > 0 for r in step["rows"])
    runners = {f"{b}/{m}" for b in pb.BACKENDS for m in pb.CROSS_ATTENTION}
    assert set(step["capture_s"]) == set(step["pool_mb"]) == set(step["totals"]) == runners
    e2e = result["e2e"]["16"]
    assert set(e2e["ms"]) == {"ours/padded", "ours/varlen", "diffusers"} and all(v > 0 for v in e2e["ms"].values())
    assert all(len(v) == 2 for v in e2e["runs_ms"].values()) and set(e2e["ratio"]) == {"padded", "varlen"}
    assert 0 < e2e["host_loop_s"] < 10 and "host Python loop (3M iterations)" in (tmp_path / "pixart_smoke.md").read_text()
    mixed = result["mixed"]
    assert set(mixed["max_images_per_s"]) == {"a", "d"} and all(v > 0 for v in mixed["max_images_per_s"].values())
    assert {r["system"] for r in mixed["rows"]} == {"a", "d"}
    assert all(r["images_per_s"] > 0 and r["unfinished"] == 0 for r in mixed["rows"])
    assert mixed["backlog_a"]["unfinished"] == mixed["backlog_d"]["unfinished"] == 0 and mixed["backlog_images"] == 189
    assert mixed["groups"] == 3 and mixed["pool_mb"] >= 0 and mixed["ratio_max"] > 0
    assert len(mixed["replay_ms"]) == 3  # per shape (empty on a CPU: no graphs, nothing timed)
    assert mixed["decode_graphs"] is False and mixed["decode"] == "eager"  # --decode-graphs auto, no --compile
    assert [t["target"] for t in result["targets"]] == ["mixed: max sustained a >= 2.0x d"]
    assert "## Targets" in (tmp_path / "pixart_smoke.md").read_text()
    phases = mixed["backlog_a_phases"]  # the backlog run of a, by phase (host clock on a CPU)
    assert set(phases["host_ms"]) == {"loop", "admit", "step", "decode", "convert"} and phases["gpu_ms"] == {}
    makespan_ms = 189 / mixed["backlog_a"]["images_per_s"] * 1000
    assert 0.5 * makespan_ms < sum(phases["host_ms"].values()) < makespan_ms + 50  # the phases tile the run
    assert sum(int(b) * n for b, n in phases["replays"].items()) >= 189 * pb.smoke().steps  # every image's steps
    assert "Where system a's backlog run went" in (tmp_path / "pixart_smoke.md").read_text()
    assert "| finish (decode + convert) |" in (tmp_path / "pixart_smoke.md").read_text()


def test_a_tuned_run_gives_diffusers_a_plain_transformer_loaded_when_its_turn_comes(tmp_path):
    """``--precision fp8`` replaces our transformer's linears in place: diffusers' side must run a plain
    transformer (the same weights), loaded only when asked, or the baseline would measure our FP8 modules."""
    from workers.fp8 import Fp8Linear
    from workers.loading import load_model
    from workers.models.tiny_pixart import make_tiny_pixart

    tiny = make_tiny_pixart(tmp_path / "tiny-pixart")
    plain = load_model(tiny)
    assert pb.baseline(plain, lambda: pytest.fail("a plain run loads no second model")) is None
    fp8 = load_model(tiny, precision="fp8")
    loads = []
    ref = pb.baseline(fp8, lambda: loads.append(1) or load_model(tiny))
    assert loads == []  # nothing loaded until diffusers' turn
    base = ref()
    assert loads == [1] and base.transformer is not fp8.transformer and base.card is fp8.card
    assert any(isinstance(m, Fp8Linear) for m in fp8.transformer.modules())
    assert not any(isinstance(m, Fp8Linear) for m in base.transformer.modules())
    for (name, a), b in zip(plain.transformer.state_dict().items(), base.transformer.state_dict().values()):
        assert torch.equal(a, b), name


def test_the_mixed_section_measures_the_engines_default_cross_attention():
    from workers.families import pixart

    assert pb.Setup().cross_attention == pixart.DEFAULT_CROSS_ATTENTION


def test_promoted_accumulation_is_refused_without_fp8(capsys):
    with pytest.raises(SystemExit):
        pb.main(["--smoke", "--fp8-promoted-accum"])
    assert "--fp8-promoted-accum needs --precision fp8" in capsys.readouterr().err
