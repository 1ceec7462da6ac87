"""The latent-to-RGB maps of previews (workers.families.previews)."""

import torch

import dataclasses

from workers.families import preview_map_of
from workers.families.flux import FLUX_VAE
from workers.families.sd3 import SD3_VAE
from workers.families.previews import IDENTITY, SD_VAE, preview_size, to_rgb
from workers.request.cards import read_card


def preview_map(family: str, latent_channels: int, pixel_space: bool):
    """The map of a card of ``family`` with these latents."""
    card = dataclasses.replace(read_card("digits"), family=family, latent_channels=latent_channels,
                               pixel_space=pixel_space)
    return preview_map_of(card)


def test_maps_by_card():
    assert preview_map("dit", 4, False) is SD_VAE and preview_map("pixart", 4, False) is SD_VAE
    assert preview_map("sd3", 16, False) is SD3_VAE and preview_map("flux", 16, False) is FLUX_VAE
    assert preview_map("dit", 1, True) is IDENTITY and preview_map("pixart", 3, True) is IDENTITY
    assert preview_map("dit", 8, False) is None and preview_map("dit", 4, True) is None
    assert preview_map_of(read_card("digits")) is IDENTITY
    assert preview_map_of(read_card("flux-dev-512")) is FLUX_VAE
    for m, c in ((SD_VAE, 4), (SD3_VAE, 16), (FLUX_VAE, 16)):
        assert len(m.weight) == c and all(len(row) == 3 for row in m.weight) and len(m.bias) == 3


def test_a_known_latent_maps_to_its_rgb():
    # SD VAE, a latent of 1 in channel 0 only: RGB = row 0 = (0.3512, 0.2297, 0.3227)
    # -> ((v + 1) * 127.5).round() = (172, 157, 169)
    x = torch.zeros(1, 4, 2, 2)
    x[:, 0] = 1.0
    out = to_rgb(x, SD_VAE)
    assert out.shape == (1, 2, 2, 3) and out.dtype == torch.uint8
    assert out[0, 0, 0].tolist() == [172, 157, 169]
    # FLUX: a zero latent is the bias (-0.0329, -0.0718, -0.0851) -> (123.3, 118.3, 116.6) -> (123, 118, 117)
    assert to_rgb(torch.zeros(1, 16, 1, 1), FLUX_VAE)[0, 0, 0].tolist() == [123, 118, 117]


def test_pixel_space_is_the_estimate_clamped_and_large_latents_shrink():
    x = torch.tensor([[[[-2.0, 0.0], [1.0, 0.5]]]])  # (1, 1, 2, 2): -2 clamps to -1 -> 0; 0.5 -> 191
    assert to_rgb(x, IDENTITY)[0, ..., 0].tolist() == [[0, 128], [255, 191]]
    assert preview_size(128, 128) == (64, 64) and preview_size(32, 96) == (21, 64) and preview_size(8, 8) == (8, 8)
    assert to_rgb(torch.randn(2, 16, 128, 96), SD3_VAE).shape == (2, 64, 48, 3)


def test_a_batch_is_its_rows():
    x = torch.randn(3, 4, 5, 7)
    whole = to_rgb(x, SD_VAE)
    assert torch.equal(whole[1:2], to_rgb(x[1:2], SD_VAE))
