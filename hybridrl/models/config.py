"""Config of the policy model (`model=tiny` or `model=hf model.path=...`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from hybridrl.errors import ConfigError


@dataclass
class TinyModelOptions:
    """Shape of the locally made tiny Qwen2 model (`model.tiny.*`)."""

    hidden_size: int = 64
    """Width of the residual stream."""
    num_layers: int = 2
    """Decoder layers."""
    num_heads: int = 2
    """Attention (query) heads."""
    num_kv_heads: int = 1
    """Key/value heads (GQA when fewer than num_heads)."""
    intermediate_size: int = 192
    """MLP width."""
    seed: int = 0
    """Seed of the random initialization and of the pre-training text (part of the cache key)."""
    tool_tokens: bool = False
    """Give the tokenizer the four tool-call tags as tokens of their own (the agent recipe); part of the cache key."""
    pretrain_steps: int = 0
    """Steps of language-model pre-training on generic digit text when the model is first made (0 = random
    init; hybridrl/models/pretrain.py says what it teaches). Part of the cache key."""

    def __post_init__(self) -> None:
        if self.pretrain_steps < 0:
            raise ConfigError(f"model.tiny.pretrain_steps must be >= 0, got {self.pretrain_steps}")


@dataclass
class TinyVLOptions:
    """Shape of the locally made tiny vision-language model (`model=tiny_vl`, `model.tiny_vl.*`)."""

    arch: str = "qwen2_vl"
    """qwen2_vl (Qwen2VLConfig) or qwen2_5_vl (Qwen2_5_VLConfig: windowed vision attention, gated vision MLP)."""
    hidden_size: int = 64
    """Width of the language model's residual stream (and of the image embeddings the merger outputs)."""
    num_layers: int = 2
    """Language model decoder layers."""
    num_heads: int = 2
    """Attention (query) heads of the language model."""
    num_kv_heads: int = 1
    """Key/value heads of the language model."""
    intermediate_size: int = 192
    """Language model MLP width."""
    vision_depth: int = 2
    """Blocks of the vision encoder."""
    vision_width: int = 32
    """Width of the vision encoder."""
    image_size: int = 112
    """Largest image side the processor keeps (images are resized to at most this many pixels squared, in multiples
    of 28): 112 gives 16 image tokens."""
    seed: int = 0
    """Seed of the random initialization and of the pre-training (part of the cache key)."""
    pretrain_steps: int = 0
    """Steps of language-model pre-training on digit text when the model is first made (as model.tiny's); 0 = none.
    Part of the cache key."""
    tower_steps: int = 0
    """Then steps teaching the vision tower alone what each picture cell holds (hybridrl/models/pretrain_vl.py says
    why captions alone are not enough on every machine); 0 = none. Part of the cache key."""
    caption_steps: int = 0
    """Then steps on captioned pictures of shapes, every other one on digit text (hybridrl/models/pretrain_vl.py
    says why a random vision tower needs them); 0 = none. Part of the cache key."""

    def __post_init__(self) -> None:
        if self.arch not in ("qwen2_vl", "qwen2_5_vl"):
            raise ConfigError(f"model.tiny_vl.arch must be qwen2_vl or qwen2_5_vl, got {self.arch!r}")
        for key in ("pretrain_steps", "tower_steps", "caption_steps"):
            if getattr(self, key) < 0:
                raise ConfigError(f"model.tiny_vl.{key} must be >= 0, got {getattr(self, key)}")
        if self.image_size < 28 or self.image_size % 28:
            raise ConfigError(f"model.tiny_vl.image_size must be a multiple of 28 (>= 28), got {self.image_size}")


#: The linear projections of a Llama / Qwen2 / Qwen3 decoder layer: LoRA's default targets.
DECODER_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass
class LoraOptions:
    """LoRA adapters on the policy (`model.lora.*`), through PEFT; off while `rank` is unset."""

    rank: Optional[int] = None
    """Rank r of each adapter (B·A with A: r × in, B: out × r); null = full fine-tuning, no adapters."""
    alpha: float = 16.0
    """Scale numerator: a layer computes W·x + (alpha / rank)·B·A·x (verl's and OpenRLHF's default, 16)."""
    dropout: float = 0.0
    """Dropout on the adapters' input during the update (PEFT's lora_dropout)."""
    target_modules: list[str] = field(default_factory=lambda: list(DECODER_PROJECTIONS))
    """Names of the decoder's linear layers that get adapters (default: every projection, q/k/v/o/gate/up/down)."""

    @property
    def enabled(self) -> bool:
        """Whether the policy trains adapters instead of its weights."""
        return self.rank is not None

    @property
    def scale(self) -> float:
        """alpha / rank, the factor on B·A."""
        return self.alpha / self.rank

    def __post_init__(self) -> None:
        if self.rank is not None and self.rank <= 0:
            raise ConfigError(f"model.lora.rank must be > 0, got {self.rank} (leave it unset for full fine-tuning)")
        if self.alpha <= 0:
            raise ConfigError(f"model.lora.alpha must be > 0, got {self.alpha}")
        if not 0 <= self.dropout < 1:
            raise ConfigError(f"model.lora.dropout must be in [0, 1), got {self.dropout}")
        names = list(self.target_modules)
        if not names or any(not n or "." in n for n in names) or len(set(names)) != len(names):
            raise ConfigError(
                f"model.lora.target_modules must be distinct module names such as q_proj (no dots), got {names}"
            )


@dataclass
class ModelConfig:
    """The policy: a Hugging Face causal LM folder, or the tiny model made locally."""

    name: str = "tiny"
    """tiny (made locally), tiny_vl (a tiny vision-language model made locally) or hf (a Hugging Face model given by
    model.path)."""
    path: Optional[str] = None
    """A folder with config.json, weights and tokenizer (any HF causal LM), or a Hub id (Qwen/Qwen2.5-0.5B-Instruct:
    fetched into the huggingface_hub cache, read from it alone with HF_HUB_OFFLINE=1); None builds the tiny model."""
    tiny: TinyModelOptions = field(default_factory=TinyModelOptions)
    """Shape of the tiny model, used when path is None."""
    tiny_vl: TinyVLOptions = field(default_factory=TinyVLOptions)
    """Shape of the tiny vision-language model, used with model=tiny_vl."""
    cache_dir: Optional[str] = None
    """Where the tiny model is saved once; None = $HYBRIDRL_CACHE or ~/.cache/hybridrl."""
    trust_remote_code: bool = False
    """Allow model code shipped inside the folder (off by default: it runs arbitrary code)."""
    attn_implementation: str = "sdpa"
    """Attention kernel for trainer and native engine: sdpa or eager (same in both keeps log-probs equal)."""
    gradient_checkpointing: bool = False
    """Recompute activations in backward to save memory."""
    lora: LoraOptions = field(default_factory=LoraOptions)
    """LoRA adapters (`model.lora.rank=8` turns them on); the base weights stay frozen."""
    freeze_vision: bool = True
    """Vision-language models: keep the vision encoder and its projector frozen (most VL RL recipes do); the language
    model trains (or its LoRA adapters). No effect on text-only models."""

    def __post_init__(self) -> None:
        if self.name not in ("tiny", "tiny_vl", "hf"):
            raise ConfigError(f"model.name must be tiny, tiny_vl or hf, got {self.name!r}")
        if self.name == "hf" and not self.path:
            raise ConfigError("model.path is required with model=hf: model=hf model.path=/path/to/hf/model")
        if self.attn_implementation not in ("sdpa", "eager", "flash_attention_2"):
            raise ConfigError(
                f"model.attn_implementation must be sdpa, eager or flash_attention_2, got {self.attn_implementation!r}"
            )
