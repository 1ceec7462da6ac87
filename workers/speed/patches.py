"""Optimisations applied to a plain diffusers DiT from outside (the model file does not know).

``break_attention(transformer)`` swaps each block's self-attention processor for one whose
attention kernel is an ``eager_on_graph`` call: under the ``breakable`` backend each layer's
attention runs eagerly between captured segments (projections, norms, MLP), the pattern SGLang
uses to keep kernels that plan from sequence lengths out of the graph. Under ``full`` or without
capture the marked call is an ordinary call, so the patched model computes what it did.

Boundary buffers. Everything that crosses a break must stay at a fixed address for the graph's
life (pitfalls 1-3). Keeping each layer's own q, k, v and output alive would pin 4 x 28 activations
per bucket (about 14 GB of graph pool for DiT-XL/2 at 256 px, buckets 1..64). Instead q, k, v and
the attention output of every layer live in ONE scratch allocation per transformer, made outside
capture (warm-up runs the largest bucket first) and shared by all layers and all buckets: layers
run one after another and buckets never replay concurrently (one runner lock), so sharing is safe.
The break reads q, k, v from it and writes its fresh result into the output slot in place (or, for an
FP8 output projection, that result's FP8 codes and row scales: ``attention_quantized_into``).
Consequence: a patched transformer must be served by one runner at a time. With the q, k, v projections
fused (the default), their three slots are one (rows, 3 x inner) block written by one matrix product.
"""

from __future__ import annotations

import torch

from graphs import eager_on_graph
from workers.speed.fp8 import FP8, dequantize_rows, fuse_linears, linear_into, plain_fp8, quantize_rows_into
from workers.speed.terms import add_part_terms, has_terms, plus_term
from workers.kernels.attention import attention

@eager_on_graph
def attention_into(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor) -> None:
    """(B, heads, T, d) x3 -> written into out (B, heads, T, d); runs eagerly between segments, by the
    kernel measured fastest for the shape on this GPU (``workers.kernels.attention``)."""
    attention(q, k, v, out)


@eager_on_graph
def attention_quantized_into(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, codes: torch.Tensor,
                             scales: torch.Tensor) -> None:
    """(B, heads, T, d) x3 -> the attention's rows (B*T, heads*d) as FP8 codes and (B*T, 1) row scales,
    written into ``codes`` and ``scales``; runs eagerly between segments. The output projection's own
    quantization of those rows, moved into the break: the kernel's result is read once, where copying it
    into the scratch and quantizing it in the next segment read and wrote it twice."""
    b, heads, t, d = q.shape
    result = attention(q, k, v)                                                 # (B, h, T, d)
    rows = result.transpose(1, 2).reshape(b * t, heads * d)  # a view where the kernel wrote (B, T, h, d) rows
    quantize_rows_into(rows, codes, scales)


def quantized_output(attn) -> bool:
    """Whether ``attn``'s output projection takes its rows from the break as FP8 codes
    (``attention_quantized_into``): an FP8 linear with no activation folded into it, adding nothing to its
    product (``plain_fp8``: a LoRA adapter's wrapper is called with the break's rows)."""
    proj = attn.to_out[0]
    return plain_fp8(proj) and proj.gelu == "none" and proj.in_features % 16 == 0


def project_output(attn, o: torch.Tensor, b: int, t: int,
                   quantized: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """The processors' end: ``attn``'s output projection (and dropout) of the attention's rows ``o``
    (B*T, inner), or of their FP8 codes and scales where the break made them (``quantized``), as (B, T, D)."""
    proj = attn.to_out[0]
    y = proj(o.view(b, t, -1)) if quantized is None else proj.mm_rows(*quantized).view(b, t, -1)
    return scaled_output(attn.to_out[1](y), attn)


def scaled_output(out: torch.Tensor, attn) -> torch.Tensor:
    """``out / attn.rescale_output_factor``, as diffusers' processors end, without the division where the
    factor is 1 (every family here): in a compiled block whose next consumer is an opaque op (the fused
    norm, ``workers.speed.norm_fusion``) a division by one is a pass of its own over the attention's output."""
    factor = attn.rescale_output_factor
    return out if factor == 1 else out / factor


class AttentionScratch:
    """One allocation for q, k, v and the attention output, reused by every layer and bucket."""

    def __init__(self) -> None:
        self.buffer: torch.Tensor | None = None
        self._retired: list[torch.Tensor] = []  # graphs captured on an older buffer still read it

    def views(self, rows: int | tuple[int, int, int, int], dim: int, like: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Four (rows, dim) views: q, k, v, out (``rows``: one count for all four, or each one's). While dynamo
        traces a compiled step (``graphs.compiled``), four fresh tensors of exactly those rows instead: an
        ``out=`` write into a slice of one fixed-size buffer makes dynamo specialise the batch (torch 2.13), so
        the step would not compile with a dynamic batch, and a product written into the first rows of a larger
        fresh tensor is one more pass over it (Inductor scatters it into the rest, left undefined). There the
        tensors are Inductor's to place. Eager calls, and a compiled step's fallback, share the buffer."""
        counts = (rows,) * 4 if isinstance(rows, int) else tuple(rows)
        if torch.compiler.is_compiling():
            return tuple(torch.empty(n, dim, dtype=like.dtype, device=like.device) for n in counts)
        most = max(counts)
        slots = self._sized(4 * most * dim, like).view(4, most, dim).unbind(0)
        return tuple(s[:n] for s, n in zip(slots, counts))

    @staticmethod
    def quantized(slot: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """An output slot (rows, dim) of two- or four-byte values as (rows, dim) FP8 codes and (rows, 1)
        float32 scales in its first rows * (dim + 4) bytes (``dim`` a multiple of 16: the codes' rows and the
        scales stay 16-byte aligned). While dynamo traces, fresh tensors (see ``views``)."""
        rows, dim = slot.shape
        if torch.compiler.is_compiling():
            return (torch.empty(rows, dim, dtype=FP8, device=slot.device),
                    torch.empty(rows, 1, dtype=torch.float32, device=slot.device))
        if slot.element_size() < 2 or dim % 16 or not slot.is_contiguous():
            raise ValueError(f"an output slot of {dim} {slot.dtype} values a row holds no FP8 codes and scales")
        flat = slot.view(-1).view(torch.uint8)                                  # rows * dim * element_size bytes
        codes = flat[:rows * dim].view(FP8).view(rows, dim)
        scales = flat[rows * dim:rows * (dim + 4)].view(torch.float32).view(rows, 1)
        return codes, scales

    def fused_views(self, rows: int, dim: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The same scratch as (rows, 3 * dim) for a fused q|k|v projection (the slots of q, k and v side
        by side), and (rows, dim) for the output; fresh tensors while dynamo traces, as ``views``."""
        if torch.compiler.is_compiling():
            return (torch.empty(rows, 3 * dim, dtype=like.dtype, device=like.device),
                    torch.empty(rows, dim, dtype=like.dtype, device=like.device))
        qkv, o = self._sized(4 * rows * dim, like).split([3 * rows * dim, rows * dim])
        return qkv.view(rows, 3 * dim), o.view(rows, dim)

    def _sized(self, n: int, like: torch.Tensor) -> torch.Tensor:
        """The first ``n`` elements of the buffer, grown (outside capture) to hold them."""
        buf = self.buffer
        if buf is None or buf.numel() < n or buf.dtype != like.dtype or buf.device != like.device:
            if like.is_cuda and torch.cuda.is_current_stream_capturing():
                raise RuntimeError("attention scratch grew during capture: warm up at the largest batch first")
            if buf is not None:
                self._retired.append(buf)
            buf = self.buffer = torch.empty(n, dtype=like.dtype, device=like.device)
        return buf[:n]


class BreakableSelfAttention:
    """Self-attention for DiT and PixArt blocks (no mask, no text tokens), as diffusers' AttnProcessor2_0,
    with q, k, v and the output in the shared scratch. With ``qkv`` (``fuse_linears`` of to_q, to_k and
    to_v), the three projections are one matrix product into a (rows, 3 * inner) slot, and q, k, v are its
    column blocks (strided views: attention kernels take any row stride). The projections (``parts``: those
    it was made with, which a wrapper replaces in ``attn`` afterwards) add their per-row terms
    (``workers.speed.terms``: a LoRA adapter's) to q, k and v, of the rows they multiplied: where the caller
    quantized them, the rows its FP8 codes stand for."""

    def __init__(self, scratch: AttentionScratch, projections: tuple[torch.nn.Module, ...],
                 qkv: torch.nn.Module | None = None) -> None:
        self.scratch, self.qkv = scratch, qkv
        self.parts = tuple(projections)  # to_q, to_k, to_v: qkv's parts where fused

    def __call__(self, attn, hidden_states: torch.Tensor, encoder_hidden_states=None,
                 attention_mask=None, temb=None, quantized=None, **kwargs) -> torch.Tensor:
        """``quantized``: the FP8 codes and row scales of the rows q, k and v are projected from, made by the
        caller (``workers.speed.norm_fusion``); ``hidden_states`` then gives only the shape and dtype."""
        b, t, _ = hidden_states.shape                                           # (B, T, D)
        inner = attn.to_q.out_features
        q, k, v, o = self._project(hidden_states.reshape(b * t, -1), b, inner, quantized)  # (B*T, inner) x4
        heads, d = attn.heads, inner // attn.heads
        split = lambda y: y.view(b, t, heads, d).transpose(1, 2)                # (B, h, T, d)
        codes = self.scratch.quantized(o) if quantized_output(attn) else None  # (B*T, inner), (B*T, 1)
        if codes is not None:
            attention_quantized_into(split(q), split(k), split(v), *codes)
        else:
            attention_into(split(q), split(k), split(v), split(o))
        return project_output(attn, o, b, t, codes)

    def _project(self, h2d: torch.Tensor, b: int, inner: int, quantized) -> tuple[torch.Tensor, ...]:
        """q, k, v of the rows ``h2d`` (B*T, D) (or of their codes, ``quantized``), with the projections' terms,
        and the output's slot: (B*T, inner) each, in the scratch."""
        if self.qkv is not None:
            qkv, o = self.scratch.fused_views(h2d.shape[0], inner, h2d)         # (B*T, 3*inner), (B*T, inner)
            linear_into(h2d, [(self.qkv, qkv)], quantized)
            outs = [qkv]
        else:
            q, k, v, o = self.scratch.views(h2d.shape[0], inner, h2d)           # (B*T, inner) x4
            linear_into(h2d, list(zip(self.parts, (q, k, v))), quantized)
            outs = [q, k, v]
        if has_terms(self.parts):  # the rows the products multiplied, batch first as a term wants them
            rows = (h2d if quantized is None else dequantize_rows(*quantized, h2d.dtype)).view(b, -1, h2d.shape[1])
            groups = [self.parts] if self.qkv is not None else [[p] for p in self.parts]
            for parts, y in zip(groups, outs):
                add_part_terms(parts, rows, y.view(b, -1, y.shape[1]))
        if self.qkv is not None:
            return (*qkv.split(inner, dim=1), o)                                # q, k, v: row stride 3*inner
        return q, k, v, o


def break_attention(transformer: torch.nn.Module, fuse_qkv: bool = True) -> int:
    """Route every self-attention of ``transformer`` through the eager break, its q, k and v projections
    fused into one (``fuse_qkv``; where they cannot be, e.g. FP8 took some and not others, separate);
    returns how many."""
    scratch = AttentionScratch()
    for block in transformer.transformer_blocks:
        attn, qkv = block.attn1, None
        if fuse_qkv:
            try:
                qkv = fuse_linears([attn.to_q, attn.to_k, attn.to_v])
            except ValueError:
                qkv = None
        attn.set_processor(BreakableSelfAttention(scratch, (attn.to_q, attn.to_k, attn.to_v), qkv))
    return len(transformer.transformer_blocks)


def restore_attention(transformer: torch.nn.Module) -> None:
    """Undo ``break_attention``: diffusers' own SDPA processor again."""
    from diffusers.models.attention_processor import AttnProcessor2_0

    for block in transformer.transformer_blocks:
        block.attn1.set_processor(AttnProcessor2_0())


class HoistedModulation:
    """Every block's adaLN-Zero modulation of a class-conditional DiT, computed at once by the first block.

    In diffusers' DiT each of the L blocks has its own conditioning path: a timestep MLP (256 -> D -> D), a
    class-embedding table and the modulation linear (D -> 6D), each applied to the batch's B rows: 3L matrix
    products of B rows, which at small batches run far below the GPU's bandwidth (on an H200 at 2 rows
    they were about half a millisecond of a 4 ms step). Their inputs (timestep, class labels) are the same
    for every block, so the first block computes all L at once: one product for the L timestep MLPs' first
    layers side by side, two batched products (``baddbmm``) for the second layers and the modulation
    linears, one gather from the stacked class tables. The blocks' own weights become views of the stacked
    ones (no memory added); each block's norm reads its slice. The same arithmetic as the blocks' own
    (tested to float32 rounding); eager calls and both graph backends run it (the result crosses the
    attention breaks like the hidden states do). The linears' per-row terms (``workers.speed.terms``: a LoRA
    adapter's) are added to their layers' products, from each layer's own input.
    """

    def __init__(self, norms: list[torch.nn.Module]) -> None:
        self.norms = norms
        embs = [n.emb for n in norms]
        self.time_proj = embs[0].time_proj
        self.w1, self.b1 = _stack_views([e.timestep_embedder.linear_1 for e in embs])  # (L, D, 256), (L, D)
        self.w2, self.b2 = _stack_views([e.timestep_embedder.linear_2 for e in embs])  # (L, D, D), (L, D)
        self.wm, self.bm = _stack_views([n.linear for n in norms])                      # (L, 6D, D), (L, 6D)
        # the linears themselves, for their per-row terms (workers.speed.terms): a wrapper replaces them in the blocks
        self.first = [e.timestep_embedder.linear_1 for e in embs]
        self.second = [e.timestep_embedder.linear_2 for e in embs]
        self.linears = [n.linear for n in norms]
        self.tables = _stack_views([e.class_embedder.embedding_table for e in embs])[0]  # (L, classes+1, D)
        self.value: torch.Tensor | None = None  # (L, B, 6D): this forward's modulation, set by block 0

    @staticmethod
    def applies(norms: list[torch.nn.Module]) -> bool:
        """Only diffusers' class-conditional adaLN-Zero with identical timestep projections and plain
        linears of one shape (FP8 leaves these in the model's dtype: their names hold "norm")."""
        from diffusers.models.embeddings import CombinedTimestepLabelEmbeddings
        from diffusers.models.normalization import AdaLayerNormZero

        if not norms or not all(type(n) is AdaLayerNormZero and isinstance(n.emb, CombinedTimestepLabelEmbeddings)
                                for n in norms):
            return False
        first = norms[0].emb
        same_proj = all(vars(n.emb.time_proj) == vars(first.time_proj) for n in norms)
        te = [n.emb.timestep_embedder for n in norms]
        plain = all(type(t.linear_1) is torch.nn.Linear and type(t.linear_2) is torch.nn.Linear and
                    type(t.act) is torch.nn.SiLU and t.cond_proj is None and t.post_act is None for t in te)
        return same_proj and plain and all(type(n.linear) is torch.nn.Linear for n in norms)

    def compute(self, timestep: torch.Tensor, class_labels: torch.Tensor, dtype: torch.dtype) -> None:
        """(L, B, 6D) for this forward: what each block's ``norm1.linear(silu(norm1.emb(t, y)))`` computes."""
        layers, d, k = self.w1.shape
        silu = torch.nn.functional.silu
        t = self.time_proj(timestep).to(dtype)                                           # (B, 256)
        h = torch.addmm(self.b1.reshape(-1), t, self.w1.reshape(layers * d, k).t())        # (B, L*D)
        h = silu(_plus_terms(self.first, [t] * layers, h.view(-1, layers, d).transpose(0, 1)))  # (L, B, D)
        emb = torch.baddbmm(self.b2[:, None], h, self.w2.transpose(1, 2))                 # (L, B, D)
        emb = _plus_terms(self.second, h, emb) + self.tables[:, class_labels]             # + class rows
        s = silu(emb)
        self.value = _plus_terms(self.linears, s, torch.baddbmm(self.bm[:, None], s, self.wm.transpose(1, 2)))

    def block_value(self, index: int, timestep: torch.Tensor, class_labels: torch.Tensor,
                    dtype: torch.dtype) -> torch.Tensor:
        """(B, 6D): block ``index``'s modulation for this forward; the first block computes every block's."""
        if index == 0:
            self.compute(timestep, class_labels, dtype)
        return self.value[index]


def _plus_terms(linears: list[torch.nn.Module], xs, y: torch.Tensor) -> torch.Tensor:
    """(L, B, out): each layer's product ``y[l]`` of ``xs[l]`` (B, in) plus its linear's per-row term
    (``workers.speed.terms``), where one of them has one; else ``y`` itself."""
    if not has_terms(linears):
        return y
    return torch.stack([plus_term(lin, x, y_l) for lin, x, y_l in zip(linears, xs, y.unbind(0))])


def _stack_views(modules: list[torch.nn.Module]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The modules' weights (and biases) stacked along a new first dimension; each module's own become views
    of the stack, so no memory is added. A linear's (L, out, in) and (L, out); an embedding's (L, rows, dim)."""
    out = []
    for name in ("weight", "bias"):
        parts = [getattr(m, name, None) for m in modules]
        if any(p is None for p in parts):
            out.append(None)
            continue
        whole = torch.stack([p.detach() for p in parts])
        for m, view in zip(modules, whole.unbind(0)):
            setattr(m, name, torch.nn.Parameter(view, requires_grad=False))
        out.append(whole)
    return out[0], out[1]


def _hoisted_norm_forward(cache: HoistedModulation, index: int):
    def forward(x, timestep=None, class_labels=None, hidden_dtype=None, emb=None):
        norm = cache.norms[index]
        emb = cache.block_value(index, timestep, class_labels, hidden_dtype or x.dtype)
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = emb.chunk(6, dim=1)
        x = norm.norm(x) * (1 + scale_msa[:, None]) + shift_msa[:, None]
        return x, gate_msa, shift_mlp, scale_mlp, gate_mlp

    return forward


def hoist_modulation(transformer: torch.nn.Module) -> bool:
    """Route every block's adaLN-Zero modulation through one ``HoistedModulation`` (see there); False, and
    nothing changed, where the model is not diffusers' class-conditional DiT. Patching again reuses the
    stacked weights (a second engine on one model must not move the weights the first one's graphs read)."""
    norms = [blk.norm1 for blk in getattr(transformer, "transformer_blocks", [])]
    cache = getattr(transformer, "_hoisted_modulation", None)
    if cache is None or cache.norms != norms:
        if not HoistedModulation.applies(norms):
            return False
        cache = HoistedModulation(norms)
        object.__setattr__(transformer, "_hoisted_modulation", cache)  # a plain reference, not a submodule
    for i, norm in enumerate(norms):
        norm.forward = _hoisted_norm_forward(cache, i)
        object.__setattr__(norm, "_hoisted", (cache, i))  # for blocks that read the modulation (norm_fusion)
    return True


def restore_modulation(transformer: torch.nn.Module) -> None:
    """Undo ``hoist_modulation``: each block computes its own modulation again (the stacked weights stay)."""
    for blk in getattr(transformer, "transformer_blocks", []):
        blk.norm1.__dict__.pop("forward", None)
        blk.norm1.__dict__.pop("_hoisted", None)
