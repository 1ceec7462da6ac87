"""Adapter files: the diffusers/PEFT keys with their alphas, kohya FLUX.1 files against diffusers' converter, kohya
SD3 files against diffusers' converter of SD3's original checkpoints, and the errors that name what is wrong."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from tests.workers.lora.cases import (flux_inputs, merged, out, random_adapter, rows_of, sd3_inputs, tiny_flux,
                                      tiny_sd3)
from workers.lora import LoraBank, LoraError, apply_lora, from_state_dict, read_adapter, validate

TOL = dict(rtol=1e-4, atol=1e-5)


def _delta(w) -> torch.Tensor:
    """A module's weight change at scale 1: scale * B @ A (out, in)."""
    return w.scale * (w.b.double() @ w.a.double())


def _run_one(transformer, adapter, inputs, scale=1.0):
    """Row 0 of ``inputs`` through ``transformer`` wrapped with ``adapter`` at ``scale`` in a bank's slot 1."""
    bank = LoraBank(transformer, slots=1, max_rank=8, per_request=1)
    bank.load(1, "a", adapter)
    apply_lora(transformer, bank)
    bank.row_slots, bank.row_scales = bank.row([("a", scale)])[0][None], bank.row([("a", scale)])[1][None]
    try:
        return out(transformer, rows_of(inputs, 0))
    finally:
        bank.row_slots = bank.row_scales = None


# -- diffusers / PEFT ----------------------------------------------------------------------------------------
def test_peft_keys_with_alphas_from_tensors_and_metadata(tmp_path):
    """Three files of one adapter: alphas as ``<module>.alpha`` tensors; in diffusers' metadata (lora_alpha plus an
    alpha_pattern entry, keys prefixed as a pipeline's save_lora_weights writes them); none (scale 1). Each read
    gives the same deltas, and the wrapped transformer equals it with the adapter merged."""
    transformer = tiny_flux()
    adapter = random_adapter(transformer, 5)  # every linear, alpha / r = 2
    names = list(adapter.weights)
    weights = {f"transformer.{m}.lora_{p}.weight": t.contiguous() for m, w in adapter.weights.items()
               for p, t in (("A", w.a), ("B", w.b))}
    alphas = {f"transformer.{m}.alpha": torch.tensor(2.0 * w.rank) for m, w in adapter.weights.items()}
    save_file({**weights, **alphas}, tmp_path / "tensors.safetensors")
    config = {"transformer.r": 4, "transformer.lora_alpha": 8,
              "transformer.alpha_pattern": {names[1]: 6.0}}  # names[1] has rank 3 (cases.random_adapter)
    save_file(weights, tmp_path / "metadata.safetensors", metadata={"lora_adapter_metadata": json.dumps(config)})
    save_file({k.replace("transformer.", "base_model.model.", 1): v for k, v in weights.items()},
              tmp_path / "bare.safetensors")
    by_tensors = read_adapter(tmp_path / "tensors.safetensors")
    by_metadata = read_adapter(tmp_path / "metadata.safetensors")
    bare = read_adapter(tmp_path / "bare.safetensors")
    assert by_tensors.format == "peft" and set(by_tensors.weights) == set(names)
    for m in names:
        assert by_tensors.weights[m].scale == 2.0 and bare.weights[m].scale == 1.0
    assert by_metadata.weights[names[0]].scale == 8 / 4 and by_metadata.weights[names[1]].scale == 6 / 3
    assert by_metadata.weights[names[3]].scale == 8 / 3  # lora_alpha over the module's own rank
    validate(by_tensors, transformer, max_rank=4)
    inputs = flux_inputs(1)
    want = out(merged(transformer, [(by_tensors, 0.7)]), inputs)  # before _run_one wraps the transformer
    torch.testing.assert_close(_run_one(transformer, by_tensors, inputs, 0.7), want, **TOL)


# -- kohya FLUX.1 ---------------------------------------------------------------------------------------------
def _kohya_pair(g, fan_in, fan_out, rank, alpha=None, parts=()):
    """lora_down (rank, in), lora_up (out, rank), alpha; ``parts``: up block-diagonal over row parts of these
    sizes, rank / len(parts) each (a LoRA trained on the parts apart, saved fused)."""
    down, up = torch.randn(rank, fan_in, generator=g) * 0.1, torch.randn(fan_out, rank, generator=g) * 0.1
    if parts:
        mask, k, row = torch.zeros(fan_out, rank), rank // len(parts), 0
        for j, rows in enumerate(parts):
            mask[row:row + rows, j * k:(j + 1) * k] = 1
            row += rows
        up = up * mask
    out = {"lora_down.weight": down, "lora_up.weight": up}
    if alpha is not None:
        out["alpha"] = torch.tensor(float(alpha))
    return out


def _named(name, pair):
    return {f"{name}.{k}": v for k, v in pair.items()}


@pytest.mark.parametrize("sparse", [False, True])
def test_a_flux_single_blocks_fused_linear_splits_as_diffusers_converter_does(sparse):
    """At FLUX.1-dev's widths (3 x 3072 + 12288 rows), where diffusers' converter handles linear1 itself: the same
    deltas (compared on probe vectors: the (21504, 3072) product is not made), and the same ranks."""
    from diffusers.loaders.lora_conversion_utils import _convert_kohya_flux_lora_to_diffusers

    g = torch.Generator().manual_seed(0)
    state = _named("lora_unet_single_blocks_0_linear1",
                   _kohya_pair(g, 3072, 7 * 3072, 8 if sparse else 4, alpha=2,
                               parts=(3072, 3072, 3072, 12288) if sparse else ()))
    ours = from_state_dict(dict(state))
    theirs = _convert_kohya_flux_lora_to_diffusers(dict(state))
    probe = torch.randn(3072, 3, generator=g, dtype=torch.float64)
    for target in ("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp"):
        w = ours.weights[f"single_transformer_blocks.0.{target}"]
        a, b = (theirs[f"transformer.single_transformer_blocks.0.{target}.lora_{p}.weight"].double() for p in "AB")
        torch.testing.assert_close(w.scale * w.b.double() @ (w.a.double() @ probe), b @ (a @ probe))
        assert w.rank == a.shape[0] == (2 if sparse else 4)


def _tiny_flux_kohya(g):
    """A kohya file on every linear of the tiny FLUX.1 (D = 16, MLP 64), alphas mixed (one absent)."""
    d, mlp = 16, 64
    parts = {"double_blocks_0_img_attn_qkv": (d, 3 * d), "double_blocks_0_img_attn_proj": (d, d),
             "double_blocks_0_img_mlp_0": (d, mlp), "double_blocks_0_img_mlp_2": (mlp, d),
             "double_blocks_0_img_mod_lin": (d, 6 * d), "double_blocks_0_txt_attn_qkv": (d, 3 * d),
             "double_blocks_0_txt_attn_proj": (d, d), "double_blocks_0_txt_mlp_0": (d, mlp),
             "double_blocks_0_txt_mlp_2": (mlp, d), "double_blocks_0_txt_mod_lin": (d, 6 * d),
             "single_blocks_0_linear1": (d, 3 * d + mlp), "single_blocks_0_linear2": (d + mlp, d),
             "single_blocks_0_modulation_lin": (d, 3 * d), "img_in": (16, d), "txt_in": (32, d),
             "time_in_in_layer": (256, d), "time_in_out_layer": (d, d), "guidance_in_in_layer": (256, d),
             "vector_in_in_layer": (32, d), "final_layer_linear": (d, 16), "final_layer_adaLN_modulation_1": (d, 2 * d)}
    state = {}
    for i, (name, (fan_in, fan_out)) in enumerate(parts.items()):
        state.update(_named(f"lora_unet_{name}", _kohya_pair(g, fan_in, fan_out, 4, alpha=None if i == 3 else 1 + i)))
    return state


def test_a_flux_kohya_file_maps_to_diffusers_converters_deltas_and_runs_on_the_transformer():
    from diffusers.loaders.lora_conversion_utils import _convert_kohya_flux_lora_to_diffusers

    g = torch.Generator().manual_seed(1)
    state = _tiny_flux_kohya(g)
    adapter = from_state_dict(dict(state))
    assert adapter.format == "kohya-flux"
    # all but linear1 (whose widths the converter fixes at FLUX.1-dev's: the test above) through diffusers' converter
    linear1 = {k: v for k, v in state.items() if "single_blocks_0_linear1" in k}
    theirs = _convert_kohya_flux_lora_to_diffusers({k: v for k, v in state.items() if k not in linear1})
    modules = {k.removeprefix("transformer.").rpartition(".lora_")[0] for k in theirs}
    for m in modules:
        a, b = (theirs[f"{p}{m}.lora_{x}.weight"] for x in "AB" for p in ("transformer.", "")
                if f"{p}{m}.lora_{x}.weight" in theirs)
        torch.testing.assert_close(_delta(adapter.weights[m]), b.double() @ a.double())
    # linear1 (the 11th part, alpha 11): q, k, v and the MLP's rows of its product, alpha / r = 11 / 4
    full = 11 / 4 * linear1["lora_unet_single_blocks_0_linear1.lora_up.weight"].double() @ \
        linear1["lora_unet_single_blocks_0_linear1.lora_down.weight"].double()
    split = [_delta(adapter.weights[f"single_transformer_blocks.0.{t}"])
             for t in ("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp")]
    torch.testing.assert_close(torch.cat(split), full)
    assert set(adapter.weights) == modules | {f"single_transformer_blocks.0.{t}"
                                              for t in ("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp")}
    transformer = tiny_flux()
    validate(adapter, transformer, max_rank=4)
    inputs = flux_inputs(1)
    want = out(merged(transformer, [(adapter, 0.9)]), inputs)
    torch.testing.assert_close(_run_one(transformer, adapter, inputs, 0.9), want, **TOL)


# -- kohya SD3 ------------------------------------------------------------------------------------------------
def _sd3_original_modules() -> dict[str, tuple[int, int]]:
    """The tiny SD3.5's linears under their original (MMDiT) names, (in, out), written from its config (D = 16,
    2 blocks, block 0 with the second attention (MMDiT-X), block 1 the last: its context part modulation only)."""
    d = 16
    mods = {"context_embedder": (64, d), "t_embedder.mlp.0": (256, d), "t_embedder.mlp.2": (d, d),
            "y_embedder.mlp.0": (64, d), "y_embedder.mlp.2": (d, d), "final_layer.linear": (d, 64),
            "final_layer.adaLN_modulation.1": (d, 2 * d)}
    for i in range(2):
        x, c = f"joint_blocks.{i}.x_block", f"joint_blocks.{i}.context_block"
        mods.update({f"{x}.attn.qkv": (d, 3 * d), f"{x}.attn.proj": (d, d), f"{x}.mlp.fc1": (d, 4 * d),
                     f"{x}.mlp.fc2": (4 * d, d), f"{x}.adaLN_modulation.1": (d, (9 if i == 0 else 6) * d),
                     f"{c}.attn.qkv": (d, 3 * d), f"{c}.adaLN_modulation.1": (d, (6 if i == 0 else 2) * d)})
    mods.update({"joint_blocks.0.x_block.attn2.qkv": (d, 3 * d), "joint_blocks.0.x_block.attn2.proj": (d, d),
                 "joint_blocks.0.context_block.attn.proj": (d, d), "joint_blocks.0.context_block.mlp.fc1": (d, 4 * d),
                 "joint_blocks.0.context_block.mlp.fc2": (4 * d, d)})
    return mods


class _Checkpoint(dict):
    """An original SD3 checkpoint holding only weight deltas: every other tensor diffusers' converter moves reads
    as zeros (the conversion is linear: the deltas it makes are the converted deltas)."""

    def pop(self, key, *default):
        return super().pop(key) if key in self else torch.zeros(6)


def test_an_sd3_kohya_file_maps_as_diffusers_converts_sd3s_original_weights():
    from diffusers.loaders.single_file_utils import convert_sd3_transformer_checkpoint_to_diffusers

    g = torch.Generator().manual_seed(2)
    state, deltas = {}, _Checkpoint()
    for i, (module, (fan_in, fan_out)) in enumerate(_sd3_original_modules().items()):
        pair = _kohya_pair(g, fan_in, fan_out, 4, alpha=None if i == 2 else 2 + i % 3)
        state.update(_named("lora_unet_" + module.replace(".", "_"), pair))
        scale = 1.0 if "alpha" not in pair else float(pair["alpha"]) / 4
        deltas[f"{module}.weight"] = scale * pair["lora_up.weight"].double() @ pair["lora_down.weight"].double()
    adapter = from_state_dict(state)
    assert adapter.format == "kohya-sd3"
    converted = convert_sd3_transformer_checkpoint_to_diffusers(deltas)
    converted = {k.removesuffix(".weight"): v for k, v in converted.items() if v.ndim == 2}
    assert set(adapter.weights) == set(converted)
    for m, want in converted.items():
        torch.testing.assert_close(_delta(adapter.weights[m]), want)
    transformer = tiny_sd3()
    validate(adapter, transformer, max_rank=4)
    inputs = sd3_inputs(1)
    want = out(merged(transformer, [(adapter, 1.3)]), inputs)
    torch.testing.assert_close(_run_one(transformer, adapter, inputs, 1.3), want, **TOL)


# -- errors ---------------------------------------------------------------------------------------------------
def test_a_pickle_file_is_refused_unread(tmp_path):
    torch.save({"transformer.x.lora_A.weight": torch.zeros(1, 1)}, tmp_path / "adapter.safetensors")
    with pytest.raises(LoraError, match="pickle"):
        read_adapter(tmp_path / "adapter.safetensors")
    (tmp_path / "junk.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}")
    with pytest.raises(LoraError, match="not a readable safetensors"):
        read_adapter(tmp_path / "junk.safetensors")
    save_file({"transformer.x.lora_A.weight": torch.zeros(1, 1)}, tmp_path / "big.safetensors")
    with pytest.raises(LoraError, match="limited to 10"):
        read_adapter(tmp_path / "big.safetensors", max_bytes=10)


def test_a_safetensors_header_whose_length_starts_like_a_pickle_is_read(tmp_path):
    """A safetensors file's first byte is its header length's low byte: 0x80 for a header of 128, 384, ... bytes,
    which is also a bare pickle's first byte. Such a file is read (here and by the API's check); pickles of every
    protocol are still refused."""
    import io
    import pickle

    from safetensors.torch import save

    from dit_serve.server.loras import AdapterError, LoraPolicy, check_bytes
    from workers.request.weights import is_pickle

    found = None
    for pad in range(400):  # metadata that pads the header until its length's low byte is 0x80
        data = save({"transformer.x.lora_A.weight": torch.ones(2, 3), "transformer.x.lora_B.weight": torch.ones(4, 2)},
                    metadata={"pad": "p" * pad})
        if data[0] == 0x80:
            found = data
            break
    assert found is not None
    (tmp_path / "a.safetensors").write_bytes(found)
    adapter = read_adapter(tmp_path / "a.safetensors")
    assert adapter.weights["x"].rank == 2 and not is_pickle(found[:9], len(found))
    check_bytes(found, LoraPolicy(slots=2))  # the API's check passes it too
    for protocol in range(2, pickle.HIGHEST_PROTOCOL + 1):
        blob = pickle.dumps({"transformer.x.lora_A.weight": [[0.0]]}, protocol=protocol)
        (tmp_path / "p.safetensors").write_bytes(blob)
        with pytest.raises(LoraError, match="pickle"):
            read_adapter(tmp_path / "p.safetensors")
        with pytest.raises(AdapterError, match="pickle"):
            check_bytes(blob, LoraPolicy(slots=2))
    zipped = io.BytesIO()
    torch.save({"w": torch.zeros(1)}, zipped)
    assert is_pickle(zipped.getvalue()[:9], len(zipped.getvalue()))


def test_keys_the_engine_cannot_serve_are_named():
    a, b = torch.zeros(2, 16), torch.zeros(16, 2)
    cases = {"text_encoder.layer.lora_A.weight": "text_encoder", "transformer.x.lora_magnitude_vector": "magnitude",
             "lora_te1_text_model_encoder_layers_0_mlp_fc1.lora_down.weight": "lora_te1"}
    for key, named in cases.items():
        with pytest.raises(LoraError, match=named):
            from_state_dict({key: a})
    with pytest.raises(LoraError, match="'x' has no lora_B"):
        from_state_dict({"transformer.x.lora_A.weight": a})
    with pytest.raises(LoraError, match="rank 2 and lora_B rank 3"):
        from_state_dict({"transformer.x.lora_A.weight": a, "transformer.x.lora_B.weight": torch.zeros(16, 3)})
    with pytest.raises(LoraError, match="lora_unet_joint_blocks_0_x_block_attn_ln_q"):
        from_state_dict(_named("lora_unet_joint_blocks_0_x_block_attn_ln_q", {"lora_down.weight": a,
                                                                              "lora_up.weight": b}))


def test_validation_names_the_first_mismatch():
    transformer = tiny_flux()
    good = random_adapter(transformer, 7, rank=4, every=5)
    validate(good, transformer, max_rank=4)
    first = next(iter(good.weights))

    def with_(name, w):
        return type(good)({**good.weights, name: w}, "peft")

    w = good.weights[first]
    cases = [
        (with_("transformer_blocks.0.attn.to_nothing", w), "'transformer_blocks.0.attn.to_nothing', which "
                                                           "FluxTransformer2DModel has not"),
        (with_("transformer_blocks.0.attn.norm_q", w), "a RMSNorm .* not a linear layer"),
        (with_(first, w._replace(a=torch.zeros(4, 15))), f"{first}.* maps 15 -> "),
        (with_(first, w._replace(b=torch.zeros(9, 4))), r"maps .* -> 9 features"),
        (with_(first, w._replace(b=w.b.clone().fill_(float("nan")))), "infinite or NaN"),
    ]
    for adapter, message in cases:
        with pytest.raises(LoraError, match=message):
            validate(adapter, transformer, max_rank=4)
    with pytest.raises(LoraError, match="rank 4; this model's adapters are of rank at most 2"):
        validate(good, transformer, max_rank=2)
    with pytest.raises(LoraError, match="bank does not hold"):
        validate(good, transformer, max_rank=4, targets=list(good.weights)[1:])
    bank = LoraBank(transformer, slots=1, max_rank=2, per_request=1)
    with pytest.raises(LoraError, match="rank at most 2"):
        bank.load(1, "good", good)  # the bank checks what it is handed too
