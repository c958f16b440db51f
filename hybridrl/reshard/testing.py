"""A stand-in engine that only holds weights: for resharding tests, layout checks and benchmarks."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from hybridrl.errors import HybridRLError
from hybridrl.reshard.layout import WeightLayout


class TensorDictEngine:
    """A `WeightSink` holding preallocated tensors by name; `load_weights` copies into them (casting dtype, moving
    device). It generates nothing."""

    def __init__(self, tensors: dict[str, torch.Tensor], style: str = "fused") -> None:
        self.tensors = tensors
        self.weight_layout_style = style

    @classmethod
    def from_layout(
        cls,
        layout: WeightLayout,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        fill: float = float("nan"),
    ) -> TensorDictEngine:
        """One tensor per spec of `layout`, filled with `fill` (NaN: an unwritten tensor never passes a check)."""
        tensors = {s.name: torch.full(s.shape, fill, dtype=dtype, device=device) for s in layout.specs()}
        return cls(tensors, layout.style)

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy each tensor into the one of the same name; unknown names and shape mismatches raise."""
        for name, t in named_tensors:
            dst = self.tensors.get(name)
            if dst is None:
                raise HybridRLError(f"TensorDictEngine: no tensor named {name}")
            if dst.shape != t.shape:
                raise HybridRLError(f"TensorDictEngine: {name} is {tuple(dst.shape)}, got {tuple(t.shape)}")
            dst.copy_(t)

    def named_weights(self) -> Iterable[tuple[str, torch.Tensor]]:
        """The held tensors (live, not copies)."""
        return self.tensors.items()

    def finish_weight_update(self) -> None:
        """Nothing to close."""
