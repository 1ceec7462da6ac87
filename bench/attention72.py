"""A bf16 attention kernel for head size 72 (DiT-XL/2, PixArt), measured against cuDNN's and flash, on a GPU.

Not used by the engine: a measured candidate (docs/benchmarks/attention72.md says what it showed).

PyTorch's fastest kernel for these heads, cuDNN's, runs a head of 72 in a 128-wide kernel (row_kernels.md:
342-381 TFLOP/s at the real size, against 602 at FLUX's 128). This kernel holds a head as 64 + 16 columns
(80: 11% padding instead of 78%), reads q, k, v and writes the output through Hopper's tensor-memory
descriptors (4-D, in the (B, T, heads, d) layout the projections make, viewed as (B, heads, T, d); the
columns past 72 and the rows past T come back as zeros), and runs the online softmax in float32. Two
switches test where its time goes: ``exp16`` (the exponentials as bf16 pairs, ``ex2.approx.ftz.bf16x2``:
twice the special-function rate) and ``lazy`` (the running maximum and the rescaling of the accumulators
only when a tile raises a row's maximum by more than 2^8). Each (tiles, warps, stages, switches) is timed as a
CUDA graph replay, median of 20; cuDNN's and flash as plain calls.

    python bench/attention72.py [OUT_DIR]   # writes OUT_DIR/attention72.json
"""
import itertools, json, math, statistics, sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.tools.tensor_descriptor import TensorDescriptor

LOG2E = 1.4426950408889634


@triton.jit
def _fwd(dq0, dq1, dk0, dk1, dv0, dv1, do0, do1, H, TQ, TK, qk_scale,
         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D0: tl.constexpr, D1: tl.constexpr,
         EVEN_N: tl.constexpr, WS: tl.constexpr, EXP16: tl.constexpr, LAZY: tl.constexpr):
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    m0 = pid_m * BLOCK_M
    q0 = dq0.load([b, h, m0, 0]).reshape(BLOCK_M, D0)
    q1 = dq1.load([b, h, m0, D0]).reshape(BLOCK_M, D1)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc0 = tl.zeros([BLOCK_M, D0], tl.float32)
    acc1 = tl.zeros([BLOCK_M, D1], tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    for start in tl.range(0, TK, BLOCK_N, warp_specialize=WS):
        k0 = dk0.load([b, h, start, 0]).reshape(BLOCK_N, D0)
        k1 = dk1.load([b, h, start, D0]).reshape(BLOCK_N, D1)
        s = tl.dot(q0, k0.T)
        s = tl.dot(q1, k1.T, s)
        if not EVEN_N:
            s = tl.where((start + offs_n)[None, :] < TK, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
        if LAZY:
            if tl.max(m_new - m_i, 0) > 8.0:
                alpha = tl.math.exp2(m_i - m_new)
                acc0 = acc0 * alpha[:, None]
                acc1 = acc1 * alpha[:, None]
                l_i = l_i * alpha
                m_i = m_new
        else:
            alpha = tl.math.exp2(m_i - m_new)
            acc0 = acc0 * alpha[:, None]
            acc1 = acc1 * alpha[:, None]
            l_i = l_i * alpha
            m_i = m_new
        x = s * qk_scale - m_i[:, None]
        if EXP16:
            pb = tl.inline_asm_elementwise("ex2.approx.ftz.bf16x2 $0, $1;", "=r,r", [x.to(tl.bfloat16)],
                                           dtype=tl.bfloat16, is_pure=True, pack=2)
            l_i = l_i + tl.sum(pb.to(tl.float32), 1)
        else:
            p = tl.math.exp2(x)
            l_i = l_i + tl.sum(p, 1)
            pb = p
        v0 = dv0.load([b, h, start, 0]).reshape(BLOCK_N, D0)
        v1 = dv1.load([b, h, start, D0]).reshape(BLOCK_N, D1)
        acc0 = tl.dot(pb.to(v0.dtype), v0, acc0)
        acc1 = tl.dot(pb.to(v0.dtype), v1, acc1)
    inv = 1.0 / l_i
    do0.store([b, h, m0, 0], (acc0 * inv[:, None]).to(q0.dtype).reshape(1, 1, BLOCK_M, D0))
    do1.store([b, h, m0, D0], (acc1 * inv[:, None]).to(q0.dtype).reshape(1, 1, BLOCK_M, D1))


def desc(t, bm, d):
    return TensorDescriptor(t, list(t.shape), list(t.stride()), [1, 1, bm, d])


def attn(q, k, v, out=None, BM=128, BN=64, warps=8, stages=3, ws=False, exp16=False, lazy=False):
    B, H, TQ, D = q.shape
    TK = k.shape[2]
    D0, D1 = 64, 16
    out = torch.empty_like(q) if out is None else out
    grid = (triton.cdiv(TQ, BM), B * H)
    _fwd[grid](desc(q, BM, D0), desc(q, BM, D1), desc(k, BN, D0), desc(k, BN, D1), desc(v, BN, D0), desc(v, BN, D1),
               desc(out, BM, D0), desc(out, BM, D1), H, TQ, TK, LOG2E / math.sqrt(D),
               BLOCK_M=BM, BLOCK_N=BN, D0=D0, D1=D1, EVEN_N=TK % BN == 0, WS=ws, EXP16=exp16, LAZY=lazy, num_warps=warps, num_stages=stages)
    return out


def ms(fn, reps=20):
    for _ in range(3): fn()
    torch.cuda.synchronize()
    st, en = [torch.cuda.Event(enable_timing=True) for _ in range(reps)], [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for i in range(reps):
        st[i].record(); fn(); en[i].record()
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(b) for a, b in zip(st, en)) * 1e3  # us


def main(out_dir: Path) -> None:
    res = {"gpu": torch.cuda.get_device_name(), "triton": triton.__version__, "torch": torch.__version__, "shapes": []}
    shapes = [("pixart-1024 2 rows", 2, 16, 4096, 4096), ("pixart-512 64 rows", 64, 16, 1024, 1024),
              ("dit 128 rows", 128, 16, 256, 256), ("pixart-512 2 rows", 2, 16, 1024, 1024)]
    torch.manual_seed(0)
    for name, B, H, TQ, TK in shapes:
        D = 72
        # the layout the model makes: (B, T, H, D) viewed as (B, H, T, D)
        q = torch.randn(B, TQ, H, D, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
        k = torch.randn(B, TK, H, D, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
        v = torch.randn(B, TK, H, D, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
        flops = 4 * B * H * TQ * TK * D
        row = {"name": name, "shape": [B, H, TQ, TK, D]}
        with sdpa_kernel([SDPBackend.MATH]):
            ref = F.scaled_dot_product_attention(q[:1].float(), k[:1].float(), v[:1].float())
        for kname, be in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)):
            try:
                with sdpa_kernel([be]):
                    row[kname] = round(ms(lambda: F.scaled_dot_product_attention(q, k, v)), 1)
            except RuntimeError as e:
                row[kname] = str(e)[:80]
        best = None
        for BM, BN, warps, stages, exp16, lazy in itertools.product((128,), (64, 128), (4, 8), (2, 3), (False, True), (False, True)):
            ws = False
            cfg = f"{BM}/{BN}/w{warps}/s{stages}/{'e16' if exp16 else 'e32'}/{'lazy' if lazy else 'eager'}"
            kw = dict(BM=BM, BN=BN, warps=warps, stages=stages, ws=ws, exp16=exp16, lazy=lazy)
            try:
                o = attn(q, k, v, **kw)
                err = ((o[:1].float() - ref).abs().max() / ref.abs().max()).item()
                gr = torch.cuda.CUDAGraph()
                with torch.cuda.graph(gr):
                    attn(q, k, v, out=o, **kw)
                t = ms(gr.replay)
            except Exception as e:
                row.setdefault("failed", {})[cfg] = str(e).splitlines()[0][:120] if str(e) else type(e).__name__
                continue
            row.setdefault("triton", {})[cfg] = [round(t, 1), round(err, 5)]
            if err < 2e-2 and (best is None or t < best[1]):
                best = (cfg, t)
        if best:
            row["best"] = [best[0], round(best[1], 1)]
            row["tflops"] = {"best": round(flops / best[1] / 1e6, 1)}
            for kname in ("cudnn", "flash"):
                if isinstance(row.get(kname), float):
                    row["tflops"][kname] = round(flops / row[kname] / 1e6, 1)
            if isinstance(row.get("cudnn"), float):
                row["vs_cudnn"] = round(best[1] / row["cudnn"], 3)
        print(json.dumps({k: v for k, v in row.items() if k not in ("triton",)}), flush=True)
        res["shapes"].append(row)
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "attention72.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "docs/benchmarks"))
