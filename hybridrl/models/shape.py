"""The dimensions of a Llama / Qwen2 / Qwen3 decoder that decide how its weights are laid out.

Both sides of a weight sync read them: the resharder (which tensors exist and how one TP rank's shard is cut) and
the native fused engine (which parameters it allocates).
"""

from __future__ import annotations

from dataclasses import dataclass

from hybridrl.errors import ConfigError

VOCAB_PAD = 64  # vLLM and SGLang pad the vocab to a multiple of 64 rows before splitting it
SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3")


@dataclass(frozen=True)
class ModelShape:
    """The dimensions of a Llama/Qwen2/Qwen3 decoder that decide its weight layout."""

    model_type: str
    num_layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool

    @classmethod
    def from_hf_config(cls, config) -> ModelShape:
        """Read the shape from an HF `PretrainedConfig` (LlamaConfig, Qwen2Config, Qwen3Config; of a vision-language
        config, its language model's, named as its decoder family: qwen2 for Qwen2-VL and Qwen2.5-VL)."""
        from hybridrl.models.vision import VISION_MODEL_TYPES

        model_type = getattr(config, "model_type", "")
        tied_override = None
        if model_type in VISION_MODEL_TYPES:
            # The top-level flag is the one from_pretrained ties lm_head by (the text config may not repeat it).
            tied_override = getattr(config, "tie_word_embeddings", None)
            config, model_type = config.get_text_config(), VISION_MODEL_TYPES[model_type]
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(
                f"reshard: model_type {model_type!r} has no weight layout; "
                f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        heads = config.num_attention_heads
        attention_bias = bool(getattr(config, "attention_bias", False))
        return cls(
            model_type=model_type,
            num_layers=config.num_hidden_layers,
            hidden=config.hidden_size,
            heads=heads,
            kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
            intermediate=config.intermediate_size,
            vocab=config.vocab_size,
            tied=bool(getattr(config, "tie_word_embeddings", False) if tied_override is None else tied_override),
            # Qwen2 hard-codes bias on q/k/v (none on o_proj); Llama/Qwen3 follow `attention_bias` for q/k/v/o.
            qkv_bias=True if model_type == "qwen2" else attention_bias,
            o_bias=False if model_type == "qwen2" else attention_bias,
            mlp_bias=bool(getattr(config, "mlp_bias", False)),
            qk_norm=model_type == "qwen3",
        )

    def hf_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every HF parameter name of the causal LM and its full shape, in module order."""
        h, d, inter = self.hidden, self.head_dim, self.intermediate
        shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (self.vocab, h)}
        for i in range(self.num_layers):
            a, m = f"model.layers.{i}.self_attn", f"model.layers.{i}.mlp"
            qkv_rows = (("q_proj", self.heads * d), ("k_proj", self.kv_heads * d), ("v_proj", self.kv_heads * d))
            for proj, rows in qkv_rows:
                shapes[f"{a}.{proj}.weight"] = (rows, h)
                if self.qkv_bias:
                    shapes[f"{a}.{proj}.bias"] = (rows,)
            shapes[f"{a}.o_proj.weight"] = (h, self.heads * d)
            if self.o_bias:
                shapes[f"{a}.o_proj.bias"] = (h,)
            if self.qk_norm:
                shapes[f"{a}.q_norm.weight"] = (d,)
                shapes[f"{a}.k_norm.weight"] = (d,)
            for proj, shape in (("gate_proj", (inter, h)), ("up_proj", (inter, h)), ("down_proj", (h, inter))):
                shapes[f"{m}.{proj}.weight"] = shape
                if self.mlp_bias:
                    shapes[f"{m}.{proj}.bias"] = shape[:1]
            shapes[f"model.layers.{i}.input_layernorm.weight"] = (h,)
            shapes[f"model.layers.{i}.post_attention_layernorm.weight"] = (h,)
        shapes["model.norm.weight"] = (h,)
        if not self.tied:
            shapes["lm_head.weight"] = (self.vocab, h)
        return shapes


def padded_vocab(vocab: int) -> int:
    """Vocab rows after padding to a multiple of `VOCAB_PAD`."""
    return -(-vocab // VOCAB_PAD) * VOCAB_PAD
