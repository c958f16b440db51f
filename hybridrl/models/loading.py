"""Load the policy and tokenizer through `from_pretrained`, for tiny and real models alike."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from hybridrl.errors import ConfigError
from hybridrl.models.config import ModelConfig
from hybridrl.models.pretrain import PretrainSpec
from hybridrl.models.tiny import ensure_tiny_model

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_model_path(cfg: ModelConfig) -> str:
    """The folder to load: the user's `model.path`, or the tiny model (made on first use)."""
    if cfg.path is None:
        t = cfg.tiny
        return str(
            ensure_tiny_model(
                cfg.cache_dir,
                hidden_size=t.hidden_size,
                num_layers=t.num_layers,
                num_heads=t.num_heads,
                num_kv_heads=t.num_kv_heads,
                intermediate_size=t.intermediate_size,
                seed=t.seed,
                pretrain_spec=PretrainSpec(steps=t.pretrain_steps, seed=t.seed),
            )
        )
    path = Path(os.path.expanduser(cfg.path))
    if not (path / "config.json").is_file():
        raise ConfigError(
            f"model.path={cfg.path!r} is not a Hugging Face model folder (no config.json there); "
            "point it at a local folder such as the output of `huggingface-cli download`"
        )
    return str(path)


def load_tokenizer(path: str, trust_remote_code: bool = False):
    """The model's tokenizer; pad falls back to EOS (decoder-only models often have no pad)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def load_causal_lm(path: str, cfg: ModelConfig, dtype: torch.dtype, device: torch.device | str = "cpu"):
    """A causal LM from `path` in `dtype` on `device`, with the configured attention kernel."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        path,
        dtype=dtype,
        attn_implementation=cfg.attn_implementation,
        trust_remote_code=cfg.trust_remote_code,
    )
    return model.to(device)
