"""Tiny models with a scalar head, made locally with no network, for `algorithm=ppo` and `reward_model=tiny`.

- The tiny **critic** needs no folder of its own: the critic loads the tiny policy's folder as a
  token-classification model (`hybridrl.training.critic.load_value_model`), its body the policy's, its value head
  fresh, exactly as a real policy folder is loaded.
- The tiny **reward model** is a Qwen2 sequence-classification model with random weights and the tiny policy's
  tokenizer and chat template, saved once to the cache folder and then loaded through `from_pretrained` like a
  real one (`reward_model.models[i].path`). Its scores mean nothing: it exercises the reward-model path.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import torch

from hybridrl.models.quiet import no_progress_bars

TINY_RM_FORMAT_VERSION = 1


def tiny_reward_model_spec(
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 2,
    num_kv_heads: int = 1,
    intermediate_size: int = 192,
    seed: int = 1,
) -> dict:
    """The tiny reward model's shape as a plain dict (also its cache key)."""
    return {
        "hidden_size": hidden_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "intermediate_size": intermediate_size,
        "seed": seed,
        "format": TINY_RM_FORMAT_VERSION,
    }


def ensure_tiny_reward_model(cache_dir: str | os.PathLike | None = None, **shape) -> Path:
    """The folder of the tiny reward model with this shape and seed, made on first use (written under a temporary
    name and renamed when complete, so a killed run never leaves a folder that looks finished)."""
    from transformers import AutoModelForSequenceClassification, Qwen2Config

    from hybridrl.models.tiny import build_tokenizer, decoder_shape, default_cache_dir

    spec = tiny_reward_model_spec(**shape)
    key = hashlib.sha1(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:10]
    root = Path(cache_dir) if cache_dir else default_cache_dir()
    target = root / f"tiny-qwen2-rm-{key}"
    if (target / "config.json").exists():
        return target
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".tmp-{target.name}-{os.getpid()}"
    tokenizer = build_tokenizer()
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        **decoder_shape(spec),
        max_position_embeddings=512,
        num_labels=1,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec["seed"])
        model = AutoModelForSequenceClassification.from_config(config, dtype=torch.float32)
        with torch.no_grad():  # a head of unit scale, so scores of different texts differ visibly
            model.score.weight.normal_(0.0, 1.0 / spec["hidden_size"] ** 0.5)
    with no_progress_bars():
        model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    try:
        os.replace(tmp, target)
    except OSError:  # another process finished first; its folder is equally good
        shutil.rmtree(tmp, ignore_errors=True)
    return target
