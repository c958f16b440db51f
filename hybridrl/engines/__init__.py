"""Rollout engines behind one interface (`RolloutEngine`): native (built in), vLLM, SGLang."""

from __future__ import annotations

import torch

from hybridrl.engines.base import Completion, RolloutEngine, SamplingParams
from hybridrl.engines.config import EngineConfig
from hybridrl.models.config import ModelConfig
from hybridrl.topology import Topology

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
    topology: Topology,
    *,
    seed: int = 0,
) -> RolloutEngine:
    """The engine `engine.name` names, for this rank of `topology`; the only place an implementation is chosen.

    vLLM, SGLang and the native engine's transformers path load the checkpoint themselves. The native fused
    engine starts with empty weights (`RolloutEngine.starts_empty`): the caller fills them with the resharder,
    exactly as every later weight sync does. TP process groups are made by the topology, and only for the
    engines that run collectives of their own.
    """
    if cfg.name == "native":
        from hybridrl.engines.native.hf import HFEngine, native_impl
        from hybridrl.models.loading import load_causal_lm, load_hf_config

        dtype = engine_dtype(cfg, device)
        hf_config = load_hf_config(model_path, model_cfg.trust_remote_code)
        if native_impl(cfg, hf_config, topology.engine_tp_size) == "hf":
            from hybridrl.engines.native.vision_hf import VisionHFEngine
            from hybridrl.models.vision import is_vision_language, tower_trains

            model = load_causal_lm(model_path, model_cfg, dtype, device)
            eos, pad = eos_ids(tokenizer, model), tokenizer.pad_token_id
            if is_vision_language(hf_config):
                return VisionHFEngine(model, eos, pad, cfg.native.max_batch_size, tower_trains(model_cfg))
            return HFEngine(model, eos, pad, cfg.native.max_batch_size)
        from hybridrl.engines.native.engine import FusedEngine

        eos = eos_ids(tokenizer, generation_config=load_generation_config(model_path, hf_config))
        from hybridrl.models.vision import is_vision_language, tower_trains

        return FusedEngine(
            hf_config,
            eos,
            tokenizer.pad_token_id,
            device=device,
            dtype=dtype,
            options=cfg.native,
            tp_group=topology.engine_tp_group(),
            seed=seed,
            tower_trains=is_vision_language(hf_config) and tower_trains(model_cfg),
        )
    if cfg.name == "vllm":
        from hybridrl.engines.vllm.engine import VllmEngine

        return VllmEngine(
            model_path,
            cfg,
            topology=topology,
            seed=seed,
            device=device.type,
            trust_remote_code=model_cfg.trust_remote_code,
        )
    if cfg.name == "sglang":
        from hybridrl.engines.sglang.engine import SglangEngine

        return SglangEngine(model_path, cfg, topology=topology, seed=seed, device=device.type)
    raise ValueError(f"unknown engine {cfg.name!r}")


def load_generation_config(model_path: str, hf_config):
    """The checkpoint's generation config (its EOS ids), as `from_pretrained` would attach it to the model."""
    from transformers import GenerationConfig

    try:
        return GenerationConfig.from_pretrained(model_path)
    except OSError:  # no generation_config.json: transformers derives one from the model config
        return GenerationConfig.from_model_config(hf_config)


def eos_ids(tokenizer, model=None, generation_config=None) -> list[int]:
    """Every token id that ends a sample: the tokenizer's EOS and the model's generation-config EOS."""
    ids = {tokenizer.eos_token_id}
    gen = generation_config if generation_config is not None else getattr(model, "generation_config", None)
    extra = getattr(gen, "eos_token_id", None)
    if isinstance(extra, int):
        ids.add(extra)
    elif extra:
        ids.update(extra)
    return sorted(i for i in ids if i is not None)
