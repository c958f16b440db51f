"""Load the policy and tokenizer through `from_pretrained`, for tiny and real models alike (a local folder or a
Hugging Face Hub id)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from hybridrl.errors import ConfigError
from hybridrl.models.config import ModelConfig
from hybridrl.models.hub import hub_command, hub_snapshot, looks_like_hub_id
from hybridrl.models.pretrain import PretrainSpec
from hybridrl.models.quiet import no_progress_bars
from hybridrl.models.tiny import ensure_tiny_model

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_model_path(cfg: ModelConfig) -> str:
    """The folder to load: the user's `model.path` (a folder or a Hub id), or the tiny model (made on first use)."""
    if cfg.path is None and cfg.name == "tiny_vl":
        from hybridrl.models.pretrain_vl import CaptionSpec
        from hybridrl.models.tiny_vl import ensure_tiny_vl_model

        v = cfg.tiny_vl
        return str(
            ensure_tiny_vl_model(
                cfg.cache_dir,
                arch=v.arch,
                hidden_size=v.hidden_size,
                num_layers=v.num_layers,
                num_heads=v.num_heads,
                num_kv_heads=v.num_kv_heads,
                intermediate_size=v.intermediate_size,
                vision_depth=v.vision_depth,
                vision_width=v.vision_width,
                image_size=v.image_size,
                seed=v.seed,
                pretrain_spec=PretrainSpec(steps=v.pretrain_steps, seed=v.seed),
                caption_spec=CaptionSpec(steps=v.caption_steps, seed=v.seed, tower_steps=v.tower_steps),
            )
        )
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
                tool_tokens=t.tool_tokens,
                pretrain_spec=PretrainSpec(steps=t.pretrain_steps, seed=t.seed),
            )
        )
    return resolve_path(cfg.path)


def resolve_path(path: str, key: str = "model.path") -> str:
    """A local Hugging Face model folder for `path`: the folder itself, or a Hub id's snapshot in the
    huggingface_hub cache (`hybridrl.models.hub`). Raises ConfigError naming `key` and what to give instead."""
    local = Path(os.path.expanduser(path))
    if (local / "config.json").is_file():
        return str(local)
    if (local / "meta.json").is_file():
        raise ConfigError(
            f"{key}={path!r} is a hybridrl checkpoint, not a model folder: evaluate it with "
            f"`python -m hybridrl.evaluate model.path={path}`, or write a model folder with "
            f"`python -m hybridrl.export --checkpoint {path} --output <folder>`"
        )
    if local.is_dir():
        raise ConfigError(
            f"{key}={path!r} is not a Hugging Face model folder (no config.json there); give a folder with "
            f"config.json, weights and tokenizer (such as the output of `{hub_command('download')} <id> "
            "--local-dir <folder>`), or a Hub id such as Qwen/Qwen2.5-0.5B-Instruct"
        )
    if looks_like_hub_id(path):
        return hub_snapshot(path, key)
    raise ConfigError(
        f"{key}={path!r}: no such folder; give a local Hugging Face model folder or a Hub id such as "
        "Qwen/Qwen2.5-0.5B-Instruct"
    )


def check_supported_architecture(model_path: str, trust_remote_code: bool = False, key: str = "model.path") -> str:
    """Decide from `config.json` alone, before any weights load, whether every role can run this model.

    The trainer, the reference and the transformers fallback of the native engine take any causal LM
    transformers knows; the trainer -> engine weight sync (reshard) has layouts for the model types in
    `hybridrl.reshard.layout.SUPPORTED_MODEL_TYPES` only, so those decide. Returns the model_type;
    raises ConfigError naming `key`, the folder and what is wrong.
    """
    from hybridrl.models.shape import SUPPORTED_MODEL_TYPES

    where = f"{key}={model_path!r}"
    try:
        config = json.loads((Path(model_path) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ConfigError(f"{where}: config.json cannot be read as JSON ({e})") from None
    if not isinstance(config, dict) or not isinstance(config.get("model_type"), str):
        raise ConfigError(f"{where}: config.json has no model_type; is this a Hugging Face model folder?")
    model_type = config["model_type"]
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    if model_type not in CONFIG_MAPPING_NAMES:
        if config.get("auto_map") and not trust_remote_code:
            raise ConfigError(
                f"{where}: model_type {model_type!r} is defined by code inside the folder; set "
                "model.trust_remote_code=true only if you trust that code"
            )
        if not config.get("auto_map"):
            import transformers

            raise ConfigError(
                f"{where}: model_type {model_type!r} is unknown to the installed transformers "
                f"{transformers.__version__}"
            )
    from hybridrl.models.vision import VISION_MODEL_TYPES

    archs = config.get("architectures") or []
    generative = ("ForCausalLM", "LMHeadModel") + (
        ("ForConditionalGeneration",) if model_type in VISION_MODEL_TYPES else ()
    )
    if archs and not any(a.endswith(generative) for a in archs):
        raise ConfigError(f"{where}: the folder holds a {', '.join(archs)}, not a causal language model")
    if model_type not in SUPPORTED_MODEL_TYPES and model_type not in VISION_MODEL_TYPES:
        raise ConfigError(
            f"{where}: model_type {model_type!r} is not supported: the trainer -> engine weight sync has layouts "
            f"for {', '.join(SUPPORTED_MODEL_TYPES + tuple(VISION_MODEL_TYPES))} only"
        )
    return model_type


def load_tokenizer(path: str, trust_remote_code: bool = False):
    """The model's tokenizer; pad falls back to EOS (decoder-only models often have no pad)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def load_hf_config(path: str, trust_remote_code: bool = False):
    """The model's config (config.json) alone, without loading any weight."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)


def load_causal_lm(path: str, cfg: ModelConfig, dtype: torch.dtype, device: torch.device | str = "cpu"):
    """A causal LM from `path` in `dtype` on `device`, with the configured attention kernel (a vision-language model
    with its vision tower: `hybridrl.models.vision`)."""
    from hybridrl.models.vision import model_class

    auto = model_class(load_hf_config(path, cfg.trust_remote_code))
    with no_progress_bars():
        model = auto.from_pretrained(
            path,
            dtype=dtype,
            attn_implementation=cfg.attn_implementation,
            trust_remote_code=cfg.trust_remote_code,
        )
    return model.to(device)
