"""Write a finished job's images into a directory: the PNGs as the service stored them, a grid and a
manifest. Client side (no torch): ``dit-serve fetch``, ``submit --out``, the demo and the examples.

Files go to a hidden staging folder first and are moved
into place one by one, the manifest last, so an interrupted fetch never leaves a manifest that
names missing files. Needs only the base install (httpx, pydantic, tqdm, pillow): no numpy.
"""

from __future__ import annotations

import io
import json
import math
import os
import shutil
import tempfile
from pathlib import Path

from PIL import Image

from dit_serve.client import Client
from dit_serve.schemas import Job, Manifest, ManifestImage


def grid(images: list[Image.Image], cols: int, min_side: int = 64, gap: int = 4) -> Image.Image:
    """Tile images row-major, each upscaled (nearest) so small ones are viewable, with a grey gap."""
    w, h = images[0].size
    scale = max(1, -(-min_side // h))
    th, tw = h * scale, w * scale
    tiles = [img.convert("RGB").resize((tw, th), Image.NEAREST) for img in images]
    rows = -(-len(tiles) // cols)
    canvas = Image.new("RGB", (cols * (tw + gap) + gap, rows * (th + gap) + gap), (96, 96, 96))
    for i, tile in enumerate(tiles):
        canvas.paste(tile, (gap + (i % cols) * (tw + gap), gap + (i // cols) * (th + gap)))
    return canvas


def publish(staging: Path, out: Path, files: list[str], manifest: Manifest) -> Path:
    """Move staged files into DIR one by one, then write the manifest last (atomically), so DIR never
    holds a manifest that names missing files. Removes the staging folder in any case."""
    try:
        for name in files:
            os.replace(staging / name, out / name)
        (staging / "manifest.json").write_text(manifest.dumps())
        os.replace(staging / "manifest.json", out / "manifest.json")
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out / "manifest.json"


def grid_columns(labels: list) -> int:
    """One row per label (or prompt) when the job is label-major (each repeated k times), else ~square."""
    run = next((i for i, lb in enumerate(labels) if lb != labels[0]), len(labels))
    if len(labels) % run == 0 and run > 1 and all(labels[i] == labels[i - i % run] for i in range(len(labels))):
        return run
    return max(1, math.ceil(math.sqrt(len(labels))))


def check_out(out: Path, force: bool = False) -> None:
    """ValueError unless images can be written into ``out``: a folder (or one to create) that is writable
    and, unless ``force``, holds no files (old PNGs beside a new manifest would look like the job's).
    Creates nothing that it does not remove again."""
    if out.exists() and not out.is_dir():
        raise ValueError(f"cannot write to {str(out)!r}: it is a file, not a folder")
    if out.is_dir() and not force and any(not p.name.startswith(".partial-") for p in out.iterdir()):
        raise ValueError(f"{str(out)!r} already holds files: choose an empty or new folder, or pass --force "
                         "(files of an earlier fetch into it are then replaced)")
    created = [p for p in (out, *out.parents) if not p.exists()]
    try:
        out.mkdir(parents=True, exist_ok=True)
        Path(tempfile.mkdtemp(prefix=".partial-", dir=out)).rmdir()
    except OSError as e:
        raise ValueError(f"cannot write to {str(out)!r}: {e.strerror or e}") from None
    finally:
        for p in created:  # innermost first
            try:
                p.rmdir()
            except OSError:
                pass


def write_job(client: Client, job: Job, out: Path, force: bool = False) -> Path:
    """Download the job's finished images into ``out`` (check_out's rules); returns the manifest's path.
    With ``force``, the files an earlier manifest in ``out`` names are replaced, not left beside the new."""
    done = [it for it in job.items if it.state == "done"]
    if not done:
        raise ValueError(f"job {job.id} has no finished images (state: {job.state})")
    check_out(out, force)
    stale = _named_by_manifest(out)
    out.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".partial-", dir=out))
    try:
        entries, images = [], []
        for it in done:
            name = f"{it.index:05d}_label{it.label}.png" if it.prompt is None else f"{it.index:05d}.png"
            png = client.image_bytes(job, it.index)
            (staging / name).write_bytes(png)
            images.append(Image.open(io.BytesIO(png)))
            entries.append(ManifestImage.of(name, it))
        grid(images, grid_columns([e.label if e.prompt is None else e.prompt for e in entries])).save(
            staging / "grid.png")
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    manifest = Manifest(job=job.id, model=job.model, state=job.state, params=job.params, grid="grid.png",
                        images=entries)
    files = [e.file for e in entries] + ["grid.png"]
    path = publish(staging, out, files, manifest)
    for name in stale - set(files):
        (out / name).unlink(missing_ok=True)
    return path


def _named_by_manifest(out: Path) -> set[str]:
    """The image files a manifest already in ``out`` names (plain names inside it only), else none."""
    try:
        old = json.loads((out / "manifest.json").read_text())
        names = {e["file"] for e in old.get("images", [])} | {old.get("grid", "")}
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return set()
    return {n for n in names if isinstance(n, str) and n and Path(n).name == n}
