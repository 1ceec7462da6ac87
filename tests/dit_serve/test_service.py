"""The whole service in one process, as users run it: real local Ray, a real worker actor with the
engine and the digits model, SQLite, uvicorn, the SDK over HTTP. One service for the module."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import subprocess
import sys
import threading
import time
import zipfile
from pathlib import Path

import httpx
import pytest
import ray
from PIL import Image

from dit_serve.cli import main as cli
from dit_serve.client import ApiError, AsyncClient, Client
from dit_serve.schemas import JobParams
from dit_serve.server.service import Service

from .conftest import oracle, patient, service_config

ROOT = Path(__file__).resolve().parents[2]
JOB_PARAMS = JobParams(sampler="ddim", steps=10, guidance=1.5)
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def svc(digits_model, tmp_path_factory):
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)  # never a stray cluster
    try:
        cfg = service_config(tmp_path_factory.mktemp("svc"), digits_model,
                             webhooks={"secret": "example-webhook-secret",  # examples/webhooks.py checks it
                                       "allow_hosts": ("127.0.0.1",)})  # its receivers listen here
        with Service(cfg) as service:
            assert service.wait_ready(patient(120)), "the worker did not start"
            yield service
    finally:
        ray.shutdown()


@pytest.fixture
def client(svc):
    with Client(svc.url) as c:
        yield c


def _wait_for(cond, timeout: float = 60.0, what: str = "condition"):
    deadline = time.monotonic() + patient(timeout)
    while not (value := cond()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)
    return value


def _pngs(svc: Service, job_id: str) -> list[str]:
    folder = svc.config.store.data_dir / "images" / job_id
    return sorted(p.name for p in folder.iterdir()) if folder.exists() else []


def test_submit_progress_images(svc, client):
    job = client.submit(labels=list(range(10)), num_per_label=2, seed=3)
    assert job.state in ("queued", "running") and job.num_items == 20  # the scheduler may lease it at once

    def mid_step():  # a running item part-way through its steps, as GET /v1/jobs/{id} reports it
        j = client.get(job)
        return j if any(0 < it.step < it.total_steps and it.state == "running" for it in j.items) else j.finished
    seen = _wait_for(mid_step, what="an item between steps")
    assert not isinstance(seen, bool), "the job finished before any progress was seen"
    job = client.wait(job, progress=False, timeout=patient(120))
    assert job.state == "done" and job.steps_done == job.steps_total == 20 * job.params.steps
    images = client.images(job)
    assert len(images) == 20 and images[0].size == (8, 8)
    assert oracle(images, [it.label for it in job.items]) >= 0.8
    assert _pngs(svc, job.id) == [f"{i:05d}.png" for i in range(20)]


def test_three_concurrent_jobs_with_the_async_client(svc):
    async def run():
        async with AsyncClient(svc.url) as c:
            jobs = await asyncio.gather(*[c.submit(labels=[d], num_per_label=4, seed=10 * d) for d in (1, 4, 8)])
            done = await asyncio.gather(*[c.wait(j, progress=False, timeout=patient(120)) for j in jobs])
            return done, [await c.images(j) for j in done]

    jobs, images = asyncio.run(run())
    assert [j.state for j in jobs] == ["done"] * 3
    flat = [im for ims in images for im in ims]
    assert len(flat) == 12 and oracle(flat, [1] * 4 + [4] * 4 + [8] * 4) >= 0.75


def test_cancel_stops_running_and_queued_items(svc, client):
    job = client.submit(labels=list(range(10)), num_per_label=8, steps=400)  # 80 items: more than one lease
    _wait_for(lambda: client.get(job, items=False).steps_done > 0, what="the job to start")
    cancelled = client.cancel(job)
    assert cancelled.state == "cancelled"
    time.sleep(1.5)  # a few heartbeats: the worker drops the items at its next step boundary
    after = client.get(job)
    assert after.counts == cancelled.counts and after.counts.get("cancelled", 0) > 0
    assert all(it.state in ("cancelled", "done") for it in after.items)
    _wait_for(lambda: all(w.leases == {} for w in svc.scheduler.workers.values()), 60, "leases to be dropped")
    quick = client.wait(client.submit(labels=[5], steps=10), progress=False, timeout=patient(60))
    assert quick.state == "done"  # the worker is free again


def test_openai_images_endpoint(svc):
    with httpx.Client(base_url=svc.url, timeout=patient(120)) as http:
        r = http.post("/v1/images/generations", json={"model": "digits", "prompt": "seven", "n": 3,
                                                      "size": "8x8", "response_format": "b64_json"})
        assert r.status_code == 200, r.text
        body = r.json()
        assert set(body) == {"created", "data"} and len(body["data"]) == 3
        images = [Image.open(io.BytesIO(base64.b64decode(d["b64_json"]))) for d in body["data"]]
        assert oracle(images, [7, 7, 7]) >= 2 / 3
        r = http.post("/v1/images/generations", json={"prompt": "2", "response_format": "url", "seed": 9})
        url = r.json()["data"][0]["url"]
        assert url.startswith(svc.url) and http.get(url).headers["content-type"] == "image/png"


def test_archive_and_metrics(svc, client):
    job = client.wait(client.submit(labels=[0, 1], steps=20), progress=False, timeout=patient(60))
    path = client.archive(job, svc.config.store.data_dir / "a.zip")
    with zipfile.ZipFile(path) as z:
        assert sorted(z.namelist()) == ["00000.png", "00001.png", "manifest.json"]
        manifest = json.loads(z.read("manifest.json"))
    assert [e["label"] for e in manifest["images"]] == [0, 1] and manifest["state"] == "done"
    text = httpx.get(f"{svc.url}/metrics").text
    for name in ("dit_serve_queue_depth", "dit_serve_items_per_second", "dit_serve_step_seconds_count",
                 "dit_serve_graph_replays", "dit_serve_graph_eager_fallbacks", "dit_serve_worker_busy_fraction"):
        assert name in text
    assert 'dit_serve_items_total{state="done"}' in text
    assert httpx.get(f"{svc.url}/healthz").json()["workers"] == 1


def test_cli_submit_status_fetch(svc, tmp_path, capsys):
    assert cli(["submit", "--url", svc.url, "--labels", "3,nine", "--num-per-label", "2", "--steps", "20",
                "--out", str(tmp_path / "imgs")]) == 0
    job_id = capsys.readouterr().out.splitlines()[0]
    manifest = json.loads((tmp_path / "imgs" / "manifest.json").read_text())
    assert [e["label"] for e in manifest["images"]] == [3, 3, 9, 9] and (tmp_path / "imgs" / "grid.png").exists()
    assert cli(["status", "--url", svc.url, job_id]) == 0
    assert f"{job_id} done: 4 done" in capsys.readouterr().out
    assert cli(["fetch", "--url", svc.url, job_id, "--out", str(tmp_path / "again")]) == 0
    assert len(list((tmp_path / "again").glob("*_label*.png"))) == 4
    capsys.readouterr()
    assert cli(["list", "--url", svc.url, "--limit", "1"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith(f"{job_id} done: 4 done") and out.count("\n") == 1
    total = int(err.split(" of ")[1].split()[0])
    assert err.startswith("1-1 of ") and ("more with --offset 1" in err) == (total > 1)
    assert cli(["list", "--url", svc.url, "--limit", "0"]) == 2
    assert "limit" in capsys.readouterr().err
    assert cli(["cancel", "--url", svc.url, job_id, "--delete"]) == 0
    assert capsys.readouterr().out.strip() == f"{job_id} done: 4 done; 80/80 steps (digits, ddim, 20 steps) (deleted)"
    assert cli(["status", "--url", svc.url, job_id]) == 2 and not _pngs(svc, job_id)
    assert capsys.readouterr().err == f"dit-serve: error: no job with id {job_id!r}\n"
    assert cli(["submit", "--url", svc.url, "--labels", "12"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "outside model 'digits'" in err
    assert cli(["status", "--url", svc.url, "nope"]) == 2


def test_finished_jobs_are_deleted_after_the_retention(svc, client):
    done = client.wait(client.submit(labels=[5], steps=5), progress=False, timeout=patient(60))
    assert _pngs(svc, done.id) == ["00000.png"]
    running = client.submit(labels=[6] * 4, steps=400)
    svc.retention.seconds = 1.0
    try:
        _wait_for(lambda: not _pngs(svc, done.id), timeout=30, what="the finished job's deletion")
        with pytest.raises(ApiError) as e:
            client.get(done)
        assert e.value.status == 404
        assert not client.get(running).finished  # an unfinished job is never deleted
    finally:
        svc.retention.seconds = 0.0
        client.cancel(running)


class _Receiver:
    """A webhook receiver on a free local port: records each POST; answers 500 to the first ``fail`` ones."""

    def __init__(self, fail: int = 0):
        import http.server

        self.posts: list[tuple[dict, bytes]] = []
        receiver = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers["Content-Length"]))
                receiver.posts.append((dict(self.headers), body))
                self.send_response(500 if len(receiver.posts) <= fail else 204)
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()


def test_a_webhook_is_delivered_signed_and_retried(svc, client):
    from dit_serve.server.config import WebhookConfig
    from dit_serve.server.webhooks import sign

    receiver = _Receiver(fail=1)
    normal = svc.notifier.cfg
    svc.notifier.cfg = WebhookConfig(secret="s3cret-for-tests", backoff_s=0.2, max_attempts=3)
    try:
        job = client.submit(labels=[2, 3], steps=5, webhook_url=receiver.url)
        assert job.webhook.state == "pending" and job.webhook.url == receiver.url
        job = client.wait(job, progress=False, timeout=patient(60))
        _wait_for(lambda: client.get(job).webhook.state == "sent", timeout=30, what="the webhook's delivery")
        assert len(receiver.posts) == 2  # a 500, then a retry that got through
        headers, body = receiver.posts[-1]
        assert headers["X-Dit-Serve-Event"] == "job.finished"
        assert headers["X-Dit-Serve-Signature"] == sign("s3cret-for-tests", body)
        sent = json.loads(body)
        assert sent["event"] == "job.finished" and sent["job"]["id"] == job.id and sent["job"]["state"] == "done"
        assert [it["state"] for it in sent["job"]["items"]] == ["done", "done"]
        assert client.get(job).webhook.attempts == 2
        assert receiver.posts[0][0]["X-Dit-Serve-Delivery"] != headers["X-Dit-Serve-Delivery"]

        dead = client.submit(labels=[4], steps=5, webhook_url="http://127.0.0.1:9/nobody-listens")
        client.wait(dead, progress=False, timeout=patient(60))
        _wait_for(lambda: client.get(dead).webhook.state == "failed", timeout=30, what="the webhook to give up")
        hook = client.get(dead).webhook
        assert hook.attempts == 3 and "ConnectError" in hook.error
    finally:
        svc.notifier.cfg = normal
        receiver.close()


@pytest.mark.parametrize("script, args", [
    ("quickstart.py", []),
    ("batch_job.py", ["--count", "30"]),
    ("openai_images.py", []),
    ("webhooks.py", ["--secret", "example-webhook-secret"]),
])
def test_examples(svc, tmp_path, script, args):
    r = subprocess.run([sys.executable, str(ROOT / "examples" / script), "--url", svc.url, "--out", str(tmp_path),
                        *args], capture_output=True, text=True, timeout=patient(180), cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "wrote" in r.stdout or "PNGs" in r.stdout
    assert list(tmp_path.glob("*.png")) or list(tmp_path.glob("*.zip"))


def test_split_roles_on_postgres(svc, digits_model, postgres_url, tmp_path):
    """The deployment with several API processes: an API-only service and a scheduler-only service
    (its own worker, in the same Ray) that share only a PostgreSQL store and the data folder."""
    cfg = service_config(tmp_path, digits_model, store={"url": postgres_url})
    with Service(cfg, roles=("scheduler",)) as sched, Service(cfg, roles=("api",)) as api, Client(api.url) as c:
        assert sched.store.engine.dialect.name == "postgresql" and api.scheduler is None
        job = c.wait(c.submit(labels=list(range(10)), seed=5), progress=False, timeout=patient(180))
        assert job.state == "done" and oracle(c.images(job), list(range(10))) >= 0.8
        assert httpx.get(f"{api.url}/healthz").json()["workers"] is None  # the API process runs none
        # ... but tells of the scheduler's, from the store
        listed = _wait_for(lambda: httpx.get(f"{api.url}/v1/workers").json()["data"], what="the worker listed")
        assert [(w["state"], w["models"]) for w in listed] == [("ready", ["digits"])]


def test_a_killed_worker_loses_nothing(svc, client):
    """Kill the worker mid-job: its items return to the queue, a new worker finishes them, and each
    item ends with exactly one PNG."""
    job = client.submit(labels=list(range(10)), num_per_label=2, steps=300, seed=50)
    _wait_for(lambda: client.get(job, items=False).steps_done > 0, what="the job to start")
    (victim,) = svc.scheduler.workers.values()
    ray.kill(victim.handle, no_restart=True)
    job = client.wait(job, progress=False, timeout=patient(180))
    assert job.state == "done"
    assert max(it.attempts for it in job.items) == 2  # two runs of the items the worker held ...
    assert {(it.attempts - 1, it.requeues, it.crashes) for it in job.items} <= {(0, 0, 0), (1, 1, 1)}  # ... uncharged
    assert _pngs(svc, job.id) == [f"{i:05d}.png" for i in range(20)]
    assert oracle(client.images(job), [it.label for it in job.items]) >= 0.8
    assert svc.scheduler.num_ready == 1 and victim.key in svc.scheduler.workers


def test_a_client_that_hangs_up_cancels_its_generation(svc):
    before = {j.id for j in svc.store.list_jobs(100, 0)[0]}
    with pytest.raises(httpx.ReadTimeout):  # the client gives up after 1 s and closes its connection
        httpx.post(f"{svc.url}/v1/images/generations", json={"prompt": "3", "n": 4, "steps": 1000}, timeout=1.0)
    (job,) = [j for j in svc.store.list_jobs(100, 0)[0] if j.id not in before]
    _wait_for(lambda: svc.store.get_job(job.id).state == "cancelled", timeout=60, what="the abandoned job's cancel")


def test_a_poison_item_fails_alone_and_its_batch_mates_finish(svc, digits_model, tmp_path, monkeypatch):
    """A worker that dies (os._exit) whenever it runs the item with seed 666: the scheduler splits the
    batches that crash until that item runs alone, fails it with the reason, and finishes the rest."""

    class PoisonedWorker:  # defined here, so Ray ships it by value; stands in for workers.actor.Worker
        def __init__(self, spec):
            self.items = {}

        def info(self):
            return {"models": ["digits"], "device": "cpu", "backend": "fake"}

        def submit(self, items):
            self.items.update({it.id: (it, time.monotonic()) for it in items})
            return [True] * len(items)

        def cancel(self, ids):
            for i in ids:
                self.items.pop(i, None)
            return [True] * len(ids)

        def poll(self, wait_s=0.0):
            import os

            now = time.monotonic()
            if any(it.seed == 666 and now - t0 > 0.2 for it, t0 in self.items.values()):
                os._exit(1)
            done = [i for i, (_, t0) in self.items.items() if now - t0 > 0.3]
            for i in done:
                del self.items[i]
            return {"progress": {}, "finished": [(i, b"png") for i in done], "failed": [], "crashed": [],
                    "step_seconds": [], "busy_s": 0.0, "window_s": 0.0, "stats": {}}

    monkeypatch.setattr("dit_serve.server.scheduler._actor_class", lambda: ray.remote(max_restarts=0, concurrency_groups={"poll": 1})(PoisonedWorker))
    monkeypatch.setattr("dit_serve.server.store.leases.requeue_backoff", lambda n: 0.0)
    cfg = service_config(tmp_path, digits_model, workers={"max_batch": 4})
    with Service(cfg, roles=("scheduler",)) as sched:
        seeds = [1, 666, 2, 3, 4, 5, 6, 7]
        job_id = sched.store.create_job("digits", JOB_PARAMS, [0] * 8, seeds)
        _wait_for(lambda: sched.store.get_job(job_id).finished, timeout=90, what="the poisoned job to end")
        job = sched.store.get_job(job_id)
        assert job.counts == {"done": 7, "failed": 1}, job.items
        bad = job.items[1]
        assert bad.error.startswith("this item crashed its worker 2 times while it ran alone (the last: worker died")
        # [0..3] crash twice (suspects), then [0, 1] crashes, [2, 3] finish, [0] finishes, [1] crashes twice alone
        assert bad.crashes == 5 and job.items[0].crashes == 3 and job.items[2].crashes == 2
        assert all(it.crashes == 0 for it in job.items[4:])


def test_a_text_model_end_to_end(svc, tmp_path):
    """Prompts through the whole service: jobs API, the worker's text encoder, the images endpoint."""
    from workers.models.tiny_pixart import make_tiny_pixart

    model_dir = make_tiny_pixart(tmp_path / "models" / "pixart-tiny")
    cfg = service_config(tmp_path / "data", str(model_dir), workers={"max_batch": 4})
    with Service(cfg) as text_svc, Client(text_svc.url) as c:
        assert text_svc.wait_ready(patient(120))
        job = c.wait(c.submit(prompts=["a red cat", "a blue house"], num_per_prompt=2, steps=4, seed=1,
                              negative_prompt="small"), progress=False, timeout=120)
        assert job.state == "done" and [it.prompt for it in job.items] == ["a red cat"] * 2 + ["a blue house"] * 2
        images = c.images(job)
        assert [im.size for im in images] == [(16, 16)] * 4 and images[0].mode == "RGB"
        assert images[0].tobytes() != images[1].tobytes()  # seeds 1 and 2
        r = httpx.post(f"{text_svc.url}/v1/images/generations", timeout=patient(60),
                       json={"prompt": "a dog", "n": 2, "steps": 3, "response_format": "b64_json"})
        assert r.status_code == 200, r.text
        assert len(r.json()["data"]) == 2 and Image.open(io.BytesIO(base64.b64decode(r.json()["data"][0]["b64_json"]))).size == (16, 16)


def test_mmdit_models_in_one_worker_end_to_end(tmp_path):
    """SD3 and FLUX (tiny, real layouts) served by one worker: prompts, negative prompts (SD3), sizes,
    exact sizes, and the images endpoint, through the whole service."""
    from workers.models.tiny_flux import make_tiny_flux
    from workers.models.tiny_sd3 import make_tiny_sd3

    sd3, flux = make_tiny_sd3(tmp_path / "models" / "sd3-tiny"), make_tiny_flux(tmp_path / "models" / "flux-tiny")
    cfg = service_config(tmp_path / "data", str(sd3), workers={"max_batch": 4, "models": (str(sd3), str(flux))})
    with Service(cfg) as svc, Client(svc.url) as c:
        assert svc.wait_ready(patient(180))
        a = c.submit(prompts=["a red cat", "a blue house"], model="sd3-tiny", steps=3, negative_prompt="blurry",
                     width=32, height=16)
        b = c.submit(prompts=["a dog"], num_per_prompt=2, model="flux-tiny", steps=3, width=90, height=60,
                     exact_size=True)
        a, b = c.wait(a, progress=False, timeout=patient(180)), c.wait(b, progress=False, timeout=patient(180))
        assert a.state == "done" and [im.size for im in c.images(a)] == [(32, 16)] * 2
        assert b.state == "done" and (b.params.width, b.params.height) == (80, 48)  # rounded down, as FluxPipeline
        assert "makes 80x48 (rounded down" in b.params.warnings[0]                  # does, and said
        assert [im.size for im in c.images(b)] == [(90, 60)] * 2                 # then resized to the asked one
        r = httpx.post(f"{svc.url}/v1/images/generations", timeout=patient(120),
                       json={"model": "flux-tiny", "prompt": "a tree", "size": "64x96", "steps": 2,
                             "response_format": "b64_json"})
        assert r.status_code == 200, r.text
        assert Image.open(io.BytesIO(base64.b64decode(r.json()["data"][0]["b64_json"]))).size == (64, 96)


def test_previews_arrive_before_their_item_and_wait_gets_pil_images(svc, client):
    job = client.submit(labels=[3, 7], seed=5, steps=400, preview_every=2)
    assert job.params.preview_every == 2
    events = []
    for ev in client.events(job, timeout=patient(120)):
        events.append(ev)
        if ev.event == "preview" and len([e for e in events if e.event == "preview"]) == 1:
            r = httpx.get(f"{svc.url}{ev.url}", timeout=10)  # may have ended meanwhile: then a 404
            assert r.status_code == 404 or (r.headers["content-type"] == "image/png"
                                            and Image.open(io.BytesIO(r.content)).size == (8, 8))
    previews = [e for e in events if e.event == "preview"]
    assert previews, "no preview event"
    for index in (0, 1):
        steps = [e.step for e in previews if e.index == index]
        assert steps == sorted(set(steps)) and all(s % 2 == 0 and 0 < s < 400 for s in steps)
        item_at = next(i for i, e in enumerate(events) if e.event == "item" and e.index == index)
        assert all(i < item_at for i, e in enumerate(events) if e.event == "preview" and e.index == index)
    with pytest.raises(ApiError) as err:  # ended: no preview any more
        client._call("GET", f"/v1/jobs/{job.id}/items/0/preview")
    assert err.value.status == 404
    assert not list((svc.config.store.data_dir / "previews" / job.id).glob("*.png"))

    got = []
    job = client.submit(labels=[1], seed=6, steps=400, preview_every=2)
    done = client.wait(job, progress=False, timeout=patient(120), on_preview=lambda i, s, im: got.append((i, s, im)))
    assert done.state == "done" and got and all(i == 0 and im.size == (8, 8) for i, _, im in got)
    assert [s for _, s, _ in got] == sorted({s for _, s, _ in got})


def test_bad_preview_every_is_a_400(svc, client):
    for bad in (-1, 1001, "x"):
        with pytest.raises(ApiError) as err:
            client.submit(labels=[1], preview_every=bad)
        assert err.value.status == 400 and err.value.param == "preview_every"


def test_an_adapter_uploaded_to_the_service_changes_only_the_images_that_name_it(tmp_path):
    """Per-request LoRA through the whole service: an adapter uploaded over HTTP, pushed to the worker, applied to
    the rows that name it (a job with it and one without, same seeds, run side by side), recorded in the job."""
    import numpy as np
    from safetensors.numpy import save

    rng = np.random.default_rng(0)
    width, rank = 128, 4  # digits-text: 4 blocks of 128-wide attention
    tensors = {}
    for block in range(4):
        for proj in ("to_q", "to_v", "to_out.0"):
            m = f"transformer.transformer_blocks.{block}.attn1.{proj}"
            tensors[f"{m}.lora_A.weight"] = rng.normal(0, 0.3, (rank, width)).astype(np.float32)
            tensors[f"{m}.lora_B.weight"] = rng.normal(0, 0.3, (width, rank)).astype(np.float32)
    adapter = tmp_path / "bold.safetensors"
    adapter.write_bytes(save(tensors))
    cfg = service_config(tmp_path / "data", "digits-text", workers={"max_batch": 8, "lora_slots": 2,
                                                                    "lora_max_rank": 8})
    with Service(cfg) as svc, Client(svc.url) as c:
        assert svc.wait_ready(patient(120))
        assert c.upload_lora(adapter, "bold", "digits-text").name == "bold"
        prompts = ["the digit three", "the digit seven"]
        plain = c.submit(prompts=prompts, seed=5, steps=6)
        styled = c.submit(prompts=prompts, seed=5, steps=6, loras=[("bold", 1.5)])
        plain, styled = (c.wait(j, progress=False, timeout=patient(120)) for j in (plain, styled))
        assert plain.state == styled.state == "done"
        assert [lo.name for lo in styled.params.loras] == ["bold"] and not plain.params.loras
        a, b = c.images(plain), c.images(styled)
        again = c.images(c.wait(c.submit(prompts=prompts, seed=5, steps=6), progress=False, timeout=patient(120)))
        assert [x.tobytes() for x in a] == [x.tobytes() for x in again]  # without it: the same images
        assert all(x.tobytes() != y.tobytes() for x, y in zip(a, b))   # with it: changed
        # /metrics: the worker's adapters (resident, loads, images per adapter), from its polled reports
        want = {"dit_serve_lora_rows": ('adapter="bold"', 2.0), "dit_serve_lora_resident": ('model="digits-text"', 1.0),
                "dit_serve_lora_loads": ("", 1.0), "dit_serve_lora_evictions": ("", 0.0)}
        deadline, got = time.monotonic() + 60, {}
        while time.monotonic() < deadline:
            lines = httpx.get(f"{svc.url}/metrics", timeout=30).text.splitlines()
            got = {name: float(ln.rsplit(" ", 1)[1]) for name, (label, _) in want.items() for ln in lines
                   if ln.startswith(name + "{") and label in ln}
            if got == {name: value for name, (_, value) in want.items()}:
                break
            time.sleep(0.5)
        assert got == {name: value for name, (_, value) in want.items()}, got
