"""A preallocated per-slot KV cache: K and V of shape [layers, slots, max_len, kv_heads_local, head_dim].

Slot b holds one sequence's keys and values at positions 0..len-1. Decode batches are always the slots
[0, B): finished sequences leave by `compact`, which moves the survivors to the front, so attention reads a
plain strided view (no per-step gather) and a CUDA graph captured for B rows stays valid.
"""

from __future__ import annotations

import torch


class KVCache:
    """K/V storage for `slots` sequences of up to `max_len` tokens each."""

    def __init__(self, layers: int, slots: int, max_len: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        shape = (layers, slots, max_len, kv_heads, head_dim)
        # Zeros, not empty: masked positions still enter q·k, and NaN garbage would survive the mask (NaN * 0).
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)

    @property
    def slots(self) -> int:
        """Sequences the cache holds."""
        return self.k.shape[1]

    @property
    def max_len(self) -> int:
        """Tokens per sequence."""
        return self.k.shape[2]

    def nbytes(self) -> int:
        """Bytes of K and V together."""
        return 2 * self.k.numel() * self.k.element_size()

    def fits(self, rows: int, length: int) -> bool:
        """Whether `rows` sequences of `length` tokens fit."""
        return rows <= self.slots and length <= self.max_len

    def write_prefill(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor, repeat: int) -> None:
        """Store prompts' K/V [B, W, kv_heads, head_dim] in slots start.. (each prompt in `repeat` slots in a row)."""
        b, w = k.shape[:2]
        if repeat > 1:
            k, v = k.repeat_interleave(repeat, 0), v.repeat_interleave(repeat, 0)
        self.k[layer, start : start + b * repeat, :w] = k
        self.v[layer, start : start + b * repeat, :w] = v

    def write_decode(self, layer: int, rows: torch.Tensor, pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store one token per row: slot rows[i], position pos[i] ← k[i], v[i] ([B, kv_heads, head_dim])."""
        self.k[layer].index_put_((rows, pos), k)
        self.v[layer].index_put_((rows, pos), v)

    def view(self, layer: int, batch: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of slots [0, batch), positions [0, length), as [batch, kv_heads, length, head_dim] views."""
        return (self.k[layer, :batch, :length].transpose(1, 2), self.v[layer, :batch, :length].transpose(1, 2))

    def compact(self, keep: torch.Tensor, length: int) -> None:
        """Move slots `keep` (ascending) to [0, len(keep)), positions [0, length) only; one layer at a time
        so the temporary stays one layer's size."""
        m = keep.numel()
        for cache in (self.k, self.v):
            for layer in range(cache.shape[0]):
                cache[layer, :m, :length] = cache[layer, keep, :length]  # the gather copies first: no overlap
