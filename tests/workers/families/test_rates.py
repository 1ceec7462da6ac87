"""A model's step rate on one GPU estimated from its card: a measured figure of its family's reference built-in,
scaled by weights x tokens x passes (workers.families.rates)."""

from dataclasses import replace

import pytest

from workers.families import FAMILIES, builtin_names
from workers.families.rates import EXTRAPOLATION, MEASURED, estimate, work
from workers.request.cards import read_card


def test_a_reference_is_its_measured_figure_and_names_the_report():
    for name, figure in MEASURED.items():
        e = estimate(read_card(name))
        assert e.rate == figure.rate and "docs/benchmarks/" in e.source
    # DiT-XL/2 256 on an H100: 15.075 images/s of 50 steps (docs/benchmarks/parity.md)
    assert estimate(read_card("dit-xl-2-256")).rate == pytest.approx(753.75)


def test_the_estimate_scales_with_tokens_weights_and_guidance_passes():
    dit256, dit512 = read_card("dit-xl-2-256"), read_card("dit-xl-2-512")
    # the same weights, 4x the pixels: a quarter of the rate
    assert estimate(dit512).rate == pytest.approx(753.75 / 4)
    # PixArt-Σ 1024 against its 512 reference: 64^2 tokens against 32^2
    assert estimate(read_card("pixart-sigma-1024")).rate == pytest.approx(MEASURED["pixart-sigma-512"].rate / 4)
    # FLUX.1-dev embeds its guidance (one pass); SD3.5-medium runs classifier-free guidance (two), with
    # 2.55 B weights against 11.99 B at the same 64^2 tokens: 11.99 / (2.55 x 2) = 2.35 x FLUX.1-dev's rate
    flux, sd35 = read_card("flux-dev-1024"), read_card("sd35-medium-1024")
    assert work(replace(flux, guidance_mode="cfg")) == 2 * work(flux)
    assert estimate(sd35).rate == pytest.approx(MEASURED["flux-dev-1024"].rate * work(flux) / work(sd35))
    assert 2.3 < estimate(sd35).rate / estimate(flux).rate < 2.4
    assert estimate(dit512).source.startswith("dit-xl-2-256's 753.8 image-steps/s (H100")
    # Sana Sprint 1.6B embeds its guidance (one pass) where Sana 1600M runs CFG (two), with 1.92 B weights each
    # (Sprint's 5.8 M more): nearly twice the rate
    sana, sprint = read_card("sana-1600m-1024"), read_card("sana-sprint-1600m-1024")
    assert work(replace(sprint, guidance_mode="cfg")) == 2 * work(sprint)
    assert 1.99 < estimate(sprint).rate / estimate(sana).rate < 2.0


def test_every_family_names_a_measured_reference_and_every_builtin_gets_an_estimate():
    for family in FAMILIES.values():
        assert family.rate_reference in MEASURED, family.name
        assert read_card(family.rate_reference).builtin  # a built-in: its card needs no download
    for name in builtin_names():
        card = read_card(name)
        if name.startswith("digits"):  # tiny: beyond the extrapolation (their step is launch-bound)
            assert estimate(card) is None
            continue
        e = estimate(card)
        assert e is not None and 0.5 < e.rate < 2000, name


def test_no_estimate_far_from_the_reference():
    flux = read_card("flux-dev-1024")
    near = replace(flux, image_size=int(1024 * EXTRAPOLATION ** 0.5))  # 16x the tokens: the edge, still estimated
    assert estimate(near).rate == pytest.approx(MEASURED["flux-dev-1024"].rate / EXTRAPOLATION)
    assert estimate(replace(flux, image_size=8192)) is None  # 64x the tokens
    assert estimate(read_card("digits")) is None  # 1.4 M weights at 8 x 8 pixels against DiT-XL/2 at 256
    assert estimate(replace(flux, family="no-such-family")) is None


def test_a_directory_is_estimated_from_its_safetensors(tmp_path):
    """A model directory's weights come from its headers (workers.families.memory): a tiny PixArt is far below
    the reference, so it has no estimate; the same card with the reference's weights has the reference's rate
    at its size."""
    from workers.models.tiny_pixart import make_tiny_pixart

    card = read_card(make_tiny_pixart(tmp_path / "p"))
    assert card.family == "pixart" and estimate(card) is None
    ref = read_card("pixart-sigma-512")
    same = replace(ref, name="mine", path="", image_size=1024)
    assert estimate(same).rate == pytest.approx(MEASURED["pixart-sigma-512"].rate / 4)
