"""The real CLI in a subprocess, on what a new user does wrong: one line on stderr, exit 2 for a usage
error, nothing half-written, help that says what each option takes. No service runs here: the client
commands are pointed at a port nothing listens on, or fail before they send anything."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import patient

ROOT = Path(__file__).resolve().parents[2]


def cli(*args: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    environ = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    for name in ("DIT_SERVE_URL", "DIT_SERVE_API_KEY"):
        if env is None or name not in env:
            environ.pop(name, None)
    return subprocess.run([sys.executable, "-m", "dit_serve.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=environ, cwd=ROOT)


def one_line(proc: subprocess.CompletedProcess, code: int = 2) -> str:
    assert proc.returncode == code, (proc.returncode, proc.stdout, proc.stderr)
    err = proc.stderr.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    return err


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_generate_with_a_degenerate_plan_is_one_line_and_writes_nothing(tmp_path):
    out = tmp_path / "new" / "out"
    err = one_line(cli("generate", "--model", "digits-text", "--prompt", "a seven", "--sampler", "dpmpp_2m",
                       "--steps", "1000", "--out", str(out)))
    assert "--steps" in err and "use at most 999 steps" in err
    assert not (tmp_path / "new").exists()


KEY = "cli-usage-key-0123"


@pytest.fixture(scope="module")
def service(digits_model, tmp_path_factory):
    """An API-only service with a key (no workers: jobs stay queued unless a test plays the worker)."""
    from dit_serve.server.service import Service

    from .conftest import service_config

    cfg = service_config(tmp_path_factory.mktemp("cli"), digits_model, server={"api_keys": [KEY]})
    with Service(cfg, roles=("api",)) as svc:
        yield svc


@pytest.fixture(scope="module")
def api(service):
    """The service's URL, a client with its key, and the env that reaches it."""
    import httpx

    with httpx.Client(base_url=service.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=10) as http:
        yield service.url, http, {"DIT_SERVE_URL": service.url, "DIT_SERVE_API_KEY": KEY}


def _play_worker(store, job_id: str, errors: list[str | None]) -> None:
    """Lease the job's items (submitted with priority 100: first in line) and end item i as a worker would:
    failed with ``errors[i]``, or done with a PNG when it is None."""
    import io

    from PIL import Image

    leases = sorted(store.lease("test-cli", ["digits"], len(errors), 60.0), key=lambda ls: ls.index)
    assert [(ls.job_id, ls.index) for ls in leases] == [(job_id, i) for i in range(len(errors))]
    for lease, error in zip(leases, errors):
        if error is None:
            buf = io.BytesIO()
            Image.new("L", (8, 8), 128).save(buf, format="PNG")
            assert store.commit_result(lease, buf.getvalue())
        else:
            assert store.fail_item(lease, error)


def _jobs(http) -> int:
    return http.get("/v1/jobs").json()["total"]


def test_non_finite_guidance_is_one_line_before_anything_is_sent(api):
    url, http, env = api
    before = _jobs(http)
    for value in ("nan", "inf"):
        err = one_line(cli("submit", "--labels", "1", "--guidance", value, env=env))
        assert "guidance must be a finite number" in err
    assert _jobs(http) == before


def test_the_sdk_names_a_non_finite_field_before_sending():
    import httpx

    from dit_serve.client import Client, InvalidRequest

    sent = []
    transport = httpx.MockTransport(lambda request: sent.append(request) or httpx.Response(500))
    with Client("http://test", http=httpx.Client(base_url="http://test", transport=transport)) as client:
        with pytest.raises(InvalidRequest, match="eta must be a finite number") as caught:
            client.submit([1], eta=float("nan"))
    assert caught.value.param == "eta" and not sent


def test_an_unwritable_out_stops_submit_before_the_job_exists(api, tmp_path):
    url, http, env = api
    before = _jobs(http)
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    for out in ("/proc/nope", str(blocker / "sub"), str(blocker)):
        err = one_line(cli("submit", "--labels", "1", "--out", out, env=env))
        assert "cannot write to" in err, err
    assert _jobs(http) == before


def test_a_reader_that_goes_away_ends_the_command_quietly(api):
    url, http, env = api
    job = http.post("/v1/jobs", json={"labels": [1], "num_per_label": 50}).json()["id"]
    environ = {**os.environ, "PYTHONPATH": str(ROOT), **env}
    for args in (["status", job, "--json"], ["list"], ["--help"]):
        proc = subprocess.Popen([sys.executable, "-m", "dit_serve.cli", *args], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, env=environ, cwd=ROOT)
        proc.stdout.close()  # `| head` that has read enough
        err = proc.stderr.read().decode()
        assert proc.wait(60) in (0, 141) and "Traceback" not in err and "BrokenPipe" not in err, (args, err)


def test_a_malformed_url_is_a_usage_error(api):
    assert "--url 'notaurl' is not a URL" in one_line(cli("status", "abc", "--url", "notaurl"))
    err = one_line(cli("list", env={"DIT_SERVE_URL": "ftp://host"}))
    assert "$DIT_SERVE_URL 'ftp://host'" in err


def test_the_url_and_key_come_from_the_environment_or_the_flags(api):
    url, http, env = api
    job = http.post("/v1/jobs", json={"labels": [2]}).json()["id"]
    proc = cli("status", job, env=env)
    assert proc.returncode == 0 and proc.stdout.startswith(job), proc.stderr
    proc = cli("status", job, "--url", url, "--api-key", KEY, env={"DIT_SERVE_URL": "http://127.0.0.1:9"})
    assert proc.returncode == 0, proc.stderr
    err = one_line(cli("status", job, "--url", url))
    assert "set DIT_SERVE_API_KEY or pass --api-key" in err


def test_ctrl_c_while_waiting_says_the_job_keeps_running_and_how_to_cancel(api):
    import signal

    url, http, env = api
    # faulthandler: should Ctrl-C ever go unheeded, SIGABRT makes the CLI print where each thread was
    environ = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONFAULTHANDLER": "1", **env}
    # SIGINT at its default in the child: a test run started in the background by a non-interactive shell has it
    # ignored, which its children inherit (a Python started so leaves Ctrl-C ignored, as a shell's background job)
    proc = subprocess.Popen([sys.executable, "-m", "dit_serve.cli", "submit", "--labels", "3", "--wait"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=environ, cwd=ROOT,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        job = proc.stdout.readline().strip()
        assert job, proc.stderr.read()
        proc.send_signal(signal.SIGINT)
        try:
            code = proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGABRT)
            pytest.fail(f"the CLI went on for 60 s after Ctrl-C; where it was:\n{proc.communicate(timeout=30)[1]}")
        assert code == 130
        err = proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
    assert f"dit-serve cancel {job}" in err and "keeps running" in err and "Traceback" not in err
    assert http.get(f"/v1/jobs/{job}").json()["state"] == "queued"


def test_fetch_refuses_a_folder_that_holds_files_unless_forced(api, tmp_path):
    url, http, env = api
    job = http.post("/v1/jobs", json={"labels": [4]}).json()["id"]
    out = tmp_path / "out"
    out.mkdir()
    (out / "00000_label1.png").write_bytes(b"an older fetch's image")
    err = one_line(cli("fetch", job, "--out", str(out), env=env))
    assert "already holds files" in err and "--force" in err
    err = one_line(cli("fetch", job, "--out", str(out), "--force", env=env))  # forced: on to the job itself
    assert "has no finished images" in err
    assert sorted(p.name for p in out.iterdir()) == ["00000_label1.png"]


def test_jobs_without_a_seed_get_different_random_seeds(api):
    url, http, env = api
    seeds = set()
    for _ in range(3):
        job = http.post("/v1/jobs", json={"labels": [5]}).json()
        seeds.add(http.get(f"/v1/jobs/{job['id']}").json()["items"][0]["seed"])
    assert len(seeds) == 3
    pinned = http.post("/v1/jobs", json={"labels": [5, 6], "seed": 9}).json()
    assert [it["seed"] for it in http.get(f"/v1/jobs/{pinned['id']}").json()["items"]] == [9, 10]


@pytest.mark.parametrize("args, words", [
    (["--help"], ["dit-serve submit --labels 3,7", "DIT_SERVE_URL", "--version"]),
    (["submit", "--help"], ["--seed", "random seed", "--preview-every", "DIT_SERVE_URL", "--api-key",
                            "ddpm, ddim, euler, euler_a, dpmpp_2m, flow_euler", "denoising steps", "DDIM's eta"]),
    (["status", "--help"], ["the job's id", "--api-key"]),
    (["fetch", "--help"], ["the job's id", "--force"]),
    (["cancel", "--help"], ["the job's id"]),
    (["demo", "--help"], ["images of each digit", "where the images go"]),
    (["generate", "--help"], ["digits-text", "random seed"]),
])
def test_help_says_what_each_option_takes(args, words):
    proc = cli(*args)
    assert proc.returncode == 0
    text = " ".join(proc.stdout.split())
    for w in words:
        assert w in text, (args, w)
    assert "digits-flow" not in text


def test_version():
    from dit_serve import __version__

    proc = cli("--version")
    assert proc.returncode == 0 and proc.stdout.strip() == f"dit-serve {__version__}"


def test_cli_and_commands_import_one_way():
    """cli imports commands; commands never imports cli (no cycle hidden in a function)."""
    import ast

    tree = ast.parse((ROOT / "dit_serve" / "commands.py").read_text())
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert "dit_serve.cli" not in imported
    assert not any(isinstance(n, ast.ImportFrom) and n.module == "dit_serve" and any(a.name == "cli" for a in n.names)
                   for n in ast.walk(tree))


def test_a_port_in_use_is_said_before_anything_starts(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        err = one_line(cli("serve", "--port", str(port), "--data-dir", str(tmp_path / "data"), timeout=60))
    assert f"cannot listen on 127.0.0.1:{port}" in err and "--port" in err
    assert not (tmp_path / "data").exists()  # nothing started: no store, no Ray


def test_the_default_data_dir_is_ignored_by_git():
    proc = subprocess.run(["git", "check-ignore", "-q", "dit-serve-data/jobs.db"], cwd=ROOT)
    assert proc.returncode == 0


def test_the_webhooks_example_explains_a_refused_receiver(api, tmp_path):
    """The service refuses the loopback receiver (as it should); the example says how to allow it."""
    url, http, env = api
    environ = {**os.environ, "PYTHONPATH": str(ROOT), **env}
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "webhooks.py"), "--url", url, "--out",
                           str(tmp_path)], capture_output=True, text=True, timeout=patient(120), env=environ, cwd=ROOT)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "allow_hosts = [\"127.0.0.1\"]" in proc.stderr and "loopback" in proc.stderr


def test_a_failed_jobs_reasons_show_in_status_and_the_jobs_json(service, api):
    url, http, env = api
    job = http.post("/v1/jobs", json={"labels": [1], "num_per_label": 3, "priority": 100}).json()["id"]
    _play_worker(service.store, job, ["out of memory", "out of memory", "plan is degenerate"])
    proc = cli("status", job, env=env)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith(f"{job} failed: 3 failed")
    assert lines[1:] == ["  2 items failed (first: item 0): out of memory",
                         "  1 item failed (first: item 2): plan is degenerate"]
    body = http.get(f"/v1/jobs/{job}?items=false").json()
    assert body["error"] == "3 of 3 items failed: out of memory (2); plan is degenerate (1)"
    assert body["failures"] == [{"error": "out of memory", "items": 2, "first": 0},
                                {"error": "plan is degenerate", "items": 1, "first": 2}]


def test_submit_wait_shows_why_a_job_failed(service, api):
    url, http, env = api
    environ = {**os.environ, "PYTHONPATH": str(ROOT), **env}
    proc = subprocess.Popen([sys.executable, "-m", "dit_serve.cli", "submit", "--labels", "2,3", "--priority", "100",
                             "--wait"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=environ,
                            cwd=ROOT)
    try:
        job = proc.stdout.readline().strip()
        assert job, proc.stderr.read()
        _play_worker(service.store, job, [None, "the worker ran out of memory"])
        assert proc.wait(60) == 1
        err = proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
    assert f"{job} failed: 1 done, 1 failed" in err
    assert "  1 item failed (first: item 1): the worker ran out of memory" in err and "Traceback" not in err


def test_a_cancelled_job_keeps_its_progress_in_status(service, api):
    url, http, env = api
    job = http.post("/v1/jobs", json={"labels": [1], "num_per_label": 2, "priority": 100, "steps": 100}).json()["id"]
    leases = sorted(service.store.lease("test-cli", ["digits"], 2, 60.0), key=lambda ls: ls.index)
    leases[0].step = 83
    assert service.store.heartbeat(leases, 60.0) == []
    assert cli("cancel", job, env=env).returncode == 0
    proc = cli("status", job, env=env)
    assert proc.returncode == 0 and f"{job} cancelled: 2 cancelled; 83/200 steps" in proc.stdout, proc.stdout


def test_keys_list_never_creates_a_store_and_keys_say_which_store(tmp_path):
    def keys(*args):
        environ = {**os.environ, "PYTHONPATH": str(ROOT)}
        return subprocess.run([sys.executable, "-m", "dit_serve.cli", "keys", *args], capture_output=True,
                              text=True, timeout=patient(120), env=environ, cwd=tmp_path)

    for args in (["list"], ["revoke", "abc"]):  # another folder, no --config: nothing there to read
        err = one_line(keys(*args))
        assert "no job store at dit-serve-data/jobs.db" in err and "--config" in err, err
    assert list(tmp_path.iterdir()) == []
    data = tmp_path / "data"
    created = keys("create", "--tenant", "alice", "--data-dir", str(data))
    assert created.returncode == 0 and f"written to the store sqlite:///{data / 'jobs.db'}" in created.stderr
    listing = keys("list", "--data-dir", str(data))
    assert listing.returncode == 0 and f"sqlite:///{data / 'jobs.db'}" in listing.stderr
    header, row = listing.stdout.splitlines()
    assert header.split() == ["ID", "TENANT", "ROLE", "STATE", "CREATED", "LIMITS", "NAME"]
    assert row.split()[1:4] == ["alice", "user", "active"] and row.index("alice") == header.index("TENANT")


def _keys(manifest: dict) -> tuple:
    """A manifest's key set: its own, its params', its images'."""
    return (sorted(manifest), sorted(manifest["params"]), sorted({k for e in manifest["images"] for k in e}))


def test_generate_submit_out_fetch_and_the_archive_write_one_manifest_schema(service, api, tmp_path):
    """Every writer writes dit_serve.schemas.Manifest's keys (the demo's: test_demo.py)."""
    import io
    import json
    import zipfile

    from dit_serve.schemas import JobParams, Manifest, ManifestImage

    schema = (sorted(Manifest.model_fields), sorted(JobParams.model_fields), sorted(ManifestImage.model_fields))
    url, http, env = api
    proc = cli("generate", "--model", "digits", "--labels", "1", "--steps", "2", "--out", str(tmp_path / "gen"))
    assert proc.returncode == 0, proc.stderr
    generated = json.loads((tmp_path / "gen" / "manifest.json").read_text())
    environ = {**os.environ, "PYTHONPATH": str(ROOT), **env}
    submit = subprocess.Popen([sys.executable, "-m", "dit_serve.cli", "submit", "--labels", "4", "--priority", "100",
                               "--out", str(tmp_path / "sub")], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=environ, cwd=ROOT)
    try:
        job = submit.stdout.readline().strip()
        assert job, submit.stderr.read()
        _play_worker(service.store, job, [None])
        assert submit.wait(60) == 0, submit.stderr.read()
    finally:
        if submit.poll() is None:
            submit.kill()
    submitted = json.loads((tmp_path / "sub" / "manifest.json").read_text())
    proc = cli("fetch", job, "--out", str(tmp_path / "fetch"), env=env)
    assert proc.returncode == 0, proc.stderr
    fetched = json.loads((tmp_path / "fetch" / "manifest.json").read_text())
    archived = json.loads(zipfile.ZipFile(io.BytesIO(http.get(f"/v1/jobs/{job}/archive").content)).read("manifest.json"))
    for manifest in (generated, submitted, fetched, archived):
        assert _keys(manifest) == schema, manifest
    assert generated["job"] is None and submitted["job"] == fetched["job"] == archived["job"] == job
    assert [(e["file"], e["label"], e["prompt"]) for e in fetched["images"]] == [("00000_label4.png", 4, None)]


@pytest.mark.parametrize("shown", [False, True])
def test_the_progress_bar_starts_no_thread_that_could_take_a_ctrl_c(shown):
    """A SIGINT goes to any thread that does not block it; one taken by a helper thread leaves the main thread
    waiting in its socket read. The bar (tqdm) must not start its monitor thread."""
    import threading

    from dit_serve.client import _Bar

    before = set(threading.enumerate())
    bar = _Bar("0123456789abcdef", shown)
    try:
        started = set(threading.enumerate()) - before
    finally:
        bar.close()
    assert not started, started


@pytest.mark.parametrize("lora, words", [("ink:strong", "is not a number"), (":0.5", "not NAME[:SCALE]"),
                                         ("ink:nan", "finite")])
def test_a_bad_lora_is_one_line(lora, words):
    err = one_line(cli("submit", "--url", f"http://127.0.0.1:{free_port()}", "--labels", "1", "--lora", lora))
    assert "--lora" in err and words in err
