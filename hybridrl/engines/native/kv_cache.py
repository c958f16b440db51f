"""The paged KV cache: fixed-size blocks in one pool per engine, a block table per sequence, a free list.

    K, V: [layers, blocks, kv_heads, block_size, head_dim]      token t of a sequence lives in its block
                                                                 table[t // block_size], row t % block_size

One mechanism serves joining, leaving and sharing: a new sequence takes blocks from the free list, a finished one
returns them (no copies, nothing else moves), and the n samples of one prompt hold references to the prompt's full
blocks (refcounts) while each gets its own copy of the partly filled last one, which its decode steps write into.
Full blocks also stay findable by their tokens for later requests with the same prefix (`blocks.BlockAllocator`).
Block 0 is never handed out: padding rows of a decode batch and padding tokens of a prefill write there.
"""

from __future__ import annotations

import torch

from hybridrl.engines.native.blocks import BlockAllocator
from hybridrl.engines.native.fixed_memory import FixedMemory, fixed_bytes

SCRATCH_BLOCK = 0


def blocks_for(tokens: int, block_size: int) -> int:
    """Blocks that hold `tokens` positions."""
    return -(-tokens // block_size)


class PagedKVCache:
    """The K/V pool on the device, with the allocator of its blocks."""

    def __init__(
        self,
        layers: int,
        num_blocks: int,
        block_size: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        memory: FixedMemory | None = None,
    ) -> None:
        """`memory`: a `FixedMemory` of at least `fixed_size` bytes to hold K and V (their addresses then survive
        `release`); None: ordinary allocations."""
        shape = (layers, num_blocks, kv_heads, block_size, head_dim)
        self.memory = memory
        if memory is None:
            self.k = torch.empty(shape, dtype=dtype, device=device)
            self.v = torch.empty(shape, dtype=dtype, device=device)
        else:
            self.k, self.v = memory.view(shape, dtype), memory.view(shape, dtype)
        self._zero()
        self.block_size = block_size
        self.allocator = BlockAllocator(num_blocks)

    @staticmethod
    def fixed_size(
        layers: int, num_blocks: int, block_size: int, kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        """Bytes of the `FixedMemory` a cache of this shape takes."""
        shape = (layers, num_blocks, kv_heads, block_size, head_dim)
        return fixed_bytes([(shape, dtype), (shape, dtype)])

    def _zero(self) -> None:
        # Zeros, not garbage: the torch attention path multiplies masked positions by 0, and NaN garbage would survive.
        self.k.zero_()
        self.v.zero_()

    @property
    def resident(self) -> bool:
        """Whether the pool's memory is on the device (False between `release` and `restore`)."""
        return self.memory is None or self.memory.mapped

    def release(self) -> bool:
        """Give the pool's device memory back, its addresses kept (a fixed-memory pool only: False otherwise)."""
        if self.memory is None:
            return False
        self.memory.release()
        return True

    def restore(self) -> None:
        """The pool's memory back at the same addresses, zeroed, every block free (what it held is gone)."""
        self.memory.restore()
        with torch.inference_mode():  # a pool made during a generate holds inference tensors
            self._zero()
        self.allocator = BlockAllocator(self.num_blocks)

    def grow(self, num_blocks: int, memory: FixedMemory | None = None) -> None:
        """More blocks, the existing ones (and what the prefix table knows of them) kept; new tensors (in `memory`, a
        new range for the larger pool, if given), so whatever captured the old ones must be rebuilt."""
        old = self.num_blocks
        self.memory = memory
        for name in ("k", "v"):
            t = getattr(self, name)
            shape = (t.shape[0], num_blocks, *t.shape[2:])
            grown = (
                torch.empty(shape, dtype=t.dtype, device=t.device) if memory is None else memory.view(shape, t.dtype)
            )
            grown[:, old:] = 0
            grown[:, :old] = t
            setattr(self, name, grown)
            del t
        self.allocator.extend(num_blocks)

    @property
    def num_blocks(self) -> int:
        """Blocks in the pool, the scratch block included."""
        return self.k.shape[1]

    def nbytes(self) -> int:
        """Bytes of K and V together."""
        return 2 * self.k.numel() * self.k.element_size()

    @staticmethod
    def bytes_per_block(layers: int, block_size: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """Bytes one block takes in K and V over all layers."""
        return 2 * layers * block_size * kv_heads * head_dim * torch.empty(0, dtype=dtype).element_size()

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer i's K and V pools [blocks, kv_heads, block_size, head_dim]."""
        return self.k[i], self.v[i]

    def copy_blocks(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy blocks src[i] → dst[i] in every layer (the per-sample copies of a shared prompt's last block)."""
        self.k[:, dst] = self.k[:, src]
        self.v[:, dst] = self.v[:, src]

    def slots(self, table: list[int], start: int, end: int) -> list[int]:
        """The cache slots (block · block_size + offset) of positions start..end-1 of a sequence with `table`."""
        bs = self.block_size
        return [table[t // bs] * bs + t % bs for t in range(start, end)]
