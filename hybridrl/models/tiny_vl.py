"""A tiny Qwen2-VL (or Qwen2.5-VL) model, its tokenizer and image processor, made locally with no network.

The folder is written once under $HYBRIDRL_CACHE in the layout of a Hub checkpoint (config.json and weights, the
tokenizer with the vision tokens and a chat template that renders image parts, preprocessor_config.json naming
`Qwen2VLImageProcessor`), and loaded from there through the same `from_pretrained` calls as
`model.path=Qwen/Qwen2.5-VL-3B-Instruct`::

    <|im_start|>user\\n<|vision_start|><|image_pad|><|vision_end|>How many red shapes?<|im_end|>\\n<|im_start|>...

The processor repeats `<|image_pad|>` once per merged 2×2 block of 14-pixel patches (16 tokens for a 112×112
image). With `pretrain_steps` the language model is first trained on the tiny text model's digit text
(`hybridrl.models.pretrain`), so it answers in digits from the start; the vision tower keeps its random
initialization (`hybridrl.models.pretrain_vl` may then teach it to see).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from pathlib import Path

import torch

from hybridrl.models.pretrain import PretrainSpec
from hybridrl.models.pretrain_vl import CaptionSpec, pretrain_vl
from hybridrl.models.quiet import no_progress_bars
from hybridrl.models.tiny import build_tokenizer, decoder_shape, default_cache_dir

log = logging.getLogger(__name__)

VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
TINY_VL_FORMAT_VERSION = 1
ARCHS = ("qwen2_vl", "qwen2_5_vl")

# Qwen2-VL's template without its default system prompt (as the tiny text template has none): string contents as
# they are; a list content renders its image parts as the vision block and its text parts as their text.
VL_CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}"
    "{%- else %}{%- for part in message['content'] %}"
    "{%- if part['type'] == 'image' or 'image' in part or 'image_url' in part %}"
    "{{- '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- elif 'text' in part %}{{- part['text'] }}{%- endif %}"
    "{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def tiny_vl_spec(
    arch: str = "qwen2_vl",
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 2,
    num_kv_heads: int = 1,
    intermediate_size: int = 192,
    vision_depth: int = 2,
    vision_width: int = 32,
    image_size: int = 112,
    max_position_embeddings: int = 1024,
    seed: int = 0,
) -> dict:
    """The tiny VL model's shape as a plain dict (also its cache key)."""
    if arch not in ARCHS:
        raise ValueError(f"tiny VL arch must be one of {ARCHS}, got {arch!r}")
    return {
        "arch": arch,
        "hidden_size": hidden_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "intermediate_size": intermediate_size,
        "vision_depth": vision_depth,
        "vision_width": vision_width,
        "image_size": image_size,
        "max_position_embeddings": max_position_embeddings,
        "seed": seed,
        "format": TINY_VL_FORMAT_VERSION,
    }


def build_vl_tokenizer():
    """The tiny byte-level tokenizer with Qwen2-VL's vision tokens (special: never split, dropped by
    `skip_special_tokens`) and the image-aware chat template."""
    tokenizer = build_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", *VISION_TOKENS]})
    tokenizer.chat_template = VL_CHAT_TEMPLATE
    return tokenizer


def mrope_section(head_dim: int) -> list[int]:
    """Qwen2-VL's split of the rotary frequencies over (temporal, height, width), scaled from its 128-dim heads'
    [16, 24, 24] to `head_dim` (the three parts cover head_dim / 2 frequencies)."""
    half = head_dim // 2
    t = max(1, half // 4)
    h = (half - t) // 2
    return [t, h, half - t - h]


def tiny_vl_config(spec: dict, tokenizer):
    """The transformers config of `spec` (Qwen2VLConfig or Qwen2_5_VLConfig)."""
    import transformers

    head_dim = spec["hidden_size"] // spec["num_attention_heads"]
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in VISION_TOKENS}
    text = dict(
        vocab_size=len(tokenizer),
        **decoder_shape(spec),
        max_position_embeddings=spec["max_position_embeddings"],
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": mrope_section(head_dim)},
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    width, depth = spec["vision_width"], spec["vision_depth"]
    common = dict(depth=depth, num_heads=2, patch_size=14, spatial_merge_size=2, temporal_patch_size=2)
    if spec["arch"] == "qwen2_vl":
        cls = transformers.Qwen2VLConfig
        vision = dict(common, embed_dim=width, hidden_size=spec["hidden_size"], mlp_ratio=2)
    else:
        cls = transformers.Qwen2_5_VLConfig
        # One windowed block and one full-attention block, as the real tower alternates them.
        vision = dict(
            common,
            hidden_size=width,
            intermediate_size=2 * width,
            out_hidden_size=spec["hidden_size"],
            window_size=56,
            fullatt_block_indexes=[depth - 1],
        )
    return cls(
        text_config=text,
        vision_config=vision,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=True,
    )


def preprocessor_config(spec: dict) -> dict:
    """preprocessor_config.json as the Hub's Qwen2-VL folders write it (read by transformers 4.x and 5.x alike):
    images are resized to at most image_size² pixels, in multiples of 28 (a merged 2×2 block of 14-pixel patches)."""
    side = spec["image_size"]
    processor = "Qwen2VLProcessor" if spec["arch"] == "qwen2_vl" else "Qwen2_5_VLProcessor"
    return {
        "image_processor_type": "Qwen2VLImageProcessor",
        "processor_class": processor,
        "do_convert_rgb": True,
        "do_normalize": True,
        "do_rescale": True,
        "do_resize": True,
        "image_mean": [0.48145466, 0.4578275, 0.40821073],
        "image_std": [0.26862954, 0.26130258, 0.27577711],
        "rescale_factor": 1 / 255,
        "resample": 3,
        "min_pixels": 28 * 28,
        "max_pixels": side * side,
        "size": {"shortest_edge": 28 * 28, "longest_edge": side * side},
        "patch_size": 14,
        "temporal_patch_size": 2,
        "merge_size": 2,
    }


def ensure_tiny_vl_model(
    cache_dir: str | os.PathLike | None = None,
    pretrain_spec: PretrainSpec | None = None,
    caption_spec: CaptionSpec | None = None,
    **shape,
) -> Path:
    """The folder of the tiny VL model with this shape (and pre-training: `pretrain_spec` on digit text, then
    `caption_spec` on captioned pictures, `hybridrl.models.pretrain_vl`), made on first use; written under a
    temporary name and renamed when complete, so a run killed half-way leaves no folder that looks finished."""
    from transformers import AutoImageProcessor

    from hybridrl.models.vision import model_class

    spec = tiny_vl_spec(**shape)
    pretrain_spec = pretrain_spec or PretrainSpec()
    caption_spec = caption_spec or CaptionSpec()
    if pretrain_spec.steps > 0:  # a random-init model keeps the key it always had
        spec["pretrain"] = pretrain_spec.key()
    if caption_spec.steps > 0 or caption_spec.tower_steps > 0:
        spec["captions"] = caption_spec.key()
    key = hashlib.sha1(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:10]
    root = Path(cache_dir) if cache_dir else default_cache_dir()
    target = root / f"tiny-{spec['arch'].replace('_', '')}-{key}"
    if (target / "config.json").exists():
        return target
    tmp = root / f".tmp-{target.name}-{os.getpid()}"
    tmp.mkdir(parents=True, exist_ok=True)

    tokenizer = build_vl_tokenizer()
    tokenizer.save_pretrained(tmp)
    (tmp / "preprocessor_config.json").write_text(json.dumps(preprocessor_config(spec), indent=2) + "\n")
    (tmp / "chat_template.json").write_text(json.dumps({"chat_template": VL_CHAT_TEMPLATE}) + "\n")
    config = tiny_vl_config(spec, tokenizer)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec["seed"])
        model = model_class(config).from_config(config, dtype=torch.float32)
    if pretrain_spec.steps > 0 or caption_spec.steps > 0 or caption_spec.tower_steps > 0:
        log.info(
            "making the tiny VL model: %d steps on digit text, %d of its vision tower alone, %d on captioned"
            " pictures, once (cached in %s)",
            pretrain_spec.steps,
            caption_spec.tower_steps,
            caption_spec.steps,
            target,
        )
        processor = AutoImageProcessor.from_pretrained(tmp)  # the folder's own, as every later load
        for stage, losses in pretrain_vl(model, tokenizer, processor, pretrain_spec, caption_spec).items():
            if losses:
                tail = losses[-20:]
                log.info("tiny VL model, %s: loss %.3f -> %.3f", stage, losses[0], sum(tail) / len(tail))
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    with no_progress_bars():
        model.save_pretrained(tmp, safe_serialization=True)
    try:
        os.replace(tmp, target)
    except OSError:  # another process finished first; its folder is equally good
        shutil.rmtree(tmp, ignore_errors=True)
    return target
