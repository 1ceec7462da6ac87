"""The edits sections of bench/workload.py (img2img, blend, edit-mix; its docstring says what each measures)
and their report, edits_<model>: image-to-image and inpainting requests of a model of a family that edits, on a
seeded source image (and a mask over its right half), against the family's diffusers pipeline made into its
image-to-image or inpainting sibling."""

from __future__ import annotations

import dataclasses
import io
import random
from pathlib import Path

import torch

import harness

from . import shared
from .shared import SYSTEMS

REPORT = "edits"
NAMES = {"img2img": "e2e", "blend": "blend", "edit-mix": "mixed"}  # section on the command line -> report key
DEFAULTS = {"models": ["flux-dev-1024"], "systems": ["diffusers", "default", "fast"], "loads": [1.0], "inflight": 8,
            "window_s": 20.0, "drain_s": 10.0, "steps": 28, "family": "flux"}
SMOKE = {"steps": 4, "reps": 2, "e2e_batch": 2, "loads": [8.0], "inflight": 4, "window_s": 0.5, "drain_s": 2.0,
         "backlog_stop_s": 60.0}
SMOKE_FAMILIES = ("flux", "sd3")
KINDS = ("text", "image", "inpaint")  # text-to-image, image-to-image, inpainting
SHARES = (0.7, 0.2, 0.1)


# -- inputs ------------------------------------------------------------------------------------------
def source_image(size: tuple[int, int], seed: int = 0):
    """A seeded picture at ``size`` (width, height): smooth colour ramps and a few discs (PIL, RGB)."""
    from PIL import Image, ImageDraw

    w, h = size
    rng = random.Random(seed)
    x = torch.linspace(0, 1, w)[None, :].expand(h, w)
    y = torch.linspace(0, 1, h)[:, None].expand(h, w)
    rgb = torch.stack([x, y, (x + y) / 2]) * 200 + 30  # (3, H, W)
    img = Image.fromarray(rgb.permute(1, 2, 0).to(torch.uint8).numpy())
    draw = ImageDraw.Draw(img)
    for _ in range(6):
        cx, cy, r = rng.uniform(0, w), rng.uniform(0, h), rng.uniform(w / 16, w / 5)
        draw.ellipse((cx - r, cy - r, cx + r, cy + r), fill=tuple(rng.randrange(256) for _ in range(3)))
    return img


def right_half_mask(size: tuple[int, int]):
    """White (repaint) over the right half, black elsewhere (PIL, L)."""
    from PIL import Image

    w, h = size
    mask = Image.new("L", (w, h), 0)
    mask.paste(255, (w // 2, 0, w, h))
    return mask


def png(img) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def edit_item(model, rid: str, seed: int, cond: int, size, kind: str, strength: float, steps=None):
    """``shared.item`` made an edit of ``kind`` (text: unchanged) of the source image at ``size``."""
    spec = shared.item(model, rid, seed, cond, size, steps)
    if kind == "text":
        return spec
    image = png(source_image(size))
    mask = png(right_half_mask(size)) if kind == "inpaint" else b""
    return dataclasses.replace(spec, image=image, mask=mask, strength=strength)


def edit_pipeline(model, kind: str):
    """The family's diffusers pipeline for ``kind`` over ``model``'s modules (the text-to-image one made into
    its image-to-image or inpainting sibling by diffusers' auto pipelines)."""
    import diffusers

    pipe = shared.pipeline(model)
    if kind == "text":
        return pipe
    auto = diffusers.AutoPipelineForImage2Image if kind == "image" else diffusers.AutoPipelineForInpainting
    out = auto.from_pipe(pipe)
    out.set_progress_bar_config(disable=True)
    return out


def call_edit(pipe, model, specs: list, kind: str, strength: float, size):
    """One pipeline call making ``specs`` (one kind, one size); numpy pixels out."""
    from workers.families import family_of

    kwargs = family_of(model).reference_call(model, specs)
    if kind != "text":
        n = len(specs)
        kwargs.update(image=[source_image(size)] * n, strength=strength)
        if kind == "inpaint":
            kwargs["mask_image"] = [right_half_mask(size)] * n
    return pipe(**kwargs, output_type="np", generator=torch.Generator().manual_seed(specs[0].seed)).images


# -- sections ----------------------------------------------------------------------------------------
def e2e(system: str, models: shared.Models, args, block: dict) -> None:
    fresh = iter(range(10_000))
    for size in args.sizes:
        row = block.setdefault(f"{size[0]}x{size[1]}", {})
        if system == "diffusers":
            model = models.get("bf16", engine=False)[0]
            pipe = edit_pipeline(model, "image")
            one = lambda: call_edit(pipe, model, [shared.item(model, "e2e", 0, next(fresh), size, args.steps)],
                                    "image", args.strength, size)
        else:
            config, why, precision = shared.engine_for(system, models, args.e2e_batch)
            if why:
                row[system] = {"skipped": why}
                continue
            model = models.get(precision)[0]
            engine, warm_s = harness.build_engine(model, config, sizes=[size])
            row.setdefault("warmup_s", {})[system] = round(warm_s, 2)

            def one():
                model.cache.clear()
                engine.generate([edit_item(model, "e2e", 0, next(fresh), size, "image", args.strength, args.steps)])
        row[system] = harness.stats(harness.wall_ms(one, args.reps, warmup=1), digits=1)


def blend(system: str, models: shared.Models, args, block: dict) -> None:
    """Each bucket's step, plain and inpainting (the engine's own groups: one request of each kind made first)."""
    from types import SimpleNamespace

    from workers.edits import inpaint_variant
    from workers.families import family_of

    if system == "diffusers":
        return
    config, why, precision = shared.engine_for(system, models, args.e2e_batch)
    if why:
        block[system] = {"skipped": why}
        return
    model = models.get(precision)[0]
    size = tuple(model.card.native_size)
    engine, _ = harness.build_engine(model, config)
    steps = 2
    engine.generate([edit_item(model, "warm", 0, 0, size, kind, args.strength, steps) for kind in ("text", "inpaint")])
    base = family_of(model).variant_of(model, SimpleNamespace(guidance=float(model.card.defaults["guidance"])))
    by_variant = {k.variant: g for k, g in engine.groups.items() if g.shape == model.latent_shape}
    groups = {False: by_variant[base], True: by_variant[inpaint_variant(base)]}
    out = block[system] = {}
    buckets = [b for b in (1, 2, 4, 8, 16, 32, 64) if b <= args.e2e_batch]
    iters = 3 if args.smoke else 20
    with torch.no_grad():
        for b in buckets:
            ms = {}
            for inpaints, group in sorted(groups.items()):
                row = engine.warmup_example(model, group.shape, group.variant)
                inputs = {k: v.expand(b, *v.shape[1:]).contiguous() for k, v in row.items()}
                ms[inpaints] = harness.stats(harness.wall_ms(lambda g=group, i=inputs: g.runner.run(**i), iters))
            out[b] = {"step_ms": ms[False], "inpaint_step_ms": ms[True],
                      "blend_share": round(ms[True]["median"] / ms[False]["median"] - 1, 4)}
    del engine
    harness.free()


def kinds_of(jobs: list, seed: int = 5) -> dict[int, str]:
    """Each job's kind, seeded, in the mix's shares."""
    rng = random.Random(seed)
    return {j.id: rng.choices(KINDS, SHARES)[0] for j in jobs}


def mixed(system: str, models: shared.Models, args, block: dict) -> None:
    precision = "bf16"
    if system != "diffusers":
        config, why, precision = shared.engine_for(system, models, args.inflight)
        if why:
            block[system] = {"skipped": why}
            return
    model = models.get(precision, engine=system != "diffusers")[0]
    size = tuple(model.card.native_size)
    targets = [(0, size)]
    if system == "diffusers":
        pipes = {kind: edit_pipeline(model, kind) for kind in KINDS}

        def run(jobs, stop, kind_of):
            def call(batch):
                kind = kind_of[batch[0].id]
                specs = [x for j in batch for x in shared.job_items([model], targets, j, args.steps)]
                call_edit(pipes[kind], model, specs, kind, args.strength, size)
            shared.run_static([None], [model], targets, jobs, args.inflight, stop, args.steps,
                                key=lambda j: kind_of[j.id], call=call)
    else:
        engine, warm_s = harness.build_engine(model, config, sizes=[size])
        engine.generate([edit_item(model, "warm", 0, 0, size, "inpaint", args.strength, 2)])  # its groups captured
        block.setdefault("warmup_s", {})[system] = round(warm_s, 2)

        def run(jobs, stop, kind_of):
            items = lambda j: [edit_item(model, f"{j.id}:0", j.id * 1000, j.cond, size, kind_of[j.id],  # noqa: E731
                                         args.strength, args.steps)]
            shared.run_engine(engine, [model], targets, jobs, args.inflight, stop, args.steps, items=items)
    out = block[system] = {"loads": [], "text_alone": []}
    backlog = [dataclasses.replace(j, n=1) for j in shared.backlog(1, 1)] * 3
    backlog = [dataclasses.replace(j, id=i) for i, j in enumerate(backlog)]
    runs = [(None, backlog, args.backlog_stop_s, False)]
    for load in args.loads:
        jobs = [dataclasses.replace(j, n=1) for j in shared.make_jobs(load, int(load * 1000) + 7, 1, 1, args.window_s)]
        runs += [(load, jobs, args.window_s + args.drain_s, False), (load, jobs, args.window_s + args.drain_s, True)]
    for load, jobs, stop, text_only in runs:
        jobs = [dataclasses.replace(j, done=0, finished=None) for j in jobs]
        kind_of = {j.id: "text" for j in jobs} if text_only else kinds_of(jobs)
        model.cache.clear()
        run(jobs, stop, kind_of)
        row = shared.summarise(load, jobs, stop, None if load is None else args.window_s)
        row["by_kind"] = {kind: shared.summarise(load, [j for j in jobs if kind_of[j.id] == kind], stop)
                          for kind in KINDS if any(kind_of[j.id] == kind for j in jobs)}
        if load is None:
            out["backlog"], out["max_images_per_s"] = row, row["images_per_s"]
        else:
            out["text_alone" if text_only else "loads"].append(row)
        print(system, load, "text alone" if text_only else "mix", row, flush=True)


SECTION = {"e2e": e2e, "blend": blend, "mixed": mixed}


# -- the report --------------------------------------------------------------------------------------
def markdown(result: dict) -> str:
    lines = [f"# Edits: {result['model']}", "", harness.hardware_line(result["env"])]
    if e := result.get("e2e"):
        for size, b in e.items():
            lines += ["", f"## One image-to-image request at {size}, strength {result['strength']} (ms)", ""]
            base = b.get("diffusers", {}).get("median")
            lines += harness.table(["system", "median", "p10", "p90", "vs diffusers", "warm-up s"],
                                   [[s, r["median"], r["p10"], r["p90"],
                                     round(r["median"] / base, 3) if base else None, b.get("warmup_s", {}).get(s)]
                                    for s, r in b.items() if s in SYSTEMS and "median" in r])
    if bl := result.get("blend"):
        lines += ["", "## Inpainting's blend per bucket (median ms of a step)", ""]
        lines += harness.table(["system", "bucket", "step", "inpainting step", "blend's share"],
                               [[s, n, r["step_ms"]["median"], r["inpaint_step_ms"]["median"], f"{r['blend_share']:.1%}"]
                                for s, b in bl.items() if "skipped" not in b for n, r in b.items()])
    if m := result.get("mixed"):
        lines += ["", "## 70% text-to-image, 20% image-to-image, 10% inpainting: images/s, p50 / p99 ms per kind", ""]
        rows = []
        for s, b in m.items():
            if s not in SYSTEMS or "loads" not in b:
                continue
            for mix_row, alone in zip(b["loads"], b["text_alone"]):
                per = "; ".join(f"{k} {r['p50_ms']:.0f} / {r['p99_ms']:.0f}" for k, r in mix_row["by_kind"].items())
                rows.append([s, b.get("max_images_per_s"), mix_row["offered_images_per_s"], mix_row["images_per_s"],
                             per, f"{alone['p50_ms']:.0f} / {alone['p99_ms']:.0f}"])
        lines += harness.table(["system", "max sustained", "offered", "images/s", "p50 / p99 by kind",
                                "text alone p50 / p99"], rows)
    return "\n".join(lines + harness.notes(result, SECTION))


def run(args, report: harness.Report | None = None) -> dict:
    """The asked sections' result for the first of --models: each asked system in turn, diffusers first (each
    engine patches the model it runs in place)."""
    name = Path(str(args.models[0])).name
    models = shared.Models(args.models[:1], args.smoke, harness.TEXT_ENCODER_DEVICES[args.text_encoder_device])
    args.sizes = args.sizes or [tuple(models.get("bf16", engine=False)[0].card.native_size)]
    result = {"model": name, "strength": args.strength, "loads": args.loads,
              "settings": {k: str(v) for k, v in vars(args).items() if k != "out"},
              "env": harness.environment(harness.device_and_dtype(args.smoke)[0]), "errors": {}}
    for section in [NAMES[s] for s in args.sections]:
        block = result.setdefault(section, {})
        for system in [s for s in SYSTEMS if s in args.systems]:
            part = lambda: SECTION[section](system, models, args, block)  # noqa: E731
            harness.attempt(result, f"{section}/{system}", part, report)
            harness.free()
    return result
