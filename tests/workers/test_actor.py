"""The worker (the body of the Ray actor) with the real engine and the digits model, without Ray:
its step-loop thread, the poll contract, cancel at a step boundary, failures and determinism."""

from __future__ import annotations

import io
import time
from pathlib import Path

import pytest
import numpy as np
from PIL import Image

from workers.actor import Worker
from workers.config import WorkerConfig
from workers.request.spec import ItemSpec

DIGITS_DIR = Path(__file__).resolve().parents[2] / "workers" / "models" / "digits"


@pytest.fixture(scope="module")
def worker():
    if not (DIGITS_DIR / "model_index.json").exists():
        pytest.skip("the shipped digits model (workers/models/digits) is missing")
    w = Worker(WorkerConfig(models=("digits",), max_batch=8, torch_threads=1))
    yield w
    w.stop()


def _item(i: int, label: int = 3, seed: int = 0, steps: int = 10, **kw) -> ItemSpec:
    return ItemSpec(id=f"job/{i}", model="digits", label=label, seed=seed, sampler="ddim", steps=steps,
                    guidance=2.0, **kw)


def _drain(worker: Worker, ids: set[str], timeout: float = 60.0) -> tuple[dict, dict, list[dict]]:
    """Poll until every id finished or failed; returns (finished, failed, reports)."""
    finished, failed, reports = {}, {}, []
    deadline = time.monotonic() + timeout
    while not ids <= finished.keys() | failed.keys():
        assert time.monotonic() < deadline, f"worker did not finish {ids - finished.keys() - failed.keys()}"
        time.sleep(0.02)
        report = worker.poll()
        reports.append(report)
        finished.update(report["finished"])
        failed.update(report["failed"])
    return finished, failed, reports


def test_items_run_with_progress_and_come_back_as_pngs(worker):
    items = [_item(i, label=i, seed=i) for i in range(4)]
    assert worker.info()["models"] == ["digits"]
    assert worker.submit(items) == [True] * 4
    finished, failed, reports = _drain(worker, {it.id for it in items})
    assert failed == {}
    steps_seen = {s for r in reports for (s, total) in r["progress"].values() if total == 10}
    assert steps_seen & set(range(1, 10)), "progress should show items between steps"
    img = Image.open(io.BytesIO(finished["job/0"]))
    assert (img.size, img.mode) == ((8, 8), "L")
    assert sum(len(r["step_seconds"]) for r in reports) >= 10
    busy, wall = sum(r["busy_s"] for r in reports), sum(r["window_s"] for r in reports)
    assert 0.0 < busy <= wall * 1.05  # a step ends in one poll's window but may have begun in the one before


def test_cancel_stops_an_item_at_a_step_boundary(worker):
    slow, quick = _item(10, steps=1000), _item(11, steps=20)
    worker.submit([slow, quick])
    deadline = time.monotonic() + 30
    while worker.poll()["progress"].get(slow.id, (0, 0))[0] < 1:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    assert worker.cancel([slow.id]) == [True]
    finished, _, reports = _drain(worker, {quick.id})
    time.sleep(0.1)
    last = worker.poll()
    assert slow.id not in finished and slow.id not in dict(last["finished"]) and slow.id not in last["progress"]
    assert worker.engine.num_active == 0


def test_a_bad_item_fails_alone(worker):
    bad_model, bad_eta, good = _item(20), _item(21), _item(22)
    bad_model = ItemSpec(**{**bad_model.__dict__, "model": "nope"})
    bad_eta = ItemSpec(**{**bad_eta.__dict__, "sampler": "euler", "eta": 0.5})
    worker.submit([bad_model, bad_eta, good])
    finished, failed, _ = _drain(worker, {bad_model.id, bad_eta.id, good.id})
    assert set(failed) == {bad_model.id, bad_eta.id} and set(finished) == {good.id}
    assert "nope" in failed[bad_model.id] and "eta" in failed[bad_eta.id]


def test_an_image_does_not_depend_on_its_batch(worker):
    alone = _item(30, label=5, seed=77)
    worker.submit([alone])
    first, _, _ = _drain(worker, {alone.id})
    crowd = [_item(31 + i, label=i % 10, seed=i) for i in range(6)] + [_item(40, label=5, seed=77)]
    worker.submit(crowd)
    second, _, _ = _drain(worker, {it.id for it in crowd})
    assert second["job/40"] == first["job/30"]


def test_a_long_poll_answers_when_an_item_ends_and_waits_when_nothing_does(worker):
    """``poll(wait_s)`` returns as soon as an item has finished (not after ``wait_s``), and an idle
    worker holds the poll for ``wait_s``: the scheduler commits an image the moment it exists without
    polling idle workers in a loop."""
    worker.poll()  # nothing left over from earlier tests
    t0 = time.monotonic()
    report = worker.poll(wait_s=0.3)
    assert report["finished"] == [] and time.monotonic() - t0 >= 0.25
    worker.submit([_item(90, steps=5)])
    t0, finished = time.monotonic(), {}
    while "job/90" not in finished:
        assert time.monotonic() - t0 < 60, "the item never finished"
        finished.update(worker.poll(wait_s=30.0)["finished"])
    assert time.monotonic() - t0 < 20.0, "the long poll waited out its wait_s instead of answering the ending"


@pytest.mark.slow
def test_a_worker_with_compile_inductor_runs_compiled_steps(tmp_path):
    """``[workers] compile = "inductor"`` reaches the worker's engine: its step is compiled once (into the
    cache directory given) and the item still comes back as a PNG."""
    w = Worker(WorkerConfig(models=("digits",), max_batch=4, torch_threads=1, compile="inductor",
                            compile_cache=str(tmp_path / "inductor"), compile_scope="blocks"))
    try:
        w.submit([_item(50, steps=4)])
        finished, failed, reports = _drain(w, {"job/50"})
        assert failed == {} and Image.open(io.BytesIO(finished["job/50"])).size == (8, 8)
        groups = reports[-1]["stats"]["groups"]
        assert [g["compile"]["graphs"] for g in groups.values()] == [1]
        assert w.engine.speed["digits"].compile_scope == "blocks"  # reached the engine (DiT compiles its whole step)
        assert [g["compile"]["scope"] for g in groups.values()] == ["step"]
        assert any((tmp_path / "inductor").iterdir())
    finally:
        w.stop()


def test_a_worker_with_decode_graphs_decodes_through_its_decode_runner(tmp_path):
    """``[workers] decode_graphs = true`` reaches the worker's engine: a latent model's group gets a decode
    runner, the worker says so at start-up, and its images come back as PNGs of the model's size."""
    from workers.models.tiny_dit import write_tiny_dit

    write_tiny_dit(tmp_path / "tiny-dit")
    w = Worker(WorkerConfig(models=(str(tmp_path / "tiny-dit"),), max_batch=4, torch_threads=1, decode_graphs=True))
    try:
        assert w.info()["decode_graphs"] == {"tiny-dit": True}
        group = next(iter(w.engine.groups.values()))
        assert group.decoder is not None
        runs = group.decoder.stats()["totals"]
        name = next(iter(w.engine.models))
        w.submit([ItemSpec(id="job/60", model=name, label=1, seed=0, sampler="ddim", steps=3, guidance=2.0)])
        finished, failed, _ = _drain(w, {"job/60"})
        side = next(iter(w.engine.models.values())).image_size
        assert failed == {} and Image.open(io.BytesIO(finished["job/60"])).size == (side, side)
        assert group.decoder.stats()["totals"] != runs  # the decode went through the runner
    finally:
        w.stop()


def test_timings_split_an_items_time_at_the_worker_and_the_lock_switches_fast(worker):
    """Each finished item's timing is (submit received, engine took it, PNG ready), in that order, and
    within the poll's wall time; the worker's interpreter switches threads every SWITCH_INTERVAL_S."""
    import sys

    from workers.actor import SWITCH_INTERVAL_S

    assert sys.getswitchinterval() == pytest.approx(SWITCH_INTERVAL_S) and SWITCH_INTERVAL_S < 0.005
    before = time.time()
    worker.submit([_item(90, steps=3)])
    timings = {}
    deadline = time.monotonic() + 60
    while "job/90" not in timings:
        assert time.monotonic() < deadline
        timings.update(worker.poll(wait_s=0.5)["timings"])
    received, admitted, ready = timings["job/90"]
    assert before <= received <= admitted < ready <= time.time()


def test_a_model_listed_in_fp8_runs_its_block_linears_in_fp8_and_says_so():
    from workers.speed.fp8 import Fp8Linear

    w = Worker(WorkerConfig(models=("digits", "digits-text"), max_batch=4, torch_threads=1,
                            precision={"digits-text": "fp8"}))
    try:
        assert w.wait_models() == ["digits", "digits-text"]
        assert w.info()["precision"] == {"digits": "bf16", "digits-text": "fp8"}
        assert w.info()["compiled"] == {"digits": False, "digits-text": False}
        linears = {name: [isinstance(m, Fp8Linear) for m in model.transformer.modules()]
                   for name, model in w.engine.models.items()}
        assert not any(linears["digits"]) and sum(linears["digits-text"]) == w.engine.models["digits-text"].fp8_linears > 0
        w.submit([ItemSpec(id="t/0", model="digits-text", prompt="a handwritten seven", seed=0, sampler="ddim",
                           steps=4, guidance=2.0)])
        finished, failed, _ = _drain(w, {"t/0"})
        assert failed == {} and Image.open(io.BytesIO(finished["t/0"])).size == (8, 8)
    finally:
        w.stop()


def test_pngs_are_encoded_off_the_step_loop_and_an_encoding_failure_fails_only_its_item(monkeypatch):
    """A finished image's PNG is encoded by an encoder thread: while one is held up, the engine keeps
    stepping the other items (the GPU does not wait for PNGs), the item counts as finished only once its
    PNG is ready, and an image that cannot be encoded fails that item alone."""
    import threading

    from workers import actor

    gate, real = threading.Event(), actor._png
    held = []

    def png(image, level=actor.PNG_COMPRESS_LEVEL):
        if not held:  # the first finished image waits for the test
            held.append(1)
            assert gate.wait(30)
        return real(image, level)

    monkeypatch.setattr(actor, "_png", png)
    w = Worker(WorkerConfig(models=("digits",), max_batch=8, torch_threads=1, png_compress_level=0))
    try:
        w.submit([_item(1, steps=2), _item(2, steps=40)])
        deadline, steps_while_held = time.monotonic() + 60, 0
        while steps_while_held < 5:  # the long item advances while the short one's PNG is held
            assert time.monotonic() < deadline, "the step loop waited for a PNG"
            report = w.poll()
            assert report["finished"] == []  # not finished until its PNG is ready
            steps_while_held = report["progress"].get("job/2", (0, 40))[0] if held else 0
            time.sleep(0.02)
        gate.set()
        finished, failed, _ = _drain(w, {"job/1", "job/2"})
        assert failed == {} and set(finished) == {"job/1", "job/2"}
        raw = Image.open(io.BytesIO(finished["job/1"]))
        assert raw.size == (8, 8) and len(finished["job/1"]) >= len(real(np.asarray(raw), 9))  # level 0: stored

        monkeypatch.setattr(actor, "_png", lambda image, level=1: (_ for _ in ()).throw(OSError("disk says no")))
        w.submit([_item(3, steps=2)])
        finished, failed, _ = _drain(w, {"job/3"})
        assert finished == {} and "could not be encoded: OSError: disk says no" in failed["job/3"]
    finally:
        gate.set()
        w.stop()


def test_previews_are_encoded_by_the_poll_that_takes_them_never_by_the_step_loop(monkeypatch):
    """A preview at every step costs the step loop no PNG: it keeps each item's latest raw preview, and the
    poll encodes only those it hands over (one per item, however many steps ran since the last poll)."""
    import threading

    from workers import actor

    real, encoded_on = actor._png, []

    def png(image, level=actor.PNG_COMPRESS_LEVEL):
        encoded_on.append((threading.current_thread().name, image.shape))
        return real(image, level)

    monkeypatch.setattr(actor, "_png", png)
    w = Worker(WorkerConfig(models=("digits",), max_batch=8, torch_threads=1))
    try:
        w.submit([_item(1, steps=300, preview_every=1), _item(2, steps=300, preview_every=1)])
        deadline = time.monotonic() + 30
        while not w._previews:  # several steps, each leaving a preview, and no poll in between
            assert time.monotonic() < deadline, "no preview"
            time.sleep(0.05)
        time.sleep(0.1)
        first = w.poll()
        assert first["previews"], "previews of running items ride along with a poll"
        assert sorted(k for k, _, _ in first["previews"]) == sorted({k for k, _, _ in first["previews"]})
        assert all(Image.open(io.BytesIO(data)).size == (8, 8) for _, _, data in first["previews"])
        finished, failed, reports = _drain(w, {"job/1", "job/2"})
        assert failed == {} and set(finished) == {"job/1", "job/2"}
        steps = sum(len(r["step_seconds"]) for r in [first, *reports])
        preview_pngs = [shape for name, shape in encoded_on if shape == (8, 8)]
        sent = sum(len(r["previews"]) for r in [first, *reports])
        assert len(preview_pngs) - 2 == sent  # the two finished images are the other (8, 8) PNGs
        assert sent < 2 * steps  # not one per item and step: the latest per poll
        loop_names = {name for name, _ in encoded_on if name == "engine-loop"}
        assert not loop_names, "the step loop encoded a PNG"
    finally:
        w.stop()


def test_the_fastest_speed_falls_back_where_the_device_lacks_fp8_attention_and_a_named_precision_does_not(caplog):
    """``fastest`` picks FP8 attention for FLUX.1; on a CPU (no FP8 attention) the worker runs FP8 linears and
    says so. A precision the config names is kept as asked (``load_model`` refuses it where it cannot run)."""
    from types import SimpleNamespace

    from workers.families import family_named

    flux, cpu = family_named("flux"), SimpleNamespace(device="cpu")
    with caplog.at_level("WARNING", logger="workers.actor"):
        speed = Worker._speed(cpu, WorkerConfig(speed="fastest"), "flux-dev-1024", flux)
    assert speed.precision == "fp8" and speed.compile == "inductor"
    assert "fp8+attention is not available on cpu" in caplog.text and "running fp8" in caplog.text
    named = Worker._speed(cpu, WorkerConfig(speed="fastest", precision={"flux-dev-1024": "fp8+attention"}),
                          "flux-dev-1024", flux)
    assert named.precision == "fp8+attention"
    assert Worker._speed(cpu, WorkerConfig(), "flux-dev-1024", flux).precision == "bf16"


def _slow_second_load(monkeypatch, fail: bool = False):
    """``load_model`` made to wait on an event (or fail) for ``digits-text``: the worker's later model."""
    import threading

    import workers.loading as loading

    real, gate = loading.load_model, threading.Event()

    def load(spec, **kw):
        if spec == "digits-text":
            gate.wait(30)
            if fail:
                raise RuntimeError("its weights are unreadable")
        return real(spec, **kw)

    monkeypatch.setattr(loading, "load_model", load)
    return gate


def test_a_worker_serves_its_first_model_while_the_second_loads(monkeypatch):
    """A worker listing two models is ready once the first is loaded and warm: it serves that one's items while
    the second loads (a worker killed mid-job is back after one model's load), then reports and serves both."""
    gate = _slow_second_load(monkeypatch)
    w = Worker(WorkerConfig(models=("digits", "digits-text"), max_batch=4, torch_threads=1))
    try:
        info = w.info()
        assert (info["models"], info["loading"]) == (["digits"], ["digits-text"])
        assert w.submit([_item(0, steps=4)]) == [True]
        finished, failed, reports = _drain(w, {"job/0"})
        assert failed == {} and "job/0" in finished
        assert all(r["models"] == ["digits"] and r["loading"] == ["digits-text"] for r in reports)
        gate.set()  # the second model's load ends: a long poll answers when it is served
        deadline = time.monotonic() + 60
        while (report := w.poll(wait_s=1.0))["models"] != ["digits", "digits-text"]:
            assert time.monotonic() < deadline, "the second model was never served"
        assert report["loading"] == [] and "load_failed" not in report
        assert w.info()["speed"] == {"digits": "default", "digits-text": "default"}
        text = ItemSpec(id="job/t", model="digits-text", prompt="a seven", seed=1, sampler="ddim", steps=4,
                        guidance=2.0)
        w.submit([text, _item(1, steps=4)])
        finished, failed, _ = _drain(w, {"job/t", "job/1"})
        assert failed == {} and {"job/t", "job/1"} <= finished.keys()
    finally:
        gate.set()
        w.stop()


def test_a_later_model_that_fails_to_load_is_reported_by_the_next_poll(monkeypatch):
    gate = _slow_second_load(monkeypatch, fail=True)
    w = Worker(WorkerConfig(models=("digits", "digits-text"), max_batch=4, torch_threads=1))
    try:
        gate.set()
        deadline = time.monotonic() + 30
        while "load_failed" not in (report := w.poll(wait_s=1.0)):
            assert time.monotonic() < deadline
        with pytest.raises(RuntimeError, match="loading model digits-text failed"):
            w.wait_models(timeout=1)
        assert report["load_failed"] == ("loading model digits-text failed: RuntimeError: its weights are "
                                         "unreadable")
        assert report["models"] == ["digits"]
    finally:
        w.stop()


def test_a_worker_switches_model_and_hands_back_the_items_it_no_longer_serves():
    """``unload`` stops the worker reporting a model at once and the step loop drops it between steps, handing
    its items back unrun (``returned``, never failed); ``load`` serves another model once loaded and warm. An
    item of a model the worker never knew still fails, as before."""
    w = Worker(WorkerConfig(models=("digits",), max_batch=4, torch_threads=1))
    try:
        w.submit([_item(0, steps=400), _item(1, steps=400)])  # long: still running when the unload comes
        deadline = time.monotonic() + 30
        while not w.poll()["progress"]:
            assert time.monotonic() < deadline
        assert w.unload(["digits"]) == [True] and w.load(["digits-text"]) == [True]
        first = w.poll()
        assert first["models"] == []  # at once: nothing leases it digits any more
        returned, models = set(first["returned"]), []
        while models != ["digits-text"] or returned != {"job/0", "job/1"}:
            assert time.monotonic() < deadline, (models, returned)
            report = w.poll(wait_s=1.0)
            returned |= set(report["returned"])
            models = report["models"]
            assert report["finished"] == [] and report["failed"] == [] and "load_failed" not in report
        assert set(w.engine.models) == {"digits-text"} and {k.model for k in w.engine.groups} == {"digits-text"}
        text = ItemSpec(id="job/t", model="digits-text", prompt="a seven", seed=1, sampler="ddim", steps=4,
                        guidance=2.0)
        stray, unknown = _item(2, steps=4), ItemSpec(**{**_item(3).__dict__, "model": "nope"})
        w.submit([text, stray, unknown])
        finished, failed, reports = _drain(w, {"job/t", "job/3"})
        assert set(finished) == {"job/t"} and set(failed) == {"job/3"}
        assert "job/2" in {k for r in reports for k in r["returned"]}  # digits: known here, not served now
        assert w.load(["digits"]) == [True] and w.load(["digits-text"]) == [False]  # served already
        while w.poll(wait_s=1.0)["models"] != ["digits", "digits-text"]:
            assert time.monotonic() < deadline + 30
    finally:
        w.stop()


def test_adapters_are_registered_listed_used_and_removed_through_the_worker(tmp_path):
    """``add_lora`` / ``remove_lora`` on the step loop, the poll's ``loras``, ``lora_dir`` at start-up; an item with an
    adapter finishes and differs from one without, an item naming an unknown adapter fails naming it."""
    import torch
    from safetensors.torch import save, save_file

    from workers.loading import load_model
    from workers.lora.validate import linear_shapes

    if not (DIGITS_DIR / "model_index.json").exists():
        pytest.skip("the shipped digits model (workers/models/digits) is missing")
    g = torch.Generator().manual_seed(0)
    state = {}
    for name, (fin, fout) in list(linear_shapes(load_model("digits").transformer).items())[::2]:
        state |= {f"transformer.{name}.lora_A.weight": torch.randn(2, fin, generator=g) / fin ** 0.5,
                  f"transformer.{name}.lora_B.weight": torch.randn(fout, 2, generator=g)}
    save_file(state, tmp_path / "thick.safetensors")
    w = Worker(WorkerConfig(models=("digits",), max_batch=4, torch_threads=1, lora_slots=1, lora_max_rank=2,
                            lora_dir=str(tmp_path)))
    try:
        assert w.poll()["loras"] == ["thick"]
        assert w.add_lora("thin", save(state), "digits")["model"] == "digits"
        with pytest.raises(ValueError, match="safetensors"):
            w.add_lora("bad", b"\x80not an adapter", "digits")
        assert w.poll()["loras"] == ["thick", "thin"]
        items = [_item(60, seed=1, steps=4), _item(61, seed=1, steps=4, loras=(("thick", 1.0),)),
                 _item(62, seed=1, steps=4, loras=(("thin", -1.0),)), _item(63, steps=4, loras=(("nope", 1.0),))]
        w.submit(items)
        finished, failed, reports = _drain(w, {it.id for it in items})
        assert set(failed) == {"job/63"} and "'nope'" in failed["job/63"]
        assert len({finished[f"job/6{i}"] for i in range(3)}) == 3  # one slot: "thin" waited for "thick" to leave
        assert reports[-1]["stats"]["lora"]["evictions"] >= 1
        assert w.remove_lora("thin") is True and w.remove_lora("thin") is False
        assert w.poll()["loras"] == ["thick"]
    finally:
        w.stop()
