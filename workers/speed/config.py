"""What the speed layer does to a model (``workers.speed.apply``): one frozen config, passed in.

Every field is a choice a user (or a benchmark comparing systems) makes; nothing is read from module globals.
The defaults are the service's defaults: the graph backends' rewrites on, bf16, no compile.
"""

from __future__ import annotations

from dataclasses import dataclass

COMPILE_MODES = ("off", "inductor")
COMPILE_SCOPES = ("step", "blocks")
PRECISIONS = ("bf16", "fp8", "fp8+attention")  # the model's dtype; FP8 linears; and FP8 joint attention


@dataclass(frozen=True)
class SpeedConfig:
    attention_patch: bool = True  # break_attention (DiT, PixArt) and joint_attention (SD3, FLUX.1) families: attention by
                                  # the kernel per shape (q, k, v one product, the kernel measured fastest per shape):
                                  # an eager break under `breakable`, captured inside the graph under `full`
    hoist_modulation: bool = True  # the same families under both graph backends: every block's adaLN modulation
                                   # computed at once by the first (workers.speed.patches.HoistedModulation); SD3's
                                   # and FLUX.1's by one product of the step's embedding, made for all of a
                                   # request's steps at admission (workers.speed.modulation)
    gelu_epilogue: bool = True    # every family under both graph backends: tanh-GELU feed-forwards with the GELU in
                                  # the product's epilogue on CUDA, FLUX's single blocks without their concatenation
                                  # (workers.speed.epilogues; FLUX.1's in workers.families.flux.fast)
    cross_attention: str = "auto"  # text families: "padded" (to max_tokens, masked) | "varlen" (real lengths)
                                   # | "auto" (the family's measured default)
    compile: str = "off"          # "inductor": each step compiled by Inductor once per model and latent shape
                                  # (dynamic batch), then captured as before (graphs.compiled) | "off"
    compile_scope: str = "step"   # with compile on: "step" compiles the whole step; "blocks" the transformer's
                                  # repeated blocks, one graph per block class (graphs.compiled, "Regions"),
                                  # where the family has them (DiT: the whole step either way)
    compile_cache: str = ""       # the compiled kernels' cache directory, kept across restarts: Inductor's,
                                  # and FlashAttention-4's under it ("": their defaults, under the temp directory)
    decode_graphs: bool = False   # the VAE decode of each group captured too (backend "full", power-of-two
                                  # batches up to DECODE_PIXELS of output, the step's pool), compiled when the step
                                  # is: 2-3x faster on an H200, off by default for the cold compile it adds per size
    precision: str = ""           # "bf16" | "fp8" | "fp8+attention": what the model runs in; "": what it was
                                  # loaded for (``load_model(precision=...)``)

    def __post_init__(self) -> None:
        if self.compile not in COMPILE_MODES:
            raise ValueError(f"compile must be one of {COMPILE_MODES}, got {self.compile!r}")
        if self.compile_scope not in COMPILE_SCOPES:
            raise ValueError(f"compile_scope must be one of {COMPILE_SCOPES}, got {self.compile_scope!r}")
        if self.precision and self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {self.precision!r}")
