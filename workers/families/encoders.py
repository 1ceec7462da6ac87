"""Text encoders: one copy per process for identical weights, optionally on another device.

Text encoders are large (T5-XXL: 4.76 B parameters, 8.9 GiB in bf16) and the families share them:
PixArt-Σ, SD3/SD3.5 and FLUX.1 all use T5-v1.1-XXL's encoder, and FLUX and SD3 the same CLIP-L. A
worker serving several of these models loads each distinct encoder once: ``load_text_encoder`` keys
its process-wide cache by the encoder's class, the target device and dtype, and a fingerprint of the
weights (``fingerprint``: the config and, per safetensors file, its name, size, header and 16 samples
of 64 KiB spread over the file, so two checkpoints that differ anywhere in practice differ here,
without reading 9 GB). Encoders are frozen and run between steps, one batch at a time, so sharing is safe.

Offload (``[workers] text_encoder_device``, e.g. "cpu" or "cuda:1"): encoders load there instead of
the transformer's GPU; their outputs are cached on the host and uploaded with the rest of a request's
conditioning at admission. It frees the encoder's memory on the serving GPU and costs encode time on
prompts that miss the cache (docs/design.md gives the measured cost).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import hashlib
import logging
from pathlib import Path

log = logging.getLogger(__name__)

SAMPLES, SAMPLE_BYTES = 16, 1 << 16
_SHARED: dict[tuple, object] = {}
_DEVICE: contextvars.ContextVar[str | None] = contextvars.ContextVar("text_encoder_device", default=None)


def fingerprint(folder: Path) -> str:
    """A digest of an encoder folder's weights (see the module docstring), without reading them all; read
    once per state of the folder (the worker's memory check and its loader both ask)."""
    files = sorted([*folder.glob("*.safetensors"), folder / "config.json"])
    state = tuple((f.name, st.st_size, st.st_mtime_ns) for f in files if f.is_file() for st in [f.stat()])
    return _fingerprint(str(folder), state)


@functools.lru_cache(maxsize=64)
def _fingerprint(folder: str, state: tuple) -> str:
    folder = Path(folder)
    h = hashlib.sha256()
    config = folder / "config.json"
    h.update(config.read_bytes() if config.is_file() else b"")
    for f in sorted(folder.glob("*.safetensors")):
        size = f.stat().st_size
        h.update(f"{f.name}:{size}".encode())
        with open(f, "rb") as fh:
            head = fh.read(8)
            h.update(head + fh.read(int.from_bytes(head, "little") if len(head) == 8 else 0))
            for i in range(SAMPLES):
                fh.seek(max(0, (size - SAMPLE_BYTES) * i // max(1, SAMPLES - 1)))
                h.update(fh.read(SAMPLE_BYTES))
    return h.hexdigest()


@contextlib.contextmanager
def encoders_on(device: str | None):
    """Load text encoders on ``device`` (None: with their transformer) inside this block."""
    token = _DEVICE.set(device or None)
    try:
        yield
    finally:
        _DEVICE.reset(token)


def encoder_device(default):
    """Where a text encoder loads: the offload device when one is set, else ``default``."""
    return _DEVICE.get() or default


def load_text_encoder(cls, folder: Path, device, dtype):
    """``cls.from_pretrained(folder)`` (local files, safetensors only) on the encoder device in ``dtype``,
    frozen; the same module again for identical weights on the same device and dtype."""
    import torch

    dev = torch.device(encoder_device(device))
    key = (cls.__name__, fingerprint(folder), str(dev), str(dtype))
    if key in _SHARED:
        log.info("sharing the text encoder of %s (same weights already loaded on %s)", folder, dev)
        return _SHARED[key]
    # use_kernels=False: transformers 5 replaces layers with kernels fetched from a model hub unless told not to;
    # the engine chooses its own kernels, and nothing is fetched at run time.
    with _no_progress_bar():
        encoder = cls.from_pretrained(str(folder), local_files_only=True, use_safetensors=True, dtype=dtype,
                                      use_kernels=False)
    _SHARED[key] = encoder = _frozen(encoder, dev, dtype)
    return encoder


@contextlib.contextmanager
def _no_progress_bar():
    """transformers' "Loading weights" bar off while an encoder loads (the worker's log and `generate` report
    loading themselves); its setting restored after."""
    from transformers.utils import logging as transformers_logging

    was = transformers_logging.is_progress_bar_enabled()
    transformers_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            transformers_logging.enable_progress_bar()


def place_encoder(encoder, device, dtype):
    """A text encoder built with its transformer (the built-ins), moved to the offload device if one is set."""
    target = encoder_device(device)
    return encoder if str(target) == str(device) else _frozen(encoder, target, dtype)


def _frozen(encoder, device, dtype):
    """Moved, cast and frozen for inference: as ``workers.loading.cast`` (which imports this module)."""
    import torch

    return torch.nn.Module.to(encoder, device=device, dtype=dtype).eval().requires_grad_(False)


def clear() -> None:
    """Forget the shared encoders (tests; a process that unloads its models)."""
    _SHARED.clear()


def release_unused(in_use) -> int:
    """Forget the shared encoders that are none of ``in_use`` (the text encoders of the models still loaded): a
    worker that unloads a model lets its encoder's memory go. Returns how many were forgotten."""
    gone = [key for key, encoder in _SHARED.items() if not any(encoder is m for m in in_use)]
    for key in gone:
        del _SHARED[key]
    return len(gone)


LENGTH_STEP = 64  # token counts are padded up to a multiple of this (at most the model's limit): few shapes


def padded_length(tokens: int, limit: int) -> int:
    """The length a batch whose longest text has ``tokens`` tokens is encoded at: the next multiple of
    LENGTH_STEP, at most ``limit`` (and at least 1)."""
    return max(1, min(limit, -(-tokens // LENGTH_STEP) * LENGTH_STEP))


class EncoderGraphs:
    """A masked text encoder (T5) replayed from CUDA graphs instead of run module by module.

    Why: T5-XXL's forward is about 600 kernel launches from Python modules; on an H200 it took 34 ms for a
    prompt and "" whether over their real tokens or padded to 300 (the host, not the GPU, sets its pace), a
    sixth of a PixArt-Σ 512 image. A replay launches it at once.

    Shapes: one ``GraphRunner`` (backend "full") per padded length (``padded_length``: multiples of
    LENGTH_STEP up to the limit), made and captured the first time a batch of that length is encoded (the
    shortest at the engine's warm-up), with batches at powers of two up to ``max_batch`` (larger ones in chunks). Texts are independent rows
    and the padding is masked, so a text's embedding does not depend on its batch. Captures go into the
    engine's graph pool (its replays and these never overlap: one engine thread encodes and steps).
    A capture that fails leaves that runner serving eagerly (GraphRunner's rule)."""

    def __init__(self, encoder, limit: int, max_batch: int = 4, pool=None, stream=None) -> None:
        self.encoder, self.limit, self.max_batch = encoder, limit, max_batch
        self.pool, self.stream = pool, stream
        self.runners: dict[int, object] = {}

    def __call__(self, input_ids, mask):
        """(n, L) token ids and mask (L a ``padded_length``) -> (n, L, D) last hidden states."""
        return self.runner(input_ids.shape[1]).run(input_ids=input_ids.long(), mask=mask.long())["hidden"]

    def runner(self, length: int):
        """The runner of ``length`` tokens, made and captured now if it is new (the engine's warm-up asks for
        the shortest, which most prompts use, so the first request does not pay its capture)."""
        if length in self.runners:
            return self.runners[length]
        import torch

        from graphs import GraphRunner, TensorSpec

        width = self.encoder.config.d_model
        device = next(self.encoder.parameters()).device
        ids, keep = TensorSpec((length,), torch.int64), TensorSpec((length,), torch.int64)
        runner = GraphRunner(self._forward, {"input_ids": ids, "mask": keep},
                             {"hidden": TensorSpec((length, width), self.encoder.dtype)},
                             max_batch=self.max_batch, backend="full", device=device,
                             pool=self.pool, stream=self.stream)
        one = torch.ones(1, length, dtype=torch.int64, device=device)
        runner.warmup(example={"input_ids": one, "mask": one})
        self.runners[length] = runner
        log.info("text encoder captured at %d tokens (batches up to %d)", length, self.max_batch)
        return runner

    def _forward(self, input_ids, mask):
        return {"hidden": self.encoder(input_ids, attention_mask=mask)[0]}
