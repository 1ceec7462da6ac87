"""Model loading: the real DiT-XL/2 hub layouts (with small random weights), bare transformer dirs,
safetensors only, and clear errors."""

import json

import pytest
import torch
from diffusers import AutoencoderKL, DiTTransformer2DModel
from safetensors.torch import save_file

from workers.loading import ModelError, load_model

# a DiT-XL/2-shaped config shrunk to run on a CPU: the keys are the real hub config's
# (facebook/DiT-XL-2-256 transformer/config.json, class Transformer2DModel)
HUB_TRANSFORMER = {
    "_class_name": "Transformer2DModel", "_diffusers_version": "0.12.0.dev0",
    "activation_fn": "gelu-approximate", "attention_bias": True, "attention_head_dim": 8,
    "cross_attention_dim": None, "dropout": 0.0, "in_channels": 4, "norm_elementwise_affine": False,
    "norm_num_groups": 32, "norm_type": "ada_norm_zero", "num_attention_heads": 2,
    "num_embeds_ada_norm": 1000, "num_layers": 2, "num_vector_embeds": None,
    "only_cross_attention": False, "out_channels": 8, "patch_size": 2, "sample_size": 8,
    "upcast_attention": False, "use_linear_projection": False,
}
HUB_VAE = {
    "_class_name": "AutoencoderKL", "act_fn": "silu", "block_out_channels": [32, 32],
    "down_block_types": ["DownEncoderBlock2D"] * 2, "in_channels": 3, "latent_channels": 4,
    "layers_per_block": 1, "norm_num_groups": 32, "out_channels": 3, "sample_size": 16,
    "up_block_types": ["UpDecoderBlock2D"] * 2,
}
HUB_SCHEDULER = {"_class_name": "DDIMScheduler", "beta_end": 0.02, "beta_schedule": "linear",
                 "beta_start": 0.0001, "clip_sample": False, "num_train_timesteps": 1000,
                 "prediction_type": "epsilon", "set_alpha_to_one": True, "steps_offset": 0,
                 "trained_betas": None}
ID2LABEL = {"0": "tench, Tinca tinca", "1": "goldfish, Carassius auratus", "207": "golden retriever",
            "360": "otter", "999": "toilet tissue, toilet paper, bathroom tissue"}


def _save(model, folder, config, name="diffusion_pytorch_model.safetensors"):
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(folder / name))


def _fields(cls, cfg):
    import inspect
    return {k: v for k, v in cfg.items() if k in inspect.signature(cls.__init__).parameters}


@pytest.fixture(scope="module")
def hub_dir(tmp_path_factory):
    """A pipeline directory laid out as facebook/DiT-XL-2-256 is, with random small weights."""
    root = tmp_path_factory.mktemp("DiT-XL-2-256")
    torch.manual_seed(0)
    transformer = DiTTransformer2DModel(**_fields(DiTTransformer2DModel, HUB_TRANSFORMER))
    vae = AutoencoderKL(**_fields(AutoencoderKL, HUB_VAE))
    _save(transformer, root / "transformer", HUB_TRANSFORMER)
    _save(vae, root / "vae", HUB_VAE)
    (root / "scheduler").mkdir()
    (root / "scheduler" / "scheduler_config.json").write_text(json.dumps(HUB_SCHEDULER))
    (root / "model_index.json").write_text(json.dumps({
        "_class_name": "DiTPipeline", "_diffusers_version": "0.12.0.dev0", "id2label": ID2LABEL,
        "scheduler": ["diffusers", "DDIMScheduler"], "transformer": ["diffusers", "Transformer2DModel"],
        "vae": ["diffusers", "AutoencoderKL"]}))
    return root, transformer


def test_hub_layout_loads_with_weights_and_labels(hub_dir):
    root, reference = hub_dir
    m = load_model(root)
    assert m.num_classes == 1000 and m.null_class == 1000
    assert m.latent_shape == (4, 8, 8) and m.image_size == 16 and m.learned_sigma
    assert m.vae is not None and m.vae_scale == pytest.approx(0.18215)
    for k, v in reference.state_dict().items():
        assert torch.equal(m.transformer.state_dict()[k], v), k
    assert m.label_id("golden retriever") == 207
    assert m.label_id("Goldfish") == 1 and m.label_id("toilet paper") == 999  # any synonym
    assert m.label_id("360") == 360 and m.label_id(5) == 5


def test_label_errors_name_the_problem(hub_dir):
    m = load_model(hub_dir[0])
    with pytest.raises(ModelError, match="outside .* 0..999"):
        m.label_id(1000)
    with pytest.raises(ModelError, match="unknown class name 'unicorn'.*tench"):
        m.label_id("unicorn")


def test_bare_transformer_dir(hub_dir, tmp_path):
    root, _ = hub_dir
    m = load_model(root / "transformer")
    assert m.vae is None and m.num_classes == 1000 and m.schedule.num_train_timesteps == 1000


def test_pickle_weights_are_refused(tmp_path):
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(HUB_TRANSFORMER))
    (d / "diffusion_pytorch_model.bin").write_bytes(b"not even opened")
    with pytest.raises(ModelError, match="pickle weights .*refused"):
        load_model(d)


@pytest.mark.parametrize("make, message", [
    (lambda p: None, "unknown model"),
    (lambda p: p.mkdir(), "neither model_index.json"),
    (lambda p: (p.mkdir(), (p / "config.json").write_text(json.dumps(HUB_TRANSFORMER))), "no weights"),
    (lambda p: (p.mkdir(), (p / "config.json").write_text("{oops")), "not valid JSON"),
    (lambda p: (p.mkdir(), (p / "config.json").write_text(json.dumps({"norm_type": "layer_norm"}))),
     "not a class-conditional DiT"),
])
def test_bad_directories(tmp_path, make, message):
    path = tmp_path / "m"
    make(path)
    with pytest.raises(ModelError, match=message):
        load_model(path)


def test_weights_that_do_not_match_the_config(hub_dir, tmp_path):
    d = tmp_path / "m"
    cfg = dict(HUB_TRANSFORMER, num_layers=3)
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg))
    (d / "diffusion_pytorch_model.safetensors").write_bytes(
        (hub_dir[0] / "transformer" / "diffusion_pytorch_model.safetensors").read_bytes())
    with pytest.raises(ModelError, match="do not match"):
        load_model(d)


def test_digits_is_shipped():
    m = load_model("digits")
    assert m.num_classes == 10 and m.latent_shape == (1, 8, 8) and m.vae is None
    assert m.label_id("seven") == 7 and m.defaults["sampler"] == "ddim"


@pytest.mark.slow
def test_builtin_dit_xl_architecture():
    m = load_model("dit-xl-2-256", device="meta")
    assert m.latent_shape == (4, 32, 32) and m.image_size == 256 and m.num_classes == 1000
    cfg = m.transformer.config
    assert (cfg.num_layers, cfg.num_attention_heads * cfg.attention_head_dim, cfg.patch_size) == (28, 1152, 2)
    # 675M in the DiT paper; diffusers' port keeps a timestep/label embedder in each block: ~750M
    assert sum(p.numel() for p in m.transformer.parameters()) == pytest.approx(749.8e6, rel=0.01)
