"""Vision-language policies (Qwen2-VL, Qwen2.5-VL, Qwen3-VL): what the roles need to know of them beyond a causal LM.

Such a model is a decoder of a known family (the language model) behind a vision encoder whose projector ("merger")
turns each 2×2 block of image patches into one embedding; the embeddings replace the prompt's image placeholder
tokens, and the decoder's rotary positions run over three axes (temporal, height, width: mrope)::

    model = model_class(config).from_pretrained(path)         # AutoModelForImageTextToText
    embeds = vision_tower(model)(pixel_values, grid_thw)       # [image tokens, hidden]: one per placeholder
    logits = model(input_ids, pixel_values=..., image_grid_thw=..., position_ids=<mrope>)

Parameter names (transformers 5): ``model.language_model.*`` (the decoder), ``model.visual.*`` (encoder and merger),
``lm_head.*``. Weights travel to the engines under the names of the original Hub checkpoints (`checkpoint_name`):
the decoder's as a plain causal LM's (``model.layers.0...``, what the weight layouts and the fused decoder are written
for), the tower's as ``visual.*``; vLLM's and SGLang's Qwen-VL loaders take these names.
"""

from __future__ import annotations

import inspect

import torch
from torch import nn

from hybridrl.errors import ConfigError

#: Vision-language model types and the decoder family of their language model.
VISION_MODEL_TYPES: dict[str, str] = {"qwen2_vl": "qwen2", "qwen2_5_vl": "qwen2", "qwen3_vl": "qwen3"}

#: Where the decoder's parameters live inside the vision-language model (transformers 5; 4.x kept them at `model.`).
LANGUAGE_PREFIX = "model.language_model."
#: The vision tower's parameters (the encoder and its merger/projector).
VISION_PREFIX = "model.visual."


def model_type_of(config) -> str:
    """The `model_type` of a config object or of config.json's dict."""
    return (config.get("model_type") if isinstance(config, dict) else getattr(config, "model_type", None)) or ""


def is_vision_language(config) -> bool:
    """Whether the config (object or config.json dict) is of a vision-language model this project runs."""
    return model_type_of(config) in VISION_MODEL_TYPES


def text_config(config):
    """The decoder's config: `text_config` of a vision-language config, the config itself otherwise."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def model_class(config):
    """The transformers auto class that builds this config's model: image-text-to-text or causal LM."""
    import transformers

    if is_vision_language(config):
        return transformers.AutoModelForImageTextToText
    return transformers.AutoModelForCausalLM


def is_vision_param(name: str) -> bool:
    """Whether a parameter (HF name, wrapper prefixes removed) belongs to the vision tower."""
    return name.startswith(("model.visual.", "visual.")) or ".visual." in name


def checkpoint_name(name: str) -> str:
    """A vision-language model's parameter under its original checkpoint name: ``model.language_model.X`` →
    ``model.X`` (the plain causal LM's), ``model.visual.X`` → ``visual.X``; ``lm_head`` and every other name (a text
    model's) unchanged."""
    if name.startswith(LANGUAGE_PREFIX):
        return "model." + name[len(LANGUAGE_PREFIX) :]
    if name.startswith(VISION_PREFIX):
        return name[len("model.") :]
    return name


def vision_shapes(config) -> dict[str, tuple[int, ...]]:
    """Every parameter of the vision tower (encoder and merger) by checkpoint name (``visual.*``), with its shape,
    from a skeleton on the meta device (no weight is read)."""
    import torch

    with torch.device("meta"):
        skeleton = model_class(config).from_config(config)
    return {
        checkpoint_name(n): tuple(p.shape)
        for n, p in skeleton.named_parameters()
        if is_vision_param(checkpoint_name(n))
    }


def vision_tower(model: nn.Module) -> nn.Module:
    """The vision encoder with its projector (`model.model.visual`, or `model.visual` in older transformers)."""
    for owner in (getattr(model, "model", None), model):
        tower = getattr(owner, "visual", None) if owner is not None else None
        if isinstance(tower, nn.Module):
            return tower
    raise ConfigError(f"{type(model).__name__} has no vision tower (expected model.visual)")


def inner_model(model: nn.Module) -> nn.Module:
    """The module that owns `get_rope_index` and the vision tower (Qwen2VLModel inside ...ForConditionalGeneration)."""
    inner = getattr(model, "model", model)
    if not hasattr(inner, "get_rope_index"):
        raise ConfigError(f"{type(model).__name__} has no get_rope_index; it is not a Qwen-VL model")
    return inner


def tower_trains(model_cfg) -> bool:
    """Whether a vision-language policy's tower trains: `model.freeze_vision=false` without LoRA (LoRA trains
    adapters on the language model alone). The trainer freezes it otherwise, the resharder sends it only then, and
    the engines keep it across sleeps otherwise."""
    return not model_cfg.freeze_vision and not model_cfg.lora.enabled


def freeze_vision_tower(model: nn.Module) -> int:
    """Stop gradients through the vision encoder and its projector (the default of VL RL recipes: the language model
    learns to read what a pre-trained encoder sees); returns how many parameters were frozen."""
    tower = vision_tower(model)
    tower.requires_grad_(False)
    return sum(p.numel() for p in tower.parameters())


def image_token_ids(config) -> dict[str, int]:
    """The placeholder tokens of the config: image (repeated once per merged patch), vision start and end."""
    out = {}
    for key in ("image_token_id", "vision_start_token_id", "vision_end_token_id", "video_token_id"):
        value = getattr(config, key, None)
        if value is None:
            value = getattr(text_config(config), key, None)
        if value is not None:
            out[key] = int(value)
    if "image_token_id" not in out:
        raise ConfigError(f"model_type {model_type_of(config)!r}: config.json has no image_token_id")
    return out


def placeholder_ids(config) -> list[int]:
    """The tokens that stand for image (and video) embeddings: a sampled one ends its sample (a forward that reads it
    would look for pixels it has none of)."""
    ids = image_token_ids(config)
    return [ids[k] for k in ("image_token_id", "video_token_id") if k in ids]


class MropeIndex:
    """Multimodal rotary positions of one sequence, by the model's own `get_rope_index`: text tokens advance one
    position on all three axes, an image's tokens take (start, start + row, start + column) of its merged grid, and
    the text after it starts past the image's largest position. The trainer and the engines both call this, so their
    positions agree by construction::

        mrope = MropeIndex(model)
        positions = mrope(prompt_ids, grid)                     # [3, len(prompt_ids)]
        next_position = positions.max() + 1                    # the first generated token's, on all three axes
    """

    def __init__(self, model: nn.Module) -> None:
        self.inner = inner_model(model)
        self.image_token_id = image_token_ids(model.config)["image_token_id"]
        # transformers >= 5.2x takes the token types the processor returns; earlier versions find images by token id
        self._takes_token_types = "mm_token_type_ids" in inspect.signature(self.inner.get_rope_index).parameters

    def __call__(self, ids: list[int], image_grid_thw: torch.Tensor | None) -> torch.Tensor:
        """Positions [3, len(ids)] of a sequence whose images have grids `image_grid_thw` ([images, 3], or None)."""
        x = torch.tensor([ids], dtype=torch.long)
        if image_grid_thw is None or not len(image_grid_thw):
            return torch.arange(len(ids)).expand(3, -1).clone()
        kwargs: dict = {"image_grid_thw": image_grid_thw}
        if self._takes_token_types:
            kwargs["mm_token_type_ids"] = (x == self.image_token_id).int()
        positions, _ = self.inner.get_rope_index(x, **kwargs)
        return positions[:, 0]


def build_vision_tower(config, dtype: torch.dtype, device: torch.device | str) -> tuple[nn.Module, nn.Module]:
    """(the vision tower with its merger, made from `config` on `device` with random weights to be loaded; the
    whole model as a skeleton on the meta device, whose `get_rope_index` `MropeIndex` calls): what an engine holding
    only the language model's weights needs of the rest."""
    with torch.device("meta"):
        skeleton = model_class(config).from_config(config)
    with torch.device(device):
        tower = type(vision_tower(skeleton))._from_config(config.vision_config, dtype=dtype)
    return tower.to(dtype).eval().requires_grad_(False), skeleton


def merged_embeddings(output) -> torch.Tensor:
    """The tower's merged image tokens [tokens, hidden] from its output (a tensor in older transformers, an output
    object with `pooler_output` in 5.x)."""
    return output if isinstance(output, torch.Tensor) else output.pooler_output
