"""FLUX.1's q, k, v codes for FP8 attention: ``workers.rope_kernel``'s kernels against Inductor's (H200).

What each system computes, per FLUX.1-dev 1024 block (one image): q's and k's RMS norms per head (the text's
and the image's weights), the text first, the rotary embedding, e4m3 codes at fixed scales, and v's codes at
the power of two of its largest magnitude.

  inductor      the path before ``rope_kernel``: diffusers' norms and ``apply_rotary_emb``, the codes and v's
                ``fp8_attention.quantize``, in one function compiled by ``torch.compile`` (what a compiled
                FP8 block ran)
  kernel/T,H,W  ``rope_kernel.launch`` by ``Plan(tokens=T, heads=H, warps=W)`` (``+reread``: a pair's partner
                read again from the cache instead of split from the registers; ``/vN``: v's codes N tokens a
                program, else 32)

Shapes: a double block's (4096 image tokens and 512 text tokens) and a single block's (4608 tokens in one
part), 24 heads of 128. Each system's call is captured 20 times into one CUDA graph and replayed (the GPU's
time alone); median us of one call over 15 replays. ``GB/s``: the least traffic (q, k, v read once in bf16,
three sets of codes written) over that time. Codes against ``rope_kernel.reference``'s.

With ``--bf16`` the same for bf16 attention (``rope_kernel.joint_qkv``: q and k normed and rotated, v beside them,
all bf16; ``inductor`` then the same path without the codes); bf16 values against ``rope_kernel.reference_qkv``'s.

    python bench/rope_codes.py            # on a GPU; writes docs/benchmarks/rope_codes.{json,md}
    python bench/rope_codes.py --bf16     # docs/benchmarks/rope_qkv_bf16.{json,md}
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.norm_quant import time_us  # noqa: E402
from workers import fp8_attention as fa  # noqa: E402
from workers import rope_kernel  # noqa: E402

P = rope_kernel.Plan
PLANS = [P(16, 4, 4, False), P(16, 4, 4), P(16, 1, 4), P(8, 4, 4), P(8, 8, 4), P(16, 2, 4), P(32, 1, 4), P(32, 2, 8),
         P(16, 4, 2), P(8, 4, 2), P(16, 8, 8), P(16, 4, 4, True, 16), P(16, 4, 4, True, 64), P(64, 1, 8)]
SHAPES = {"double block": (1, 4096, 512, 24, 128), "single block": (1, 4608, 0, 24, 128)}


def plan_name(p: rope_kernel.Plan) -> str:
    return f"kernel/{p.tokens},{p.heads},{p.warps}{'' if p.split else '+reread'}{'' if p.v_tokens == 32 else f'/v{p.v_tokens}'}"


def inputs(b, n, l, heads, d, seed=0):
    g = torch.Generator("cuda").manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, device="cuda")

    def part(t, spread):  # views of one (B, T, 3 * heads * d) product, as the projections' outputs sit
        whole = (r(b, t, 3 * heads * d) * spread).bfloat16()
        return [y.unflatten(-1, (heads, d)) for y in whole.split(heads * d, dim=-1)]

    weights = lambda: [(1 + 0.1 * r(d)).bfloat16() for _ in range(2)]
    image = part(n, 4.0) + weights()
    text = part(l, 1.0) + weights() if l else None
    angles = r(n + l, d // 2).repeat_interleave(2, dim=1)
    return image, text, angles.cos(), angles.sin()


def inductor_system(scale_q: float | None, scale_k: float | None, eps: float = 1e-6):
    """The compiled path before the kernels; without scales (bf16 attention) it returns q, k and v as they are."""
    from diffusers.models.embeddings import apply_rotary_emb

    def path(image, text, cos, sin):
        norm = lambda x, w: F.rms_norm(x, (x.shape[-1],), w, eps)
        q, k = norm(image[0], image[3]), norm(image[1], image[4])
        v = image[2]
        if text is not None:
            q = torch.cat([norm(text[0], text[3]), q], dim=1)
            k = torch.cat([norm(text[1], text[4]), k], dim=1)
            v = torch.cat([text[2], v], dim=1)
        q, k = apply_rotary_emb(q, (cos, sin), sequence_dim=1), apply_rotary_emb(k, (cos, sin), sequence_dim=1)
        if scale_q is None:
            return q, k, v
        code = lambda x, s: (x.float() * s).clamp(-fa.FP8_MAX, fa.FP8_MAX).to(fa.FP8)
        v8, dv = fa.quantize(v)
        return code(q, scale_q), code(k, scale_k), v8, dv

    return torch.compile(path, fullgraph=True)


def differ(got, want) -> float:
    return round(max((g.view(torch.uint8) != w.view(torch.uint8)).float().mean().item() for g, w in zip(got, want)), 5)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("docs/benchmarks"))
    p.add_argument("--stem", default=None, help="rope_codes, or rope_qkv_bf16 with --bf16")
    p.add_argument("--bf16", action="store_true", help="bf16 attention's pass (rope_kernel.joint_qkv)")
    a = p.parse_args(argv)
    a.stem = a.stem or ("rope_qkv_bf16" if a.bf16 else "rope_codes")
    scale_q, scale_k = 16.0, 16.0
    dq = torch.full((1, 1, 1, 1), 1 / scale_q, device="cuda")
    dk = torch.full((1, 1, 1, 1), 1 / scale_k, device="cuda")
    systems = {"inductor": None, **{plan_name(p): p for p in PLANS if not (a.bf16 and p.v_tokens != 32)}}
    rows = []
    for where, shape in SHAPES.items():
        image, text, cos, sin = inputs(*shape)
        if a.bf16:
            want = rope_kernel.reference_qkv(*image, cos, sin, text=text)
        else:
            want = rope_kernel.reference(*image, dq, dk, cos, sin, text=text)
        b, n, l, heads, d = shape
        traffic = b * (n + l) * heads * d * 3 * (2 + (2 if a.bf16 else 1))
        row = {"where": where, "shape": dict(zip("bnlhd", shape)), "us": {}, "GB/s": {}, "codes_differ": {}}
        for name, plan in systems.items():
            if plan is None:
                fn = inductor_system(None, None) if a.bf16 else inductor_system(scale_q, scale_k)
                call = lambda: fn(image, text, cos, sin)
            elif a.bf16:
                call = (lambda plan: lambda: rope_kernel.launch_qkv(*image, text, cos, sin, plan=plan))(plan)
            else:
                call = (lambda plan: lambda: rope_kernel.launch(*image, dq, dk, text, cos, sin, plan=plan))(plan)
            row["codes_differ"][name] = differ(call(), want)
            us = time_us(lambda: call(), ())
            row["us"][name] = us
            row["GB/s"][name] = round(traffic / us / 1e3, 1)
            print(f"{where} {name}: {us} us ({row['GB/s'][name]} GB/s), codes differ {row['codes_differ'][name]}",
                  flush=True)
        rows.append(row)
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "python": platform.python_version(),
              "triton": __import__("triton").__version__, "rows": rows}
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / f"{a.stem}.json").write_text(json.dumps(report, indent=1))
    names = list(systems)
    title = "q, k, v for bf16 attention" if a.bf16 else "q, k, v codes for FP8 attention"
    lines = [f"# FLUX.1's {title} on {report['device']}", "",
             f"`python bench/rope_codes.py{' --bf16' if a.bf16 else ''}`; torch {report['torch']}, triton {report['triton']}. Median us of one call "
             "(20 calls in a CUDA graph, 15 replays); GB/s of the least traffic; largest share of codes that differ "
             "from the reference's (q, k or v).", "",
             "| system | " + " | ".join(r["where"] for r in rows) + " |", "|---|" + "---|" * len(rows)]
    for name in names:
        cells = [f"{r['us'][name]} us ({r['GB/s'][name]} GB/s, {r['codes_differ'][name]:.2%} differ)" for r in rows]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    (a.out / f"{a.stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
