"""Tiny Llama/Qwen2/Qwen3 configs shaped to hit the layout's corner cases (shared by tests and the dist worker)."""

from __future__ import annotations

import torch
import transformers


def tiny_config(kind: str, **overrides):
    """A 2-layer config: llama (untied, GQA 4/2, vocab 99: uneven FSDP shards, vocab padding), qwen2 (q/k/v bias,
    1 kv head: replicated at tp > 1, tied), qwen3 (q_norm/k_norm, head_dim 16 != hidden/heads, odd hidden 34)."""
    common = dict(num_hidden_layers=2, intermediate_size=48)
    if kind == "llama":
        kw = dict(hidden_size=40, num_attention_heads=4, num_key_value_heads=2, vocab_size=99)
        return transformers.LlamaConfig(**{**common, **kw, **overrides})
    if kind == "qwen2":
        kw = dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=1, vocab_size=130,
                  tie_word_embeddings=True)
        return transformers.Qwen2Config(**{**common, **kw, **overrides})
    if kind == "qwen3":
        kw = dict(hidden_size=34, num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=100)
        return transformers.Qwen3Config(**{**common, **kw, **overrides})
    raise ValueError(kind)


def tiny_model(kind: str, seed: int = 0, **overrides) -> torch.nn.Module:
    """A float32 causal LM randomly initialized from `tiny_config` (biases and norms randomized too, so every
    misplaced row shows)."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(tiny_config(kind, **overrides), dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()
    return model


KINDS = ("llama", "qwen2", "qwen3")
