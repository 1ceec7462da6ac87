"""Whole images through the engine against the family's diffusers pipelines: one image end to end, mixed
workloads under seeded Poisson arrivals, image-to-image and inpainting, and per-request LoRA, for any family.

Sections (``--sections``; default e2e mixed), in three groups, each writing its own report under
docs/benchmarks, named after the first of --models. Any family, workload_<model>.{json,md}:

  e2e          one image, conditioning to pixels (the card's sampler, steps and guidance; text encoding and
               VAE decode included), a prompt or label never seen before in every run (the encoding cache
               cleared), at each size the first of --models makes of --sizes (its native size if none): each
               preset's engine (warmed at that size first) against the pipeline at the same size, median of --reps
               runs after one warm-up; a table per size. With --text-encoder-device cpu, the text encoders run on
               the host for both (the option's help says how) and each run's host encode time is reported.
  mixed        requests of 1 image (70%), 2-8 (25%) or --largest/2 to --largest (5%), each at one of the
               models and sizes asked (--models, --sizes; 1:1 by request), seeded Poisson arrivals at each
               offered load (images/s), one single-threaded clock (a request's latency runs from its arrival
               to its last image decoded). A preset's engine batches at step level (images join at any step,
               admitted as the service leases: ``workers.request.admission``), at most --inflight images in flight,
               warmed at every size first; ``diffusers`` batches statically (the first queued request and the
               queued ones of its model and size, up to --inflight images a call, waiting at most 0.1 s). Per
               system: the max sustained images/s (a backlog with the mix exactly, queued at t=0, run to
               completion) and images/s, p50/p99 at each load.
  consistency  whether an image depends on its batch: the same requests generated each alone, then all
               together (power-of-two replays, padding where it pays); largest and mean uint8 difference.

Edits, on the first of --models (a family that edits), a seeded source image and a mask over its right half,
edits_<model>.{json,md}:

  img2img      one image-to-image request at --strength with the card's sampler and --steps, at each --sizes,
               the prompt new every run: each preset's engine (warmed first) against the family's diffusers
               pipeline made into its image-to-image one (``AutoPipelineForImage2Image.from_pipe``:
               FluxImg2ImgPipeline, StableDiffusion3Img2ImgPipeline, ...); median of --reps runs after one warm-up.
  blend        at every bucket, the captured step of the card's default request against its inpainting variant
               (the same step, then the per-row blend of the image's noised latents outside the mask): median ms
               and the blend's share of the step.
  edit-mix     seeded Poisson arrivals of 1-image requests, 70% text-to-image, 20% image-to-image, 10% inpainting,
               at each offered load: our engine (all three kinds in one running batch) against diffusers' three
               pipelines with static batching per kind (the queued requests of one kind, up to --inflight a call);
               and text-to-image alone at the same load as the latency reference. Per system and kind: images/s,
               p50 / p99 ms; the max sustained images/s from a backlog of the mix.

Per-request LoRA, on the first of --models (FLUX.1, SD3 and PixArt have PEFT targets here) with --adapters random
adapters of rank --rank on the attention projections, lora_<model>.{json,md}:

  lora-step    one step of --images images, the rows spread over the adapters (row i: adapter i mod N), against
               the same preset's engine without adapters (``lora_slots`` 0) and with the bank but every row at
               slot 0, for each kernel of the rows' terms (--lora-kernels: ``bmm``, gathered batched products;
               ``triton``, ``workers.kernels.lora``; where Triton does not run it is ``bmm``); median ms, the
               ratio, and the bank's memory. A row has --per-request adapter places (the worker's default 4),
               one used.
  lora-load    the step of --images rows with adapters, timed with an adapter loaded into a free slot (on the
               bank's side stream) before every step, against the same steps with no load; and the load's own
               time (the host call, and until its copy is done).
  lora-mix     seeded Poisson arrivals of 1-4 image requests, each naming one of the adapters (uniformly): our
               engine (step-level batching, adapters per row) with and without the adapters named, and
               ``diffusers``: the pipeline with every adapter loaded (``load_lora_adapter``), ``set_adapters``
               before each call, static batches of queued requests of one adapter, and the same pipeline with no
               adapter as the reference: the max sustained images/s (a backlog, queued at t=0) and images/s,
               p50/p99 at each offered load.

Where a group's default differs (--models, --systems, --loads, --largest, --inflight, --window-s, --drain-s,
--steps, --family; ``--help`` lists them), an option not given takes each group's own; one given applies to
every group asked. ``--smoke`` runs a tiny random model of --family on a CPU, with each group's small settings.

    python bench/workload.py --models dit-xl-2-256 --sections e2e mixed --loads 4 8 12
    python bench/workload.py --models dit-xl-2-256 dit-xl-2-512 --sections mixed     # two models, one mix
    python bench/workload.py --models pixart-sigma-512 --sizes 512x512 512x768 768x512 --systems diffusers fast fastest
    python bench/workload.py --models flux-dev-1024 --sections e2e --systems diffusers fast fastest
    python bench/workload.py --models flux-dev-1024 --sections e2e --sizes 512x512 1024x1024 --systems diffusers default
    python bench/workload.py --models flux2-dev-1024 --sections e2e --sizes 512x512 --text-encoder-device cpu
    python bench/workload.py --models flux-dev-1024 --sections img2img blend edit-mix --systems diffusers fast
    python bench/workload.py --models flux-dev-1024 --sections img2img --sizes 1024x1024 512x512 --systems fast
    python bench/workload.py --models flux-dev-1024 --sections lora-step lora-load lora-mix --systems diffusers fast
    python bench/workload.py --smoke [--family pixart]      # a tiny random model on a CPU, seconds
    python bench/workload.py --smoke --sections img2img blend edit-mix [--family sd3]
    python bench/workload.py --smoke --sections lora-step lora-load lora-mix [--family sd3]
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402
from workloads import edits, lora, plain, shared  # noqa: E402

GROUPS = (plain, edits, lora)  # each: REPORT, NAMES, DEFAULTS, SMOKE, SMOKE_FAMILIES, run(args, report), markdown
SECTIONS = tuple(name for group in GROUPS for name in group.NAMES)


def by_group(option: str) -> str:
    """``option``'s default in each group that sets one, for --help."""
    show = lambda v: "the card's" if v is None else " ".join(map(str, v)) if isinstance(v, list) else str(v)
    return "; ".join(f"{g.REPORT}: {show(g.DEFAULTS[option])}" for g in GROUPS if option in g.DEFAULTS)


def parse(argv: list[str] | None) -> list[tuple[object, argparse.Namespace]]:
    """Each group with a section asked, and its settings: the options given, its defaults for the others."""
    p = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    p.add_argument("--models", nargs="+", help="built-ins or model directories; the edits and LoRA sections take the "
                                               f"first ({by_group('models')})")
    p.add_argument("--sections", nargs="+", choices=SECTIONS, default=["e2e", "mixed"], metavar="SECTION",
                   help=f"of {', '.join(SECTIONS)} (default: e2e mixed; with --smoke: {' '.join(plain.NAMES)})")
    p.add_argument("--systems", nargs="+", choices=shared.SYSTEMS, metavar="SYSTEM",
                   help=f"of {', '.join(shared.SYSTEMS)} ({by_group('systems')}; with --smoke: diffusers default)")
    p.add_argument("--sizes", nargs="*", default=[], help="WxH sizes: made by e2e and img2img (one table each), "
                                                          "asked in mixed's mix (default: each model's native)")
    p.add_argument("--text-encoder-device", choices=tuple(harness.TEXT_ENCODER_DEVICES), default="gpu",
                   help=harness.TEXT_ENCODER_HELP + "; not the LoRA sections")
    p.add_argument("--loads", type=float, nargs="*", help=f"offered images/s of the mixes ({by_group('loads')})")
    p.add_argument("--largest", type=int, help=f"the mix's largest request ({by_group('largest')})")
    p.add_argument("--inflight", type=int, help="images in flight (engine) or per call (diffusers) "
                                                f"({by_group('inflight')})")
    p.add_argument("--window-s", type=float, help=f"seconds of arrivals per load ({by_group('window_s')})")
    p.add_argument("--drain-s", type=float, help=f"seconds a load point runs past its window ({by_group('drain_s')})")
    p.add_argument("--backlog-stop-s", type=float, default=180.0)
    p.add_argument("--steps", type=int, help="steps per image; of the whole schedule for an edit, whose --strength "
                                             f"runs its tail ({by_group('steps')})")
    p.add_argument("--reps", type=int, default=5, help="e2e and img2img: runs per system")
    p.add_argument("--e2e-batch", type=int, default=8, help="e2e, img2img and blend: the engine's largest bucket")
    p.add_argument("--requests", type=int, default=16, help="consistency: requests")
    p.add_argument("--strength", type=float, default=0.6, help="img2img and edit-mix: the edits' strength")
    p.add_argument("--adapters", type=int, default=8, help="LoRA sections: adapters")
    p.add_argument("--rank", type=int, default=64, help="LoRA sections: the adapters' rank")
    p.add_argument("--images", type=int, default=16, help="lora-step and lora-load: rows of the step")
    p.add_argument("--per-request", type=int, default=4, help="LoRA sections: adapter places a row (lora_per_request; "
                                                              "a request names one, the others stay empty)")
    p.add_argument("--lora-kernels", nargs="+", choices=("bmm", "triton"), default=["triton", "bmm"],
                   help="lora-step: each kernel of the rows' terms (lora_kernel); the other sections run the first "
                        "(by default the worker's, triton)")
    p.add_argument("--lora-targets", nargs="*", default=[], metavar="REGEX",
                   help="LoRA sections: the linears the bank holds (lora_targets; default: every one the step "
                        "reaches); 'adapters' names the adapters' own targets")
    p.add_argument("--out", type=Path, help="report folder (default docs/benchmarks; a temp folder with --smoke)")
    p.add_argument("--smoke", action="store_true", help="a tiny random model on a CPU (--family picks which)")
    p.add_argument("--family", choices=harness.FAMILIES, help=f"--smoke's model family ({by_group('family')}; "
                   f"the edits sections run {', '.join(edits.SMOKE_FAMILIES)}, the LoRA sections "
                   f"{', '.join(lora.SMOKE_FAMILIES)})")
    args = p.parse_args(argv)
    given = argv if argv is not None else sys.argv
    args.sizes = [tuple(int(v) for v in s.lower().split("x")) for s in args.sizes]
    if args.smoke and "--sections" not in given:
        args.sections = list(plain.NAMES)
    asked = [(group, [s for s in args.sections if s in group.NAMES]) for group in GROUPS]
    asked = [(group, sections) for group, sections in asked if sections]
    for group, _ in asked:
        if group is lora and args.text_encoder_device != "gpu":
            p.error("--text-encoder-device cpu: the LoRA sections load text encoders with the transformer")
        if args.smoke and (args.family or group.DEFAULTS["family"]) not in group.SMOKE_FAMILIES:
            p.error(f"--smoke --family {args.family}: the {group.REPORT} sections run "
                    f"{', '.join(group.SMOKE_FAMILIES)}")
    return [(group, settings(group, args, sections, given)) for group, sections in asked]


def settings(group, args: argparse.Namespace, sections: list[str], given: list[str]) -> argparse.Namespace:
    """``group``'s settings: the options given, the group's defaults for the others; with --smoke, a tiny model of
    --family and the group's small settings."""
    g = argparse.Namespace(**copy.deepcopy(vars(args)))
    g.sections = sections
    for option, value in group.DEFAULTS.items():
        if getattr(g, option) is None:
            setattr(g, option, copy.deepcopy(value))
    if g.smoke:
        g.models = [harness.tiny_model(g.family)]
        vars(g).update(copy.deepcopy(group.SMOKE))
        if "--systems" not in given:
            g.systems = ["diffusers", "default"]  # compiling on a CPU takes minutes
    return g


def main(argv: list[str] | None = None) -> int:
    failed = False
    for group, args in parse(argv):
        name = f"{group.REPORT}_{Path(str(args.models[0])).name}"
        report = harness.Report(harness.out_dir(args.out, args.smoke), name, group.markdown)
        result = group.run(args, report)
        paths = report.save(result)
        print(group.markdown(result) + f"\nwrote {paths[0]}")
        failed |= bool(result["errors"])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
