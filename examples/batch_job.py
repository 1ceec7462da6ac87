"""A large batch: 1,000 digit images in one job, then the zip of all of them with its manifest.

    python examples/batch_job.py                          # 1,000 images on a local service
    python examples/batch_job.py --count 50 --url URL     # fewer, on a running service

Items are leased to workers in batches; the engine batches them step by step, so throughput grows
with the batch size up to the largest graph bucket.
"""

from __future__ import annotations

import argparse
import json
import time
import zipfile
from pathlib import Path

from dit_serve.client import Client, service_url


def run(url: str, count: int, out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    labels = [i % 10 for i in range(count)]
    seeds = [1000 + i for i in range(count)]  # explicit per-item seeds: rerunning gives the same images
    with Client(url) as client:
        t0 = time.perf_counter()
        job = client.submit(labels=labels, seeds=seeds)
        job = client.wait(job, progress=True)
        seconds = time.perf_counter() - t0
        archive = client.archive(job, out / f"{job.id}.zip")
    with zipfile.ZipFile(archive) as z:
        manifest = json.loads(z.read("manifest.json"))
        pngs = [n for n in z.namelist() if n.endswith(".png")]
    print(f"job {job.id}: {job.state}; {len(pngs)} PNGs in {archive} "
          f"({count / seconds:.1f} images/s end to end, {len(manifest['images'])} manifest entries)")
    return archive


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", help="a running service; default: start a local one for this run")
    p.add_argument("--count", type=int, default=1000)
    p.add_argument("--out", type=Path, default=Path("out/batch_job"))
    args = p.parse_args()
    with service_url(args.url) as url:
        run(url, args.count, args.out)


if __name__ == "__main__":
    main()
