"""The feed-forward with GELU in the product's epilogue (``workers.epilogues``) against GELU as its own pass.

For each family's feed-forward shape (rows = images x tokens, x CFG where the family doubles them; K -> 4K
-> K), the whole feed-forward ``down(gelu_tanh(up(x)))`` two ways: eager's ``F.linear`` then ``F.gelu``,
and ``torch._addmm_activation`` (cuBLASLt's bias + tanh-GELU epilogue) then the down product. Each is
timed as a CUDA graph replay of 20 calls, median of 15 replays, bf16. The same run checks that the
epilogue is the tanh form (``workers.epilogues.epilogue_ok``). ``--smoke`` runs two small shapes on a CPU
(where ``_addmm_activation`` is the erf form: the timing only, to keep the script working).

    python bench/gelu_epilogue.py            # writes docs/benchmarks/gelu_epilogue.{json,md}
    python bench/gelu_epilogue.py --smoke --out /tmp
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

# (family, K, rows): DiT-XL/2 256 (256 tokens, CFG) at 1-64 images; PixArt-Σ 1024 (4096 tokens, CFG) at 1-2;
# FLUX.1 512 double blocks' image stream (1024 tokens) at 1-8 and single blocks (1536 tokens) at 8
SHAPES = [("dit-xl-2-256", 1152, 512 * n) for n in (1, 2, 4, 8, 16, 32, 64)] + \
         [("pixart-sigma-1024", 1152, 8192 * n) for n in (1, 2)] + \
         [("flux-dev-512", 3072, 1024 * n) for n in (1, 2, 4, 8)] + [("flux-dev-512", 3072, 12288)]
SMOKE = [("tiny", 64, 32), ("tiny", 64, 128)]


def _row_kernels():
    """bench/row_kernels.py, for its timers (``graph_us``: a CUDA graph of 20 calls, median of 15 replays)."""
    spec = importlib.util.spec_from_file_location("row_kernels", Path(__file__).resolve().parent / "row_kernels.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def timed(fn, cuda: bool) -> float:
    """ms per call: row_kernels' CUDA-graph timer, or its CPU one (median of 5 plain calls)."""
    rk = _row_kernels()
    return (rk.graph_us(fn) if cuda else rk.cpu_us(fn)) / 1e3


def measure(family: str, k: int, rows: int, device: str, dtype) -> dict:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(rows, k, generator=g).to(device, dtype)
    up_w, up_b = (torch.randn(4 * k, k, generator=g) * 0.02).to(device, dtype), torch.randn(4 * k, generator=g).to(device, dtype)
    down_w = (torch.randn(k, 4 * k, generator=g) * 0.02).to(device, dtype)
    cuda = device == "cuda"
    separate = timed(lambda: F.linear(F.gelu(F.linear(x, up_w, up_b), approximate="tanh"), down_w), cuda)
    epilogue = timed(lambda: F.linear(torch._addmm_activation(up_b, x, up_w.t(), use_gelu=True), down_w), cuda)
    return {"family": family, "rows": rows, "k": k, "separate_ms": round(separate, 4), "epilogue_ms": round(epilogue, 4),
            "speedup": round(separate / epilogue, 3)}


def markdown(result: dict) -> str:
    v = result["versions"]
    lines = [f"# GELU in the product's epilogue: {v['hardware']}", "",
             f"torch {v['torch']}, CUDA {v['cuda']}, Python {v['python']}. `{result['command']}`. The epilogue is "
             f"the tanh form on this device: {result['epilogue_is_tanh']}.", "",
             f"One feed-forward, down(gelu_tanh(up(x))), {result['dtype']}, ms per call (median):", "",
             "| model shape | rows | K | GELU as a pass | GELU in the epilogue | speedup |", "|---|---|---|---|---|---|"]
    lines += [f"| {r['family']} | {r['rows']} | {r['k']} | {r['separate_ms']:.4f} | {r['epilogue_ms']:.4f} | "
              f"{r['speedup']:.3f}x |" for r in result["rows"]]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    from workers.epilogues import epilogue_ok

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("docs/benchmarks"))
    p.add_argument("--smoke", action="store_true", help="two small shapes on a CPU, float32")
    args = p.parse_args(argv)
    cuda = torch.cuda.is_available() and not args.smoke
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    result = {"command": " ".join(["python bench/gelu_epilogue.py", *(argv if argv is not None else sys.argv[1:])]),
              "versions": {"hardware": torch.cuda.get_device_name() if cuda else "CPU", "torch": torch.__version__,
                           "cuda": torch.version.cuda, "python": platform.python_version()},
              "dtype": str(dtype).removeprefix("torch."), "epilogue_is_tanh": epilogue_ok(device), "rows": []}
    for family, k, rows in SMOKE if args.smoke else SHAPES:
        result["rows"].append(measure(family, k, rows, device, dtype))
        print(result["rows"][-1], flush=True)
    stem = "gelu_epilogue" + ("_smoke" if args.smoke else "")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{stem}.json").write_text(json.dumps(result, indent=1))
    (args.out / f"{stem}.md").write_text(markdown(result))
    print(markdown(result))
    return result


if __name__ == "__main__":
    main()
