"""`pip install dit-serve` is the SDK and the client commands only: the wheel, built from this tree and
installed into a fresh virtualenv without extras, brings neither torch nor ray nor the web server, and
its `dit-serve submit/status/list/fetch` work against a real service (run from the project's own
environment, which has the `server` extra); its `dit-serve serve` says which extra to install.

pip fetches the base dependencies (httpx, pydantic, tqdm, pillow) from the configured index; the wheel
is built with this environment's setuptools where it is recent enough (nothing downloaded for it).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import pytest
from PIL import Image

from dit_serve.cli import SERVICE_MODULES, build_parser, main, server_modules

from .conftest import patient, serving_url

ROOT = Path(__file__).resolve().parents[2]
SERVER_ONLY = ("torch", "ray", "diffusers", "transformers", "safetensors", "fastapi", "uvicorn", "sqlalchemy",
               "numpy")
EXTRA_LINE = "pip install 'dit-serve[server]'"


def _run(cmd: list, timeout: float = 300, **kw) -> subprocess.CompletedProcess:
    r = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=timeout, **kw)
    assert r.returncode == 0, f"{cmd}: {r.stdout[-2000:]}{r.stderr[-3000:]}"
    return r


def _no_build_isolation() -> list[str]:
    """Build with this environment's setuptools when it meets pyproject's ``setuptools>=77``."""
    try:
        return ["--no-build-isolation"] if int(version("setuptools").split(".")[0]) >= 77 else []
    except (PackageNotFoundError, ValueError):
        return []


def _build_wheel(tmp: Path) -> Path:
    """The wheel of a copy of the tree (an in-tree build would leave build/ behind in the checkout)."""
    src = tmp / "src"
    junk = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
    for name in ("dit_serve", "samplers", "graphs", "workers"):
        shutil.copytree(ROOT / name, src / name, ignore=junk)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", *_no_build_isolation(), "-w", tmp / "dist", src])
    (wheel,) = (tmp / "dist").glob("dit_serve-*.whl")
    return wheel


def _client_venv(tmp: Path, wheel: Path) -> Path:
    """A fresh virtualenv with the wheel and its base dependencies; returns its bin/ folder."""
    venv = tmp / "client-venv"
    _run([sys.executable, "-m", "venv", "--without-pip", venv])  # this pip installs into it: faster than ensurepip
    _run([sys.executable, "-m", "pip", "--python", venv / "bin" / "python", "install", "-q", wheel])
    return venv / "bin"


def _start_service(data_dir: Path, log: Path) -> subprocess.Popen:
    """`dit-serve serve` from this (server) environment, on a free port."""
    with log.open("w") as err:
        return subprocess.Popen([sys.executable, "-m", "dit_serve.cli", "serve", "--port", "0", "--data-dir",
                                 str(data_dir), "--model", "digits"], stdout=subprocess.PIPE, stderr=err,
                                text=True, cwd=ROOT, start_new_session=True)


class FreshClient:
    """The fresh virtualenv's `python` and `dit-serve`, run outside the checkout (nothing of the tree on
    sys.path) and without this environment's PYTHONPATH."""

    def __init__(self, bin_: Path, cwd: Path):
        self.bin, self.cwd = bin_, cwd
        self.env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}

    def run(self, exe: str, *argv, check: bool = True) -> subprocess.CompletedProcess:
        r = subprocess.run([str(self.bin / exe), *map(str, argv)], capture_output=True, text=True, timeout=patient(180),
                           cwd=self.cwd, env=self.env)
        assert not check or r.returncode == 0, f"{exe} {argv}: {r.stdout[-2000:]}{r.stderr[-3000:]}"
        return r

    def cli(self, *argv, check: bool = True) -> subprocess.CompletedProcess:
        return self.run("dit-serve", *argv, check=check)


def _check_nothing_server_side(fresh: FreshClient) -> None:
    probe = ("import importlib.util, json, dit_serve; print(json.dumps([dit_serve.__file__, "
             f"[m for m in {SERVER_ONLY!r} if importlib.util.find_spec(m)]]))")
    where, present = json.loads(fresh.run("python", "-c", probe).stdout)
    assert Path(where).is_relative_to(fresh.bin.parent), where  # the wheel's copy, not the checkout's
    assert present == [], f"the base install pulled in server-side packages: {present}"


def _check_server_commands_name_the_extra(fresh: FreshClient) -> None:
    for argv in (["serve"], ["serve", "--role", "api"], ["generate", "--labels", "1", "--out", "x"], ["demo"],
                 ["keys", "list"]):
        r = fresh.cli(*argv, check=False)
        assert (r.returncode, r.stdout) == (2, ""), (argv, r.returncode, r.stdout, r.stderr)
        (line,) = r.stderr.splitlines()
        assert line.startswith(f"dit-serve {argv[0]} needs the server extra (") and line.endswith(EXTRA_LINE), line
    assert not (fresh.cwd / "x").exists()


def _check_submit_status_list_fetch(fresh: FreshClient, url: str, out: Path) -> None:
    r = fresh.cli("submit", "--url", url, "--labels", "3,seven", "--num-per-label", "2", "--sampler", "ddim",
                  "--steps", "10", "--seed", "4", "--wait")
    job = r.stdout.strip()
    assert job and len(job.split()) == 1, r.stdout
    assert fresh.cli("status", job, "--url", url).stdout.startswith(f"{job} done: 4 done;")
    assert json.loads(fresh.cli("status", job, "--url", url, "--json").stdout)["state"] == "done"
    assert job in fresh.cli("list", "--url", url).stdout

    fresh.cli("fetch", job, "--url", url, "--out", out)
    manifest = json.loads((out / "manifest.json").read_text())
    entries = manifest["images"]
    assert (manifest["job"], manifest["state"]) == (job, "done")
    assert [(e["label"], e["seed"]) for e in entries] == [(3, 4), (3, 5), (7, 6), (7, 7)]
    assert all(Image.open(out / e["file"]).size == (8, 8) for e in entries)
    assert Image.open(out / "grid.png").size == (2 * 68 + 4, 2 * 68 + 4)  # one row per label: 64 px tiles, 4 px gaps


def test_a_server_command_without_the_extra_names_it(monkeypatch, capsys, tmp_path):
    """torch looks absent, as in a base install: `serve` and `generate` say so in one line, exit 2 and
    write nothing; `serve --role api` runs no model, so it does not ask for torch."""
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torch" else find_spec(name, *a))
    for argv in (["serve"], ["generate", "--labels", "1", "--out", str(tmp_path / "out")]):
        assert main(argv) == 2
        assert capsys.readouterr().err == f"dit-serve {argv[0]} needs the server extra (torch is not installed): {EXTRA_LINE}\n"
    assert not (tmp_path / "out").exists()
    assert server_modules(build_parser().parse_args(["serve", "--role", "api"])) == SERVICE_MODULES
    assert server_modules(build_parser().parse_args(["status", "JOB"])) == ()


@pytest.mark.slow
def test_the_base_install_is_the_client_only(digits_model, tmp_path):
    log = tmp_path / "serve.log"
    server = _start_service(tmp_path / "data", log)  # Ray starts while the wheel builds and installs
    try:
        fresh = FreshClient(_client_venv(tmp_path, _build_wheel(tmp_path)), tmp_path)
        _check_nothing_server_side(fresh)
        _check_server_commands_name_the_extra(fresh)
        try:
            _check_submit_status_list_fetch(fresh, serving_url(server, log), tmp_path / "fetched")
        except AssertionError as e:
            raise AssertionError(f"{e}\nservice log: {log.read_text()[-3000:]}") from None
        server.send_signal(signal.SIGTERM)
        assert server.wait(60) == 0, log.read_text()[-3000:]
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
