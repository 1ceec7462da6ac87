"""A Qwen-Image-Edit pipeline directory in the layout of ``Qwen/Qwen-Image-Edit`` (``QwenImageEditPipeline``) or
``Qwen/Qwen-Image-Edit-2509`` (``plus``: ``QwenImageEditPlusPipeline``), shrunk to run on a CPU in seconds, with
random weights: Qwen-Image's parts as ``workers.models.tiny_qwenimage`` makes them (sharded transformer, the
16-channel AutoencoderKLQwenImage, a Qwen2.5-VL text encoder with its vision tower, the real scheduler config), a
tokenizer with Qwen2.5-VL's vision tokens, and the ``processor/`` folder of the published layout: the same
tokenizer files beside ``preprocessor_config.json`` (Qwen2VLImageProcessor, Qwen2.5-VL's). Nothing is downloaded.

The tokenizer's BPE is learnt from the text-to-image and edit chat templates, so the edit template's system
part is 64 tokens, as with Qwen's own vocabulary: the 64 tokens the edit pipelines drop. ``zero_cond_t``: the
transformer flag of ``Qwen/Qwen-Image-Edit-2511`` (a Plus pipeline; the reference tokens modulated at t = 0).

The pipelines resize a reference to about 1024 x 1024 px (the Plus pipeline's vision input to 384 x 384): slow
on a CPU, so the directory asks for smaller areas (``dit_serve.reference_area``, ``dit_serve.vision_area``:
``REFERENCE_AREA``, ``VISION_AREA``). Outputs 64x64 (latents 16x8x8), also 96x64 and 64x96.

    python -m workers.models.tiny_qwenimage_edit OUT_DIR [--plus]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from workers.models.tiny_qwenimage import IMAGE_SIZE, MAX_TOKENS, SCHEDULER, SIZES, SPECIALS, tokenizer_files

REFERENCE_AREA = 96 * 96  # the pipelines' 1024 * 1024 (calculate_dimensions' target area of the reference)
VISION_AREA = 64 * 64     # the Plus pipeline's CONDITION_IMAGE_SIZE, 384 * 384
VISION_SPECIALS = ("<|vision_start|>", "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>")
# processor/preprocessor_config.json of Qwen/Qwen-Image-Edit (Qwen2.5-VL-7B-Instruct's image processor)
PREPROCESSOR = {"do_convert_rgb": True, "do_normalize": True, "do_rescale": True, "do_resize": True,
                "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_processor_type": "Qwen2VLImageProcessor",
                "image_std": [0.26862954, 0.26130258, 0.27577711], "max_pixels": 12845056, "merge_size": 2,
                "min_pixels": 3136, "patch_size": 14, "processor_class": "Qwen2_5_VLProcessor", "resample": 3,
                "rescale_factor": 0.00392156862745098, "temporal_patch_size": 2,
                "size": {"longest_edge": 12845056, "shortest_edge": 3136}}


def make_tiny_qwenimage_edit(path: Path, seed: int = 0, plus: bool = False, zero_cond_t: bool = False,
                             head_dim: int = 16) -> Path:
    """Qwen-Image-Edit's layout (``plus``: Qwen-Image-Edit-2509's); ``head_dim``: 2 heads of it, its rotary axes
    (1/4, 3/8, 3/8 of it, as the real 16, 56, 56 of 128)."""
    import torch
    from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImageTransformer2DModel
    from transformers import AutoTokenizer, Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    from workers.families.qwenimage.edit import EDIT_TEMPLATE, PICTURE, PLUS_TEMPLATE

    path = Path(path)
    torch.manual_seed(seed)
    templates = (EDIT_TEMPLATE, PLUS_TEMPLATE.format(PICTURE.format(1) + "{}"))
    tokenizer_files(path / "tokenizer", templates, SPECIALS + VISION_SPECIALS)
    tokenizer_files(path / "processor", templates, SPECIALS + VISION_SPECIALS)
    (path / "processor" / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR, indent=2))
    tokenizer = AutoTokenizer.from_pretrained(str(path / "tokenizer"), local_files_only=True)
    token = tokenizer.convert_tokens_to_ids
    ids = dict(bos_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
               pad_token_id=tokenizer.pad_token_id)
    Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(
        text_config=dict(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048, rms_norm_eps=1e-6,
                         rope_theta=1000000.0, rope_scaling={"type": "mrope", "mrope_section": [1, 1, 2]}, **ids),
        vision_config=dict(depth=2, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32,
                           patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                           fullatt_block_indexes=[1]),
        image_token_id=token("<|image_pad|>"), video_token_id=token("<|video_pad|>"),
        vision_start_token_id=token("<|vision_start|>"), vision_end_token_id=token("<|vision_end|>"),
        tie_word_embeddings=False, **ids)
    ).save_pretrained(path / "text_encoder", safe_serialization=True, max_shard_size="40KB")
    rope = head_dim // 4, 3 * head_dim // 8, 3 * head_dim // 8
    QwenImageTransformer2DModel(patch_size=2, in_channels=64, out_channels=16, num_layers=2, attention_head_dim=head_dim,
                                num_attention_heads=2, joint_attention_dim=32, axes_dims_rope=rope,
                                zero_cond_t=zero_cond_t
                                ).save_pretrained(path / "transformer", safe_serialization=True, max_shard_size="40KB")
    AutoencoderKLQwenImage(base_dim=8, z_dim=16, dim_mult=[1, 2, 2, 2], num_res_blocks=1
                           ).save_pretrained(path / "vae", safe_serialization=True)
    FlowMatchEulerDiscreteScheduler(**SCHEDULER).save_pretrained(path / "scheduler")
    (path / "model_index.json").write_text(json.dumps({
        "_class_name": "QwenImageEditPlusPipeline" if plus else "QwenImageEditPipeline",
        "processor": ["transformers", "Qwen2VLProcessor"],
        "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
        "text_encoder": ["transformers", "Qwen2_5_VLForConditionalGeneration"],
        "tokenizer": ["transformers", "Qwen2Tokenizer"], "transformer": ["diffusers", "QwenImageTransformer2DModel"],
        "vae": ["diffusers", "AutoencoderKLQwenImage"],
        "dit_serve": {"dtype": "float32", "max_sequence_length": MAX_TOKENS, "image_size": IMAGE_SIZE,
                      "sizes": list(SIZES), "reference_area": REFERENCE_AREA,
                      **({"vision_area": VISION_AREA} if plus else {})}}, indent=2))
    return path


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--plus", action="store_true", help="Qwen-Image-Edit-2509's (QwenImageEditPlusPipeline)")
    args = parser.parse_args()
    print(make_tiny_qwenimage_edit(args.out, plus=args.plus))
