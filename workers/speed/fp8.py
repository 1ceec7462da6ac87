"""FP8 matrix products for a transformer's linears: opt-in per model (``[workers.precision]``).

What changes
------------
Each ``nn.Linear`` inside the transformer's blocks (``block_lists``: ``transformer_blocks``, FLUX's
``single_transformer_blocks``, Z-Image's refiners and ``layers``): the attention projections and the feed-forward layers. Not the adaLN
modulation linears (``norm`` in their name), the embedders, the time and caption projections or the final
projection: they are small, and the image is most sensitive to them. Nor a linear with a dimension
that is not a multiple of 16 (the FP8 GEMM's constraint): it keeps the model's dtype.

How
---
* Weights: float8 e4m3 with one scale per output row (its largest magnitude / 448), made once at load.
* Activations: quantized per row (per token) at run time from each row's own largest magnitude
  (dynamic scaling). On the device, with no host synchronisation, so it captures into CUDA graphs and
  compiles like any other step code.
* The product: ``torch._scaled_mm``, which applies both scales and the bias in its epilogue and writes
  the model's dtype (bfloat16 on a GPU).
* Inputs shared by several projections (q, k and v read the same hidden states) are quantized once
  (``quantize_rows``, then ``Fp8Linear.mm_into``; ``workers.speed.patches`` does this).
* On CUDA the quantization is one Triton kernel (``workers.kernels.quant``: one read of the rows, one
  write), and a feed-forward's GELU moves into it: the first linear writes its bf16 product and the
  second linear's quantization applies the GELU as it reads it (``fold_gelus``), so the activation costs
  no pass of its own. Elsewhere the same arithmetic runs as PyTorch operations.
* In a compiled step, a linear whose input is made by the step's own code (a block's norm and modulation,
  or its residual add: the attention input projections and the feed-forward's first linear,
  ``fused_input``) quantizes through the PyTorch operations instead, so Inductor makes one kernel of the
  norm and the quantization: the norm's bf16 rows are never written and read back. On an H200 that took
  the norm-then-quantize of PixArt-Σ 512's 65536 rows of 1152 from 364 to 256 us, FLUX.1's 4608 rows of
  3072 from 178 to 81 (``bench/norm_quant.py`` (in git history), ``docs/benchmarks/norm_quant.md`` (in git history)). Inputs made elsewhere
  (an attention break's output, a product's, the prompt's states) keep the Triton kernel: Inductor's
  quantization alone is about three times slower than it.
* FLUX.1's single blocks run ``proj_out(cat([attention, gelu(proj_mlp(x))]))``: their GELU moves into
  ``proj_out``'s quantization too, which reads the attention and the MLP's product from where they are
  (``quantize_pair``; ``workers.families.flux.fast.fold_single_block_gelus``): the activation and the concatenation are never written
  (on an H200, FLUX.1-dev 1024's FP8 step 2.2-3.9 ms faster, ``docs/benchmarks/kernels_flux1024_fp8_pair.md`` (in git history)).
* PixArt's, DiT's and FLUX.1's blocks go one step further (``workers.speed.norm_fusion``): each norm, its modulation and the next
  linear's quantization are one kernel of our own (``workers.kernels.norm``), and the projections take its
  codes (``linear_into(..., quantized=...)``, ``Fp8Linear.mm_rows``).

Where
-----
CUDA devices of compute capability 8.9 or newer (Ada, Hopper, Blackwell). An A100 (8.0) has no FP8
tensor cores: asking for fp8 there is refused with the reason (``unsupported_reason``). On a CPU it
runs on PyTorch's CPU kernel, which is what the tests use; it is not faster there.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from workers.kernels import quant
from workers.speed.terms import row_term

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448
_ALIGN = 16  # the FP8 GEMM needs both dimensions of the weight to be multiples of this
def block_lists(transformer: nn.Module) -> list[tuple[str, nn.ModuleList]]:
    """The transformer's stacks of blocks: each ``ModuleList`` attribute whose modules are all of one class
    (``transformer_blocks``; FLUX's ``single_transformer_blocks``; Z-Image's refiners and ``layers``), in order."""
    return [(name, child) for name, child in transformer.named_children()
            if isinstance(child, nn.ModuleList) and len(child) and len({type(m) for m in child}) == 1]


def unsupported_reason(device: str | torch.device) -> str | None:
    """Why FP8 cannot run on ``device``, or None when it can."""
    device = torch.device(device)
    if not hasattr(torch, "_scaled_mm"):
        return f"this PyTorch ({torch.__version__}) has no FP8 matrix product (torch._scaled_mm)"
    if device.type == "cpu":
        return None
    if device.type != "cuda":
        return f"FP8 runs on CUDA GPUs and CPUs, not on {device.type}"
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        return (f"{torch.cuda.get_device_name(device)} (compute capability {major}.{minor}) has no FP8 tensor cores; "
                "FP8 needs 8.9 or newer (Ada, Hopper, Blackwell): use precision 'bf16' for this model")
    return None


def _row_scales(x: torch.Tensor) -> torch.Tensor:
    """(M, 1) float32: each row's largest magnitude over FP8's largest value (a zero row gets a tiny scale).
    The largest magnitude is one reduction (an infinity norm), not an absolute value and then a maximum."""
    peak = torch.linalg.vector_norm(x, ord=float("inf"), dim=1, keepdim=True)
    return (peak.float() / FP8_MAX).clamp_(min=1e-12)


def quantize_rows(x: torch.Tensor, gelu: str = "none", fuse: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(M, K) -> (M, K) float8 e4m3 and its (M, 1) float32 scales, so that gelu(x) ~ q * scale row by row
    (``gelu``: "none", or F.gelu's "tanh" / "erf" form, applied first). ``fuse``: x is made by the compiled
    code around this call, so while it is traced the PyTorch operations are used, for Inductor to fuse them
    into x's kernel.

    On CUDA one Triton kernel (``workers.kernels.quant``) does all of it in float32. Otherwise the rows
    are multiplied by the scales' reciprocals in x's own dtype: on a GPU (bf16) that keeps the passes over
    the activations in 2 bytes per value instead of promoting them to float32; bf16's rounding (2^-9) is
    far below e4m3's (2^-4)."""
    fused = fuse and gelu == "none" and torch.compiler.is_compiling()
    if not fused and quant.available(x):
        return torch.ops.dit_serve.quantize_rows(x, gelu)
    if gelu != "none":
        x = F.gelu(x, approximate="tanh" if gelu == "tanh" else "none")
    scale = _row_scales(x)
    return (x * scale.reciprocal().to(x.dtype)).clamp_(-FP8_MAX, FP8_MAX).to(FP8), scale


def dequantize_rows(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(M, K) codes and their (M, 1) scales (``quantize_rows``) -> (M, K) in ``dtype``: the rows an FP8 product
    of them multiplies."""
    return (codes.float() * scales).to(dtype)


def plain_fp8(linear: nn.Module) -> bool:
    """Whether ``linear`` is an ``Fp8Linear`` that adds nothing to its product: not wrapped, no per-row term
    (``workers.speed.terms``). Only then may a rewrite hand it codes made elsewhere instead of calling it."""
    return type(linear) is Fp8Linear and row_term(linear) is None


def codes_product(linear: nn.Module, rows: tuple[torch.Tensor, torch.Tensor], lead: tuple[int, ...],
                  dtype: torch.dtype) -> torch.Tensor:
    """``linear`` of rows quantized elsewhere (``rows``: (M, K) codes and (M, 1) scales, M = prod(lead)) ->
    (*lead, N) in ``dtype``: the product of the codes where ``linear`` is ``plain_fp8``; else (a wrapper or a term
    adds to it: a LoRA adapter's) ``linear`` called with the rows the codes stand for, batch first as a term wants
    them (its base quantizes them again: the same codes, to float32's rounding)."""
    if plain_fp8(linear):
        return linear.mm_rows(*rows).view(*lead, -1)
    return linear(dequantize_rows(*rows, dtype).view(*lead, -1))


def quantize_pair(a: torch.Tensor, b: torch.Tensor, gelu: str = "tanh",
                  a_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(M, KA), (M, KB) -> ``quantize_rows`` of ``cat([a, gelu(b)], -1)``: the codes (M, KA + KB) and (M, 1)
    scales. ``a_scale``: ``a`` is e4m3 codes at that one-element float32 descale (FP8 attention's output),
    read as ``a * a_scale``. On CUDA one kernel (``quant.launch_pair``) reads both and writes the codes:
    neither the activation nor the concatenation is written. Elsewhere, those operations in PyTorch."""
    if quant.pair_available(a, b):
        return torch.ops.dit_serve.quantize_pair(a, b, gelu, a_scale)
    if a_scale is not None:
        a = (a.float() * a_scale.reshape(())).to(b.dtype)
    if gelu != "none":
        b = F.gelu(b, approximate="tanh" if gelu == "tanh" else "none")
    return quantize_rows(torch.cat([a, b], dim=-1))


def quantize_rows_into(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> None:
    """``quantize_rows(x)`` written into ``codes`` (M, K) and ``scales`` (M, 1): the same codes, into buffers
    that must stay where they are (an attention break's output, ``workers.speed.patches``). On CUDA the kernel
    writes them directly; elsewhere the PyTorch rows are copied in."""
    if quant.available(x):
        quant.launch(x, "none", quant.plan_for(x.shape[-1]), out=(codes, scales))
        return
    q, s = quantize_rows(x)
    codes.copy_(q)
    scales.copy_(s)


class Fp8Linear(nn.Module):
    """``nn.Linear`` with float8 weights (a scale per output row) and per-row dynamic activation scales."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight, self.dtype = linear.weight.detach(), linear.weight.dtype
        q, scale = quantize_rows(weight)
        self.register_buffer("weight_fp8", q)                        # (N, K): its .t() is the column-major operand
        self.register_buffer("weight_scale", scale.t().contiguous())  # (1, N)
        bias = linear.bias
        self.register_buffer("bias", None if bias is None else bias.detach().clone())
        self.gelu = "none"  # an activation applied to the input first (fold_gelus), in its quantization
        self.fused_input = False  # its input is made by the step's compiled code (mark_fused_inputs)

    def extra_repr(self) -> str:
        act = "" if self.gelu == "none" else f", gelu({self.gelu}) of the input first"
        return f"in_features={self.in_features}, out_features={self.out_features}, fp8 e4m3, row scales{act}"

    def mm_into(self, xq: torch.Tensor, x_scale: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``out`` (M, N) <- the product of quantized rows (``quantize_rows``) with this weight, plus bias."""
        return self._mm(xq, x_scale, out.dtype, out)

    def mm_rows(self, xq: torch.Tensor, x_scale: torch.Tensor) -> torch.Tensor:
        """(M, N) in the model's dtype: the product of rows quantized elsewhere (``workers.speed.norm_fusion``)."""
        return self._mm(xq, x_scale, self.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead, rows = x.shape[:-1], x.reshape(-1, self.in_features)
        xq, scale = quantize_rows(rows, self.gelu, fuse=self.fused_input)
        return self._mm(xq, scale, x.dtype).view(*lead, self.out_features)

    def _mm(self, xq: torch.Tensor, x_scale: torch.Tensor, dtype: torch.dtype,
            out: torch.Tensor | None = None) -> torch.Tensor:
        """The scaled product in ``dtype`` (into ``out`` when given). The bias goes in the GEMM's epilogue,
        except for float32 results, where the kernel takes none (CUDA refuses it): added after. While dynamo
        traces (a compiled step), the functional op and a copy: ``_scaled_mm.out`` has no fake kernel, and
        Inductor places the result itself."""
        # The products' accumulation: Hopper's FP8 tensor cores keep about 22 bits of a partial sum, and cuBLASLt by
        # default promotes the partial sums to float32 every few k-blocks; ``use_fast_accum`` skips that promotion
        # (faster, less exact; torchao's inference default). Measured on an H200 it takes PixArt-Σ 512's 32-image
        # step's products from 66.9 to 56.9 ms and FLUX.1-dev 1024's step from 100.1 to 94.5 ms, and it moves the four
        # families' final images by at most 0.11 dB of PSNR against bf16 (docs/benchmarks/fp8_quality_fastaccum.md (in git history)).
        bias = self._bias(dtype)
        fused = bias if dtype != torch.float32 else None
        if out is None or torch.compiler.is_compiling():
            y = torch._scaled_mm(xq, self.weight_fp8.t(), x_scale, self.weight_scale, bias=fused, out_dtype=dtype,
                                 use_fast_accum=True)
            if bias is not None and fused is None:
                y = y + bias
            return y if out is None else out.copy_(y)
        torch._scaled_mm(xq, self.weight_fp8.t(), x_scale, self.weight_scale, bias=fused, out_dtype=dtype,
                         use_fast_accum=True, out=out)
        if bias is not None and fused is None:
            out.add_(bias)
        return out

    def _bias(self, dtype: torch.dtype) -> torch.Tensor | None:
        if self.bias is None or self.bias.dtype == dtype:
            return self.bias
        return self.bias.to(dtype)


MODULATION = ("norm", "adaln", "img_mod", "txt_mod", "modulation")  # in a linear's name: it makes a block's
# adaLN modulation (DiT's, PixArt's, SD3's, FLUX's norm*.linear; Z-Image's adaLN_modulation; Qwen-Image's img_mod)


def quantizable(name: str, module: nn.Module) -> bool:
    """A linear of a block that FP8 takes: not a modulation linear, both dimensions multiples of 16."""
    return (isinstance(module, nn.Linear) and not any(m in name.lower() for m in MODULATION)
            and module.in_features % _ALIGN == 0 and module.out_features % _ALIGN == 0)


def quantize_linears(transformer: nn.Module) -> list[str]:
    """Replace the block linears of ``transformer`` (see the module docstring) by ``Fp8Linear``, in place;
    returns their names. The original weights are released."""
    done = []
    for list_name, blocks in block_lists(transformer):
        for name, module in list(blocks.named_modules()):
            if not quantizable(name, module):
                continue
            parent_name, _, child = name.rpartition(".")
            parent = blocks.get_submodule(parent_name) if parent_name else blocks
            parent._modules[child] = Fp8Linear(module)
            done.append(f"{list_name}.{name}")
    fold_gelus(transformer)
    mark_fused_inputs(transformer)
    return done


# Linears of a block whose input is the block's own norm (or residual) output: the attention's input
# projections, the joint blocks' context projections, FLUX.1's single-block MLP, a feed-forward's first
FUSED_INPUTS = ("to_q", "to_k", "to_v", "add_q_proj", "add_k_proj", "add_v_proj", "proj_mlp", "net.0.proj")


def mark_fused_inputs(transformer: nn.Module) -> int:
    """Set ``fused_input`` on the block ``Fp8Linear``s whose input the block computes (``FUSED_INPUTS``),
    except a cross-attention's keys and values (their input is the prompt's states, the step's input).
    Returns how many were marked."""
    marked = 0
    for _, blocks in block_lists(transformer):
        for name, module in blocks.named_modules():
            if not isinstance(module, Fp8Linear):
                continue
            owner_name, _, leaf = name.rpartition(".")
            owner = blocks.get_submodule(owner_name) if owner_name else blocks
            cross = leaf in ("to_k", "to_v") and getattr(owner, "is_cross_attention", False)
            module.fused_input = any(name == s or name.endswith("." + s) for s in FUSED_INPUTS) and not cross
            marked += module.fused_input
    return marked


class Projection(nn.Module):
    """What is left of diffusers' ``GELU`` once its activation moved into the next linear: the product."""

    def __init__(self, proj: nn.Module) -> None:
        super().__init__()
        self.proj = proj  # the same attribute name, so state-dict keys stay ``net.0.proj.*``

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x)


def fold_gelus(transformer: nn.Module) -> int:
    """In each feed-forward ``net`` of GELU(proj) -> [Dropout] -> linear where both linears are FP8, move
    the GELU into the second linear's input quantization (``Fp8Linear.gelu``); the result is the same
    function (dropout is the identity in inference). Returns how many were folded."""
    from diffusers.models.activations import GELU

    folded = 0
    for module in transformer.modules():
        net = getattr(module, "net", None)
        if not isinstance(net, nn.ModuleList):
            continue
        for i, act in enumerate(net):
            if not (type(act) is GELU and isinstance(act.proj, Fp8Linear)):
                continue
            j = i + 1
            while j < len(net) and isinstance(net[j], nn.Dropout):
                j += 1
            if j < len(net) and isinstance(net[j], Fp8Linear) and net[j].gelu == "none":
                net[j].gelu = "tanh" if act.approximate == "tanh" else "erf"
                net[i] = Projection(act.proj)
                folded += 1
    return folded


def linear_into(x: torch.Tensor, projections: list[tuple[nn.Module, torch.Tensor]],
                quantized: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """Each ``out`` <- ``proj(x)`` for (proj, out) in ``projections``, written in place: an ``nn.Linear`` by
    one (add)mm; ``Fp8Linear`` ones share one quantization of ``x`` (``quantized``: x's codes and row scales,
    made by the caller, e.g. with the norm that made x)."""
    fuse = all(p.fused_input for p, _ in projections if isinstance(p, Fp8Linear))
    if quantized is not None and not all(isinstance(p, Fp8Linear) for p, _ in projections):
        raise ValueError("rows quantized by the caller feed FP8 linears only")  # x may not be their rows
    for proj, out in projections:
        if isinstance(proj, Fp8Linear):
            if quantized is None:
                quantized = quantize_rows(x, fuse=fuse)
            proj.mm_into(*quantized, out)
        elif proj.bias is None:
            torch.mm(x, proj.weight.t(), out=out)
        else:
            torch.addmm(proj.bias, x, proj.weight.t(), out=out)


def fuse_linears(parts: list[nn.Module]) -> nn.Module:
    """One linear computing ``parts`` (linears of one input) side by side: ``cat([p(x) for p in parts], -1)``,
    one matrix product instead of several (q, k and v: one wide GEMM fills a GPU that three narrow ones
    leave partly idle at small batches). The parts' weights become views of the fused ones, so no memory
    is added. ``nn.Linear`` parts give an ``nn.Linear``, ``Fp8Linear`` parts an ``Fp8Linear`` (their
    per-row scales concatenate exactly); a mix, or parts of different inputs, is refused (ValueError). The fused
    module's ``parts`` are the parts: whoever computes with it adds their per-row terms
    (``workers.speed.terms.add_part_terms``).

    Fusing the same parts again returns the same fused module (``_fused_before``): a second engine on one
    model (the worker's, a benchmark's) must not re-fuse, which would move the parts' weights into a new
    tensor and free the one the first engine's captured graphs read. Each part keeps its fused module
    alive (they share one storage, so that costs no memory)."""
    if (fused := _fused_before(parts)) is not None:
        return fused
    dims, ins = [p.out_features for p in parts], {p.in_features for p in parts}
    if len(ins) != 1 or not (all(type(p) is nn.Linear for p in parts) or all(type(p) is Fp8Linear for p in parts)):
        raise ValueError(f"cannot fuse {[type(p).__name__ for p in parts]} of inputs {sorted(ins)}")
    if type(parts[0]) is nn.Linear:
        fused = nn.Linear(ins.pop(), sum(dims), bias=False, device="meta")  # its tensors are set below
        _fuse(parts, fused, "weight", 0, dims, parameter=True)
    else:
        fused = Fp8Linear.__new__(Fp8Linear)
        nn.Module.__init__(fused)
        fused.in_features, fused.out_features, fused.dtype = ins.pop(), sum(dims), parts[0].dtype
        fused.gelu = "none"
        fused.fused_input = all(p.fused_input for p in parts)
        _fuse(parts, fused, "weight_fp8", 0, dims)
        _fuse(parts, fused, "weight_scale", 1, dims)  # (1, N): the output rows' scales side by side
        fused.register_buffer("bias", None)
    plain = type(parts[0]) is nn.Linear
    if any(p.bias is not None for p in parts):
        ref = next(p.bias for p in parts if p.bias is not None)
        for p, d in zip(parts, dims):
            if p.bias is None:  # a part without bias adds zeros
                p.bias = nn.Parameter(ref.new_zeros(d), requires_grad=False) if plain else ref.new_zeros(d)
        _fuse(parts, fused, "bias", 0, dims, parameter=plain)
    record = (tuple(id(p) for p in parts), fused)
    for p in parts:  # not a submodule (no state-dict key, no second visit by module walks): a plain reference
        object.__setattr__(p, "_fused_into", record)
    object.__setattr__(fused, "parts", tuple(parts))  # for their per-row terms (workers.speed.terms)
    return fused


def _fused_before(parts: list[nn.Module]) -> nn.Module | None:
    """The module ``fuse_linears`` made of exactly these parts, if their tensors are still views of it."""
    records = [getattr(p, "_fused_into", None) for p in parts]
    record = records[0]
    if record is None or any(r is not record for r in records) or record[0] != tuple(id(p) for p in parts):
        return None
    fused = record[1]
    names = ("weight",) if isinstance(fused, nn.Linear) else ("weight_fp8", "weight_scale")
    for name in (*names, "bias"):
        whole = getattr(fused, name, None)
        for p in parts:
            mine = getattr(p, name, None)
            if (whole is None) != (mine is None) or (
                    whole is not None and mine.untyped_storage().data_ptr() != whole.untyped_storage().data_ptr()):
                return None  # a part was changed since (replaced, reloaded): fuse afresh
    return fused


def _free_bytes(device: torch.device) -> int:
    """Memory ``device`` can still hand out (unbounded off CUDA): the driver's free memory and what PyTorch's
    allocator holds unused."""
    if device.type != "cuda":
        return 1 << 62
    free, _ = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


def _fuse(parts: list[nn.Module], fused: nn.Module, name: str, axis: int, dims: list[int],
          parameter: bool = False) -> None:
    """``fused.<name>`` <- the parts' tensors concatenated along ``axis``; each part's becomes its view. Where
    the device cannot hold the concatenation beside the parts (FLUX.1-dev's modulation weights, 6.5 GB in bf16,
    ``workers.speed.modulation``), the parts go through host memory first, so fusing needs no more device memory
    than the parts had."""
    tensors = [getattr(p, name).detach() for p in parts]
    device = tensors[0].device
    if _free_bytes(device) < sum(t.numel() for t in tensors) * tensors[0].element_size() + (256 << 20):
        tensors = [t.cpu() for t in tensors]
        for p in parts:  # the device copies go before the concatenation is made
            setattr(p, name, None)
        whole = torch.cat(tensors, dim=axis).to(device)
    else:
        whole = torch.cat(tensors, dim=axis)
    del tensors
    wrap = (lambda t: nn.Parameter(t, requires_grad=False)) if parameter else (lambda t: t)
    setattr(fused, name, wrap(whole))
    for p, view in zip(parts, whole.split(dims, dim=axis)):
        setattr(p, name, wrap(view))
