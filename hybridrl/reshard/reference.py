"""An independent statement of what each engine shard must contain, used only to verify the resharder.

Written apart from `layout.py` on purpose: it works from engine names and per-head indexing (index lists of
heads, rows and columns) instead of the offsets and `narrow`/`cat` pieces that `TensorSpec.build` uses, so a bug
in the fuse/split code does not reproduce itself here.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch

_QKV = re.compile(r"(model\.layers\.\d+\.self_attn)\.qkv_proj\.(weight|bias)")
_GATE_UP = re.compile(r"(model\.layers\.\d+\.mlp)\.gate_up_proj\.(weight|bias)")
_ROW = re.compile(r"model\.layers\.\d+\.(self_attn\.o_proj|mlp\.down_proj)\.weight")
_VOCAB = ("model.embed_tokens.weight", "lm_head.weight")


def _heads(w: torch.Tensor, head_dim: int, heads: list[int]) -> torch.Tensor:
    """Rows of the listed heads, in list order (w: [n_heads * head_dim, ...])."""
    per_head = w.reshape(-1, head_dim, *w.shape[1:])
    return per_head[torch.tensor(heads, dtype=torch.long)].reshape(-1, *w.shape[1:])


def reference_shard(
    config,
    engine_name: str,
    full: Mapping[str, torch.Tensor],
    *,
    style: str = "fused",
    tp_rank: int = 0,
    tp_size: int = 1,
) -> torch.Tensor:
    """The tensor engine rank `tp_rank` of `tp_size` must hold under `engine_name`, from full HF tensors."""
    if style == "hf":
        return full[engine_name]
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    r, tp = tp_rank, tp_size

    if m := _QKV.fullmatch(engine_name):
        prefix, kind = m.groups()
        q_heads = [r * (heads // tp) + j for j in range(heads // tp)]
        if tp <= kv_heads:
            kv = [r * (kv_heads // tp) + j for j in range(kv_heads // tp)]
        else:  # each kv head is replicated on tp / kv_heads consecutive ranks
            kv = [r // (tp // kv_heads)]
        q, k, v = (full[f"{prefix}.{p}.{kind}"] for p in ("q_proj", "k_proj", "v_proj"))
        return torch.cat([_heads(q, head_dim, q_heads), _heads(k, head_dim, kv), _heads(v, head_dim, kv)])

    if m := _GATE_UP.fullmatch(engine_name):
        prefix, kind = m.groups()
        inter = config.intermediate_size // tp
        rows = torch.arange(r * inter, (r + 1) * inter)
        return torch.cat([full[f"{prefix}.gate_proj.{kind}"][rows], full[f"{prefix}.up_proj.{kind}"][rows]])

    if _ROW.fullmatch(engine_name):
        w = full[engine_name]
        cols = w.shape[1] // tp
        return w[:, torch.arange(r * cols, (r + 1) * cols)]

    if engine_name in _VOCAB:
        w = full[engine_name]
        vocab_padded = (w.shape[0] + 63) // 64 * 64
        padded = torch.zeros((vocab_padded, *w.shape[1:]), dtype=w.dtype, device=w.device)
        padded[: w.shape[0]] = w
        rows = vocab_padded // tp
        return padded[torch.arange(r * rows, (r + 1) * rows)]

    return full[engine_name]  # norms, q_norm/k_norm and row-parallel biases: replicated
