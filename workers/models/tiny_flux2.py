"""A FLUX.2 pipeline directory in the layout of ``black-forest-labs/FLUX.2-klein-4B`` (``Flux2KleinPipeline``; its
base variant with ``--base``; ``-9B``'s proportions with ``--9b``) or ``black-forest-labs/FLUX.2-dev``
(``Flux2Pipeline``, ``--dev``), shrunk to run on a CPU in seconds, with random weights: the transformer (sharded
safetensors with its index), the text encoder (sharded, as the real ones: Qwen3ForCausalLM with as many layers as
the pipeline reads, 27, for 9B the real 36; or Mistral3ForConditionalGeneration with a tiny Pixtral vision tower
and 30 text layers), its tokenizer made here (a byte-level BPE over a small vocabulary with the real special tokens
and chat template in tokenizer_config.json; for [dev] a PixtralProcessor around one), AutoencoderKLFlux2 (32 channels
at /8, batch-norm statistics of its patchified latents set away from 0 and 1 so that the normalisation shows), and
the scheduler's config. Nothing is downloaded.

Images 64x64 (latents 128 x 4 x 4, 16 tokens), also 96x64 and 64x96; prompts of ``MAX_TOKENS`` tokens after the
chat template (``DEV_MAX_TOKENS`` for [dev], whose system message comes first).

    python -m workers.models.tiny_flux2 OUT_DIR [--base] [--9b] | OUT_DIR --dev
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

MAX_TOKENS = 48      # [klein]: the chat template's 13 tokens and the prompt
DEV_MAX_TOKENS = 80  # [dev]: Flux2Pipeline's system message (about 35 tokens here) first
IMAGE_SIZE = 64
SIZES = ("64x64", "96x64", "64x96")  # width x height
WIDTH = 16  # the text encoder's hidden size: joint_attention_dim is three of it
# FLUX.2-klein-9B beside -4B (their published configs): Qwen3-8B (4096 wide, its LM head untied) for Qwen3-4B (2560,
# tied), so joint_attention_dim 12288 for 7680; 32 heads of 128 for 24; 8 double and 24 single blocks for 5 and 20.
# Both encoders have 36 layers, of which the pipeline reads 9, 18 and 27. Here: wider, untied, more heads and blocks.
KLEIN_9B_ENCODER = dict(hidden_size=24, num_hidden_layers=36, tie_word_embeddings=False)
KLEIN_9B_TRANSFORMER = dict(num_layers=2, num_single_layers=2, num_attention_heads=3)
WORDS = ("a an the red blue green cat dog tree house small big drawn photo of on in with user assistant system "
         "you are ai that about image").split()
# [dev]'s tokenizer knows the words of Flux2Pipeline's system message too
MISTRAL_WORDS = WORDS + ("You AI reasons descriptions give structured responses focusing object relationships "
                         "attribution and actions without speculation").split()
# scheduler/scheduler_config.json of the FLUX.2 checkpoints (FLUX.1-dev's)
SCHEDULER = {"base_image_seq_len": 256, "base_shift": 0.5, "max_image_seq_len": 4096, "max_shift": 1.15,
             "num_train_timesteps": 1000, "shift": 3.0, "time_shift_type": "exponential",
             "use_dynamic_shifting": True}
# Qwen3's chat template (tokenizer_config.json of Qwen/Qwen3-4B, which FLUX.2 [klein] 4B ships): thinking off puts
# an empty think block after the generation prompt
QWEN3_CHAT_TEMPLATE = (
    "{%- if tools %}\n    {{- '<|im_start|>system\\n' }}\n    {%- if messages[0].role == 'system' %}\n"
    "        {{- messages[0].content + '\\n\\n' }}\n    {%- endif %}\n"
    "    {{- \"# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided "
    "with function signatures within <tools></tools> XML tags:\\n<tools>\" }}\n    {%- for tool in tools %}\n"
    "        {{- \"\\n\" }}\n        {{- tool | tojson }}\n    {%- endfor %}\n"
    "    {{- \"\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\\"name\\\": <function-name>, \\\"arguments\\\": "
    "<args-json-object>}\\n</tool_call><|im_end|>\\n\" }}\n{%- else %}\n    {%- if messages[0].role == 'system' %}\n"
    "        {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}\n    {%- endif %}\n{%- endif %}\n"
    "{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}\n"
    "{%- for message in messages[::-1] %}\n    {%- set index = (messages|length - 1) - loop.index0 %}\n"
    "    {%- if ns.multi_step_tool and message.role == \"user\" and message.content is string and "
    "not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}\n"
    "        {%- set ns.multi_step_tool = false %}\n        {%- set ns.last_query_index = index %}\n    {%- endif %}\n"
    "{%- endfor %}\n{%- for message in messages %}\n    {%- if message.content is string %}\n"
    "        {%- set content = message.content %}\n    {%- else %}\n        {%- set content = '' %}\n    {%- endif %}\n"
    "    {%- if (message.role == \"user\") or (message.role == \"system\" and not loop.first) %}\n"
    "        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}\n"
    "    {%- elif message.role == \"assistant\" %}\n        {%- set reasoning_content = '' %}\n"
    "        {%- if message.reasoning_content is string %}\n"
    "            {%- set reasoning_content = message.reasoning_content %}\n        {%- else %}\n"
    "            {%- if '</think>' in content %}\n"
    "                {%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1]"
    ".lstrip('\\n') %}\n"
    "                {%- set content = content.split('</think>')[-1].lstrip('\\n') %}\n            {%- endif %}\n"
    "        {%- endif %}\n        {%- if loop.index0 > ns.last_query_index %}\n"
    "            {%- if loop.last or (not loop.last and reasoning_content) %}\n"
    "                {{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + "
    "'\\n</think>\\n\\n' + content.lstrip('\\n') }}\n            {%- else %}\n"
    "                {{- '<|im_start|>' + message.role + '\\n' + content }}\n            {%- endif %}\n"
    "        {%- else %}\n            {{- '<|im_start|>' + message.role + '\\n' + content }}\n        {%- endif %}\n"
    "        {%- if message.tool_calls %}\n            {%- for tool_call in message.tool_calls %}\n"
    "                {%- if (loop.first and content) or (not loop.first) %}\n                    {{- '\\n' }}\n"
    "                {%- endif %}\n                {%- if tool_call.function %}\n"
    "                    {%- set tool_call = tool_call.function %}\n                {%- endif %}\n"
    "                {{- '<tool_call>\\n{\"name\": \"' }}\n                {{- tool_call.name }}\n"
    "                {{- '\", \"arguments\": ' }}\n                {%- if tool_call.arguments is string %}\n"
    "                    {{- tool_call.arguments }}\n                {%- else %}\n"
    "                    {{- tool_call.arguments | tojson }}\n                {%- endif %}\n"
    "                {{- '}\\n</tool_call>' }}\n            {%- endfor %}\n        {%- endif %}\n"
    "        {{- '<|im_end|>\\n' }}\n    {%- elif message.role == \"tool\" %}\n"
    "        {%- if loop.first or (messages[loop.index0 - 1].role != \"tool\") %}\n"
    "            {{- '<|im_start|>user' }}\n        {%- endif %}\n        {{- '\\n<tool_response>\\n' }}\n"
    "        {{- content }}\n        {{- '\\n</tool_response>' }}\n"
    "        {%- if loop.last or (messages[loop.index0 + 1].role != \"tool\") %}\n"
    "            {{- '<|im_end|>\\n' }}\n        {%- endif %}\n    {%- endif %}\n{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n    {{- '<|im_start|>assistant\\n' }}\n"
    "    {%- if enable_thinking is defined and enable_thinking is false %}\n"
    "        {{- '<think>\\n\\n</think>\\n\\n' }}\n    {%- endif %}\n{%- endif %}")
QWEN_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # Qwen's 151643-151645
QWEN_ADDED = ("<think>", "</think>")                              # added, not special (151667-151668)
# Mistral's (Tekken's) control tokens, ids 0-18
MISTRAL_SPECIALS = ("<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]",
                    "[TOOL_RESULTS]", "[/TOOL_RESULTS]", "[TOOL_CALLS]", "[IMG]", "<pad>", "[IMG_BREAK]", "[IMG_END]",
                    "[PREFIX]", "[MIDDLE]", "[SUFFIX]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]")
# the chat template of mistralai/Mistral-Small-3.1-24B-Instruct-2503 (FLUX.2 [dev]'s tokenizer): the system message,
# then each user turn in [INST] ... [/INST], text blocks as given, image blocks as [IMG]
MISTRAL_CHAT_TEMPLATE = (
    "{%- set today = strftime_now(\"%Y-%m-%d\") %}\n"
    "{%- set default_system_message = \"You are Mistral Small 3, a Large Language Model (LLM) created by Mistral AI, "
    "a French startup headquartered in Paris.\\nYour knowledge base was last updated on 2023-10-01. The current date "
    "is \" + today + \".\\n\\nWhen you're not sure about some information, you say that you don't have the "
    "information and don't make up anything.\\nIf the user's question is not clear, ambiguous, or does not provide "
    "enough context for you to accurately answer the question, you do not try to answer it right away and you "
    "rather ask the user to clarify their request (e.g. \\\"What are some good restaurants around me?\\\" => "
    "\\\"Where are you?\\\" or \\\"When is the next flight to Tokyo\\\" => \\\"Where do you travel "
    "from?\\\")\" %}\n\n{{- bos_token }}\n\n"
    "{%- if messages[0]['role'] == 'system' %}\n    {%- if messages[0]['content'] is string %}\n"
    "        {%- set system_message = messages[0]['content'] %}\n    {%- else %}\n"
    "        {%- set system_message = messages[0]['content'][0]['text'] %}\n    {%- endif %}\n"
    "    {%- set loop_messages = messages[1:] %}\n{%- else %}\n"
    "    {%- set system_message = default_system_message %}\n    {%- set loop_messages = messages %}\n"
    "{%- endif %}\n{{- '[SYSTEM_PROMPT]' + system_message + '[/SYSTEM_PROMPT]' }}\n\n"
    "{%- for message in loop_messages %}\n    {%- if message['role'] == 'user' %}\n"
    "        {%- if message['content'] is string %}\n            {{- '[INST]' + message['content'] + '[/INST]' }}\n"
    "        {%- else %}\n            {{- '[INST]' }}\n            {%- for block in message['content'] %}\n"
    "                {%- if block['type'] == 'text' %}\n                    {{- block['text'] }}\n"
    "                {%- elif block['type'] in ['image', 'image_url'] %}\n                    {{- '[IMG]' }}\n"
    "                {%- else %}\n"
    "                    {{- raise_exception('Only text and image blocks are supported in message content!') }}\n"
    "                {%- endif %}\n            {%- endfor %}\n            {{- '[/INST]' }}\n        {%- endif %}\n"
    "    {%- elif message['role'] == 'system' %}\n        {%- if message['content'] is string %}\n"
    "            {{- '[SYSTEM_PROMPT]' + message['content'] + '[/SYSTEM_PROMPT]' }}\n        {%- else %}\n"
    "            {{- '[SYSTEM_PROMPT]' + message['content'][0]['text'] + '[/SYSTEM_PROMPT]' }}\n"
    "        {%- endif %}\n    {%- elif message['role'] == 'assistant' %}\n"
    "        {%- if message['content'] is string %}\n            {{- message['content'] + eos_token }}\n"
    "        {%- else %}\n            {{- message['content'][0]['text'] + eos_token }}\n        {%- endif %}\n"
    "    {%- else %}\n        {{- raise_exception('Only user, system and assistant roles are supported!') }}\n"
    "    {%- endif %}\n{%- endfor %}")


def bpe_vocab(words=WORDS, pairs: bool = False, space: str = "Ġ") -> tuple[dict[str, int], list[tuple[str, str]]]:
    """A byte-level BPE (vocab, merges): the 256 byte symbols, then (``pairs``) every letter pair, plain and after a
    space, then each word built letter by letter, its space-led form first (``space`` + word, as GPT-2-style
    pre-tokenisation makes it) so that a word after a space becomes one token."""
    from itertools import product

    from tokenizers.pre_tokenizers import ByteLevel

    vocab = {s: i for i, s in enumerate(sorted(ByteLevel.alphabet()))}
    merges: list[tuple[str, str]] = []

    def merge(a: str, b: str) -> None:
        if (a, b) not in merges:
            merges.append((a, b))
        vocab.setdefault(a + b, len(vocab))

    for word in [space + w for w in words] + list(words):
        for i in range(1, len(word)):
            merge(word[:i], word[i])
    if pairs:
        letters = "abcdefghijklmnopqrstuvwxyz"
        for c in letters:
            merge(space, c)
        for a, b in product(letters, repeat=2):
            merge(a, b)
            merge(space + a, b)
    return vocab, merges


def qwen_tokenizer(pairs: bool = False):
    """Qwen2Tokenizer (transformers' Qwen2TokenizerFast) over ``bpe_vocab`` with Qwen3's special and added tokens
    and chat template; eos <|im_end|>, pad <|endoftext|>, as FLUX.2 [klein]'s tokenizer."""
    from tokenizers import AddedToken
    from transformers import Qwen2Tokenizer

    vocab, merges = bpe_vocab(pairs=pairs)
    tok = Qwen2Tokenizer(vocab=vocab, merges=merges, unk_token=None, eos_token="<|im_end|>",
                         pad_token="<|endoftext|>", errors="replace")
    tok.add_special_tokens({"additional_special_tokens": list(QWEN_SPECIALS[1:])})
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in QWEN_ADDED])
    tok.chat_template = QWEN3_CHAT_TEMPLATE
    return tok


def mistral_tokenizer(pairs: bool = False, words=MISTRAL_WORDS):
    """A Tekken-like fast tokenizer: Mistral's control tokens first (ids 0-18: <unk>, <s>, </s>, [INST], [/INST],
    ..., [IMG] 10, <pad> 11, [IMG_BREAK] 12, [IMG_END] 13, ..., [SYSTEM_PROMPT] 17, [/SYSTEM_PROMPT] 18), then a
    byte-level BPE over ``bpe_vocab``; <s> prepended."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab, merges = bpe_vocab(words, pairs=pairs)
    vocab = {**{t: i for i, t in enumerate(MISTRAL_SPECIALS)},
             **{t: i + len(MISTRAL_SPECIALS) for t, i in vocab.items()}}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A $B", special_tokens=[("<s>", 1)])
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in MISTRAL_SPECIALS])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   pad_token="<pad>")


def write_mistral_tokenizer(path: Path, pairs: bool = False):
    """FLUX.2 [dev]'s ``tokenizer/``, a PixtralProcessor's files (processor_config.json, preprocessor_config.json for
    Pixtral's image processor, the chat template in chat_template.jinja) around ``mistral_tokenizer``, written
    directly: transformers builds a PixtralProcessor only with torchvision. Returns the tokenizer."""
    tok = mistral_tokenizer(pairs)
    tok.chat_template = MISTRAL_CHAT_TEMPLATE
    tok.save_pretrained(path)
    config = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**config, "processor_class": "PixtralProcessor"}, indent=2))
    (path / "processor_config.json").write_text(json.dumps({
        "image_break_token": "[IMG_BREAK]", "image_end_token": "[IMG_END]", "image_token": "[IMG]", "patch_size": 14,
        "processor_class": "PixtralProcessor", "spatial_merge_size": 2}, indent=2))
    (path / "preprocessor_config.json").write_text(json.dumps({
        "do_convert_rgb": True, "do_normalize": True, "do_rescale": True, "do_resize": True,
        "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_processor_type": "PixtralImageProcessor",
        "image_std": [0.26862954, 0.26130258, 0.27577711], "patch_size": {"height": 14, "width": 14},
        "processor_class": "PixtralProcessor", "resample": 3, "rescale_factor": 0.00392156862745098,
        "size": {"longest_edge": 1540}}, indent=2))
    (path / "chat_template.jinja").write_text(MISTRAL_CHAT_TEMPLATE)
    return tok


def save_tokenizer(tok, path: Path) -> None:
    """``tok`` saved, its chat template in tokenizer_config.json as the published tokenizers keep it (not in a
    chat_template.jinja beside it)."""
    tok.save_pretrained(path)
    config = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": tok.chat_template}, indent=2))
    (path / "chat_template.jinja").unlink(missing_ok=True)


def make_tiny_flux2(path: Path, seed: int = 0, base: bool = False, dev: bool = False, nine_b: bool = False) -> Path:
    """FLUX.2 [klein]'s layout, step-distilled (``is_distilled``: one forward per image, guidance ignored) or
    ``base`` (classifier-free guidance), in 4B's proportions or 9B's (``nine_b``: ``KLEIN_9B_*``); or [dev]'s
    (``dev``: Mistral3 and the embedded guidance scale)."""
    import torch
    from diffusers import AutoencoderKLFlux2, FlowMatchEulerDiscreteScheduler, Flux2Transformer2DModel

    path = Path(path)
    torch.manual_seed(seed)
    nine_b = nine_b and not dev
    encoder = KLEIN_9B_ENCODER if nine_b else {}
    encoder_class, tokenizer_class = _write_mistral(path) if dev else _write_qwen(path, **encoder)
    blocks = {"num_layers": 1, "num_single_layers": 1, "num_attention_heads": 2,
              **(KLEIN_9B_TRANSFORMER if nine_b else {})}
    Flux2Transformer2DModel(patch_size=1, in_channels=128, attention_head_dim=16, **blocks,
                            joint_attention_dim=3 * encoder.get("hidden_size", WIDTH), axes_dims_rope=(4, 4, 4, 4),
                            guidance_embeds=dev
                            ).save_pretrained(path / "transformer", safe_serialization=True, max_shard_size="100KB")
    vae = AutoencoderKLFlux2(block_out_channels=[8, 8, 16, 16], layers_per_block=1, norm_num_groups=8,
                             latent_channels=32, sample_size=IMAGE_SIZE)
    vae.bn.running_mean.normal_(0.0, 0.3)
    vae.bn.running_var.uniform_(0.5, 2.0)
    vae.save_pretrained(path / "vae", safe_serialization=True)
    FlowMatchEulerDiscreteScheduler(**SCHEDULER).save_pretrained(path / "scheduler")
    index = {"_class_name": "Flux2Pipeline" if dev else "Flux2KleinPipeline", "_diffusers_version": "0.37.0.dev0",
             **({} if dev or base else {"is_distilled": True}),
             "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
             "text_encoder": ["transformers", encoder_class], "tokenizer": ["transformers", tokenizer_class],
             "transformer": ["diffusers", "Flux2Transformer2DModel"], "vae": ["diffusers", "AutoencoderKLFlux2"],
             "dit_serve": {"dtype": "float32", "max_sequence_length": DEV_MAX_TOKENS if dev else MAX_TOKENS,
                           "image_size": IMAGE_SIZE,
                           "sizes": list(SIZES)}}
    (path / "model_index.json").write_text(json.dumps(index, indent=2))
    return path


def _write_qwen(path: Path, **config) -> tuple[str, str]:
    """text_encoder/ (Qwen3ForCausalLM, 27 layers: the pipeline reads hidden states 9, 18, 27; ``config`` overrides,
    ``KLEIN_9B_ENCODER``) and tokenizer/."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    tok = qwen_tokenizer()
    save_tokenizer(tok, path / "tokenizer")
    ids = tok.convert_tokens_to_ids(list(QWEN_SPECIALS))
    config = {"hidden_size": WIDTH, "num_hidden_layers": 27, "tie_word_embeddings": True, **config}
    Qwen3ForCausalLM(Qwen3Config(vocab_size=len(tok), intermediate_size=32, num_attention_heads=2,
                                 num_key_value_heads=1, head_dim=8, max_position_embeddings=512, rope_theta=1000000.0,
                                 bos_token_id=ids[0], eos_token_id=ids[2], **config)
                     ).save_pretrained(path / "text_encoder", safe_serialization=True, max_shard_size="100KB")
    return "Qwen3ForCausalLM", "Qwen2TokenizerFast"


def _write_mistral(path: Path) -> tuple[str, str]:
    """text_encoder/ (Mistral3ForConditionalGeneration: 30 text layers, as the pipeline reads hidden states 10, 20,
    30, and a one-layer Pixtral vision tower) and tokenizer/ (PixtralProcessor)."""
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration

    tok = write_mistral_tokenizer(path / "tokenizer")
    Mistral3ForConditionalGeneration(Mistral3Config(
        text_config=dict(model_type="mistral", vocab_size=len(tok), hidden_size=WIDTH, intermediate_size=32,
                         num_hidden_layers=30, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                         max_position_embeddings=512, rope_theta=1000000000.0, rms_norm_eps=1e-5,
                         sliding_window=None, tie_word_embeddings=False),
        vision_config=dict(model_type="pixtral", hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                           num_attention_heads=2, head_dim=8, image_size=56, patch_size=14, rope_theta=10000.0),
        image_token_index=MISTRAL_SPECIALS.index("[IMG]"), multimodal_projector_bias=False,
        projector_hidden_act="gelu", spatial_merge_size=2, tie_word_embeddings=False)
    ).save_pretrained(path / "text_encoder", safe_serialization=True, max_shard_size="100KB")
    return "Mistral3ForConditionalGeneration", "PixtralProcessor"


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--base", action="store_true", help="FLUX.2 [klein] base's layout (classifier-free guidance)")
    group.add_argument("--dev", action="store_true", help="FLUX.2 [dev]'s layout (Mistral3, embedded guidance)")
    parser.add_argument("--9b", dest="nine_b", action="store_true", help="[klein] in 9B's proportions (Qwen3-8B's)")
    args = parser.parse_args()
    if args.dev and args.nine_b:
        parser.error("--9b is a [klein] layout: not with --dev")
    print(make_tiny_flux2(args.out, base=args.base, dev=args.dev, nine_b=args.nine_b))
