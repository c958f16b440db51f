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
    """tiny (made locally) or hf (a Hugging Face model given by model.path)."""
    path: Optional[str] = None
    """A folder with config.json, weights and tokenizer (any HF causal LM), or a Hub id (Qwen/Qwen2.5-0.5B-Instruct:
    fetched into the huggingface_hub cache, read from it alone with HF_HUB_OFFLINE=1); None builds the tiny model."""
    tiny: TinyModelOptions = field(default_factory=TinyModelOptions)
    """Shape of the tiny model, used when path is None."""
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

    def __post_init__(self) -> None:
        if self.name not in ("tiny", "hf"):
            raise ConfigError(f"model.name must be tiny or hf, got {self.name!r}")
        if self.name == "hf" and not self.path:
            raise ConfigError("model.path is required with model=hf: model=hf model.path=/path/to/hf/model")
        if self.attn_implementation not in ("sdpa", "eager", "flash_attention_2"):
            raise ConfigError(
                f"model.attn_implementation must be sdpa, eager or flash_attention_2, got {self.attn_implementation!r}"
            )
