"""What the fused decoder supports of an HF config, and its rotary-embedding tables.

Unsupported features raise `UnsupportedModel`, so `engine.native.impl=auto` falls back to the transformers model.
"""

from __future__ import annotations

import torch

from hybridrl.errors import HybridRLError
from hybridrl.models.shape import SUPPORTED_MODEL_TYPES

# RoPE types whose frequencies are fixed at start-up (computed once by transformers' own init function).
# "dynamic" and "longrope" rescale with the sequence length at run time: not supported here.
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


class UnsupportedModel(HybridRLError):
    """The fused decoder cannot run this model; use the transformers path (`engine.native.impl=hf`)."""


def rope_parameters(config) -> dict:
    """The config's RoPE settings as one flat dict with `rope_type` and `rope_theta` (transformers 4.x and 5.x)."""
    params = getattr(config, "rope_parameters", None)
    if params is None:  # transformers 4.x: rope_theta + rope_scaling
        params = dict(getattr(config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    params = dict(params)
    if "rope_theta" not in params and any(isinstance(v, dict) for v in params.values()):
        raise UnsupportedModel(f"RoPE parameters per layer type ({sorted(params)})")
    params.setdefault("rope_type", params.get("type", "default"))
    return params


def mrope_section(config) -> list[int] | None:
    """A Qwen2-VL / Qwen2.5-VL language model's multimodal RoPE sections (rotary frequencies per axis: temporal,
    height, width; they sum to head_dim / 2), or None for a text model."""
    from hybridrl.models.vision import is_vision_language, text_config

    if not is_vision_language(config):
        return None
    return list(rope_parameters(text_config(config)).get("mrope_section") or [])


def check_supported(config) -> None:
    """Raise `UnsupportedModel` naming the first feature of `config` the fused decoder does not implement. Of a
    vision-language config, its language model's: Qwen2-VL's and Qwen2.5-VL's (a Qwen2 decoder with multimodal RoPE
    in sections), not Qwen3-VL's (interleaved sections)."""
    from hybridrl.models.vision import VISION_MODEL_TYPES, is_vision_language, text_config

    if is_vision_language(config):
        model_type = VISION_MODEL_TYPES[config.model_type]
        if model_type != "qwen2":
            raise UnsupportedModel(f"model_type {config.model_type!r} (fused decoder: qwen2_vl, qwen2_5_vl)")
        text = text_config(config)
        sections = mrope_section(config)
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        if len(sections) != 3 or sum(sections) != head_dim // 2:
            raise UnsupportedModel(
                f"mrope_section {sections} (three sections summing to head_dim / 2 = {head_dim // 2})"
            )
        config = text
    else:
        model_type = getattr(config, "model_type", "")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModel(f"model_type {model_type!r} (fused decoder: {', '.join(SUPPORTED_MODEL_TYPES)})")
    if getattr(config, "hidden_act", "silu") != "silu":
        raise UnsupportedModel(f"hidden_act {config.hidden_act!r} (fused decoder: silu)")
    sliding = "sliding_attention" in (getattr(config, "layer_types", None) or [])
    if sliding or getattr(config, "use_sliding_window", False):
        raise UnsupportedModel("sliding-window attention")
    rope = rope_parameters(config)
    if rope["rope_type"] not in STATIC_ROPE_TYPES:
        raise UnsupportedModel(f"rope_type {rope['rope_type']!r} (fused decoder: {', '.join(STATIC_ROPE_TYPES)})")
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        raise UnsupportedModel(f"partial_rotary_factor {rope['partial_rotary_factor']}")


def inv_freq(config) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [head_dim / 2] in float32, cos/sin scale), exactly as transformers computes them."""
    from hybridrl.models.vision import text_config

    check_supported(config)
    config = text_config(config)
    rope = rope_parameters(config)
    if rope["rope_type"] == "default":
        dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        base = rope["rope_theta"]
        return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)), 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    freqs, scale = ROPE_INIT_FUNCTIONS[rope["rope_type"]](config)
    return freqs.float().cpu(), float(scale)


def rope_tables(config, length: int, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [length, head_dim] for positions 0..length-1: float32 math, then cast (as transformers does)."""
    freqs_1, scale = inv_freq(config)
    # On the engine's device, as transformers computes them per forward there (same kernels, same rounding).
    freqs = torch.arange(length, dtype=torch.float, device=device)[:, None] * freqs_1.to(device)[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype)
