"""The fused decoder's view of its engine tensor-parallel group, and the two collectives it runs over it.

The group itself is made by the caller (the run's topology, once, on every rank in the same order), and handed to
the engine; None means a single rank with no collectives.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

# torch 2.13 renamed all_gather_into_tensor (deprecated there) to all_gather_single; 2.11 has only the former.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass
class TensorParallel:
    """One engine TP group as the decoder sees it: its rank, size and the two collectives it needs."""

    group: dist.ProcessGroup | None = None
    rank: int = 0
    size: int = 1

    @classmethod
    def of(cls, group: dist.ProcessGroup | None) -> TensorParallel:
        """The TP view of `group` (None: a single rank)."""
        if group is None:
            return cls()
        return cls(group, dist.get_rank(group), dist.get_world_size(group))

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the group, in place (row-parallel outputs, vocab-parallel embedding lookups)."""
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's `x` [N, R] along the last dim → [N, size * R] (vocab-parallel logits)."""
        if self.size == 1:
            return x
        n, r = x.shape
        out = x.new_empty(self.size * n, r)  # rank-major along dim 0, the shape gloo and NCCL both take
        _all_gather(out, x.contiguous(), group=self.group)
        return out.view(self.size, n, r).permute(1, 0, 2).reshape(n, self.size * r)
