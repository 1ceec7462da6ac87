"""Text encoders: one copy per process for identical weights (across models and families), a new one
for other weights, and the offload device honoured."""

import shutil

import pytest
import torch

from workers.families import encoders
from workers.families.memory import check_fits, components
from workers.loading import load_model
from workers.models.tiny_pixart import make_tiny_pixart
from workers.request.cards import read_card


@pytest.fixture()
def dirs(tmp_path):
    encoders.clear()
    a = make_tiny_pixart(tmp_path / "a", seed=0)
    b = make_tiny_pixart(tmp_path / "b", seed=1)          # another transformer ...
    shutil.rmtree(b / "text_encoder")
    shutil.copytree(a / "text_encoder", b / "text_encoder")  # ... with a's encoder
    c = make_tiny_pixart(tmp_path / "c", seed=2)          # its own encoder
    yield a, b, c
    encoders.clear()


def test_identical_encoder_weights_load_once(dirs):
    a, b, c = (load_model(d) for d in dirs)
    assert a.text_encoder is b.text_encoder and a.transformer is not b.transformer
    assert c.text_encoder is not a.text_encoder
    assert encoders.fingerprint(dirs[0] / "text_encoder") == encoders.fingerprint(dirs[1] / "text_encoder")
    assert encoders.fingerprint(dirs[0] / "text_encoder") != encoders.fingerprint(dirs[2] / "text_encoder")


def test_the_fit_check_counts_a_shared_encoder_once_and_an_offloaded_one_not_at_all(dirs):
    parts = {name: n for name, (n, _) in components(read_card(dirs[0])).items()}
    one, enc = sum(parts.values()), parts["text_encoder"]
    fits = 4 * (2 * one - enc) / 0.85  # float32: exactly what a and b need with the encoder once
    check_fits([str(dirs[0]), str(dirs[1])], ["float32"] * 2, int(fits) + 8, "cuda:0")
    with pytest.raises(MemoryError, match="run the text encoders elsewhere"):
        check_fits([str(dirs[0]), str(dirs[2])], ["float32"] * 2, int(fits) + 8, "cuda:0")
    check_fits([str(dirs[0]), str(dirs[2])], ["float32"] * 2, int(4 * (2 * one - 2 * enc) / 0.85) + 8, "cuda:0",
               encoders_here=False)


def test_encoders_load_on_the_offload_device(dirs):
    model = load_model(dirs[2], encoder_device="meta")  # the plumbing; a real offload is "cpu" or "cuda:1"
    assert next(model.text_encoder.parameters()).device.type == "meta"
    assert next(model.transformer.parameters()).device.type == "cpu"
    assert encoders.encoder_device("cpu") == "cpu"  # outside load_model: with the transformer


def test_loading_an_encoder_draws_no_progress_bar_and_restores_the_setting(monkeypatch, capfd):
    """`generate --model digits-text` once showed transformers' "Loading weights" bar."""
    from transformers import T5EncoderModel
    from transformers.utils import logging as transformers_logging

    from workers.request.cards import MODELS_DIR

    monkeypatch.setattr(encoders, "_SHARED", {})  # a real load, not the cached one
    assert transformers_logging.is_progress_bar_enabled()
    encoders.load_text_encoder(T5EncoderModel, MODELS_DIR / "digits-text" / "text_encoder", "cpu", torch.float32)
    assert "Loading weights" not in capfd.readouterr().err
    assert transformers_logging.is_progress_bar_enabled()
