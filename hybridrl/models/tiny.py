"""A tiny Qwen2-family model and a character-level tokenizer, made locally with no network.

Both are saved once to a cache folder and then loaded through the same `from_pretrained`
path a real checkpoint (`model.path=/path/to/Qwen2.5-0.5B-Instruct`) takes, so tests and the
CPU demo exercise the real loading code. With `pretrain=PretrainSpec(steps=N)` the random
initialization is first trained for N steps on generic digit text (`hybridrl.models.pretrain`);
the default run does this once (about a minute of CPU time) and reuses the cached result.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

import torch

from hybridrl.models.chat_template import install_chat_template
from hybridrl.models.pretrain import PretrainSpec, pretrain
from hybridrl.models.quiet import no_progress_bars

log = logging.getLogger(__name__)

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TINY_FORMAT_VERSION = 2  # 2: the chat template renders tool calls and results


def tiny_model_config(
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 2,
    num_kv_heads: int = 1,
    intermediate_size: int = 192,
    max_position_embeddings: int = 512,
    seed: int = 0,
    tool_tokens: bool = False,
) -> dict:
    """The tiny model's shape as a plain dict (also the cache key)."""
    spec = {
        "hidden_size": hidden_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "intermediate_size": intermediate_size,
        "max_position_embeddings": max_position_embeddings,
        "seed": seed,
        "format": TINY_FORMAT_VERSION,
    }
    if tool_tokens:  # only then: every other tiny model keeps its key
        spec["tool_tokens"] = True
    return spec


def build_tokenizer(tool_tokens: bool = False):
    """A byte-level tokenizer with no merges (one token per byte), built as Qwen2's tokenizer is.

    Using Qwen2's own tokenizer class and pre-tokenizer means `AutoTokenizer` (and vLLM, which
    loads tokenizers the same way) reconstructs exactly this tokenizer from the saved folder. Its chat template
    renders tool calls and tool results (Qwen2.5's layout, `models/chat_template.py`); `tool_tokens` adds the
    four tool tags as tokens of their own (the agent recipe's model), else they are spelled in bytes.
    """
    from tokenizers import pre_tokenizers
    from transformers import Qwen2Tokenizer

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[ch] = len(vocab)
    tokenizer = Qwen2Tokenizer(
        vocab=vocab,
        merges=[],
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
    )
    install_chat_template(tokenizer, add_tokens=tool_tokens)
    return tokenizer


def default_cache_dir() -> Path:
    """Where made-up models live: $HYBRIDRL_CACHE, else ~/.cache/hybridrl."""
    root = os.environ.get("HYBRIDRL_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "hybridrl")
    return Path(root)


def decoder_shape(spec: dict) -> dict:
    """The decoder's size keys of a tiny model's shape dict, as transformers' Qwen2 configs name them."""
    keys = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "intermediate_size")
    return {k: spec[k] for k in keys}


def ensure_tiny_model(
    cache_dir: str | os.PathLike | None = None, pretrain_spec: PretrainSpec | None = None, **shape
) -> Path:
    """Return the folder of the tiny model with this shape (and pre-training), creating it on first use.

    The folder is written under a temporary name and renamed when complete, so a run killed
    half-way never leaves a folder that looks finished.
    """
    from transformers import AutoModelForCausalLM, Qwen2Config

    spec = tiny_model_config(**shape)
    if pretrain_spec is not None and pretrain_spec.steps > 0:
        spec["pretrain"] = pretrain_spec.key()  # a random-init model keeps the key it always had
    key = hashlib.sha1(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:10]
    root = Path(cache_dir) if cache_dir else default_cache_dir()
    target = root / f"tiny-qwen2-{key}"
    if (target / "config.json").exists():
        return target
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".tmp-{target.name}-{os.getpid()}"

    tokenizer = build_tokenizer(tool_tokens=spec.get("tool_tokens", False))
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        **decoder_shape(spec),
        max_position_embeddings=spec["max_position_embeddings"],
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec["seed"])
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if "pretrain" in spec:
        log.info(
            "making the tiny model: %d steps of pre-training on digit text, once (cached in %s)",
            pretrain_spec.steps,
            target,
        )
        losses = pretrain(model, tokenizer, pretrain_spec)
        log.info("tiny model pre-trained: loss %.3f -> %.3f", losses[0], sum(losses[-50:]) / len(losses[-50:]))
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    with no_progress_bars():
        model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    try:
        os.replace(tmp, target)
    except OSError:
        # Another process finished first; its folder is equally good.
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return target
