"""Ulysses sequence parallelism, the attention side (DeepSpeed-Ulysses; verl's ulysses_sequence_parallel_size).

Every layer but attention works token by token, so a rank can run it on its slice of a packed row
(`training/sequence_parallel.py`). Attention needs every token of a sequence; it is independent per head. Around
it, one all-to-all per tensor trades tokens for heads, and one trades them back::

    q, k, v   [T/sp tokens, H heads]   --all-to-all-->   [T tokens, H/sp heads]
    varlen attention over the whole row's cu_seqlens, this rank's heads (`training/attention.py`)
    out       [T tokens, H/sp heads]   --all-to-all-->   [T/sp tokens, H heads]   → o_proj on this rank's tokens

RoPE is applied before, on each token's own position (the slice's position_ids), so nothing else changes. The
all-to-all is torch's differentiable functional collective (its backward is the reverse all-to-all, and
torch.compile traces it). num_attention_heads must divide by the degree; KV heads that do not are repeated up to
the least common multiple first (as verl does), which keeps each rank's query heads with their own KV heads.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

import torch

from hybridrl.errors import ConfigError
from hybridrl.models.config import ModelConfig
from hybridrl.training.attention import use_packed_attention, varlen_attention_forward
from hybridrl.training.config import TrainerConfig

log = logging.getLogger(__name__)

#: The name the Ulysses attention is registered under in transformers' AttentionInterface.
ULYSSES = "hybridrl_ulysses"


def _all_to_all(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Chunk i of `x` (split along dim 0) goes to rank i; chunk i of the result came from rank i."""
    from torch.distributed._functional_collectives import all_to_all_single_autograd

    return all_to_all_single_autograd(x.contiguous(), None, None, group)


def seq_to_heads(x: torch.Tensor, group: Any) -> torch.Tensor:
    """[H, T/sp, D] (this rank's tokens, every head) → [H/sp, T, D] (every token, this rank's heads)."""
    sp = group.size()
    heads, n, d = x.shape
    got = _all_to_all(x.reshape(sp, heads // sp, n, d), group)  # [sp, H/sp, n, D]: rank i's tokens, my heads
    return got.transpose(0, 1).reshape(heads // sp, sp * n, d)


def heads_to_seq(x: torch.Tensor, group: Any) -> torch.Tensor:
    """[H/sp, T, D] (every token, this rank's heads) → [H, T/sp, D] (this rank's tokens, every head)."""
    sp = group.size()
    local_heads, t, d = x.shape
    send = x.reshape(local_heads, sp, t // sp, d).transpose(0, 1)  # chunk j: rank j's tokens
    return _all_to_all(send, group).reshape(sp * local_heads, t // sp, d)  # rank i's heads come i-th


def kv_repeats(kv_heads: int, degree: int) -> int:
    """How many times each KV head is repeated so the KV heads divide over `degree` ranks (1 when they do)."""
    return degree // math.gcd(kv_heads, degree)


def ulysses_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention signature over one rank's slice of a packed row: query [1, H, T/sp, D], key/value
    [1, Hkv, T/sp, D], `kwargs["sequence_parallel_group"]` the SP group and `cu_seq_lens_q` the whole row's
    boundaries; returns [1, T/sp, H, D]. Without a group (an unsharded row) it is the varlen attention itself."""
    group = kwargs.pop("sequence_parallel_group", None)
    if group is None:
        return varlen_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    if query.shape[0] != 1:
        raise ValueError(f"sequence-parallel attention takes one packed row, got a batch of {query.shape[0]}")
    sp = group.size()
    repeat = kv_repeats(key.shape[1], sp)
    if repeat > 1:
        key, value = key.repeat_interleave(repeat, dim=1), value.repeat_interleave(repeat, dim=1)
    q, k, v = (seq_to_heads(t[0], group)[None] for t in (query, key, value))
    out, _ = varlen_attention_forward(module, q, k, v, None, dropout, scaling, **kwargs)  # [1, T, H/sp, D]
    return heads_to_seq(out[0].transpose(0, 1), group).transpose(0, 1).unsqueeze(0), None


def register() -> None:
    """Make ULYSSES a name transformers knows (idempotent), with FlashAttention's mask rule (no mask for packed
    rows), as the varlen attention has."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

    AttentionInterface.register(ULYSSES, ulysses_attention_forward)
    AttentionMaskInterface.register(ULYSSES, flash_attention_mask)


def check_heads(degree: int, heads: int, kv_heads: int, where: str) -> None:
    """ConfigError unless `heads` query heads split over `degree` ranks (KV heads need not: they are repeated)."""
    if heads % degree:
        raise ConfigError(
            f"trainer.sequence_parallel_size={degree} must divide the attention heads of {where} "
            f"(num_attention_heads={heads}, num_key_value_heads={kv_heads}): each rank attends with "
            f"num_attention_heads / {degree} heads; pick a degree that divides {heads}"
        )


def model_heads(model: ModelConfig, path: str | None = None) -> tuple[int, int]:
    """(num_attention_heads, num_key_value_heads) of a model from its config alone, before any weights load:
    `path`'s config.json, else `model.path`'s, else the tiny model's options."""
    path = path or model.path
    if path is None:
        return model.tiny.num_heads, model.tiny.num_kv_heads
    file = Path(path).expanduser() / "config.json"
    try:
        config = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ConfigError(f"{file} cannot be read ({e}); trainer.sequence_parallel_size needs the head counts") from e
    text = config.get("text_config") or config
    heads = text.get("num_attention_heads")
    if not isinstance(heads, int):
        raise ConfigError(f"{file} has no num_attention_heads; trainer.sequence_parallel_size needs it")
    return heads, text.get("num_key_value_heads") or heads


def use_training_attention(
    model: torch.nn.Module, cfg: TrainerConfig, attn_implementation: str, sequence_parallel_size: int = 1
) -> None:
    """Switch a trainer role's model (an HF PreTrainedModel, before FSDP wraps it) to the attention its passes
    need: Ulysses around the varlen attention under sequence parallelism, else the packed attention
    `trainer.packed_attention` picks (padding_free), else the model's own."""
    if sequence_parallel_size == 1:
        if cfg.padding_free:
            use_packed_attention(model, cfg.packed_attention, attn_implementation)
        return
    config = model.config.get_text_config()
    heads = config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    check_heads(sequence_parallel_size, heads, kv, type(model).__name__)
    register()
    model.set_attn_implementation(ULYSSES)
    if model.config._attn_implementation != ULYSSES:  # the slices would attend to themselves only: refuse
        raise ConfigError(
            f"trainer.sequence_parallel_size={sequence_parallel_size}: {type(model).__name__} does not take "
            "transformers' attention interface"
        )
    if kv_repeats(kv, sequence_parallel_size) > 1:
        log.info(
            "sequence parallel %d: %d KV heads repeated %d times to divide over the ranks",
            sequence_parallel_size,
            kv,
            kv_repeats(kv, sequence_parallel_size),
        )
