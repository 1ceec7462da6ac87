"""Model cards of pipeline directories no family reads: refused from model_index.json alone, at once."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from workers.request.cards import CardError, read_card, supported_pipelines


def _sdxl_dir(tmp_path):
    """A pipeline directory as stabilityai/stable-diffusion-xl-base-1.0 lays it out (only the JSON a card reader
    could look at): a UNet, which no family reads."""
    d = tmp_path / "sdxl"
    (d / "unet").mkdir(parents=True)
    (d / "model_index.json").write_text(json.dumps({"_class_name": "StableDiffusionXLPipeline",
                                                    "unet": ["diffusers", "UNet2DConditionModel"]}))
    (d / "unet" / "config.json").write_text(json.dumps({"_class_name": "UNet2DConditionModel"}))
    return d


def test_the_supported_pipelines_are_the_families_own():
    assert supported_pipelines() == ["DiTPipeline", "PixArtSigmaPipeline", "PixArtAlphaPipeline",
                                     "StableDiffusion3Pipeline", "FluxPipeline", "FluxKontextPipeline",
                                     "Flux2KleinPipeline", "Flux2Pipeline", "QwenImagePipeline", "QwenImageEditPipeline",
                                     "QwenImageEditPlusPipeline", "ZImagePipeline",
                                     "SanaPipeline", "SanaSprintPipeline"]


def test_a_pipeline_no_family_reads_is_named_with_the_supported_ones(tmp_path):
    with pytest.raises(CardError) as e:
        read_card(_sdxl_dir(tmp_path))
    assert str(e.value).startswith("StableDiffusionXLPipeline is not supported; supported: DiTPipeline, "
                                    "PixArtSigmaPipeline")
    assert "class-conditional" not in str(e.value)  # not the DiT reader's message about its transformer


def test_generate_refuses_it_before_importing_torch(tmp_path):
    """The real CLI: one line, exit 2, and torch never imported (no 9 s wait for the refusal)."""
    code = ("import sys; from dit_serve.cli import main; c = main(sys.argv[1:]); "
            "print('torch' in sys.modules); sys.exit(c)")
    proc = subprocess.run([sys.executable, "-c", code, "generate", "--model", str(_sdxl_dir(tmp_path)),
                           "--prompt", "a cat", "--out", str(tmp_path / "o")], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("dit-serve: error: StableDiffusionXLPipeline is not supported; supported: DiTPipeline")
    assert proc.stderr.count("\n") == 1 and proc.stdout.strip() == "False"
    assert not (tmp_path / "o").exists()
