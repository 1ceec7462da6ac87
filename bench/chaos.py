"""Reliability under failure: workers and the whole service killed mid-job, fuzzed requests, overload.

Each subcommand starts `dit-serve serve` as a subprocess (its own session, a fresh data folder, a free
port), drives it over HTTP, writes docs/benchmarks/chaos_<name>.json (hardware, versions, the command
line; `_smoke` is added to the name for --smoke, whose reports go to a temporary folder unless --out names
one) and prints a table. Exit status 1 if a check failed.

  worker-kill  one job of N images (labels 0..9 cycling, item i with seed i); the worker actor process
               (`ray::Worker`, a descendant of this serve) gets SIGKILL K times, each time once a new
               worker is ready and the job has progressed again, after a seeded random delay. Then: every
               item done once, none failed, one PNG each, each equal to the same (label, seed) made by a
               local engine (equality required on a CPU, or with --exact; bf16 on a GPU may differ by a
               few uint8 levels with the batch's composition).
  serve-kill   the same, but SIGKILL the serve process alone and start it again on the same data folder
               and port; its descendants still alive 10 s after the kill are recorded as leaked (then
               killed, so they do not pile up).
  fuzz         schemathesis (all checks) against /openapi.json of a service with an API key, until at least
               --cases test cases ran: no 5xx, and the jobs in the store changed by exactly the accepted
               submissions minus the purged jobs, as recorded in schemathesis' HAR report.
  overload     capacity (images/s of a saturated job), then --factor x capacity offered as jobs of 1-8
               images from client threads, 429s not retried: status codes, Retry-After on every 429,
               queue depth over time (bounded by [limits] max_queued_items), RSS of serve and its children.

--autoscale (worker-kill, serve-kill; the report's name gets `_autoscale`): the service runs with [autoscale]
on from no worker (min_workers 0, up to --autoscale-workers: CPU workers on a machine without CUDA, else one per
GPU): the job is submitted first and its backlog starts the workers; a killed worker is replaced because the
backlog still asks for it; after the job, the idle workers must stop (scale to zero within --idle-timeout and
a minute).

    python bench/chaos.py worker-kill --images 500 --kills 20 [--model dit-xl-2-256] [--exact]
    python bench/chaos.py serve-kill --images 500 --kills 10
    python bench/chaos.py fuzz --cases 2000
    python bench/chaos.py overload --minutes 10 --factor 2
    python bench/chaos.py all --smoke       # each at a tiny size on a CPU (20 images, 2 kills, 50 cases, 20 s)
    python bench/chaos.py all --smoke --autoscale   # worker-kill and serve-kill with [autoscale] on
"""

from __future__ import annotations

import argparse
import io
import json
import math
import os
import platform
import queue
import random
import re
import secrets
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import httpx
import numpy as np
from PIL import Image

URL_LINE = re.compile(r"dit-serve: serving .* at (http://\S+?); store")
WORKER_TITLE = "ray::Worker"  # Ray names an actor's process after its class: "ray::Worker", "ray::Worker.poll"
# --smoke: tiny sizes for a CPU; 100 steps so that a kill can land while a batch runs; a queue bound of
# 100 (64 running + 36 queued) so that 20 s at twice the capacity meet it
SMOKE = {"images": 20, "kills": 2, "steps": 100, "cases": 50, "minutes": 1 / 3, "probe_images": 64,
         "max_queued": 100, "sample_s": 1.0}


# -- processes, from /proc ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Proc:
    pid: int
    ppid: int
    start: int     # start time in clock ticks after boot: tells a reused PID apart
    cmdline: str

    @property
    def title(self) -> str:
        return self.cmdline.split(" ", 1)[0]


def processes() -> dict[int, Proc]:
    """The machine's live processes (zombies left out)."""
    table = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(entry.path, "stat").read_text()
            cmd = Path(entry.path, "cmdline").read_bytes()
        except OSError:  # ended meanwhile
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # the name before it may hold spaces and parentheses
        if fields[0] != "Z":
            table[int(entry.name)] = Proc(int(entry.name), int(fields[1]), int(fields[19]),
                                          cmd.replace(b"\0", b" ").decode(errors="replace").strip())
    return table


def descendants(root: int, table: dict[int, Proc] | None = None) -> list[Proc]:
    table = processes() if table is None else table
    children: dict[int, list[Proc]] = {}
    for p in table.values():
        children.setdefault(p.ppid, []).append(p)
    found, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child.pid)
    return found


def still_alive(procs: list[Proc]) -> list[Proc]:
    table = processes()
    return [p for p in procs if (q := table.get(p.pid)) is not None and q.start == p.start]


def kill_all(procs: list[Proc]) -> None:
    for p in still_alive(procs):
        try:
            os.kill(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def rss_bytes(pids: list[int]) -> int:
    total = 0
    for pid in pids:
        try:
            total += int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, IndexError):
            pass
    return total


def tree_rss(root: int) -> int:
    return rss_bytes([root] + [p.pid for p in descendants(root)])


def proc_label(pid: int) -> str:
    """A short name for a process of the service's tree: the serve process, Ray's daemons (gcs_server,
    raylet, ...), and Ray workers by what they run (``ray::Worker`` for the worker actor)."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return "?"
    first = argv[0]
    if first.startswith("ray::"):
        return first.split(".")[0].split(" ")[0]
    name = Path(first.split(" ")[0]).name
    if name.startswith("python"):
        script = next((a for a in argv[1:] if a and not a.startswith("-")), "")
        return f"python {Path(script).name}" if script else name
    return name


def rss_by_process(root: int) -> dict[str, float]:
    """RSS in MiB per process label (processes with the same label summed)."""
    out: dict[str, float] = {}
    for pid in [root] + [p.pid for p in descendants(root)]:
        label = "serve" if pid == root else proc_label(pid)
        out[label] = round(out.get(label, 0.0) + rss_bytes([pid]) / 2**20, 1)
    return out


# -- the service as a subprocess ---------------------------------------------------------------------
@dataclass
class Served:
    proc: subprocess.Popen
    url: str
    log: Path


def start_serve(data_dir: Path, log: Path, port: int = 0, config: Path | None = None, models=(),
                env: dict | None = None, timeout: float = 120.0) -> Served:
    """`dit-serve serve` in its own session; returns once it printed the URL it listens on."""
    cmd = [sys.executable, "-m", "dit_serve.cli", "serve", "--port", str(port), "--data-dir", str(data_dir)]
    cmd += ["--config", str(config)] if config else []
    cmd += [a for m in models for a in ("--model", m)]
    with log.open("ab") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, env={**os.environ, **(env or {})},
                                start_new_session=True)
    found: queue.Queue = queue.Queue()
    threading.Thread(target=_pump, args=(proc, log, found), daemon=True).start()
    try:
        url = found.get(timeout=timeout)
    except queue.Empty:
        url = None
    if url is None:
        stop_serve(Served(proc, "", log), timeout=10)
        raise RuntimeError(f"serve did not start: {tail(log)}")
    return Served(proc, url, log)


def _pump(proc: subprocess.Popen, log: Path, found: queue.Queue) -> None:
    """Copy serve's stdout to the log, handing the URL over when its line appears (the pipe must drain)."""
    with log.open("ab") as f:
        for line in proc.stdout:
            f.write(line)
            f.flush()
            if m := URL_LINE.search(line.decode(errors="replace")):
                found.put(m.group(1))
    found.put(None)


def tail(log: Path, n: int = 2000) -> str:
    return log.read_text(errors="replace")[-n:] if log.exists() else ""


def wait_ready(s: Served, workers: int = 1, timeout: float = 300.0) -> float:
    """Until /healthz reports ``workers`` ready workers; returns the seconds waited."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if s.proc.poll() is not None:
            raise RuntimeError(f"serve exited with {s.proc.returncode}: {tail(s.log)}")
        if ((health(s.url) or {}).get("workers") or 0) >= workers:
            return time.monotonic() - t0
        time.sleep(0.2)
    raise RuntimeError(f"no worker ready within {timeout:.0f} s: {tail(s.log)}")


def stop_serve(s: Served, timeout: float = 90.0) -> dict:
    """SIGTERM (a drain), then SIGKILL of its session if it hangs; reports its descendants left running."""
    tree = descendants(s.proc.pid)
    if s.proc.poll() is None:
        s.proc.send_signal(signal.SIGTERM)
    try:
        code = s.proc.wait(timeout)
    except subprocess.TimeoutExpired:
        os.killpg(s.proc.pid, signal.SIGKILL)
        code = s.proc.wait(30)
    time.sleep(5.0)  # a local Ray's processes follow their service within about 3 s (dit_serve.server.reaper)
    left = still_alive(tree)
    kill_all(left)
    return {"exit_code": code, "left_running": [p.title for p in left]}


def write_config(path: Path, args, text: str = "") -> Path | None:
    """The serve's config file: ``text``, and with --autoscale the [autoscale] section; None when empty."""
    if args.autoscale:
        import torch

        if not torch.cuda.is_available():  # no GPU node to wait for: the workers are CPU slots
            text += f'[workers]\nresource = "CPU"\ncpu_workers = {args.autoscale_workers}\n'
        # the default rate (100 image-steps/s) over 5 s: the job's backlog asks for every worker allowed
        text += (f"[autoscale]\nenabled = true\nmin_workers = 0\nmax_workers = {args.autoscale_workers}\n"
                 f"idle_timeout_s = {args.idle_timeout}\ntarget_drain_s = 5\n")
    if not text:
        return None
    path.write_text(text)
    return path


def wait_scaled_to_zero(s: Served, args) -> dict:
    """After the job, with --autoscale: until no worker is ready or running (/healthz, the worker processes),
    within the idle timeout and a minute."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < args.idle_timeout + 60:
        if ((health(s.url) or {}).get("workers") or 0) == 0 and not worker_procs(s.proc.pid):
            return {"ok": True, "s": round(time.monotonic() - t0, 1)}
        time.sleep(0.5)
    return {"ok": False, "s": None}


def autoscale_checks(result: dict, scaled: dict | None) -> None:
    """With --autoscale: the idle workers stopped after the job."""
    if scaled is not None:
        result["summary"]["scaled to zero after the job (s)"] = scaled["s"]
        result["checks"]["idle workers stopped (scale to zero)"] = scaled["ok"]


# -- HTTP --------------------------------------------------------------------------------------------
def health(url: str) -> dict | None:
    try:
        return httpx.get(f"{url}/healthz", timeout=5).json()
    except (httpx.HTTPError, ValueError):
        return None


def get_job(url: str, job_id: str, items: bool = False) -> dict:
    """The job as JSON (not the SDK's model: per-item fields newer than the SDK show up too)."""
    r = httpx.get(f"{url}/v1/jobs/{job_id}", params={"items": items}, timeout=30)
    r.raise_for_status()
    return r.json()


def wait_job(url_of, job_id: str, timeout: float) -> dict:
    """Poll until the job has finished; ``url_of()`` gives the current URL (it changes on restarts)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            job = get_job(url_of(), job_id)
            if job["state"] in ("done", "failed", "cancelled"):
                return get_job(url_of(), job_id, items=True)
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"job {job_id} not finished after {timeout:.0f} s")


def metrics(url: str, counters: bool = True) -> dict[str, float]:
    """The service's samples from /metrics (``dit_serve_*``; only the counters, ``*_total``, by default)."""
    out = {}
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        name, _, value = line.rpartition(" ")
        if line.startswith("dit_serve_") and ("_total" in name or not counters):
            out[name] = float(value)
    return out


def submit_job(url: str, args, key: str) -> str:
    from dit_serve.client import Client

    with Client(url) as c:
        job = c.submit([i % 10 for i in range(args.images)], model=args.model or "digits", seed=0,
                       sampler=args.sampler, steps=args.steps, idempotency_key=key)
    return job.id


# -- killing mid-job ---------------------------------------------------------------------------------
def wait_progress(url_of, job_id: str, timeout: float = 300.0) -> dict | None:
    """Until the job's steps grow past what they were when this was called: a batch is running.
    None if the job finished first."""
    base = get_job(url_of(), job_id)["steps_done"]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        job = get_job(url_of(), job_id)
        if job["state"] in ("done", "failed", "cancelled"):
            return None
        if job["steps_done"] > base:
            return job
        time.sleep(0.1)
    raise TimeoutError(f"job {job_id} made no progress within {timeout:.0f} s")


def worker_procs(serve_pid: int) -> list[Proc]:
    return [p for p in descendants(serve_pid) if p.title == WORKER_TITLE or p.title.startswith(WORKER_TITLE + ".")]


def kill_worker(s: Served, job_id: str, workers: int, rng: random.Random, max_delay: float) -> dict | None:
    """One kill: wait until all ``workers`` are back (the scheduler dropped the dead one and started
    another) and the job progresses, then a random delay, then SIGKILL to one worker process."""
    t0 = time.monotonic()
    while len(worker_procs(s.proc.pid)) < workers:
        if time.monotonic() - t0 > 300:
            raise RuntimeError(f"no new worker process within 300 s: {tail(s.log)}")
        time.sleep(0.1)
    wait_ready(s, workers)
    recovery = time.monotonic() - t0
    if wait_progress(lambda: s.url, job_id) is None:
        return None
    time.sleep(rng.uniform(0.0, max_delay))
    victim = rng.choice(worker_procs(s.proc.pid))
    before = get_job(s.url, job_id)
    os.kill(victim.pid, signal.SIGKILL)
    while still_alive([victim]):
        time.sleep(0.05)
    return {"pid": victim.pid, "recovery_s": round(recovery, 2), "counts": before["counts"],
            "steps_done": before["steps_done"]}


def run_worker_kill(args, tmp: Path) -> dict:
    config = write_config(tmp / "dit-serve.toml", args)
    s = start_serve(tmp / "data", tmp / "serve.log", config=config, models=[args.model] if args.model else [])
    scaled = None
    try:
        if args.autoscale:  # no worker until the job's backlog asks for them; kills need one back, not all
            t0 = time.monotonic()
            job_id = submit_job(s.url, args, key=f"chaos-{secrets.token_hex(8)}")
            wait_ready(s)
            workers = 1
        else:
            wait_ready(s)
            workers = len(worker_procs(s.proc.pid))  # one per GPU: all started together, so alive by now
            wait_ready(s, workers)
            t0 = time.monotonic()
            job_id = submit_job(s.url, args, key=f"chaos-{secrets.token_hex(8)}")
        rng, kills = random.Random(args.seed), []
        while len(kills) < args.kills and (k := kill_worker(s, job_id, workers, rng, args.max_delay)) is not None:
            kills.append({"t_s": round(time.monotonic() - t0, 2), **k})
            print(f"chaos: kill {len(kills)}/{args.kills} at {kills[-1]['t_s']} s", file=sys.stderr, flush=True)
        job = wait_job(lambda: s.url, job_id, args.timeout)
        elapsed = time.monotonic() - t0
        commits = metrics(s.url)
        scaled = wait_scaled_to_zero(s, args) if args.autoscale else None
    finally:
        stopped = stop_serve(s)
    result = kill_result(check_job(job, tmp / "data", args), kills, args.kills, elapsed, stopped)
    autoscale_checks(result, scaled)
    done_commits = commits.get('dit_serve_items_total{state="done"}', 0)
    result["checks"]["one commit per done item (metrics)"] = done_commits == result["summary"]["done"]
    result["details"]["counters"] = commits
    return result


def run_serve_kill(args, tmp: Path) -> dict:
    config = write_config(tmp / "dit-serve.toml", args, f"[store]\nlease_seconds = {args.lease_seconds}\n")
    models, data, log = [args.model] if args.model else [], tmp / "data", tmp / "serve.log"
    s = start_serve(data, log, config=config, models=models)
    rng, kills, scaled = random.Random(args.seed), [], None
    try:
        if not args.autoscale:  # with it, the job's backlog starts the workers
            wait_ready(s)
        t0 = time.monotonic()
        job_id = submit_job(s.url, args, key=f"chaos-{secrets.token_hex(8)}")  # the only submission
        while len(kills) < args.kills and wait_progress(lambda: s.url, job_id) is not None:
            time.sleep(rng.uniform(0.0, args.max_delay))
            kills.append({"t_s": round(time.monotonic() - t0, 2), **kill_serve(s, job_id)})
            print(f"chaos: kill {len(kills)}/{args.kills} at {kills[-1]['t_s']} s", file=sys.stderr, flush=True)
            t1 = time.monotonic()
            s = restart(data, log, config, models, port=int(s.url.rsplit(":", 1)[1]))
            wait_ready(s)  # with --autoscale, once the dead process's leases expired and queued its items again
            kills[-1]["restart_s"] = round(time.monotonic() - t1, 2)
        job = wait_job(lambda: s.url, job_id, args.timeout)
        elapsed = time.monotonic() - t0
        scaled = wait_scaled_to_zero(s, args) if args.autoscale else None
    finally:
        stopped = stop_serve(s)
    result = kill_result(check_job(job, data, args), kills, args.kills, elapsed, stopped)
    autoscale_checks(result, scaled)
    leaked = [len(k["leaked"]) for k in kills]
    result["summary"]["leaked per kill"] = leaked
    result["checks"]["nothing leaked after SIGKILL"] = not any(leaked)
    return result


def kill_serve(s: Served, job_id: str) -> dict:
    """SIGKILL to the serve process alone; what it had started and is still running 10 s later is leaked
    (recorded, then killed so that it does not pile up)."""
    tree = descendants(s.proc.pid)
    counts = get_job(s.url, job_id)["counts"]
    s.proc.send_signal(signal.SIGKILL)
    s.proc.wait(30)
    time.sleep(10.0)
    leaked = still_alive(tree)
    kill_all(leaked)
    return {"counts": counts, "descendants": len(tree), "leaked": [p.title for p in leaked]}


def kill_result(result: dict, kills: list[dict], wanted: int, elapsed: float, stopped: dict) -> dict:
    """``check_job``'s result with the kills: how many, how many hit running items, and the drain at the end."""
    hits = sum(k["counts"].get("running", 0) > 0 for k in kills)
    result["summary"] = {"kills": f"{len(kills)}/{wanted}", "kills hitting running items": hits,
                         **result["summary"], "total s": round(elapsed, 1)}
    result["checks"]["all kills done"] = len(kills) == wanted
    result["checks"]["SIGTERM exits 0, nothing left"] = clean_exit(stopped)
    result["details"].update(kills=kills, after_sigterm=stopped)
    return result


def clean_exit(stopped: dict) -> bool:
    return stopped["exit_code"] == 0 and not stopped["left_running"]


def restart(data: Path, log: Path, config: Path, models: list[str], port: int) -> Served:
    """The same port when it is free again, else any."""
    try:
        return start_serve(data, log, port=port, config=config, models=models)
    except RuntimeError:
        return start_serve(data, log, port=0, config=config, models=models)


# -- checking a finished job ---------------------------------------------------------------------------
def check_job(job: dict, data_dir: Path, args) -> dict:
    """Lost, failed, duplicated items and images against the same (label, seed) made alone."""
    items = job["items"]
    states = Counter(it["state"] for it in items)
    folder = data_dir / "images" / job["id"]
    files = sorted(p.name for p in folder.iterdir()) if folder.exists() else []
    expected = {f"{it['index']:05d}.png" for it in items if it["state"] == "done"}
    extra_png = [f for f in files if f.endswith(".png") and f not in expected]
    stray = [f for f in files if not f.endswith(".png")]
    pngs = {int(Path(f).stem): (folder / f).read_bytes() for f in files if f in expected}
    lost = len(items) - states["done"] - states["failed"] + len(expected - set(files))
    diffs = compare_with_reference(job, pngs, max_batch=args.max_batch)
    diffs["equality_required"] = exact = args.exact or not diffs["cuda"]
    return {"summary": {"items": len(items), "done": states["done"], "failed": states["failed"], "lost": lost,
                        "duplicated": len(extra_png), "stray files": len(stray),
                        "max uint8 diff": diffs["max"], "mean uint8 diff": diffs["mean"],
                        **per_item_fields(items)},
            "checks": {"0 lost": lost == 0, "0 failed": states["failed"] == 0, "0 duplicated": not extra_png,
                       "job done": job["state"] == "done",
                       "images equal to alone (if required)": diffs["max"] == 0 or (not exact and diffs["compared"] > 0)},
            "details": {"job_id": job["id"], "params": job["params"], "model": job["model"], "states": dict(states),
                        "errors": dict(Counter(it.get("error") for it in items if it.get("error"))),
                        "stray_files": stray[:20], "extra_png": extra_png[:20], "image_diff": diffs}}


def per_item_fields(items: list[dict]) -> dict:
    """Each integer per-item field the job exposes (attempts, and any counters the service adds): max and
    the histogram."""
    skip = {"index", "label", "seed", "step", "total_steps"}
    out = {}
    for key in sorted(k for k, v in items[0].items() if isinstance(v, int) and k not in skip):
        values = Counter(it[key] for it in items)
        out[f"{key} (max; histogram)"] = f"{max(values)}; {dict(sorted(values.items()))}"
    return out


def compare_with_reference(job: dict, pngs: dict[int, bytes], max_batch: int) -> dict:
    done = [it for it in job["items"] if it["index"] in pngs]
    if not done:
        return {"max": None, "mean": None, "cuda": False, "compared": 0}
    ref, cuda = reference_images(job["model"], [(it["label"], it["seed"]) for it in done], job["params"], max_batch)
    diff = np.stack([np.abs(np.asarray(Image.open(io.BytesIO(pngs[it["index"]]))).astype(np.int16) - r.astype(np.int16))
                     for it, r in zip(done, ref)])
    per_item = diff.reshape(len(done), -1).max(axis=1)
    return {"max": int(diff.max()), "mean": round(float(diff.mean()), 5), "cuda": cuda, "compared": len(done),
            "items_differing": int((per_item > 0).sum())}


def reference_images(model: str, items: list[tuple[int, int]], params: dict, max_batch: int):
    """Each (label, seed) generated by a local engine as `dit-serve generate` does, on the worker's device,
    dtype and backend, in batches of ``max_batch`` (an image does not depend on its batch)."""
    import torch

    from workers.config import WorkerConfig
    from workers.engine import Engine
    from workers.request.spec import ItemSpec
    from workers.loading import load_model

    cuda = torch.cuda.is_available()
    loaded = load_model(model, device="cuda" if cuda else "cpu", dtype=worker_dtype(model, cuda))
    engine = Engine(loaded, WorkerConfig(backend="breakable" if cuda else "eager", max_batch=max_batch))
    engine.warmup()
    reqs = [ItemSpec(id=str(i), label=label, seed=seed, sampler=params["sampler"], steps=params["steps"],
                         guidance=params["guidance"], eta=params.get("eta", 0.0)) for i, (label, seed) in enumerate(items)]
    return [r.image for r in engine.generate(reqs, max_active=max_batch)], cuda


def worker_dtype(model: str, cuda: bool):
    """What a worker runs ``model`` in: float32 on a CPU; on CUDA the dtype its model card names, or,
    for a service without model cards, the worker's own rule."""
    import torch

    if not cuda:
        return torch.float32
    from workers.request.cards import read_card

    return getattr(torch, read_card(model).dtype)


# -- fuzz ----------------------------------------------------------------------------------------------
def run_fuzz(args, tmp: Path) -> dict:
    key = secrets.token_hex(16)
    config = tmp / "dit-serve.toml"  # small jobs: accepted fuzz jobs must not queue hours of work
    config.write_text("[limits]\nmax_items_per_job = 8\nmax_steps = 50\nmax_images_per_request = 4\n")
    s = start_serve(tmp / "data", tmp / "serve.log", config=config, env={"DIT_SERVE_API_KEY": key},
                    models=[args.model] if args.model else [])
    auth = {"Authorization": f"Bearer {key}"}
    try:
        wait_ready(s)
        before = httpx.get(f"{s.url}/v1/jobs", params={"limit": 1}, headers=auth).json()["total"]
        spec = httpx.get(f"{s.url}/openapi.json").json()
        ops = sum(len(methods) for methods in spec["paths"].values())
        rounds, entries, per_example = [], [], 4.0 * ops  # cases per --max-examples: a guess, then measured
        while sum(r["cases"] for r in rounds) < args.cases and len(rounds) < 6:
            n = max(5, math.ceil(1.25 * (args.cases - sum(r["cases"] for r in rounds)) / per_example))
            rounds.append(schemathesis_round(s.url, key, n, args.seed + len(rounds), tmp / f"st{len(rounds)}"))
            entries += rounds[-1].pop("entries")
            per_example = max(1.0, rounds[-1]["cases"] / n)
        after = httpx.get(f"{s.url}/v1/jobs", params={"limit": 1}, headers=auth).json()["total"]
    finally:
        stopped = stop_serve(s)
    result = fuzz_result(rounds, entries, before, after, args.cases, stopped)
    result["summary"] = {"operations": ops, **result["summary"]}
    return result


def schemathesis_round(url: str, key: str, max_examples: int, seed: int, out: Path) -> dict:
    exe = Path(sys.executable).with_name("schemathesis")
    if not exe.exists():
        raise SystemExit(f"fuzz needs schemathesis: {Path(sys.executable).with_name('pip')} install schemathesis")
    cmd = ["schemathesis", "run", f"{url}/openapi.json", "--checks", "all", "--max-examples", str(max_examples),
           "--seed", str(seed), "--header", f"Authorization: Bearer {key}", "--report", "har,json",
           "--report-dir", str(out), "--request-timeout", "120", "--generation-database", "none", "--no-color"]
    run = subprocess.run([str(exe), *cmd[1:]], cwd=out.parent, capture_output=True, text=True)
    report = json.loads(next(out.glob("json-*.json")).read_text())
    har = json.loads(next(out.glob("har-*.json")).read_text())["log"]["entries"]
    (out / "stdout.txt").write_text(run.stdout + run.stderr)
    shown = " ".join(shlex.quote(a) for a in cmd).replace(key, "$KEY")
    return {"command": shown, "exit_code": run.returncode, "cases": report["test_cases"]["generated"],
            "max_examples": max_examples, "failures": {f"{f['code']} {f['title']}": f["count"] for f in report["failures"]},
            "version": report["schemathesis_version"], "entries": har}


def fuzz_result(rounds: list[dict], entries: list[dict], before: int, after: int, target: int, stopped: dict) -> dict:
    """What the HAR entries say was stored: accepted jobs (202, not an idempotent replay) and images
    requests (generations, edits) that returned images each store one job; a 200 DELETE with purge removes one."""
    status = Counter(e["response"]["status"] for e in entries)
    server_errors = [f'{e["request"]["method"]} {e["request"]["url"]} -> {e["response"]["status"]}'
                     for e in entries if e["response"]["status"] >= 500]
    created = sum(_stored(e) for e in entries)
    purged = sum(_purged(e) for e in entries)
    failures, cases = Counter(), sum(r["cases"] for r in rounds)
    for r in rounds:
        failures.update(r["failures"])
    return {"summary": {"cases": cases, "requests": len(entries), "5xx": len(server_errors),
                        "jobs stored": after - before, "accepted": created, "purged": purged,
                        "schemathesis": rounds[0]["version"] if rounds else None},
            "checks": {"0 5xx": not server_errors, f"cases >= {target}": cases >= target,
                       "stored == accepted - purged": after - before == created - purged,
                       "SIGTERM exits 0, nothing left": clean_exit(stopped)},
            "details": {"status_codes": dict(sorted(status.items())), "server_errors": server_errors[:50],
                        "schemathesis_failures": dict(failures), "rounds": rounds, "after_sigterm": stopped,
                        "checked": "every response of every generated case (HAR) has a status below 500; the "
                                   "jobs total (GET /v1/jobs) after the run minus before equals the 202 job "
                                   "submissions that were not idempotent replays plus the 200 images requests (generations, edits), "
                                   "minus the 200 DELETEs with purge: rejected requests stored nothing"}}


def _header(entry: dict, name: str) -> str | None:
    return next((h["value"] for h in entry["response"]["headers"] if h["name"].lower() == name), None)


def _path(entry: dict) -> str:
    return httpx.URL(entry["request"]["url"]).path


def _stored(e: dict) -> bool:
    method, path, code = e["request"]["method"], _path(e), e["response"]["status"]
    if method == "POST" and path == "/v1/jobs":
        return code == 202 and _header(e, "idempotent-replayed") != "true"
    return method == "POST" and path in ("/v1/images/generations", "/v1/images/edits") and code == 200


def _purged(e: dict) -> bool:
    query = {q["name"]: q["value"] for q in e["request"].get("queryString", [])}
    return (e["request"]["method"] == "DELETE" and e["response"]["status"] == 200
            and str(query.get("purge", "")).lower() in ("1", "true", "t", "yes", "y", "on"))


# -- overload --------------------------------------------------------------------------------------------
def run_overload(args, tmp: Path) -> dict:
    from dit_serve.server.config import LimitsConfig

    bounded = "max_queued_items" in LimitsConfig.model_fields  # the field is new: older services lack it
    config = tmp / "dit-serve.toml"
    config.write_text(f"[limits]\nmax_queued_items = {args.max_queued}\n" if bounded else "")
    s = start_serve(tmp / "data", tmp / "serve.log", config=config, models=[args.model] if args.model else [])
    try:
        wait_ready(s)
        capacity = measure_capacity(s.url, args)
        offered = args.factor * capacity
        rss_start = tree_rss(s.proc.pid)
        load, samples = offer_load(s, args, offered)
        rss_end = tree_rss(s.proc.pid)
    finally:
        stopped = stop_serve(s)
    return overload_result(args, capacity, offered, load, samples, rss_start, rss_end, bounded, stopped)


def measure_capacity(url: str, args) -> float:
    """Images/s of one saturating job on a ready worker (from its creation to its end, server clock)."""
    from dit_serve.client import Client

    with Client(url) as c:
        job = c.submit([i % 10 for i in range(args.probe_images)], model=args.model or "digits",
                       sampler=args.sampler, steps=args.steps)
        job = c.wait(job, progress=False, timeout=args.timeout)
    return args.probe_images / (job.finished_at - job.created_at)


def offer_load(s: Served, args, images_per_s: float) -> tuple[dict, list[dict]]:
    """``threads`` open-loop clients (seeded Poisson arrivals) submitting jobs of 1-8 images for the
    duration, and one thread sampling queue depth and RSS."""
    stop, lock = threading.Event(), threading.Lock()
    tally = {"status": Counter(), "retry_after": Counter(), "images_offered": 0, "images_accepted": 0, "behind": 0}
    samples: list[dict] = []
    rate = images_per_s / args.threads / 4.5  # jobs/s per thread; 4.5 = mean size of 1..8
    t0 = time.monotonic()
    threads = [threading.Thread(target=_client_loop, args=(s.url, args, rate, i, stop, lock, tally))
               for i in range(args.threads)]
    threads.append(threading.Thread(target=_sample_loop, args=(s, args.sample_s, t0, stop, samples)))
    for t in threads:
        t.start()
    stop.wait(args.minutes * 60)
    stop.set()
    for t in threads:
        t.join()
    tally["seconds"] = time.monotonic() - t0
    return tally, samples


def _client_loop(url: str, args, rate: float, i: int, stop: threading.Event, lock, tally: dict) -> None:
    rng = random.Random(args.seed * 1000 + i)
    with httpx.Client(base_url=url, timeout=30) as http:
        next_t = time.monotonic()
        while not stop.is_set():
            next_t += rng.expovariate(rate)
            if stop.wait(max(0.0, next_t - time.monotonic())):
                break
            if time.monotonic() - next_t > 1.0:  # a slow answer put this client behind: do not burst to catch up
                next_t = time.monotonic()
                with lock:
                    tally["behind"] += 1
            n = rng.randint(1, 8)
            body = {"model": args.model or "digits", "labels": [rng.randrange(10) for _ in range(n)],
                    "seed": rng.randrange(2 ** 31), "sampler": args.sampler, "steps": args.steps}
            try:
                r = http.post("/v1/jobs", json=body)
                code, retry_after = str(r.status_code), "Retry-After" in r.headers
            except httpx.HTTPError as e:
                code, retry_after = type(e).__name__, False
            with lock:
                tally["status"][code] += 1
                tally["images_offered"] += n
                tally["images_accepted"] += n if code == "202" else 0
                if code == "429":
                    tally["retry_after"][retry_after] += 1


def _sample_loop(s: Served, every: float, t0: float, stop: threading.Event, samples: list[dict]) -> None:
    while True:
        h = health(s.url) or {}
        running = h.get("running")  # read by the store in the same query as the queue depth
        if running is None:  # a service without it: the scheduler's gauge (updated every heartbeat)
            try:
                running = metrics(s.url, counters=False).get("dit_serve_items_running")
            except httpx.HTTPError:
                running = None
        samples.append({"t_s": round(time.monotonic() - t0, 1), "queue_depth": h.get("queue_depth"),
                        "running": running, "workers": h.get("workers"),
                        "rss_mb": round(tree_rss(s.proc.pid) / 2**20, 1),
                        "rss_mb_by_process": rss_by_process(s.proc.pid)})
        if stop.wait(every):
            return


def memory_growth(samples: list[dict]) -> dict:
    """RSS growth (MiB) over the second half of the run, in total and per process: the first half holds
    the warm-up (caches, allocator arenas, Ray's bounded tables filling), a leak keeps growing after."""
    mid = [x for x in samples if x["t_s"] >= samples[-1]["t_s"] / 2 and "rss_mb" in x] if samples else []
    if len(mid) < 2:
        return {"total": None, "by_process": {}}
    a, b = mid[0], mid[-1]
    labels = set(a.get("rss_mb_by_process", {})) | set(b.get("rss_mb_by_process", {}))
    by = {k: round(b.get("rss_mb_by_process", {}).get(k, 0.0) - a.get("rss_mb_by_process", {}).get(k, 0.0), 1)
          for k in sorted(labels)}
    return {"total": round(b["rss_mb"] - a["rss_mb"], 1), "by_process": by}


FLAT_MIB_PER_MIN = 0.5  # "memory flat": the RSS trend over the second half of the run stays below this
TREND_MIN_S = 120.0     # ... judged only over a second half this long: a worker's buffers (+-5 MiB) swing a
                        # shorter trend by more than the bound (a 20 s smoke run read 2-51 MiB/min on any code)


def memory_slope(samples: list[dict]) -> float | None:
    """The least-squares trend of the whole tree's RSS over the second half of the run, MiB per minute."""
    half = [x for x in samples if x["t_s"] >= samples[-1]["t_s"] / 2 and "rss_mb" in x] if samples else []
    if len(half) < 3:
        return None
    mt = sum(x["t_s"] for x in half) / len(half)
    mr = sum(x["rss_mb"] for x in half) / len(half)
    var = sum((x["t_s"] - mt) ** 2 for x in half)
    return round(60 * sum((x["t_s"] - mt) * (x["rss_mb"] - mr) for x in half) / var, 3) if var else None


def overload_result(args, capacity, offered, load, samples, rss_start, rss_end, bounded, stopped) -> dict:
    """The bound holds queued + running items (both from /healthz, one store query)."""
    depths = [x["queue_depth"] for x in samples if x["queue_depth"] is not None]
    held = [x["queue_depth"] + (x.get("running") or 0) for x in samples if x["queue_depth"] is not None]
    codes = load["status"]
    five = sum(v for k, v in codes.items() if k.isdigit() and int(k) >= 500)
    limit = args.max_queued if bounded else None
    growth, slope = memory_growth(samples), memory_slope(samples)
    judged = bool(samples) and samples[-1]["t_s"] / 2 >= TREND_MIN_S
    return {"summary": {"capacity images/s": round(capacity, 2), "offered images/s": round(offered, 2),
                        "sent images/s": round(load["images_offered"] / load["seconds"], 2),
                        "accepted images/s": round(load["images_accepted"] / load["seconds"], 2),
                        "status codes": dict(sorted(codes.items())), "429 with Retry-After":
                        f"{load['retry_after'][True]}/{codes['429']}", "queue depth max": max(depths, default=None),
                        "queue depth last": depths[-1] if depths else None,
                        "queued + running max": max(held, default=None), "bound": limit,
                        "rss MiB start -> end": f"{rss_start / 2**20:.0f} -> {rss_end / 2**20:.0f}",
                        "rss MiB growth, second half": growth["total"],
                        "rss trend MiB/min, second half":
                            slope if judged else f"{slope} (not judged: the second half is under {TREND_MIN_S:.0f} s)",
                        "rss MiB growth by process, second half": growth["by_process"],
                        "seconds": round(load["seconds"], 1)},
            "checks": {"0 5xx": five == 0, "every 429 has Retry-After": load["retry_after"][False] == 0,
                       "queued + running within the bound": limit is not None and max(held, default=0) <= limit,
                       "no transport errors": all(k.isdigit() for k in codes),
                       "SIGTERM exits 0, nothing left": clean_exit(stopped),
                       **({f"memory flat (RSS trend over the second half <= {FLAT_MIB_PER_MIN} MiB/min)":
                           slope is not None and slope <= FLAT_MIB_PER_MIN} if judged else {})},
            "details": {"samples": samples, "clients_behind": load["behind"], "after_sigterm": stopped,
                        "rss_bytes": {"start": rss_start, "end": rss_end}}}


# -- reports ---------------------------------------------------------------------------------------------
def hardware() -> dict:
    import torch

    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), platform.processor())
    info = {"cpu": cpu, "cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
            "ray": _version("ray"), "schemathesis": _version("schemathesis")}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return info


def _version(package: str) -> str | None:
    try:
        return version(package)
    except PackageNotFoundError:
        return None


def write_report(name: str, result: dict, out_dir: Path, smoke: bool, extra: dict) -> Path:
    """docs/benchmarks/chaos_<name>[_smoke].json: ``extra`` (hardware, command, settings) and the result."""
    report = {"bench": name, "smoke": smoke, **extra, "ok": all(result["checks"].values()), **result}
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"chaos_{name.replace('-', '_')}{'_smoke' if smoke else ''}.json"
    path.write_text(json.dumps(report, indent=1, default=str) + "\n")
    return path


def format_table(report: dict) -> str:
    """Two columns: the summary's values, then each check as ok / FAILED."""
    rows = [(k, json.dumps(v) if isinstance(v, (dict, list)) else str(v)) for k, v in report["summary"].items()]
    rows += [(f"check: {k}", "ok" if v else "FAILED") for k, v in report["checks"].items()]
    width = max(len(k) for k, _ in rows)
    head = f"{report['bench']}{' (smoke)' if report.get('smoke') else ''}: {'ok' if report['ok'] else 'FAILED'}"
    return "\n".join([head] + [f"  {k:<{width}}  {v}" for k, v in rows])


RUNS = {"worker-kill": run_worker_kill, "serve-kill": run_serve_kill, "fuzz": run_fuzz, "overload": run_overload}
AUTOSCALED = ("worker-kill", "serve-kill")  # the runs --autoscale applies to


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("bench", choices=[*RUNS, "all"])
    p.add_argument("--smoke", action="store_true", help="tiny sizes, for a CPU: " + json.dumps(SMOKE))
    p.add_argument("--model", help="serve this model (default: the service's default, digits)")
    p.add_argument("--images", type=int, default=500, help="items of the job (worker-kill, serve-kill)")
    p.add_argument("--kills", type=int, default=None, help="SIGKILLs (default 20 for worker-kill, 10 for serve-kill)")
    p.add_argument("--max-delay", type=float, default=1.0, help="a kill comes up to this long after progress")
    p.add_argument("--lease-seconds", type=float, default=10.0, help="[store] lease_seconds for serve-kill")
    p.add_argument("--exact", action="store_true", help="require equal images on a GPU too")
    p.add_argument("--sampler", default="ddim")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--max-batch", type=int, default=64, help="the reference engine's batch ([workers] max_batch)")
    p.add_argument("--cases", type=int, default=2000, help="fuzz: at least this many generated test cases")
    p.add_argument("--minutes", type=float, default=10.0, help="overload: how long the load is offered")
    p.add_argument("--factor", type=float, default=2.0, help="overload: offered load / measured capacity")
    p.add_argument("--threads", type=int, default=4, help="overload: client threads")
    p.add_argument("--probe-images", type=int, default=512, help="overload: size of the capacity job")
    p.add_argument("--max-queued", type=int, default=2000, help="overload: [limits] max_queued_items")
    p.add_argument("--sample-s", type=float, default=2.0, help="overload: queue depth sampling period")
    p.add_argument("--seed", type=int, default=0, help="seeds the kill moments, fuzzing and arrivals")
    p.add_argument("--timeout", type=float, default=1800.0, help="longest wait for a job to finish")
    p.add_argument("--autoscale", action="store_true", help="worker-kill, serve-kill: with [autoscale] on, from no "
                                                            "worker (the module docstring)")
    p.add_argument("--autoscale-workers", type=int, default=2, help="--autoscale: [autoscale] max_workers")
    p.add_argument("--idle-timeout", type=float, default=5.0, help="--autoscale: [autoscale] idle_timeout_s")
    p.add_argument("--out", type=Path, default=None, help="where the report goes (default docs/benchmarks; "
                                                          "--smoke: a temporary folder)")
    return p


def run_one(name: str, args, info: dict) -> bool:
    a = argparse.Namespace(**vars(args))
    if a.kills is None:
        a.kills = 20 if name == "worker-kill" else 10
    if a.smoke:
        vars(a).update(SMOKE)
    with tempfile.TemporaryDirectory(prefix=f"chaos-{name}-") as tmp:
        result = RUNS[name](a, Path(tmp))
    settings = {k: v for k, v in vars(a).items() if k not in ("bench", "out")}
    out = a.out or (Path(tempfile.mkdtemp(prefix="chaos-smoke-")) if a.smoke else Path("docs/benchmarks"))
    report_path = write_report(name + ("-autoscale" if a.autoscale else ""), result, out, a.smoke,
                               {"hardware": info, "command": shlex.join(["python", *sys.argv]), "settings": settings})
    print(format_table(json.loads(report_path.read_text())), flush=True)
    print(f"  report: {report_path}", flush=True)
    return all(result["checks"].values())


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.autoscale and args.bench not in (*AUTOSCALED, "all"):
        parser.error(f"--autoscale applies to {' and '.join(AUTOSCALED)} (and `all`, which then runs those)")
    info = hardware()
    names = (list(AUTOSCALED) if args.autoscale else list(RUNS)) if args.bench == "all" else [args.bench]
    return 0 if all([run_one(n, args, info) for n in names]) else 1


if __name__ == "__main__":
    sys.exit(main())
