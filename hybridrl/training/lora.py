"""LoRA on the actor through PEFT: target check, wrapping, the base as the reference, adapter-only checkpoints.

With `model.lora.rank` set, the actor is built as::

    check_target_modules(path, model_cfg)               # before any weight loads: names exist in this architecture
    model = load_causal_lm(path, model_cfg, frozen_dtype)   # the base, stored like a frozen model (bf16 on GPU)
    peft = wrap_with_lora(model, model_cfg.lora, seed)  # adapters in float32; `model` is PEFT's inner HF model
    shard_model(model, mesh, mp)                         # FSDP2 over base + adapters; AdamW over adapters only
    with peft.disable_adapter(): ref_logp = ...          # the reference policy: the same base, adapters off

The resharder merges W + (alpha/rank)·B·A on the fly (`reshard/lora_merge.py`); a checkpoint holds the adapters and
their optimizer state (the base comes from `model.path` again); `hybridrl/export.py` writes the PEFT adapter folder
or, with `--merge`, the merged model.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
from torch import nn

from hybridrl.errors import ConfigError
from hybridrl.models.config import LoraOptions, ModelConfig
from hybridrl.models.vision import is_vision_language
from hybridrl.training.fsdp import decoder_layers
from hybridrl.training.offload import local_tensor
from hybridrl.training.vision import VISION_MODULES


def decoder_linear_names(model: nn.Module) -> set[str]:
    """Names (last path component) of the nn.Linear modules inside the model's decoder layers."""
    return {
        name.rsplit(".", 1)[-1]
        for layer in decoder_layers(model)[:1]
        for name, m in layer.named_modules()
        if isinstance(m, nn.Linear)
    }


def check_target_modules(model_path: str, model_cfg: ModelConfig) -> None:
    """ConfigError naming `model.lora.target_modules` when a name is not a linear layer of this architecture's
    decoder; decided from config.json alone (the model is built on the meta device: no weight is read)."""
    from hybridrl.models.loading import load_hf_config
    from hybridrl.models.vision import model_class

    config = load_hf_config(model_path, model_cfg.trust_remote_code)
    with torch.device("meta"):
        skeleton = model_class(config).from_config(config, trust_remote_code=model_cfg.trust_remote_code)
    known = decoder_linear_names(skeleton)
    unknown = [n for n in model_cfg.lora.target_modules if n not in known]
    if unknown:
        raise ConfigError(
            f"model.lora.target_modules: {unknown} are not linear layers of the "
            f"{getattr(config, 'model_type', '?')} decoder; choose from {sorted(known)}"
        )


def peft_config(opts: LoraOptions, exclude: str | None = None):
    """PEFT's LoraConfig for `model.lora` (plain LoRA: no bias, no DoRA); `exclude`, a regex of module names that
    get no adapter (a vision-language model's tower, whose MLP shares the decoder's projection names)."""
    from peft import LoraConfig

    return LoraConfig(
        r=opts.rank,
        lora_alpha=opts.alpha,
        lora_dropout=opts.dropout,
        target_modules=list(opts.target_modules),
        exclude_modules=exclude,
        bias="none",
        task_type="CAUSAL_LM",
    )


def wrap_with_lora(model: nn.Module, opts: LoraOptions, seed: int):
    """Inject adapters into `model` in place and return the PeftModel around it (only adapters train).

    Adapters are initialized from `seed` alone (every rank builds the same A, as FSDP needs; B starts at 0, so the
    policy starts equal to the base) without disturbing the global RNG streams; PEFT keeps them in float32 when the
    base is stored in bfloat16.
    """
    from peft import get_peft_model

    devices = [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    with torch.random.fork_rng(devices=devices), warnings.catch_warnings():
        # PEFT reads transformers' deprecated `is_gradient_checkpointing` (a FutureWarning on every run, ours to
        # neither fix nor act on).
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        torch.manual_seed(seed)
        exclude = VISION_MODULES if is_vision_language(model.config) else None  # adapters on the language part
        return get_peft_model(model, peft_config(opts, exclude), autocast_adapter_dtype=True)


def lora_memory_stats(model: nn.Module) -> dict[str, float]:
    """GiB of this rank's adapter and frozen base shards; the reference costs nothing (it is the base)."""
    trainable = frozen = 0
    for p in model.parameters():
        nbytes = local_tensor(p).numel() * p.element_size()
        if p.requires_grad:
            trainable += nbytes
        else:
            frozen += nbytes
    return {"lora_adapter_gb": trainable / 2**30, "lora_base_gb": frozen / 2**30, "ref_copy_gb": 0.0}


def load_adapter_weights(checkpoint: str | Path, model: nn.Module) -> None:
    """The adapters of a LoRA checkpoint into `model` (the inner HF model of a fresh `wrap_with_lora`), one process."""
    import torch.distributed.checkpoint as dcp

    wanted = {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}
    state = {"model": dict(wanted)}
    dcp.load(state, checkpoint_id=str(Path(checkpoint) / "dcp"), no_dist=True)
    with torch.no_grad():
        for name, value in state["model"].items():
            if value is not wanted[name]:
                wanted[name].copy_(value)


def export_model(base: nn.Module, opts: LoraOptions, checkpoint: str | Path, merge: bool) -> nn.Module:
    """What `hybridrl/export.py` saves for a LoRA checkpoint: the PeftModel (its `save_pretrained` writes the
    adapter folder), or with `merge` the base with the adapters merged in (a plain HF model)."""
    peft = wrap_with_lora(base, opts, seed=0)
    load_adapter_weights(checkpoint, peft.get_base_model())
    return peft.merge_and_unload() if merge else peft
