"""What offloading the text encoder costs: T5-XXL's encoder (the one PixArt-Σ, SD3.5 and FLUX.1 use;
random weights, bf16) encoding prompts padded to 300 tokens, on the GPU and on the host CPU, and the
GPU memory the offload frees. A prompt is encoded once (the encodings are cached), so the cost is per
distinct prompt. Prints a table; writes docs/benchmarks/encoder_offload.{json,md}.

    python bench/encoder_offload.py [--batches 1 4] [--out docs/benchmarks]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch


def timed(fn, reps: int) -> float:
    fn()
    out = []
    for _ in range(reps):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        out.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(out)


def main() -> None:
    import transformers

    from workers.builtins import T5_XXL, materialise, t5_tokenizer

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 4])
    p.add_argument("--out", type=Path, default=Path("docs/benchmarks"))
    args = p.parse_args()
    from transformers import T5Config, T5EncoderModel

    tok = t5_tokenizer()
    prompts = [f"a photograph of a red fox number {i} in the snow, golden hour, 85mm" for i in range(max(args.batches))]
    rows: list[dict] = []
    result = {"gpu": torch.cuda.get_device_name(), "cpu_threads": torch.get_num_threads(),
                        "cpus": os.cpu_count(), "torch": torch.__version__, "transformers": transformers.__version__,
                        "tokens": 300, "rows": rows}
    for device in ("cuda", "cpu"):
        with torch.device("meta"):
            enc = T5EncoderModel(T5Config(**T5_XXL))
        t0 = time.perf_counter()
        enc = materialise(enc, device, torch.bfloat16, torch.Generator(device).manual_seed(0))
        build_s = time.perf_counter() - t0
        if device == "cuda":
            result["gpu_memory_gib"] = round(torch.cuda.memory_allocated() / 2**30, 2)
        for b in args.batches:
            ids = tok(prompts[:b], padding="max_length", max_length=300, truncation=True, return_tensors="pt")
            ids = {k: v.to(device) for k, v in ids.items()}
            with torch.no_grad():
                ms = timed(lambda: enc(ids["input_ids"], attention_mask=ids["attention_mask"]), 5 if device == "cuda" else 1)
            rows.append({"device": device, "batch": b, "ms": round(ms, 1), "build_s": round(build_s, 1)})
            print(rows[-1], flush=True)
        del enc
        torch.cuda.empty_cache()
    lines = [f"# T5-XXL encoder (bf16, 300 tokens): GPU {result['gpu']} against the host CPU "
             f"({result['cpu_threads']} threads)", "", "| device | prompts | ms (median) |", "|---|---|---|"]
    lines += [f"| {r['device']} | {r['batch']} | {r['ms']} |" for r in rows]
    lines += ["", f"Offloading frees {result['gpu_memory_gib']} GiB of GPU memory (the encoder's weights)."]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "encoder_offload.json").write_text(json.dumps(result, indent=1) + "\n")
    (args.out / "encoder_offload.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
