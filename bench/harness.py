"""What every benchmark shares: the systems it compares, timing, statistics, the machine it ran on, and
its one current report.

Systems. A benchmark compares *systems*; each is a name in ``SYSTEMS``:

    diffusers       the diffusers pipeline over the same modules (its loop body for one step), eager
    torch.compile   the same with its transformer wrapped in ``torch.compile`` (what a diffusers user gets)
    default         our engine as a worker runs it out of the box: CUDA graphs, the model's dtype, no compile
    fast            default, compiled by Inductor inside the graphs with the scope each family measured best
                    (``FAST_SCOPE``), the VAE decode captured and compiled too
    fastest         fast, with FP8 block linears where the GPU has them, and FP8 attention for the families
                    that have an FP8 attention kernel (SD3, FLUX.1)

An engine's settings come from ``engine_config(preset, family, **overrides)`` alone: a benchmark that
compares one setting passes it as an override (``engine_config("fast", "flux", compile_scope="step")``),
never by patching a module.

Timing. ``wall_ms`` times a call with the host's clock, synchronised after it (what a caller waits for);
``cuda_ms`` with CUDA events around it (the GPU's time; the host clock off CUDA); ``replay_us`` captures
``calls`` calls of a kernel in one CUDA graph and times its replays (a kernel's time without the host's
launches). Each returns every sample; ``stats`` gives their median and percentiles.

Reports. ``write_report(out, name, result, markdown)`` writes ``out/name.json`` (the result with the
environment and the command line) and ``out/name.md``, overwriting: one current report per workload. A
``--smoke`` run writes under a temporary folder unless told otherwise, so smoke figures never land in
docs/benchmarks.
"""

from __future__ import annotations

import dataclasses
import datetime
import gc
import json
import os
import platform
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

import torch

REPORTS = Path(__file__).resolve().parents[1] / "docs" / "benchmarks"

# -- systems -----------------------------------------------------------------------------------------
BASELINES = ("diffusers", "torch.compile")
PRESETS = ("default", "fast", "fastest")
SYSTEMS = BASELINES + PRESETS


class Setup(NamedTuple):
    """A system's engine settings: the worker's config and what the speed layer does to the model."""

    worker: object  # workers.config.WorkerConfig
    speed: object   # workers.speed.SpeedConfig


def engine_config(preset: str, family: str, **overrides) -> tuple[Setup, str]:
    """The engine's settings and the model's load precision for ``preset`` on a model of ``family``, as a
    worker at that speed makes them (``WorkerConfig.speed_for``), with ``overrides`` (WorkerConfig fields such
    as backend, max_batch, compile, compile_scope, decode_graphs; SpeedConfig fields; or ``precision``)
    applied last. The one place a benchmark's engine settings are made."""
    from dataclasses import fields, replace

    from workers.config import WorkerConfig
    from workers.families import family_named
    from workers.speed import SpeedConfig

    if preset not in PRESETS:
        raise ValueError(f"preset must be one of {PRESETS}, got {preset!r}")
    speed_fields = {f.name for f in fields(SpeedConfig)} - set(WorkerConfig.model_fields)
    own = {k: overrides.pop(k) for k in list(overrides) if k in speed_fields}
    precision = overrides.pop("precision", None)
    worker = WorkerConfig(backend="graphs", speed=preset, **overrides)
    speed = replace(worker.speed_for("model", family_named(family)), **own)
    speed = replace(speed, precision=precision or speed.precision or "bf16")
    return Setup(worker, speed), speed.precision


def describe(config: Setup) -> dict:
    """A system's settings for its report: the engine's backend and buckets, and the speed layer's fields."""
    import dataclasses

    return {"backend": config.worker.backend, "max_batch": config.worker.max_batch,
            "text_encoder_device": config.worker.text_encoder_device, **dataclasses.asdict(config.speed)}


def unavailable(precision: str, device: str) -> str | None:
    """Why ``precision`` cannot run on ``device`` (a system to skip, with its reason), or None."""
    from workers.speed.apply import unsupported_reason

    return unsupported_reason(precision, device)


# -- models ------------------------------------------------------------------------------------------
SMOKE_MODELS = {"dit": "tiny_dit", "pixart": "tiny_pixart", "sd3": "tiny_sd3", "flux": "tiny_flux",
                "flux2": "tiny_flux2", "qwenimage": "tiny_qwenimage", "zimage": "tiny_zimage",
                "sana": "tiny_sana"}
FAMILIES = tuple(SMOKE_MODELS)  # every family, by its tiny model (a test holds them equal to the registry)


def device_and_dtype(smoke: bool) -> tuple[str, torch.dtype]:
    """Where a run's models live: float32 on the CPU for a smoke run, else bf16 on the GPU."""
    return ("cpu", torch.float32) if smoke or not torch.cuda.is_available() else ("cuda", torch.bfloat16)


def tiny_model(family: str, root: Path | None = None) -> Path:
    """A tiny random model directory of ``family`` (made offline, seconds on a CPU): what ``--smoke`` runs."""
    from workers.models import (tiny_flux, tiny_flux2, tiny_pixart, tiny_qwenimage, tiny_sana, tiny_sd3,
                                tiny_zimage)
    from workers.models.tiny_dit import write_tiny_dit

    path = Path(root or tempfile.mkdtemp(prefix="bench-")) / f"tiny-{family}"
    if not path.exists():
        make = {"dit": write_tiny_dit, "pixart": tiny_pixart.make_tiny_pixart, "sd3": tiny_sd3.make_tiny_sd3,
                "flux": tiny_flux.make_tiny_flux, "flux2": tiny_flux2.make_tiny_flux2,
                "qwenimage": tiny_qwenimage.make_tiny_qwenimage, "zimage": tiny_zimage.make_tiny_zimage,
                "sana": tiny_sana.make_tiny_sana}[family]
        make(path)
    return path


def load(model: str | Path, precision: str = "bf16", smoke: bool = False, text_encoder_device: str = ""):
    """A loaded model: a built-in's random weights (made on the GPU) or a directory; ``precision`` as the
    loader takes it; its text encoders on ``text_encoder_device`` ("": with the transformer), as a worker with
    that ``WorkerConfig.text_encoder_device`` loads them."""
    from workers.loading import load_model

    device, dtype = device_and_dtype(smoke)
    return load_model(model, device=device, dtype=dtype, precision=precision,
                      encoder_device=text_encoder_device or None)


# -- text encoders on the host ------------------------------------------------------------------------
TEXT_ENCODER_DEVICES = {"gpu": "", "cpu": "cpu"}  # --text-encoder-device -> WorkerConfig.text_encoder_device
TEXT_ENCODER_HELP = ("where text encoders run (WorkerConfig.text_encoder_device): gpu, with the transformer; cpu, "
                     "on the host: ours loads them there as such a worker does; diffusers' pipeline runs over the "
                     "same host encoders, its token ids moved to them and the embeddings back to its GPU (not "
                     "enable_model_cpu_offload, which brings each module to the GPU for its turn)")


def text_encoders(model) -> list:
    """``model``'s text encoder modules (``text_encoder``, ``text_encoder_2``, ...), each once."""
    found = {id(v): v for k, v in sorted(vars(model).items())
             if k.startswith("text_encoder") and isinstance(v, torch.nn.Module)}
    return list(found.values())  # a module under two names once, at its first


def encoder_device(model) -> str | None:
    """Where ``model``'s text encoders are ("cpu", "cuda:0"; the first's), None for a model without one."""
    for encoder in text_encoders(model):
        return str(next(encoder.parameters()).device)
    return None


def _to_own_device(module, args, kwargs):
    """A forward pre-hook: the module's tensor arguments moved to the device of its weights."""
    device = next(module.parameters()).device
    move = lambda v: v.to(device) if isinstance(v, torch.Tensor) and v.device != device else v  # noqa: E731
    return tuple(move(v) for v in args), {k: move(v) for k, v in kwargs.items()}


def feed_encoders(model) -> None:
    """Let a diffusers pipeline over ``model`` run with its text encoders on another device than its transformer
    (the host): the pipeline computes on the transformer's GPU (``DiffusionPipeline.device`` prefers an accelerator)
    and puts the token ids there, so each such encoder gets a pre-hook moving its inputs to its own device; the
    pipeline moves the embeddings it keeps to its device itself (``prompt_embeds.to(device=device)``). Once per
    encoder; nothing for encoders beside the transformer."""
    for encoder in text_encoders(model):
        if next(encoder.parameters()).device.type == torch.device(model.device).type:
            continue
        if not any(h is _to_own_device for h in encoder._forward_pre_hooks.values()):
            encoder.register_forward_pre_hook(_to_own_device, with_kwargs=True)


class EncodeClock:
    """Milliseconds the host spends in a model's text encoders while it is open: each call of an encoder, or of the
    language model inside it (``get_decoder()``: FLUX.2's encode calls that, its pipeline the encoder), timed once
    (a call inside another is part of it). For encoders on the host: a GPU encoder's kernels run after its call
    returns. ``take()``: the milliseconds since the last take."""

    def __init__(self, model) -> None:
        self.modules = []
        for encoder in text_encoders(model):
            inner = encoder.get_decoder() if hasattr(encoder, "get_decoder") else encoder
            self.modules += [encoder] + ([inner] if isinstance(inner, torch.nn.Module) and inner is not encoder else [])
        self.depth, self.start, self.ms, self.handles = 0, 0.0, 0.0, []

    def __enter__(self) -> "EncodeClock":
        for m in self.modules:
            self.handles += [m.register_forward_pre_hook(self._enter), m.register_forward_hook(self._leave,
                                                                                                always_call=True)]
        return self

    def __exit__(self, *exc) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []

    def _enter(self, module, args) -> None:
        self.depth += 1
        if self.depth == 1:
            self.start = time.perf_counter()

    def _leave(self, module, args, output) -> None:
        self.depth -= 1
        if self.depth == 0:
            self.ms += (time.perf_counter() - self.start) * 1e3

    def take(self) -> float:
        ms, self.ms = self.ms, 0.0
        return ms


def build_engine(models, config: Setup, sizes=()) -> tuple[object, float]:
    """An engine over ``models`` (with ``config``, ``engine_config``'s) warmed as a worker warms it (at ``sizes`` too); and the seconds it took."""
    from workers.engine import Engine

    t0 = time.perf_counter()
    engine = Engine(models, config.worker, speed=config.speed)
    engine.warmup(sizes=sizes)
    sync()
    return engine, time.perf_counter() - t0


def free() -> None:
    """Drop what the last system left (its graphs and pool) before the next one is built."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


# -- timing ------------------------------------------------------------------------------------------
def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def wall_ms(fn, iters: int, warmup: int = 3) -> list[float]:
    """ms of each of ``iters`` calls of ``fn()`` by the host's clock, synchronised after each (its host
    work included), after ``warmup`` untimed calls."""
    for _ in range(warmup):
        fn()
    sync()
    out = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        sync()
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def cuda_ms(fn, iters: int, warmup: int = 3) -> list[float]:
    """ms of each call by CUDA events recorded around it (the GPU's time); ``wall_ms`` off CUDA."""
    if not torch.cuda.is_available():
        return wall_ms(fn, iters, warmup)
    for _ in range(warmup):
        fn()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return [start.elapsed_time(end) for start, end in events]


def replay_us(fn, calls: int = 20, reps: int = 15) -> list[float]:
    """us of one call of ``fn()`` (a kernel), from ``calls`` calls captured in one CUDA graph and replayed
    ``reps`` times (each replay timed by CUDA events, divided by ``calls``). Off CUDA: ``wall_ms`` of one
    call, in us."""
    if not torch.cuda.is_available():
        return [ms * 1e3 for ms in wall_ms(fn, reps, warmup=1)]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):  # lazy initialisation and autotuning outside the capture
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    return [ms * 1e3 / calls for ms in cuda_ms(graph.replay, reps, warmup=1)]


def percentile(samples: list[float], q: float) -> float:
    """The ``q``-th percentile (0-100) by linear interpolation between the closest ranks (numpy's default)."""
    xs = sorted(samples)
    pos = (len(xs) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def stats(samples: list[float], digits: int = 3) -> dict:
    """The median, p10 and p90 of ``samples`` and their count."""
    r = lambda x: round(x, digits)
    return {"median": r(statistics.median(samples)), "p10": r(percentile(samples, 10)),
            "p90": r(percentile(samples, 90)), "n": len(samples)}


# -- the machine -------------------------------------------------------------------------------------
def _version(name: str) -> str:
    try:
        return __import__(name).__version__
    except ImportError:
        return "none"


def environment(device: str | None = None) -> dict:
    """The GPU (or CPU), the host, the versions and the command line a report's figures came from."""
    cuda = torch.cuda.is_available() and device != "cpu"
    gpu = {"gpu": torch.cuda.get_device_name(), "gpus": torch.cuda.device_count(),
           "capability": ".".join(map(str, torch.cuda.get_device_capability()))} if cuda else {"gpu": None}
    return {**gpu, "host_cpu": platform.processor() or platform.machine(), "host_cores": os.cpu_count(),
            "python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
            "triton": _version("triton"), "diffusers": _version("diffusers"),
            "transformers": _version("transformers"),
            "command": "python " + " ".join(shlex.quote(a) for a in [os.path.relpath(sys.argv[0]), *sys.argv[1:]]),
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}


def hardware_line(env: dict) -> str:
    """One line naming where a report ran, for its Markdown."""
    where = env["gpu"] or f"CPU ({env['host_cpu']}, {env['host_cores']} cores)"
    return (f"{where}; torch {env['torch']}, diffusers {env['diffusers']}, triton {env['triton']}; "
            f"{env['date']}; `{env['command']}`")


# -- reports -----------------------------------------------------------------------------------------
def out_dir(out: Path | None, smoke: bool) -> Path:
    """Where a run writes: ``--out``, else docs/benchmarks, else (smoke) a fresh temporary folder."""
    if out is not None:
        return Path(out)
    return Path(tempfile.mkdtemp(prefix="bench-smoke-")) if smoke else REPORTS


def table(headers: list[str], rows: list[list]) -> list[str]:
    """A Markdown table's lines; None cells print as "-"."""
    cell = lambda v: "-" if v is None else (f"{v:.2f}" if isinstance(v, float) else str(v))
    return ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers),
            *("| " + " | ".join(cell(v) for v in row) + " |" for row in rows)]


def _jsonable(value):
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    if isinstance(value, (Path, torch.dtype, torch.device)):
        return str(value)
    raise TypeError(f"not JSON: {type(value).__name__}")


def notes(result: dict, sections) -> list[str]:
    """A report's closing markdown lines: each system a section skipped (its ``{"skipped": why}``), and each part
    that failed (``attempt``'s ``errors``)."""
    lines = [f"\n{s} skipped ({section}): {b['skipped']}" for section in sections
             for s, b in result.get(section, {}).items() if isinstance(b, dict) and "skipped" in b]
    return lines + [f"\n- {part} failed: `{err.splitlines()[0][:300]}`" for part, err in result.get("errors", {}).items()]


def write_report(out: Path, name: str, result: dict, markdown: str) -> list[Path]:
    """``out/name.json`` and ``out/name.md``, overwritten: the workload's one current report."""
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / f"{name}.json", out / f"{name}.md"]
    paths[0].write_text(json.dumps(result, indent=1, default=_jsonable) + "\n")
    paths[1].write_text(markdown.rstrip() + "\n")
    return paths


class Report:
    """A workload's one current report (``out/name.{json,md}``), drawn by ``markdown(result)``. ``attempt`` saves it
    after every part, marked partial, so a run stopped by a time limit keeps what it measured; ``save`` at the end
    writes the whole."""

    def __init__(self, out: Path, name: str, markdown):
        self.out, self.name, self.markdown = out, name, markdown

    def save(self, result: dict, partial: bool = False) -> list[Path]:
        try:
            text = self.markdown(result)
        except Exception as exc:  # a section half done may not draw; its JSON still holds what was measured
            text = f"(not drawn from this partial result: {type(exc).__name__}: {exc})"
        if partial:
            result = {**result, "partial": True}
            text = "**Partial: written while the run went on; it stopped before the end.**\n\n" + text
        return write_report(self.out, self.name, result, text)


def attempt(result: dict, part: str, fn, report: Report | None = None) -> None:
    """Run one part of a benchmark; an exception is recorded under ``result["errors"][part]`` and the
    rest still runs (a part failing is a result to report, not a reason to lose the others). With ``report``,
    the result so far is saved after the part, marked partial."""
    t0 = time.perf_counter()
    try:
        fn()
    except Exception as exc:
        result.setdefault("errors", {})[part] = f"{type(exc).__name__}: {exc}"[:2000]
        free()
    failed = result.get("errors", {}).get(part)
    print(f"{part}: {time.perf_counter() - t0:.1f} s" + (f" FAILED {failed[:300]}" if failed else ""), flush=True)
    if report is not None:
        report.save(result, partial=True)
