"""The worker's config, defined once: the ``[workers]`` section of the service's TOML file, what the scheduler
hands each worker actor, and what the engine runs by. Torch-free (the API process reads it too).

    [workers]
    models = ["digits", "digits-text"]
    speed = "fast"                       # "default" | "fast" | "fastest", for every model
    model_speed = {"flux-dev-1024" = "fastest"}   # a model's own, over `speed`

The three speeds (``SPEEDS``) are what a user picks; ``speed_for`` turns one into the speed layer's
``SpeedConfig`` for one model of one family:

- ``default``: whole-step CUDA graphs (breakable where a step has eager breaks) in the model's dtype, nothing
  compiled: a worker starts in seconds;
- ``fast``: each step compiled by Inductor inside the graphs, at the scope its family measured best
  (``Family.compile_scope``), and the VAE decode captured and compiled too; the compiled kernels are kept
  under the data directory (``compile_cache``), so a restart is warm;
- ``fastest``: ``fast`` with the transformer blocks' linears as FP8 matrix products where the GPU has them
  (compute capability 8.9+), and SD3's and FLUX.1's joint attention in FP8 too where cuDNN's FP8 attention is
  installed (Hopper, ``pip install 'dit-serve[fp8-attention]'``): faster, with images a little changed
  (docs/design.md states the PSNR per family).

The finer fields (``compile``, ``compile_scope``, ``decode_graphs``, ``precision``) override what the speed
picks, for experts and benchmarks; left unset, the speed decides.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from workers.request.sizes import parse_size
from workers.speed.config import SpeedConfig

SPEEDS = ("default", "fast", "fastest")
Speed = Literal["default", "fast", "fastest"]
Precision = Literal["bf16", "fp8", "fp8+attention"]


class WorkerConfig(BaseModel):
    """One worker: which models it serves, on what, and how fast (see the module docstring)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    models: tuple[str, ...] = ("digits", "digits-text")
    resource: str = Field("auto", min_length=1, description="auto | GPU | CPU | a custom resource name")
    cpu_workers: int = Field(1, ge=1, description="workers when running on CPUs")
    num_cpus: float = Field(1.0, ge=0, description="CPUs reserved by each worker actor")
    device: str = Field("auto", description="auto: CUDA when present (Ray sets CUDA_VISIBLE_DEVICES per actor)")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="auto: the model card's on CUDA (bfloat16 unless it says float32), else float32")
    backend: Literal["auto", "eager", "full", "breakable", "graphs"] = Field(
        "auto", description="auto: graphs on CUDA (whole-step graphs per model, breakable ones where its step "
                            "has eager breaks), eager elsewhere")
    max_batch: int = Field(64, ge=1, description="largest graph bucket, a power of two")
    max_inflight: int = Field(0, ge=0, description="items leased to one worker at once; 0: max_batch")
    max_shapes: int = Field(8, ge=1, le=64, description="image sizes of one model kept captured at once; the "
                                                       "least recently used idle one beyond it is dropped")
    torch_threads: int | None = Field(None, ge=1)
    text_encoder_device: str = Field("", max_length=50, description="text models: where text encoders run "
                                     "('' with the transformer; 'cpu' or 'cuda:1' to free the serving GPU)")
    warm_sizes: tuple[str, ...] = Field((), description="'WxH' sizes captured at start-up besides each model's "
                                                        "native size (others are captured when first asked for)")
    png_compress_level: int = Field(1, ge=0, le=9, description="zlib level of the stored PNGs: 1 encodes a 1024 px "
                                    "image about 6x faster than Pillow's default 6, for files about 15% larger")
    png_threads: int = Field(0, ge=0, le=64, description="threads encoding PNGs off the step loop; 0: one per "
                                                         "core, at most 4")
    # how fast: the speed, per model over it, and the finer fields that override what it picks
    speed: Speed = Field("default", description="default | fast | fastest (the module docstring says what each "
                                                "turns on)")
    model_speed: dict[str, Speed] = Field(default_factory=dict, description="a model's own speed, over `speed`")
    cross_attention: Literal["auto", "padded", "varlen"] = Field(
        "auto", description="text models: cross-attention over prompts padded to the token limit (masked), "
                            "or over each prompt's real tokens in an eager break; auto: the family's measured "
                            "default (varlen for PixArt)")
    compile: Literal["off", "inductor"] | None = Field(
        None, description="over the speed: 'inductor' compiles each model's step by Inductor once per size "
                          "(dynamic batch) inside the same graphs; 'off' does not")
    compile_scope: Literal["step", "blocks"] | None = Field(
        None, description="over the speed: 'step' compiles the whole step, 'blocks' the transformer's repeated "
                          "blocks, one graph per block class (a far shorter cold compile for large models)")
    decode_graphs: bool | None = Field(None, description="over the speed: the VAE decode captured in graphs too "
                                                         "(compiled when the model's step is)")
    compile_cache: str = Field("", max_length=500, description="the compiled kernels' directory (Inductor's, and "
                                                               "FlashAttention-4's under it), kept across restarts; "
                                                               "'': <data_dir>/compile-cache under the service")
    # per-request LoRA (workers.lora): a fixed-shape adapter bank per served model; 0 slots: off, nothing added
    lora_slots: int = Field(0, ge=0, le=1024, description="adapters held on the device at once per model; 0: LoRA "
                            "off (no bank, no step inputs, zero cost)")
    lora_max_rank: int = Field(64, ge=1, le=1024, description="the largest adapter rank the bank holds (smaller "
                               "ranks are zero-padded)")
    lora_per_request: int = Field(4, ge=1, le=16, description="adapters one request may apply")
    lora_kernel: Literal["bmm", "triton"] = Field("triton", description="how the rows' adapter terms are "
                                                  "computed: 'triton' reads each row's adapters in place and skips "
                                                  "empty places (CUDA with Triton; elsewhere 'bmm'); 'bmm' gathers "
                                                  "each row's adapters and multiplies them in two batched products")
    lora_dir: str = Field("", max_length=500, description="every *.safetensors in it becomes an adapter named by "
                          "its stem (its model: a <stem>.json sidecar's \"model\", or the file's metadata key "
                          "\"dit_serve.model\"; else any served model of a matching family)")
    lora_max_bytes: int = Field(512 << 20, ge=1, description="the largest adapter file accepted")
    lora_targets: tuple[str, ...] = Field((), max_length=64, description="regular expressions: the bank holds the "
                                          "linears whose paths one of them matches (re.search), e.g. "
                                          "[\"attn\"] for adapters on the attention alone; empty: every linear "
                                          "the served step reaches. Linears left out keep their fast paths (the "
                                          "GELU epilogue) and cost nothing; an adapter targeting one is refused")
    precision: dict[str, Precision] = Field(
        default_factory=dict, description="per model, over the speed: 'fp8' runs its transformer blocks' linears "
        "as FP8 matrix products (compute capability 8.9+: Ada, Hopper; refused on others); 'fp8+attention' also "
        "SD3's and FLUX.1's joint attention (Hopper, with the cuDNN frontend); 'bf16': the model's dtype")

    @field_validator("lora_targets")
    @classmethod
    def _patterns(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        for pattern in v:
            if not pattern or len(pattern) > 200:
                raise ValueError(f"a lora_targets pattern needs 1 to 200 characters (got {pattern!r})")
            try:
                re.compile(pattern)
            except re.error as e:
                raise ValueError(f"lora_targets pattern {pattern!r} is not a regular expression: {e}") from None
        return v

    @field_validator("warm_sizes")
    @classmethod
    def _sizes(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        for text in v:
            parse_size(text)
        return v

    def inflight(self) -> int:
        return self.max_inflight or self.max_batch

    def speed_of(self, model: str) -> str:
        """``model``'s speed: its own in ``model_speed``, else ``speed``."""
        return self.model_speed.get(model, self.speed)

    def speed_for(self, model: str, family) -> SpeedConfig:
        """What the speed layer does to ``model`` (a model of ``family``, a ``workers.families.base.Family``):
        its speed's choices, then the finer fields that are set. ``fastest``'s precision is what the speed asks
        for; ``precision_for`` says whether it is the user's own (refused where the GPU lacks it) or the
        speed's (fallen back from where the GPU lacks it)."""
        fast = self.speed_of(model) != "default"
        compile_mode = self.compile or ("inductor" if fast else "off")
        return SpeedConfig(
            cross_attention=self.cross_attention, compile=compile_mode,
            compile_scope=self.compile_scope or (family.compile_scope if fast else "step"),
            decode_graphs=fast if self.decode_graphs is None else self.decode_graphs,
            compile_cache=self.compile_cache, precision=self.precision_for(model, family)[0])

    def precision_for(self, model: str, family) -> tuple[str, bool]:
        """(``model``'s precision, whether the user asked for it): its ``precision`` entry, else FP8 for the
        ``fastest`` speed (with FP8 attention where its family has it), else "" (what the model was loaded
        for: its dtype, unless the caller loaded it otherwise)."""
        if model in self.precision:
            return self.precision[model], True
        if self.speed_of(model) == "fastest":
            return ("fp8+attention" if family.fp8_attention else "fp8"), False
        return "", False
