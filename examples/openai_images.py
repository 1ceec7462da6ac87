"""The OpenAI-compatible images endpoint, with the official ``openai`` package when it is installed
and with plain httpx either way.

    python examples/openai_images.py                      # a local service just for this run
    python examples/openai_images.py --url http://HOST:8000

For class-conditional models the prompt names the class: a digit ("7" or "seven") for ``digits``,
an ImageNet class name for DiT-XL/2. ``size`` must be the model's size (or "auto").
"""

from __future__ import annotations

import argparse
import base64
import io
from pathlib import Path

import httpx
from PIL import Image

from dit_serve.client import service_url


def with_httpx(url: str, out: Path) -> list[Path]:
    r = httpx.post(f"{url}/v1/images/generations", timeout=120,
                   json={"model": "digits", "prompt": "seven", "n": 2, "size": "8x8", "response_format": "b64_json"})
    r.raise_for_status()
    paths = []
    for i, item in enumerate(r.json()["data"]):
        paths.append(out / f"httpx_{i}.png")
        Image.open(io.BytesIO(base64.b64decode(item["b64_json"]))).save(paths[-1])
    return paths


def with_openai(url: str, out: Path) -> list[Path]:
    from openai import OpenAI

    client = OpenAI(base_url=f"{url}/v1", api_key="unused")  # the service checks no key
    result = client.images.generate(model="digits", prompt="3", n=2, size="auto", response_format="url",
                                    extra_body={"seed": 5})
    paths = []
    for i, item in enumerate(result.data):
        paths.append(out / f"openai_{i}.png")
        paths[-1].write_bytes(httpx.get(item.url, timeout=30).content)
    return paths


def run(url: str, out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    paths = with_httpx(url, out)
    try:
        paths += with_openai(url, out)
    except ImportError:
        print("the openai package is not installed; showed plain httpx only")
    print(f"wrote {len(paths)} images to {out}")
    return paths


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", help="a running service; default: start a local one for this run")
    p.add_argument("--out", type=Path, default=Path("out/openai_images"))
    args = p.parse_args()
    with service_url(args.url) as url:
        run(url, args.out)


if __name__ == "__main__":
    main()
