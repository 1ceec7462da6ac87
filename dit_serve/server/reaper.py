"""Nothing of a local Ray outlives the ``dit-serve`` process that started it, even after a SIGKILL.

Why: when that process is killed, Ray 2.60's raylet, GCS and workers exit on their own, but its
dashboard and runtime-env agents notice that their raylet died and then hang, ignoring SIGTERM
(about 190 MB each time; every crash-restart adds two more).

Guarantee: within about 3 s of the death of the process that called ``watch_local_ray`` (or of
``release_local_ray`` after ``ray.shutdown()``), every process of its Ray is gone: SIGTERM, then
SIGKILL 2 s later. If the watchdog could not do it (it was killed too), the next ``watch_local_ray``
with the same data dir does, and logs a warning saying how many it stopped.

How:

* ``watch_local_ray`` starts ``python -m dit_serve.server.reaper``, a watchdog of only the standard library,
  in a session of its own (a signal to the service's process group does not reach it). Its stdin is
  the read end of a pipe whose write end only the service holds (not inheritable), so it reads EOF
  when the service dies, however it dies; a byte on the pipe is a normal stop.
* Every second it records Ray's processes: the node's own (gcs_server, raylet, log monitor...) and
  all their descendants (agents, workers), each as ``(pid, start time)``, the start time being
  field 22 of ``/proc/<pid>/stat``: a pid reused by another program never matches. It writes them,
  with the service's own ``(pid, start time)`` and the boot id, to ``<data_dir>/local-ray.pids``.
* When the service is gone it stops what it recorded that still matches, plus their descendants,
  removes the file and exits.

Never another service's Ray: only the processes of the node this process started are recorded (a
cluster joined by address is not watched at all, and a node that ``ray.init()`` merely connected to
has no processes of ours), and a pid file whose owner still runs, or that comes from another boot or
host, is left alone. Linux only (``/proc``); elsewhere a no-op.
"""

from __future__ import annotations

import json
import logging
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

log = logging.getLogger("dit_serve.server.reaper")  # also when run as __main__

PID_FILE = "local-ray.pids"
TICK_S = 1.0   # how often the watchdog records Ray's processes
GRACE_S = 2.0  # between SIGTERM and SIGKILL
Proc = tuple[int, int]  # (pid, start time in clock ticks after boot)

# ray.init is process-global, so is the watchdog of the Ray it started: (watchdog, write end of its pipe)
_watchdog: tuple[subprocess.Popen, int] | None = None


def _stat(pid: int) -> list[str] | None:
    """The fields of /proc/<pid>/stat after the name (state first, start time at [19])."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat[stat.rindex(")") + 2:].split()  # the name, in parentheses, may hold spaces


def start_time(pid: int) -> int | None:
    """When ``pid`` started; None when it is gone or a zombie."""
    fields = _stat(pid)
    return None if fields is None or fields[0] in "ZX" else int(fields[19])


def with_descendants(procs: set[Proc]) -> set[Proc]:
    """Those of ``procs`` still alive, and every live descendant of them."""
    children: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit() and (fields := _stat(int(entry.name))):
            children.setdefault(int(fields[1]), []).append(int(entry.name))
    found, stack = set(), list(procs)
    while stack:
        pid, start = stack.pop()
        if (pid, start) not in found and start_time(pid) == start:
            found.add((pid, start))
            stack += [(c, t) for c in children.get(pid, ()) if (t := start_time(c)) is not None]
    return found


def kill(procs: set[Proc]) -> int:
    """SIGTERM to those of ``procs`` still alive and their descendants, SIGKILL to what is left
    ``GRACE_S`` later; how many were alive."""
    alive = with_descendants(procs)
    count = len(alive)
    _signal(alive, signal.SIGTERM)
    deadline = time.monotonic() + GRACE_S
    while alive and time.monotonic() < deadline:
        time.sleep(0.05)
        alive = with_descendants(alive)  # children started meanwhile are killed too
    _signal(alive, signal.SIGKILL)
    return count


def _signal(procs: set[Proc], sig: int) -> None:
    for pid, start in procs:
        if start_time(pid) == start:  # not a pid reused since
            try:
                os.kill(pid, sig)
            except (ProcessLookupError, PermissionError):
                pass


def boot_id() -> str:
    """This boot's id: a pid file from before a reboot (or from another host) names no process of ours."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def clean_leftovers(pid_file: Path) -> int:
    """Stop the processes named in ``pid_file`` when the dit-serve that wrote it is gone; how many
    were still running."""
    try:
        data = json.loads(pid_file.read_text())
        file_boot_id, (pid, start) = data["boot_id"], data["owner"]
        procs = {(p, t) for p, t in data["processes"]}
    except FileNotFoundError:
        return 0
    except (OSError, ValueError, KeyError, TypeError):
        log.warning("ignoring the unreadable %s", pid_file)
        return 0
    if file_boot_id != boot_id() or start_time(pid) == start:
        return 0  # another boot or host, or its owner still runs (and its watchdog with it)
    count = kill(procs)
    pid_file.unlink(missing_ok=True)
    if count:
        log.warning("cleaned up %d processes left by a previous dit-serve that did not stop cleanly", count)
    return count


def watch_local_ray(data_dir: Path) -> None:
    """Call right after ``ray.init()`` started a local Ray: stops what a crashed predecessor left
    (named in ``<data_dir>/local-ray.pids``), then starts the watchdog. Never raises: without it the
    service still works, and a crash may leave Ray's processes behind (which the log says)."""
    global _watchdog
    release_local_ray()
    if not Path("/proc/self/stat").exists():
        log.info("no /proc: Ray processes left by a crash are not cleaned up")
        return
    pid_file = Path(data_dir).resolve() / PID_FILE
    try:
        clean_leftovers(pid_file)
        import ray

        node = ray._private.worker._global_node  # the local node's processes (ProcessInfo lists)
        roots = [(i.process.pid, start_time(i.process.pid)) for infos in node.all_processes.values() for i in infos]
        owner = (os.getpid(), start_time(os.getpid()))
        r, w = os.pipe()  # not inheritable: only this process holds the write end
        try:
            proc = subprocess.Popen([sys.executable, "-m", "dit_serve.server.reaper", str(pid_file), json.dumps(owner),
                                     json.dumps([p for p in roots if p[1] is not None])],
                                    stdin=r, stdout=subprocess.DEVNULL, start_new_session=True,
                                    cwd=Path(__file__).resolve().parents[2])  # imports this copy of the package
        except BaseException:
            os.close(w)
            raise
        finally:
            os.close(r)
    except Exception as e:  # Ray's internals or the OS: the service must start regardless
        log.warning("cannot watch the local Ray (%s): a crash may leave its processes running", e)
        return
    _watchdog = (proc, w)


def release_local_ray(timeout: float = 10.0) -> None:
    """After ``ray.shutdown()``: the watchdog stops what is left of the local Ray and exits."""
    global _watchdog
    if _watchdog is None:
        return
    (proc, w), _watchdog = _watchdog, None
    try:
        os.write(w, b"\n")  # a normal stop, even if a forked child holds a copy of the write end
    except OSError:
        pass  # the watchdog is gone already
    os.close(w)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        log.warning("the watchdog of the local Ray (pid %d) did not exit within %.0f s", proc.pid, timeout)


def _watch(pid_file: Path, owner: Proc, roots: set[Proc]) -> None:
    """The watchdog: record Ray's processes every ``TICK_S`` until the owner stops or dies, then
    stop them."""
    recorded, written, stopped = roots, None, False
    while start_time(owner[0]) == owner[1]:  # else it died, though a forked child may hold the pipe
        if select.select([sys.stdin], [], [], 0 if written is None else TICK_S)[0]:
            stopped = os.read(sys.stdin.fileno(), 1) == b"\n"  # b"": EOF, the owner died
            break
        if (recorded := with_descendants(recorded)) != written:
            _write(pid_file, owner, recorded)
            written = recorded
    if (count := kill(recorded)) and not stopped:
        log.warning("dit-serve (pid %d) ended without stopping its local Ray: stopped its %d processes",
                    owner[0], count)
    if _owner(pid_file) == list(owner):  # not yet overwritten by a successor's watchdog
        pid_file.unlink(missing_ok=True)


def _write(pid_file: Path, owner: Proc, procs: set[Proc]) -> None:
    tmp = pid_file.with_suffix(f".tmp{os.getpid()}")
    try:
        pid_file.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps({"boot_id": boot_id(), "owner": owner, "processes": sorted(procs)}))
        os.replace(tmp, pid_file)  # readers never see half a file
    except OSError as e:
        log.warning("cannot write %s: %s", pid_file, e)


def _owner(pid_file: Path) -> list[int] | None:
    try:
        return json.loads(pid_file.read_text())["owner"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    _watch(Path(sys.argv[1]), tuple(json.loads(sys.argv[2])), {tuple(p) for p in json.loads(sys.argv[3])})
