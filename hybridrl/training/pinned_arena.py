"""Host tensors carved out of a few large (pinned) blocks.

torch's pinned-memory allocator rounds every allocation up to a power of two (a 271 MB Adam moment of a 7B layer
takes 512 MB; vLLM's CPU offload was seen using 1.9x what it asked for). Blocks whose size is itself a power of two
lose nothing to that rounding, and tensors packed into them lose only each block's unused tail.
"""

from __future__ import annotations

import math

import torch

#: Blocks are at least this large (or, for less in all, the smallest power of two that holds it all).
BLOCK_BYTES = 2**30
#: Each tensor starts at a multiple of this many bytes (any dtype's alignment, and the copy engines' preference).
ALIGN = 512


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


class PinnedArena:
    """Zero-filled host tensors as views of blocks that stay allocated for the arena's life; pinned when `pin`."""

    def __init__(self, pin: bool, block_bytes: int = BLOCK_BYTES) -> None:
        self.pin, self.block_bytes = pin, block_bytes
        self._blocks: list[list] = []  # [uint8 block, bytes used]

    @property
    def reserved_bytes(self) -> int:
        """Host bytes the arena's blocks hold."""
        return sum(block.numel() for block, _ in self._blocks)

    def zeros(self, shapes: list[tuple[torch.Size, torch.dtype]]) -> list[torch.Tensor]:
        """One zero tensor per (shape, dtype), packed first-fit into the blocks (new ones as needed)."""
        out = self.empty(shapes)
        for t in out:
            t.zero_()
        return out

    def empty(self, shapes: list[tuple[torch.Size, torch.dtype]]) -> list[torch.Tensor]:
        """One uninitialised tensor per (shape, dtype), packed first-fit into the blocks (new ones as needed): ask
        for many at once, so the blocks are sized for all of them."""
        # Normal tensors even when asked for inside inference mode (an engine's memory gate offloading the trainer's
        # state during a generate): they are written again in later phases, outside it, where an inference tensor
        # refuses in-place updates.
        with torch.inference_mode(False):
            return self._carve(shapes)

    def _carve(self, shapes: list[tuple[torch.Size, torch.dtype]]) -> list[torch.Tensor]:
        sizes = [math.prod(shape) * dtype.itemsize for shape, dtype in shapes]
        if not sizes:
            return []
        total = sum(-(-n // ALIGN) * ALIGN for n in sizes)
        block = max(_pow2_at_least(max(sizes)), min(self.block_bytes, _pow2_at_least(total)))
        out = []
        for (shape, dtype), nbytes in zip(shapes, sizes):
            slot = next((b for b in self._blocks if b[1] + nbytes <= b[0].numel()), None)
            if slot is None:
                slot = [torch.empty(max(block, _pow2_at_least(nbytes)), dtype=torch.uint8, pin_memory=self.pin), 0]
                self._blocks.append(slot)
            view = slot[0][slot[1] : slot[1] + nbytes].view(dtype).view(shape)
            slot[1] += -(-nbytes // ALIGN) * ALIGN
            out.append(view)
        return out
