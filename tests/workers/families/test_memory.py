"""Weights' memory from safetensors headers and the worker's fit check, before anything is loaded."""

import pytest
import torch
from safetensors.torch import save_file

from workers.families.memory import check_fits, safetensors_params, weight_bytes, weight_params
from workers.request.cards import read_card


def test_params_come_from_the_headers(tmp_path):
    save_file({"a": torch.zeros(3, 5), "b": torch.zeros(7, dtype=torch.bfloat16)}, str(tmp_path / "w.safetensors"))
    assert safetensors_params(tmp_path / "w.safetensors") == 22


def test_a_pipeline_counts_every_component_it_loads(tmp_path):
    from workers.loading import load_model
    from workers.models.tiny_pixart import make_tiny_pixart

    path = make_tiny_pixart(tmp_path / "p")
    m = load_model(path)
    want = sum(p.numel() for mod in (m.transformer, m.vae, m.text_encoder) for p in mod.parameters())
    assert weight_params(read_card(path)) == want
    assert weight_bytes(read_card(path), "bfloat16") == 2 * want
    assert weight_params(read_card("pixart-sigma-1024")) == 610_856_096 + 4_762_310_656 + 83_653_863


def test_models_that_do_not_fit_name_what_each_needs():
    check_fits(["dit-xl-2-256"], ["bfloat16"], 80 * 2**30, "cuda:0")
    with pytest.raises(MemoryError, match=r"need 11.7 GiB of weights \(dit-xl-2-256 1.6 GiB, pixart-sigma-1024 "
                                          r"10.2 GiB\); cuda:0 has 8.0 GiB free"):
        check_fits(["dit-xl-2-256", "pixart-sigma-1024"], ["bfloat16", "bfloat16"], 8 * 2**30, "cuda:0")


def test_every_builtin_has_a_size():
    from workers.families import builtin_names

    for name in builtin_names():
        assert weight_params(read_card(name)) > 0


def test_flux2_dev_fits_one_80_gb_gpu_with_its_encoder_elsewhere_and_not_with_it():
    """FLUX.2-dev's 32B transformer (60 GiB in bf16) fits an 80 GB H100 (79.1 GiB free) when its 24B Mistral
    encoder runs elsewhere (``[workers] text_encoder_device = "cpu"``); with the encoder on the GPU too, the worker
    refuses to start and says what each part needs."""
    from workers.families.memory import check_fits, weight_bytes
    from workers.request.cards import read_card

    free = int(79.1 * 2**30)
    card = read_card("flux2-dev-1024")
    assert 59 * 2**30 < weight_bytes(card, "bfloat16", encoders=False) < 61 * 2**30
    check_fits(["flux2-dev-1024"], ["bfloat16"], free, "cuda:0", encoders_here=False)
    with pytest.raises(MemoryError, match="text_encoder_device"):
        check_fits(["flux2-dev-1024"], ["bfloat16"], free, "cuda:0")


def test_sana_sprints_builtin_counts_its_transformer_vae_and_gemma():
    """Sana Sprint 1.6B in bf16: transformer + DC-AE 1.92 B (3.6 GiB), Gemma-2-2B 2.61 B (4.9 GiB): 8.5 GiB, which
    fits 12 GiB free (85% of it: 10.2) and not 8 (6.8). Its encoder counts apart from Sana 1600M's (other random
    weights)."""
    card = read_card("sana-sprint-1600m-1024")
    assert weight_params(card, encoders=False) == 1_610_237_472 + 312_250_275
    assert weight_params(card) == 1_610_237_472 + 312_250_275 + 2_614_341_888
    assert 3.5 * 2**30 < weight_bytes(card, "bfloat16", encoders=False) < 3.6 * 2**30
    check_fits(["sana-sprint-1600m-1024"], ["bfloat16"], 12 * 2**30, "cuda:0")
    with pytest.raises(MemoryError, match=r"need 8.5 GiB of weights \(sana-sprint-1600m-1024 8.5 GiB\)"):
        check_fits(["sana-sprint-1600m-1024"], ["bfloat16"], 8 * 2**30, "cuda:0")
    with pytest.raises(MemoryError, match=r"need 16.9 GiB .*sana-1600m-1024 8.4 GiB"):
        check_fits(["sana-sprint-1600m-1024", "sana-1600m-1024"], ["bfloat16"] * 2, 16 * 2**30, "cuda:0")
