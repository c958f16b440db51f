"""Tiny Llama / Qwen2 / Qwen3 models at the weight layout's corner cases, for the reshard and fused-engine tests."""

from __future__ import annotations

import torch
import transformers

KINDS = ("llama", "qwen2", "qwen3")
PROMPTS = [[5, 17, 3, 9, 11], [21, 2], [7, 8, 9, 10, 11, 12, 13, 14, 15]]


def tiny_config(kind: str, **overrides):
    """2-layer configs at the layout's corner cases: llama (untied, GQA 4/2, vocab 99 → padded 128), qwen2 (q/k/v
    bias, 1 kv head: replicated at TP > 1, tied), qwen3 (q_norm/k_norm, head_dim 16 != hidden/heads)."""
    common = dict(num_hidden_layers=2, intermediate_size=48, max_position_embeddings=256)
    if kind == "llama":
        kw = dict(hidden_size=40, num_attention_heads=4, num_key_value_heads=2, vocab_size=99)
        return transformers.LlamaConfig(**{**common, **kw, **overrides})
    if kind == "qwen2":
        kw = dict(
            hidden_size=32, num_attention_heads=4, num_key_value_heads=1, vocab_size=130, tie_word_embeddings=True
        )
        return transformers.Qwen2Config(**{**common, **kw, **overrides})
    if kind == "qwen3":
        kw = dict(hidden_size=34, num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=100)
        return transformers.Qwen3Config(**{**common, **kw, **overrides})
    raise ValueError(kind)


def tiny_model(kind: str, seed: int = 0, **overrides) -> torch.nn.Module:
    """A float32 causal LM from `tiny_config` with every tensor randomized (norms around 1, biases nonzero), scaled
    so logits stay O(1) and a 1e-5 tolerance is meaningful."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(tiny_config(kind, **overrides), dtype=torch.float32)
    return randomized(model).eval()


@torch.no_grad()
def randomized(model: torch.nn.Module) -> torch.nn.Module:
    """`model` with every tensor drawn again from torch's generator: norms around 1, the rest small and nonzero."""
    for name, p in model.named_parameters():
        if "norm" in name:
            p.copy_(1 + 0.2 * torch.randn_like(p))
        else:
            p.normal_(0, 0.3 if p.ndim == 1 else 0.15)
    return model


def reference_logprobs(model, prompt: list[int], tokens: list[int], temperature: float = 1.0) -> torch.Tensor:
    """log_softmax(logits / T) of `tokens` after `prompt` from one full forward (what a trainer computes)."""
    dev = next(model.parameters()).device
    seq = torch.tensor([prompt + tokens], device=dev)
    with torch.no_grad():
        logits = model(seq).logits[0, len(prompt) - 1 : -1].float()
    t = temperature if temperature > 0 else 1.0
    return torch.log_softmax(logits / t, -1).gather(-1, torch.tensor(tokens, device=dev)[:, None]).squeeze(-1).cpu()


def reference_last_logits(model, prompts: list[list[int]]) -> torch.Tensor:
    """Each prompt's last-position logits [B, vocab], one unpadded forward per prompt."""
    dev = next(model.parameters()).device
    with torch.no_grad():
        return torch.stack([model(torch.tensor([p], device=dev)).logits[0, -1].float().cpu() for p in prompts])
