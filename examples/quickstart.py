"""Quickstart: submit a job through the Python SDK, watch its progress bar, save the images.

    python examples/quickstart.py                            # a local service just for this run
    python examples/quickstart.py --url http://HOST:8000     # a running `dit-serve serve`

The SDK (``dit_serve.client``) needs neither torch nor ray: a laptop can submit to a remote cluster.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from dit_serve.client import Client, service_url


def run(url: str, out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    with Client(url) as client:
        print("models:", ", ".join(m.id for m in client.models().data))
        job = client.submit(labels=[0, 1, 2, "seven"], num_per_label=2, seed=1)  # numbers or class names
        job = client.wait(job, progress=True)                                      # a tqdm bar
        print(f"job {job.id}: {job.state}, {job.counts}")
        paths = []
        for item, image in zip([it for it in job.items if it.state == "done"], client.images(job)):
            paths.append(out / f"{item.index:02d}_label{item.label}.png")
            image.save(paths[-1])
    print(f"wrote {len(paths)} images to {out}")
    return paths


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", help="a running service; default: start a local one for this run")
    p.add_argument("--out", type=Path, default=Path("out/quickstart"))
    args = p.parse_args()
    with service_url(args.url) as url:
        run(url, args.out)


if __name__ == "__main__":
    main()
