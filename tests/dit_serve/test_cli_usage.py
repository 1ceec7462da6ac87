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
