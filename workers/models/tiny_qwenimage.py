"""A Qwen-Image pipeline directory in the layout of ``Qwen/Qwen-Image``, shrunk to run on a CPU in seconds, with
random weights: transformer (sharded safetensors with its index, as the real 9-shard checkpoint), the
16-channel AutoencoderKLQwenImage with the real latent statistics, a Qwen2.5-VL text encoder (language
model and vision tower, sharded as the real one) and a byte-level BPE Qwen2 tokenizer (vocab.json +
merges.txt + tokenizer_config.json, as the real one), the real scheduler config. Nothing is downloaded.

The tokenizer's few hundred tokens are learnt here (``tokenizers``' BPE trainer, deterministic) from the
pipeline's chat template and a few words, so the template's system part is 34 tokens, as with Qwen's own
vocabulary: the 34 tokens the pipeline drops.

Images 64x64 (latents 16x8x8, 16 packed tokens), also 96x64 and 64x96; prompts of ``MAX_TOKENS`` tokens.

    python -m workers.models.tiny_qwenimage OUT_DIR
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

MAX_TOKENS = 16
IMAGE_SIZE = 64
SIZES = ("64x64", "96x64", "64x96")  # width x height
# Qwen/Qwen-Image's scheduler/scheduler_config.json
SCHEDULER = {"base_image_seq_len": 256, "base_shift": 0.5, "invert_sigmas": False, "max_image_seq_len": 8192,
             "max_shift": 0.9, "num_train_timesteps": 1000, "shift": 1.0, "shift_terminal": 0.02,
             "stochastic_sampling": False, "time_shift_type": "exponential", "use_beta_sigmas": False,
             "use_dynamic_shifting": True, "use_exponential_sigmas": False, "use_karras_sigmas": False}
WORDS = "a an the red blue green cat dog tree house small big drawn photo of on in with and sitting table".split()
SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # Qwen2's, in its order
VOCAB = 1000  # the trainer's limit; it stops before, once every word of its text is one token


def tokenizer_files(path: Path, templates: tuple[str, ...] = (), specials: tuple[str, ...] = SPECIALS) -> Path:
    """vocab.json, merges.txt and tokenizer_config.json of a Qwen2Tokenizer whose BPE is learnt from the
    pipeline's chat template (and ``templates``, each with one "{}") and WORDS, with Qwen2's special tokens
    (``specials``: SPECIALS first) last (<|endoftext|> pads)."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers, trainers
    from transformers import Qwen2Tokenizer
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    from workers.families.qwenimage.runtime import PROMPT_TEMPLATE

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated"),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    text = "".join(t.format(" ".join(WORDS)) for t in (PROMPT_TEMPLATE, *templates))
    pieces = re.split("|".join(map(re.escape, specials)), text)
    tok.train_from_iterator(pieces, trainers.BpeTrainer(vocab_size=VOCAB, show_progress=False,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    model = json.loads(tok.to_str())["model"]
    vocab = dict(model["vocab"])
    vocab.update({s: len(vocab) + i for i, s in enumerate(specials)})
    path.mkdir(parents=True, exist_ok=True)
    (path / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False))
    (path / "merges.txt").write_text("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in model["merges"]))
    Qwen2Tokenizer(vocab=str(path / "vocab.json"), merges=str(path / "merges.txt"), errors="replace", unk_token=None,
                   bos_token=None, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                   additional_special_tokens=list(specials[1:]), model_max_length=131072).save_pretrained(path)
    (path / "tokenizer.json").unlink()  # the published tokenizer/ is vocab.json + merges.txt
    return path


def make_tiny_qwenimage(path: Path, seed: int = 0, head_dim: int = 16) -> Path:
    """Qwen-Image's layout; ``head_dim``: 2 heads of it, its rotary axes (1/4, 3/8, 3/8 of it, as the real
    16, 56, 56 of 128)."""
    import torch
    from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImageTransformer2DModel
    from transformers import AutoTokenizer, Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    path = Path(path)
    torch.manual_seed(seed)
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_files(path / "tokenizer")), local_files_only=True)
    ids = dict(bos_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
               pad_token_id=tokenizer.pad_token_id)
    vocab = len(tokenizer) + 4  # the image and video placeholders, vision start and end, past the tokenizer's
    Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(
        text_config=dict(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048, rms_norm_eps=1e-6,
                         rope_theta=1000000.0, rope_scaling={"type": "mrope", "mrope_section": [1, 1, 2]}, **ids),
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32,
                           patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                           fullatt_block_indexes=[0]),
        image_token_id=vocab - 3, video_token_id=vocab - 2, vision_start_token_id=vocab - 4,
        vision_end_token_id=vocab - 1, tie_word_embeddings=False, **ids)
    ).save_pretrained(path / "text_encoder", safe_serialization=True, max_shard_size="40KB")
    rope = head_dim // 4, 3 * head_dim // 8, 3 * head_dim // 8
    QwenImageTransformer2DModel(patch_size=2, in_channels=64, out_channels=16, num_layers=2, attention_head_dim=head_dim,
                                num_attention_heads=2, joint_attention_dim=32, axes_dims_rope=rope
                                ).save_pretrained(path / "transformer", safe_serialization=True, max_shard_size="40KB")
    AutoencoderKLQwenImage(base_dim=8, z_dim=16, dim_mult=[1, 2, 2, 2], num_res_blocks=1
                           ).save_pretrained(path / "vae", safe_serialization=True)
    FlowMatchEulerDiscreteScheduler(**SCHEDULER).save_pretrained(path / "scheduler")
    (path / "model_index.json").write_text(json.dumps({
        "_class_name": "QwenImagePipeline", "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
        "text_encoder": ["transformers", "Qwen2_5_VLForConditionalGeneration"],
        "tokenizer": ["transformers", "Qwen2Tokenizer"], "transformer": ["diffusers", "QwenImageTransformer2DModel"],
        "vae": ["diffusers", "AutoencoderKLQwenImage"],
        "dit_serve": {"dtype": "float32", "max_sequence_length": MAX_TOKENS, "image_size": IMAGE_SIZE,
                      "sizes": list(SIZES)}}, indent=2))
    return path


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    args = parser.parse_args()
    print(make_tiny_qwenimage(args.out))
