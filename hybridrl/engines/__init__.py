"""Rollout engines behind one interface (`RolloutEngine`): native (built in), vLLM, SGLang."""

from __future__ import annotations

import torch

from hybridrl.engines.base import Completion, RolloutEngine, SamplingParams
from hybridrl.engines.config import EngineConfig
from hybridrl.models.config import ModelConfig

__all__ = ["Completion", "EngineConfig", "RolloutEngine", "SamplingParams", "build_engine", "engine_dtype"]


def engine_dtype(cfg: EngineConfig, device: torch.device) -> torch.dtype:
    """The engine's weight dtype: `engine.dtype`, or float32 on CPU / bfloat16 on GPU for auto."""
    if cfg.dtype == "auto":
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    return getattr(torch, cfg.dtype)


def build_engine(
    cfg: EngineConfig,
    model_cfg: ModelConfig,
    model_path: str,
    tokenizer,
    device: torch.device,
    *,
    tp_rank: int = 0,
    tp_size: int = 1,
    seed: int = 0,
    tp_group=None,
) -> RolloutEngine:
    """The engine `engine.name` names, loaded from the same checkpoint as the trainer. `tp_group` is this rank's
    engine TP group (`engines.fused.groups.engine_tp_group`); the native fused engine shards over it."""
    if cfg.name == "native":
        from hybridrl.engines.native import NativeEngine, native_impl
        from hybridrl.models.loading import load_causal_lm

        dtype = engine_dtype(cfg, device)
        model = load_causal_lm(model_path, model_cfg, dtype, device)
        eos = eos_ids(tokenizer, model)
        if native_impl(cfg, model.config, tp_size, tp_group) == "hf":
            return NativeEngine(model, eos, tokenizer.pad_token_id, cfg.max_batch_size)
        engine = NativeEngine.fused(model.config, eos, tokenizer.pad_token_id, device=device, dtype=dtype, cfg=cfg,
                                    tp_group=tp_group, seed=seed)
        engine.load_from(model)  # this rank's fused shards, cut by the resharder from the full model
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
        return engine
    if cfg.name == "vllm":
        from hybridrl.engines.vllm_engine import VllmEngine

        return VllmEngine(model_path, cfg, tp_rank=tp_rank, tp_size=tp_size, seed=seed, device=device.type)
    if cfg.name == "sglang":
        from hybridrl.engines.sglang_engine import SglangEngine

        return SglangEngine(model_path, cfg, tp_rank=tp_rank, tp_size=tp_size, seed=seed, device=device.type)
    raise ValueError(f"unknown engine {cfg.name!r}")


def eos_ids(tokenizer, model=None) -> list[int]:
    """Every token id that ends a sample: the tokenizer's EOS and the model's generation-config EOS."""
    ids = {tokenizer.eos_token_id}
    gen = getattr(model, "generation_config", None)
    extra = getattr(gen, "eos_token_id", None)
    if isinstance(extra, int):
        ids.add(extra)
    elif extra:
        ids.update(extra)
    return sorted(i for i in ids if i is not None)
