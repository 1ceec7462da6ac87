"""Model loading: the real DiT-XL/2 hub layouts (with small random weights), bare transformer dirs,
safetensors only, and clear errors."""

import json

import pytest
import torch

from workers.loading import ModelError, load_model

from workers.models.tiny_dit import HUB_TRANSFORMER, write_tiny_dit


@pytest.fixture(scope="module")
def hub_dir(tmp_path_factory):
    """A pipeline directory laid out as facebook/DiT-XL-2-256 is, with random small weights."""
    root = tmp_path_factory.mktemp("hub") / "DiT-XL-2-256"
    transformer = write_tiny_dit(root)
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


def test_a_component_is_refused_before_it_is_built_and_built_without_random_init(hub_dir, tmp_path, monkeypatch):
    """``load_component``: a pickle-only folder is refused before anything is built (a DiT-XL/2-sized
    config took 15 s of random initialisation on a CPU before its refusal); a good one is built without
    torch.nn.init's initialisers (they are back afterwards), every tensor from the file, the computed
    position table as a normal build makes it, and images the same as from a normal build."""
    from diffusers import DiTTransformer2DModel

    from workers import loading

    d = tmp_path / "pickled"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(HUB_TRANSFORMER))
    (d / "diffusion_pytorch_model.bin").write_bytes(b"not even opened")
    built: list[str] = []
    real = loading.instantiate
    monkeypatch.setattr(loading, "instantiate", lambda cls, cfg: built.append(cls.__name__) or real(cls, cfg))
    with pytest.raises(ModelError, match="pickle weights"):
        loading.load_component(DiTTransformer2DModel, d)
    assert built == []
    initialisers = {name: getattr(torch.nn.init, name) for name in loading._INITIALISERS}
    calls: list[str] = []
    monkeypatch.setattr(torch.nn.init, "kaiming_uniform_", lambda t, *a, **k: calls.append("init") or t)
    model = loading.load_component(DiTTransformer2DModel, hub_dir[0] / "transformer")
    assert built == ["DiTTransformer2DModel"] and calls == []  # no initialiser ran while it was built
    assert torch.nn.init.kaiming_uniform_ is not initialisers["kaiming_uniform_"]  # our patch, restored
    monkeypatch.undo()
    assert all(getattr(torch.nn.init, n) is f for n, f in initialisers.items())
    reference = hub_dir[1]
    for k, v in reference.state_dict().items():
        assert torch.equal(model.state_dict()[k], v), k
    x, t, y = torch.randn(2, 4, 8, 8), torch.tensor([10, 500]), torch.tensor([1, 7])
    with torch.no_grad():
        assert torch.equal(model(x, timestep=t, class_labels=y).sample,
                           reference.eval()(x, timestep=t, class_labels=y).sample)


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
