"""`dit-serve generate`: outputs, determinism across batch sizes, and one-line errors with exit 2."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from PIL import Image

from dit_serve.cli import main


def _run(tmp_path, *extra, out="out"):
    return main(["generate", "--model", "digits", "--out", str(tmp_path / out), *extra])


def test_generate_writes_pngs_grid_and_manifest(tmp_path):
    code = _run(tmp_path, "--labels", "0,1,seven", "--num-per-label", "2", "--sampler", "ddim",
                "--steps", "10", "--guidance", "1.5", "--seed", "5")
    assert code == 0
    out = tmp_path / "out"
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["model"] == "digits"
    assert [e["label"] for e in manifest["images"]] == [0, 0, 1, 1, 7, 7]
    assert [e["seed"] for e in manifest["images"]] == [5, 6, 7, 8, 9, 10]
    params = manifest["params"]
    assert (params["sampler"], params["steps"], params["guidance"], params["warnings"]) == ("ddim", 10, 1.5, [])
    assert manifest["job"] is None and manifest["state"] == "done"
    for e in manifest["images"]:
        assert Image.open(out / e["file"]).size == (8, 8)
    grid = Image.open(out / "grid.png")
    assert grid.size[0] >= 2 * 64 and grid.size[1] >= 3 * 64  # upscaled for viewing
    assert not [p for p in os.listdir(out) if p.startswith(".partial")]


def test_an_image_does_not_depend_on_its_batch(tmp_path):
    """Image i uses seed + i: generated alone or among others, it is the same image."""
    _run(tmp_path, "--labels", "3,4,5,6", "--num-per-label", "3", "--steps", "8", "--seed", "0", out="batch")
    _run(tmp_path, "--labels", "5", "--steps", "8", "--seed", "6", out="alone")
    batch = json.loads((tmp_path / "batch" / "manifest.json").read_text())["images"]
    (entry,) = [e for e in batch if e["seed"] == 6]
    a = np.asarray(Image.open(tmp_path / "batch" / entry["file"]))
    b = np.asarray(Image.open(tmp_path / "alone" / "00000_label5.png"))
    assert np.array_equal(a, b)


def _exit_code(argv):
    try:
        return main(argv)
    except SystemExit as e:  # argparse's own type errors
        return e.code


@pytest.mark.parametrize("args, message", [
    (["--model", "no-such-model", "--labels", "1"], "unknown model 'no-such-model'"),
    (["--labels", "10"], "label 10 is outside"),
    (["--labels", "eleven"], "unknown class name 'eleven'"),
    (["--labels", "1", "--steps", "0"], "--steps must be between 1 and 1000"),
    (["--labels", "1", "--steps", "1001"], "--steps must be between 1 and 1000"),
    (["--labels", "1", "--sampler", "plms"], "unknown sampler 'plms'; choose one of: ddim"),
    (["--labels", "1", "--guidance", "-1"], "--guidance must be >= 0"),
    (["--labels", "1", "--steps", "many"], "invalid int value"),
])
def test_bad_input_is_one_line_exit_2_and_writes_nothing(tmp_path, capsys, args, message):
    out = tmp_path / "out"
    model = [] if "--model" in args else ["--model", "digits"]
    assert _exit_code(["generate", "--out", str(out), *model, *args]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1 and "Traceback" not in err
    assert not out.exists() or not any(out.iterdir())


def test_unwritable_output_directory(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("a file, not a directory")
    assert main(["generate", "--labels", "1", "--out", str(blocker / "sub")]) == 2
    assert "is not writable" in capsys.readouterr().err


def test_pickle_model_dir_exit_2(tmp_path, capsys):
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"norm_type": "ada_norm_zero", "num_embeds_ada_norm": 10}))
    (d / "diffusion_pytorch_model.bin").write_bytes(b"\x80\x04")
    assert main(["generate", "--model", str(d), "--labels", "1", "--out", str(tmp_path / "o")]) == 2
    assert "pickle" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_console_script_has_no_traceback(tmp_path):
    """The installed entry point: one line on stderr, exit code 2."""
    proc = subprocess.run([sys.executable, "-m", "dit_serve.cli", "generate", "--labels", "1", "--steps", "0",
                           "--out", str(tmp_path / "o")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "Traceback" not in proc.stderr


def test_generate_in_fp8_writes_digits_close_to_the_models_dtype(tmp_path, monkeypatch, capsys):
    """--precision fp8 goes through the same loader as the service; on a GPU without FP8 it is a one-line
    error naming the reason (faked here: an A100's capability)."""
    args = ("--labels", "3,8", "--steps", "10", "--seed", "2", "--device", "cpu")
    assert _run(tmp_path, *args, out="plain") == 0 and _run(tmp_path, *args, "--precision", "fp8", out="fp8") == 0
    for name in ("00000_label3.png", "00001_label8.png"):
        a, b = (np.asarray(Image.open(tmp_path / d / name), dtype=np.float32) for d in ("plain", "fp8"))
        assert 0.0 < np.abs(a - b).mean() < 8.0  # of 255: FP8 changes the pixels a little, not the digit
    import torch

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "NVIDIA A100-SXM4-80GB")
    capsys.readouterr()
    assert _run(tmp_path, *args[:-1], "cuda", "--precision", "fp8", out="a100") != 0
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "A100-SXM4-80GB (compute capability 8.0) has no FP8 tensor cores" in err


def test_a_failed_run_leaves_no_folder_it_created(tmp_path, monkeypatch):
    """The engine failing mid-run: neither the staging folder nor the new --out folder stays behind."""
    from workers.engine import Engine

    def fail(*_, **__):
        raise RuntimeError("the engine failed")

    monkeypatch.setattr(Engine, "generate", fail)
    out = tmp_path / "fresh"
    with pytest.raises(RuntimeError, match="the engine failed"):
        main(["generate", "--model", "digits", "--labels", "1", "--steps", "2", "--out", str(out)])
    assert not out.exists()


def test_generate_edits_a_local_image_and_records_its_hash(tmp_path, capsys):
    """--image (and --mask, --strength) locally: the manifest records each input's sha256; outside the mask the
    source's pixels are kept exactly; bad input is one line, exit 2, nothing written."""
    import hashlib

    Image.new("L", (8, 8), 70).save(tmp_path / "in.png")
    mask = Image.new("L", (8, 8), 0)
    mask.paste(255, (0, 0, 4, 8))
    mask.save(tmp_path / "mask.png")
    Image.new("L", (9, 8), 0).save(tmp_path / "wide.png")
    code = main(["generate", "--model", "digits-text", "--prompt", "an eight", "--image", str(tmp_path / "in.png"),
                 "--mask", str(tmp_path / "mask.png"), "--steps", "4", "--seed", "1", "--out", str(tmp_path / "out")])
    assert code == 0
    params = json.loads((tmp_path / "out" / "manifest.json").read_text())["params"]
    assert params["image"]["sha256"] == hashlib.sha256((tmp_path / "in.png").read_bytes()).hexdigest()
    assert params["mask"]["sha256"] == hashlib.sha256((tmp_path / "mask.png").read_bytes()).hexdigest()
    assert params["strength"] == 1.0 and params["image"]["id"] is None
    assert (np.asarray(Image.open(tmp_path / "out" / "00000.png"))[:, 4:] == 70).all()
    capsys.readouterr()
    # --image repeats (an instruction edit's reference images): a second one is a second image, refused here
    image = ["--image", str(tmp_path / "in.png")]
    for extra, message in (([*image, "--mask", str(tmp_path / "wide.png")], "--mask: 9x8 differs from the image's 8x8"),
                           ([*image, "--strength", "0"], "--strength must be a number in (0, 1]"),
                           (["--image", str(tmp_path / "nope.png")], "--image: cannot read"),
                           ([*image, *image], "--image: model 'digits-text' takes one input image; 2 were given")):
        args = ["generate", "--model", "digits-text", "--prompt", "an eight", *extra, "--out", str(tmp_path / "bad")]
        assert _exit_code(args) == 2
        err = capsys.readouterr().err.strip()
        assert message in err and len(err.splitlines()) == 1, err
        assert not (tmp_path / "bad").exists()


THICK = os.path.join(os.path.dirname(__file__), "..", "..", "workers", "models", "digits-text-thick.safetensors")


def test_generate_applies_an_adapter_file_and_records_it(tmp_path):
    """--lora FILE[:SCALE]: the shipped ``thick`` adapter thickens the same prompts and seeds' digits; at scale 0 the
    images are the plain ones exactly; the manifest records the file's name, scale and SHA-256."""
    import hashlib

    from workers.models.train_digits_lora import ink

    def run(out, *lora):
        code = main(["generate", "--model", "digits-text", "--prompt", "a handwritten seven", "--prompt",
                     "the number 3", "--num-per-prompt", "3", "--steps", "10", "--seed", "3", *lora,
                     "--out", str(tmp_path / out)])
        assert code == 0
        manifest = json.loads((tmp_path / out / "manifest.json").read_text())
        pixels = np.stack([np.asarray(Image.open(tmp_path / out / e["file"]), np.float32) / 127.5 - 1
                           for e in manifest["images"]])
        return pixels, manifest["params"]["loras"]

    plain, none = run("plain")
    thick, used = run("thick", "--lora", THICK)
    zero, _ = run("zero", "--lora", f"{THICK}:0")
    assert none == [] and (zero == plain).all()
    assert ink(thick).mean() > ink(plain).mean() + 0.03, (ink(thick).mean(), ink(plain).mean())
    sha = hashlib.sha256(open(THICK, "rb").read()).hexdigest()
    assert used == [{"name": "digits-text-thick.safetensors", "scale": 1.0, "sha256": sha}]


def test_generate_refuses_a_bad_adapter_in_one_line(tmp_path, capsys):
    import torch

    from safetensors.torch import save_file

    torch.save({"x": torch.zeros(2)}, tmp_path / "pickled.safetensors")
    save_file({"transformer_blocks.0.attn1.to_q.lora_A.weight": torch.zeros(4, 7),  # the linear takes 128
               "transformer_blocks.0.attn1.to_q.lora_B.weight": torch.zeros(128, 4)}, tmp_path / "narrow.safetensors")
    prompt = ["--model", "digits-text", "--prompt", "a 3"]
    for extra, message in (
            (["--lora", str(tmp_path / "none.safetensors")], "--lora: cannot read"),
            (["--lora", str(tmp_path / "pickled.safetensors")], "is a pickle (torch.save) file"),
            (["--lora", f"{THICK}:5"], "scale 5 is outside [-4, 4]"),
            (["--lora", THICK] * 5, "--lora: at most 4 adapters, got 5"),
            (["--lora", str(tmp_path / "narrow.safetensors")], "transformer_blocks.0.attn1.to_q")):
        args = ["generate", *prompt, *extra, "--out", str(tmp_path / "bad")]
        assert _exit_code(args) == 2
        err = capsys.readouterr().err.strip()
        assert message in err and len(err.splitlines()) == 1 and "Traceback" not in err, err
        assert not (tmp_path / "bad").exists()
