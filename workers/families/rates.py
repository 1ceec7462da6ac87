"""How many denoising steps of one image a second one GPU worker does of a model, estimated from its card before
any worker has measured it: autoscaling sizes a model's workers by this rate until the workers' step reports
replace it (``dit_serve.server.autoscale.Rates``).

An estimate starts from a measured figure: the image-steps per second of one GPU at a full batch, measured on a
built-in architecture (``MEASURED``, each figure with the report it comes from). A family names the built-in
whose figure stands for its models (``Family.rate_reference``: its own, or a kin family's where none of its own
was measured), and a model's estimate is that figure scaled by how much arithmetic one image-step takes,
relative to the reference's:

    work(card) = weights x tokens x passes

with the weights' parameters (transformer and VAE, ``workers.families.memory``; text encoders run once per
prompt, not per step), the image tokens at the native size ((image side / size multiple)^2; the size multiple is
the VAE's factor times the patch, so DiT's cards, which only make their native size, count pixels, as their
reference does), and 2 passes for classifier-free guidance (the batch doubles), else 1. Attention's share,
which grows with the square of the tokens, is left out: the estimate is an order of magnitude, which is what
sizing workers needs before the first measurement.

Beyond ``EXTRAPOLATION`` times the reference's work, either way, there is no estimate: a tiny model's step is
bound by kernel launches, not arithmetic (the shipped ``digits`` would otherwise read millions of steps a
second), and a far larger one may not fit the batch the figure was measured at.
"""

from __future__ import annotations

from dataclasses import dataclass

from workers.families import FAMILIES
from workers.families.memory import weight_params
from workers.request.cards import ModelCard, read_card

EXTRAPOLATION = 16.0  # the most an estimate scales its reference's figure by, up or down


@dataclass(frozen=True)
class StepRate:
    """A measured rate: image-steps per second of one GPU worker, at a full batch."""

    rate: float
    where: str  # the GPU, the settings and the report it was measured in


MEASURED: dict[str, StepRate] = {
    # 128 images admitted 64 at a time, DDIM 50 steps: 15.075 images/s x 50 steps
    "dit-xl-2-256": StepRate(15.075 * 50, "H100, speed default, 128 images 64 at a time: 15.075 images/s of 50 "
                                          "steps (docs/benchmarks/parity.md, 2026-12-07)"),
    # one image's step: 1000 / 128.584 ms. At 4096 tokens the step is bound by arithmetic (81% of the matmul peak,
    # docs/benchmarks/kernels_flux1024_tables.md), so a fuller batch does not step an image faster
    "flux-dev-1024": StepRate(1000 / 128.584, "H100, speed fast: one step of one image 128.584 ms "
                                              "(docs/benchmarks/parity.md, 2026-12-07)"),
    # a CFG step of 32 images, full graphs, varlen cross-attention: 32 / 214.99 ms
    "pixart-sigma-512": StepRate(32 / 0.21499, "H200, speed default: one CFG step of 32 images 214.99 ms "
                                              "(docs/benchmarks/pixart.md)"),
}


@dataclass(frozen=True)
class Estimate:
    rate: float  # image-steps per second of one GPU worker
    source: str  # how it was reached, for the logs


def work(card: ModelCard) -> float:
    """One image-step's arithmetic, up to a constant: weights x tokens x passes (the module docstring)."""
    tokens = (card.image_size / max(1, card.size_multiple)) ** 2
    passes = 2 if card.guidance_mode == "cfg" else 1
    return weight_params(card, encoders=False) * tokens * passes


def estimate(card: ModelCard) -> Estimate | None:
    """``card``'s rate on one GPU from its family's reference figure, or None: its family names none, or the
    model is beyond ``EXTRAPOLATION`` of the reference."""
    family = FAMILIES.get(card.family)
    reference = family.rate_reference if family is not None else ""
    figure = MEASURED.get(reference)
    if figure is None:
        return None
    scale = work(read_card(reference)) / work(card)
    if not 1 / EXTRAPOLATION <= scale <= EXTRAPOLATION:
        return None
    source = f"{reference}'s {figure.rate:.4g} image-steps/s ({figure.where})"
    if card.name != reference:
        source += f" x {scale:.3g} (its work per image-step over {card.name}'s)"
    return Estimate(figure.rate * scale, source)
