"""Adapters (LoRA) at the service's edge: an adapter file checked before it is registered, a request's adapters
checked against the registry and the model, and ``[workers] lora_dir`` registered at start-up.

What the API checks (it may run without torch): the file is a safetensors file (a pickle is refused before any
parsing; nothing is ever unpickled), of at most ``lora_max_bytes``, whose header lists 2-D float LoRA weights in a
format the workers read (``workers.lora.formats``: diffusers/PEFT, kohya FLUX.1, kohya SD3) of rank at most
``lora_max_rank``, for a family that format is made for. Where torch is importable the file is also read whole by
``workers.lora.formats.read_adapter``, whose ``LoraError`` names the first key at fault. Whether each targeted linear
exists with those shapes needs the model: the worker checks that when the adapter is pushed to it, and fails the
items that name an adapter it refused, with the reason."""

from __future__ import annotations

import json
import logging
import math
import re
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

from dit_serve.schemas import LORA_NAME, LoraRef, LoraUse, clip
from dit_serve.server.catalog import NewJob, RequestError
from workers.config import WorkerConfig
from workers.request.cards import ModelCard
from workers.request.weights import HEAD, is_pickle

log = logging.getLogger(__name__)

FLOATS = {"F16": 2, "BF16": 2, "F32": 4, "F64": 8}  # bytes per element of the dtypes an adapter's weights may have
MAX_HEADER = 100 << 20  # safetensors' own bound on the JSON header
FORMAT_FAMILY = {"kohya-flux": "flux", "kohya-sd3": "sd3"}  # formats made for one family; peft: any
MODEL_KEY = "dit_serve.model"  # a lora_dir file's metadata key naming its model


@dataclass(frozen=True)
class LoraPolicy:
    """The ``[workers]`` fields the API reads: LoRA is off with ``slots`` 0."""

    slots: int = 0
    max_rank: int = 64
    per_request: int = 4
    max_bytes: int = 512 << 20
    targets: tuple[str, ...] = ()  # lora_targets: the linears the workers' banks hold (empty: every one reached)

    @classmethod
    def of(cls, workers: WorkerConfig) -> "LoraPolicy":
        return cls(workers.lora_slots, workers.lora_max_rank, workers.lora_per_request, workers.lora_max_bytes,
                   workers.lora_targets)


@dataclass(frozen=True)
class Checked:
    format: str
    rank: int
    modules: int
    metadata: dict


class AdapterError(ValueError):
    """An adapter file the service does not register: the message names the first problem."""


def check_name(name: str) -> None:
    if not re.match(LORA_NAME, name or ""):
        raise RequestError(f"name {clip(name or '', 70)!r} is not an adapter name: 1-64 characters of A-Z, a-z, 0-9, "
                           "'.', '_', '-', starting with a letter or digit", "name")


def header(data: bytes) -> tuple[dict[str, tuple[str, list[int]]], dict[str, str]]:
    """(tensors: key -> (dtype, shape), metadata) of a safetensors file's bytes; AdapterError when it is none."""
    if len(data) < 8:
        raise AdapterError("the file is not a safetensors file (it is shorter than its header)")
    n = int.from_bytes(data[:8], "little")
    if n > min(MAX_HEADER, len(data) - 8):
        raise AdapterError("the file is not a safetensors file (its header length is past its end)")
    try:
        head = json.loads(data[8:8 + n])
    except (ValueError, UnicodeDecodeError):
        raise AdapterError("the file is not a safetensors file (its header is not JSON)") from None
    if not isinstance(head, dict):
        raise AdapterError("the file is not a safetensors file (its header is not a JSON object)")
    metadata = head.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise AdapterError("the file's __metadata__ is not a map of strings")
    body, tensors = len(data) - 8 - n, {}
    for key, entry in head.items():
        try:
            dtype, shape, (start, end) = entry["dtype"], list(entry["shape"]), entry["data_offsets"]
            ok = all(isinstance(d, int) and d >= 0 for d in shape) and 0 <= start <= end <= body
        except (TypeError, KeyError, ValueError):
            ok = False
        if not ok:
            raise AdapterError(f"tensor {clip(key, 120)!r}: its header entry is malformed")
        if dtype not in FLOATS:
            raise AdapterError(f"tensor {clip(key, 120)!r} is {clip(str(dtype), 20)}: adapter weights are floats "
                               f"({', '.join(FLOATS)})")
        if end - start != FLOATS[dtype] * math.prod(shape):
            raise AdapterError(f"tensor {clip(key, 120)!r}: {end - start} bytes do not hold {dtype} {shape}")
        tensors[key] = (dtype, shape)
    if not tensors:
        raise AdapterError("the file holds no tensors")
    return tensors, metadata


def lora_format(keys) -> str:
    """The format its keys say (as ``workers.lora.formats.from_state_dict`` tells them apart)."""
    if any(k.startswith("lora_unet_joint_blocks_") for k in keys):
        return "kohya-sd3"
    if any(".lora_down.weight" in k for k in keys):
        return "kohya-flux"
    return "peft"


DOWN = re.compile(r"(?P<module>.+)\.(?:lora_A|lora_down)\.weight")


def check_bytes(data: bytes, policy: LoraPolicy) -> Checked:
    """The first problem of an adapter file as ``AdapterError`` (the module docstring says what is checked)."""
    if not data:
        raise AdapterError("the file is empty")
    if len(data) > policy.max_bytes:
        raise AdapterError(f"the file is {len(data):,} bytes; adapters are limited to {policy.max_bytes:,} "
                           "([workers] lora_max_bytes)")
    if is_pickle(data[:HEAD], len(data)):
        raise AdapterError("the file is a pickle (torch.save): only safetensors adapters are read, nothing is "
                           "unpickled")
    tensors, metadata = header(data)
    fmt = lora_format(tensors)
    downs = {m["module"]: tensors[k][1] for k in tensors if (m := DOWN.fullmatch(k))}
    if not downs:
        raise AdapterError("the file holds no LoRA weights (lora_A / lora_down)")
    for module, shape in downs.items():
        if len(shape) != 2:
            raise AdapterError(f"module {clip(module, 120)!r}: lora weights of shape {shape} are not a linear layer's "
                               "(convolutions are not served)")
    rank = max(shape[0] for shape in downs.values())
    if rank > policy.max_rank:
        worst = next(m for m, s in downs.items() if s[0] == rank)
        raise AdapterError(f"module {clip(worst, 120)!r} has rank {rank}; this service's adapters are of rank at "
                           f"most {policy.max_rank} ([workers] lora_max_rank)")
    modules = _read_whole(data)
    if modules is not None and policy.targets:
        if left := next((m for m in modules if not any(re.search(p, m) for p in policy.targets)), None):
            raise AdapterError(f"module {clip(left, 120)!r}: the workers' adapter banks leave it out ([workers] "
                               f"lora_targets {list(policy.targets)})")
    return Checked(fmt, rank, len(modules) if modules is not None else len(downs), metadata)


def _read_whole(data: bytes) -> list[str] | None:
    """The linears (transformer paths) the workers' reader finds (it raises what it refuses, as AdapterError); None
    without torch."""
    try:
        from workers.lora.formats import LoraError, read_adapter
    except ImportError:  # an API process without torch: the worker reads it when it is pushed there
        return None
    with tempfile.NamedTemporaryFile(suffix=".safetensors") as f:
        f.write(data)
        f.flush()
        try:
            return list(read_adapter(f.name).weights)
        except LoraError as e:
            raise AdapterError(str(e)) from None


def check_family(checked: Checked, card: ModelCard | None) -> str:
    """The family the adapter is registered for: its model's (AdapterError when the format is made for another)."""
    want = FORMAT_FAMILY.get(checked.format)
    if card is None:
        return want or ""
    if want is not None and card.family != want:
        raise AdapterError(f"the file is a {checked.format} adapter, for the {want} family; model {card.name!r} is "
                           f"of the {card.family} family")
    return card.family


def resolve_loras(new: NewJob, refs: list[LoraRef] | None, store, tenant: str | None, card: ModelCard,
                  policy: LoraPolicy, param: str = "loras") -> NewJob:
    """``new`` with its adapters recorded in its params (name, scale, sha256); a 400 naming the first adapter that
    is unknown to ``tenant`` (None: admin, any), repeated, past ``per_request``, or for another model or family."""
    if not refs:
        return new
    if policy.slots == 0:
        raise RequestError("this service applies no adapters ([workers] lora_slots is 0): send no loras", param)
    if len(refs) > policy.per_request:
        raise RequestError(f"{len(refs)} adapters were named; a request applies at most {policy.per_request} "
                           "([workers] lora_per_request)", param)
    found = store.get_loras([r.name for r in refs], tenant=tenant)
    uses, seen = [], set()
    for ref in refs:
        if ref.name in seen:
            raise RequestError(f"adapter {ref.name!r} is named twice: name it once, with the sum of its scales", param)
        seen.add(ref.name)
        lora = found.get(ref.name)
        if lora is None:
            raise RequestError(f"no adapter {ref.name!r} (GET /v1/loras lists those you may use)", param)
        if lora.model and lora.model != card.name:
            raise RequestError(f"adapter {ref.name!r} is for model {lora.model!r}, not {card.name!r}", param)
        if lora.family and lora.family != card.family:
            raise RequestError(f"adapter {ref.name!r} is for the {lora.family} family; model {card.name!r} is of the "
                               f"{card.family} family", param)
        uses.append(LoraUse(name=ref.name, scale=ref.scale, sha256=lora.sha256))
    return replace(new, params=new.params.model_copy(update={"loras": uses}))


def register_dir(store, folder: str | Path, policy: LoraPolicy, cards: dict[str, ModelCard]) -> list[str]:
    """Register (or refresh) every ``*.safetensors`` of ``folder`` as a shared adapter named by its stem; returns
    their names. A file that is refused is logged and skipped; a name an upload holds is left to the upload."""
    from dit_serve.server.store import DEFAULT_TENANT, LoraNameTaken

    names = []
    for path in sorted(Path(folder).glob("*.safetensors")):
        try:
            check_name(path.stem)
            data = path.read_bytes()
            checked = check_bytes(data, policy)
            model = _dir_model(path, checked.metadata)
            if model and model not in cards:
                raise AdapterError(f"its model {model!r} is not served here")
            family = check_family(checked, cards.get(model)) if model else FORMAT_FAMILY.get(checked.format, "")
            store.put_lora(path.stem, data, DEFAULT_TENANT, True, model, family, checked.format, checked.rank,
                           checked.modules, source="dir", replace=True)
            names.append(path.stem)
        except (AdapterError, RequestError, LoraNameTaken, OSError) as e:
            log.warning("lora_dir: %s not registered: %s", path.name, getattr(e, "message", e))
    return names


def _dir_model(path: Path, metadata: dict) -> str:
    sidecar = path.with_suffix(".json")
    if sidecar.exists():
        try:
            return str(json.loads(sidecar.read_text()).get("model") or "")
        except (ValueError, AttributeError) as e:
            raise AdapterError(f"its sidecar {sidecar.name} is not a JSON object: {e}") from None
    return metadata.get(MODEL_KEY, "")
