"""The per-request LoRA sections of bench/workload.py (lora-step, lora-load, lora-mix; its docstring says what
each measures) and their report, lora_<model>: ``--adapters`` random adapters of rank ``--rank`` on the attention
projections of a model's transformer (FLUX.1, SD3 and PixArt have PEFT targets here), the targets a LoRA trainer
picks by default (to_q, to_k, to_v, to_out.0, and the context stream's add_*_proj and to_add_out), written as
diffusers / PEFT safetensors files."""

from __future__ import annotations

import dataclasses
import json
import re
import tempfile
import time
from pathlib import Path

import torch

import harness
import step as step_bench

from . import shared
from .shared import SYSTEMS

REPORT = "lora"
NAMES = {"lora-step": "step", "lora-load": "load", "lora-mix": "mixed"}  # section on the command line -> report key
DEFAULTS = {"models": ["pixart-sigma-512"], "systems": ["diffusers", "fast"], "loads": [2.0], "largest": 4,
            "inflight": 16, "window_s": 10.0, "drain_s": 5.0, "steps": None, "family": "pixart"}
SMOKE = {"adapters": 3, "rank": 4, "images": 4, "loads": [8.0], "inflight": 4, "window_s": 0.5, "drain_s": 2.0,
         "backlog_stop_s": 60.0, "steps": 2}
SMOKE_FAMILIES = ("flux", "sd3", "pixart")
TARGET = re.compile(r"(^|\.)(to_q|to_k|to_v|to_out\.0|add_q_proj|add_k_proj|add_v_proj|to_add_out)$")


# -- adapters ----------------------------------------------------------------------------------------
def adapter_files(model, count: int, rank: int, folder: Path) -> list[Path]:
    """``count`` random rank-``rank`` adapters on the attention projections of ``model``'s transformer, as
    diffusers / PEFT files (``transformer.<module>.lora_A.weight`` / ``lora_B.weight``, lora_alpha = rank in the
    metadata as diffusers writes it); B's scale makes each adapter move a row's output by about 1% of the base."""
    from safetensors.torch import save_file

    from workers.lora.validate import linear_shapes

    targets = {n: s for n, s in linear_shapes(model.transformer).items() if TARGET.search(n)}
    config = json.dumps({f"transformer.{k}": v for k, v in  # prefixed, as diffusers' save_lora_adapter writes it
                         {"r": rank, "lora_alpha": rank, "target_modules": sorted(targets)}.items()})
    out = []
    for k in range(count):
        g = torch.Generator().manual_seed(1000 + k)
        state = {}
        for name, (fin, fout) in targets.items():
            state[f"transformer.{name}.lora_A.weight"] = (torch.randn(rank, fin, generator=g) / fin ** 0.5).to(torch.bfloat16)
            state[f"transformer.{name}.lora_B.weight"] = (torch.randn(fout, rank, generator=g) * 0.01 / rank ** 0.5).to(torch.bfloat16)
        path = folder / f"adapter{k}.safetensors"
        save_file(state, str(path), metadata={"format": "pt", "lora_adapter_metadata": config})
        out.append(path)
    return out


def bank_targets(args) -> tuple[str, ...]:
    """--lora-targets as the worker's ``lora_targets``: 'adapters' is the adapters' own targets (``TARGET``)."""
    return tuple(TARGET.pattern if t == "adapters" else t for t in getattr(args, "lora_targets", None) or ())


def load_adapters(transformer, files: list[Path], rank: int) -> None:
    """Every adapter into a diffusers transformer as ``a0``, ``a1``, ...: by its ``load_lora_adapter`` (what the
    pipelines' ``load_lora_weights`` calls), or, for a model diffusers gives no LoRA loader (PixArt), by PEFT's own
    injection, which makes the same layers."""
    if hasattr(transformer, "load_lora_adapter"):
        for i, f in enumerate(files):
            transformer.load_lora_adapter(str(f), adapter_name=f"a{i}", prefix="transformer", use_safetensors=True)
        return
    from peft import LoraConfig, inject_adapter_in_model, set_peft_model_state_dict
    from safetensors.torch import load_file

    for i, f in enumerate(files):
        state = {k.removeprefix("transformer."): v for k, v in load_file(str(f)).items()}
        modules = sorted({k.rsplit(".lora_", 1)[0] for k in state})
        inject_adapter_in_model(LoraConfig(r=rank, lora_alpha=rank, target_modules=modules), transformer,
                                adapter_name=f"a{i}")
        set_peft_model_state_dict(transformer, state, adapter_name=f"a{i}")


def lora_engine(preset: str, model, files: list[Path], args, max_batch: int, kernel: str | None = None):
    """The preset's engine over ``model`` with a bank of len(files) slots of rank --rank, --per-request places a
    row and the rows' terms by ``kernel`` (default: the first of --lora-kernels), every adapter registered (none
    resident yet); or the reason the preset cannot run here."""
    config, precision = harness.engine_config(preset, model.card.family, max_batch=max_batch,
                                              lora_slots=len(files), lora_max_rank=args.rank,
                                              lora_per_request=args.per_request,
                                              lora_kernel=kernel or args.lora_kernels[0],
                                              lora_targets=bank_targets(args))
    if (why := harness.unavailable(precision, model.device.type)) is not None:
        return None, why
    engine, warm_s = harness.build_engine(model, config)
    for i, f in enumerate(files):
        engine.add_lora(f"a{i}", f.read_bytes(), model=model.name)
    return engine, warm_s


def ran(kernel: str, model) -> str:
    """The kernel an engine asked for ``kernel`` runs on ``model``: ``bmm`` where Triton does not run."""
    from workers.kernels import lora as lora_kernel

    return kernel if kernel == "bmm" or lora_kernel.runs_on(model.device, model.dtype) else "bmm"


def resident(engine, model, names: list[str]) -> None:
    """Load ``names`` into the bank now (each into its own slot) and wait for the copies."""
    in_use: set[int] = set()
    for name in names:
        assert engine.lora.make_resident([(name, 1.0)], model.name, in_use), "the bank has too few slots"
    harness.sync()


def runner_and_inputs(engine, model, images: int, slots: list[int] | None):
    """The card's default request's runner, and --images rows of its step's inputs (``step.step_inputs``) with
    rows' adapter slots ``slots`` (None: slot 0, no adapter, where the engine has a bank)."""
    from types import SimpleNamespace

    from workers.families import family_of

    variant = family_of(model).variant_of(model, SimpleNamespace(guidance=float(model.card.defaults["guidance"])))
    runner = next(g.runner for k, g in engine.groups.items() if k.variant == variant)
    inputs = step_bench.step_inputs(engine, model, images)
    if slots is not None:  # the row's adapter in its first place, the others empty (slot 0, scale 0)
        places = engine.config.lora_per_request
        inputs["lora_slots"] = torch.zeros(images, places, dtype=torch.int64, device=model.device)
        inputs["lora_slots"][:, 0] = torch.tensor(slots, device=model.device)
        inputs["lora_scales"] = torch.zeros(images, places, device=model.device)
        inputs["lora_scales"][:, 0] = 1.0
    return runner, inputs


# -- sections ----------------------------------------------------------------------------------------
def step_section(preset: str, model, files, args, block: dict) -> None:
    """One step of --images rows: without a bank; then, for each of --lora-kernels, with the bank at slot 0 and
    across the adapters."""
    iters = 3 if args.smoke else 20
    plain, warm_s = harness.build_engine(model, harness.engine_config(preset, model.card.family, max_batch=args.images)[0])
    runner, inputs = runner_and_inputs(plain, model, args.images, None)
    with torch.no_grad():
        base = harness.stats(harness.wall_ms(lambda: runner.run(**inputs), iters))
    del plain, runner
    harness.free()
    out = block[preset] = {"without_adapters": base, "kernels": {}}
    for kernel in args.lora_kernels:
        engine, why = lora_engine(preset, model, files, args, args.images, kernel)
        if engine is None:
            block[preset] = {"skipped": why}
            return
        names = [f"a{i}" for i in range(len(files))]
        resident(engine, model, names)
        slots = [engine.lora.banks[model.name].slot_of(names[i % len(names)]) for i in range(args.images)]
        got = out["kernels"][kernel] = {"ran": ran(kernel, model)}
        for label, rows in (("bank_slot_0", None), ("across_adapters", slots)):
            runner, inputs = runner_and_inputs(engine, model, args.images, rows)
            with torch.no_grad():
                got[label] = harness.stats(harness.wall_ms(lambda: runner.run(**inputs), iters))
        got["ratio"] = round(got["across_adapters"]["median"] / base["median"], 4)
        out["bank_mib"] = round(engine.lora.banks[model.name].nbytes / 2**20, 1)
        from workers.lora import remove_lora

        remove_lora(model)  # the next kernel's engine wraps the plain linears again
        del engine, runner
        harness.free()


def load_section(preset: str, model, files, args, block: dict) -> None:
    """Step times of --images rows with adapters, with an adapter loaded before each step and without."""
    engine, why = lora_engine(preset, model, files, args, args.images)
    if engine is None:
        block[preset] = {"skipped": why}
        return
    bank, names = engine.lora.banks[model.name], [f"a{i}" for i in range(len(files))]
    running = names[: len(names) // 2]  # the rows' adapters; the others rotate through the remaining slots
    resident(engine, model, running)
    slots = [bank.slot_of(running[i % len(running)]) for i in range(args.images)]
    runner, inputs = runner_and_inputs(engine, model, args.images, slots)
    held = {bank.slot_of(n) for n in running}
    spare = names[len(running):]
    calls, spin = [], iter(range(10**6))

    def load() -> int:
        """Load the next spare adapter (evicted first if resident) into a slot no row uses; its slot."""
        name = spare[next(spin) % len(spare)]
        if bank.slot_of(name) is not None:
            bank.evict(bank.slot_of(name))
        t0 = time.perf_counter()
        assert engine.lora.make_resident([(name, 1.0)], model.name, set(held))
        calls.append((time.perf_counter() - t0) * 1e3)
        return bank.slot_of(name)

    def load_until_ready():
        slot = load()
        while not bank.ready(slot):  # the side stream's copy done
            time.sleep(0)

    iters = 3 if args.smoke else 20
    with torch.no_grad():
        steady = harness.stats(harness.wall_ms(lambda: runner.run(**inputs), iters))
        with_loads = harness.stats(harness.wall_ms(lambda: (load(), runner.run(**inputs)), iters))
        alone = harness.stats(harness.wall_ms(load_until_ready, iters))
    block[preset] = {"lora_kernel": ran(args.lora_kernels[0], model), "step_ms": steady,
                     "step_with_a_load_ms": with_loads,
                     "load_call_ms": harness.stats(calls), "load_alone_ms": alone,
                     "adapter_mib": round(sum(f.stat().st_size for f in files) / len(files) / 2**20, 1)}
    del engine
    harness.free()


def mixed_section(system: str, model, files, args, block: dict) -> None:
    """The mixed-adapter workload (lora-mix in bench/workload.py's docstring) for one system: a preset, or
    ``diffusers``."""
    targets = [(0, tuple(model.card.native_size))]
    adapter_of = lambda j: j.cond % len(files)  # noqa: E731  (the job's adapter, uniform over the adapters)

    def items(j, with_lora: bool):
        specs = shared.job_items([model], targets, j, args.steps)
        return [dataclasses.replace(s, loras=((f"a{adapter_of(j)}", 1.0),)) for s in specs] if with_lora else specs

    runs = [(None, shared.backlog(1, args.largest), args.backlog_stop_s)]
    runs += [(load, shared.make_jobs(load, int(load * 1000) + 7, 1, args.largest, args.window_s),
              args.window_s + args.drain_s) for load in args.loads]
    if system == "diffusers":
        from diffusers.utils.peft_utils import set_adapter_layers, set_weights_and_activate_adapters

        pipe = shared.pipeline(model)
        load_adapters(pipe.transformer, files, args.rank)

        def set_adapter(p, batch):  # what the pipelines' set_adapters does to the transformer
            set_weights_and_activate_adapters(p.transformer, [f"a{adapter_of(batch[0])}"], [1.0])

        def adapters(jobs, stop):
            shared.run_static([pipe], [model], targets, jobs, args.inflight, stop, args.steps,
                                key=adapter_of, before=set_adapter)

        def plain(jobs, stop):
            set_adapter_layers(pipe.transformer, enabled=False)
            try:
                shared.run_static([pipe], [model], targets, jobs, args.inflight, stop, args.steps)
            finally:
                set_adapter_layers(pipe.transformer, enabled=True)

        modes = {"no adapters": plain, "adapters": adapters}
    else:  # without a bank, then with one (built second: an engine wraps its model's linears around its bank)
        config, precision = harness.engine_config(system, model.card.family, max_batch=args.inflight)
        if (why := harness.unavailable(precision, model.device.type)) is not None:
            block[system] = {"skipped": why}
            return
        engines = {"no adapters": lambda: harness.build_engine(model, config)[0],
                   "adapters": lambda: lora_engine(system, model, files, args, args.inflight)[0]}
        modes = {label: (lambda jobs, stop, label=label: shared.run_engine(
                     built[label], [model], targets, jobs, args.inflight, stop, args.steps,
                     items=lambda j: items(j, label == "adapters")))
                 for label in engines}
    out = block[system] = {} if system == "diffusers" else {"lora_kernel": ran(args.lora_kernels[0], model)}
    built: dict = {}
    for label, run in modes.items():
        if system != "diffusers":
            built.clear()
            harness.free()
            built[label] = engines[label]()
        res = out[label] = {"loads": []}
        for load, jobs, stop in runs:
            jobs = [dataclasses.replace(j, done=0, finished=None) for j in jobs]
            model.cache.clear()
            run(jobs, stop)
            row = shared.summarise(load, jobs, stop, None if load is None else args.window_s)
            if load is None:
                res["backlog"], res["max_images_per_s"] = row, row["images_per_s"]
            else:
                res["loads"].append(row)
            print(system, label, load, row, flush=True)
    out["with_over_without"] = round(out["adapters"]["max_images_per_s"] / out["no adapters"]["max_images_per_s"], 3)


SECTION = {"step": step_section, "load": load_section, "mixed": mixed_section}


# -- the report --------------------------------------------------------------------------------------
def markdown(result: dict) -> str:
    lines = [f"# Per-request LoRA: {result['model']}, {result['adapters']} adapters of rank {result['rank']}", "",
             harness.hardware_line(result["env"]), "",
             "The adapters target the attention projections; the bank holds "
             + (f"the linears `lora_targets` {result['lora_targets']} name." if result.get("lora_targets")
                else "every linear the step reaches.")]
    if s := result.get("step"):
        lines += ["", f"## One step of {result['images']} images, {result.get('per_request', 1)} adapter places a row "
                  "(median ms)", ""]
        lines += harness.table(["preset", "lora_kernel", "no bank", "bank, no adapter", "across the adapters",
                                "ratio", "bank MiB"],
                               [[p, k if kb.get("ran", k) == k else f"{k} (ran {kb['ran']})",
                                 b["without_adapters"]["median"], kb["bank_slot_0"]["median"],
                                 kb["across_adapters"]["median"], kb["ratio"], b["bank_mib"]]
                                for p, b in s.items() for k, kb in b.get("kernels", {}).items()])
    if ld := result.get("load"):
        lines += ["", f"## Loading an adapter between steps of {result['images']} rows (median ms)", ""]
        lines += harness.table(["preset", "lora_kernel", "step", "a load, then the step", "load call (host)",
                                "load until copied", "adapter MiB"],
                               [[p, b.get("lora_kernel", ""), b["step_ms"]["median"],
                                 b["step_with_a_load_ms"]["median"], b["load_call_ms"]["median"],
                                 b["load_alone_ms"]["median"], b["adapter_mib"]]
                                for p, b in ld.items() if "step_ms" in b])
    if m := result.get("mixed"):
        loads = result["loads"]
        lines += ["", "## Requests of 1-4 images, each naming one adapter: images/s (p50 / p99 ms)", ""]
        rows = []
        for system, b in m.items():
            for label in ("no adapters", "adapters"):
                if label in b:
                    cells = [f"{r['images_per_s']:.2f} ({r['p50_ms']:.0f} / {r['p99_ms']:.0f})" for r in b[label]["loads"]]
                    rows.append([system, b.get("lora_kernel", ""), label, b[label]["max_images_per_s"], *cells])
        lines += harness.table(["system", "lora_kernel", "requests", "max sustained",
                                *(f"at {x} images/s" for x in loads)], rows)
        ratios = {s: b["with_over_without"] for s, b in m.items() if "with_over_without" in b}
        lines += ["", "With adapters over without (max sustained): " + ", ".join(f"{s} {r}" for s, r in ratios.items())]
    return "\n".join(lines + harness.notes(result, SECTION))


def run(args, report: harness.Report | None = None) -> dict:
    """The asked sections' result for the first of --models: each asked preset, and diffusers in the mixed
    workload, each on a fresh load of the model."""
    name = Path(str(args.models[0])).name
    result = {"model": name, "adapters": args.adapters, "rank": args.rank, "images": args.images, "loads": args.loads,
              "per_request": args.per_request, "lora_targets": list(bank_targets(args)),
              "settings": {k: str(v) for k, v in vars(args).items() if k != "out"},
              "env": harness.environment(harness.device_and_dtype(args.smoke)[0]), "errors": {}}
    folder = Path(tempfile.mkdtemp(prefix="bench-lora-"))
    models = shared.Models(args.models[:1], args.smoke)
    files = adapter_files(models.get("bf16", engine=False)[0], args.adapters, args.rank, folder)
    for section in [NAMES[s] for s in args.sections]:
        block = result.setdefault(section, {})
        for system in [s for s in SYSTEMS if s in args.systems and (section == "mixed" or s != "diffusers")]:
            def one(system=system, section=section):
                # a fresh model each time: an engine rewrites its model in place, and wraps its linears around
                # its own adapter bank
                precision = "bf16" if system == "diffusers" else harness.engine_config(system, models.family())[1]
                models.loaded, models.precision = [], None
                SECTION[section](system, models.get(precision)[0], files, args, block)
            harness.attempt(result, f"{section}/{system}", one, report)
            harness.free()
    return result
