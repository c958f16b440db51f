"""A rollout batch: prompts, response-aligned tensors and per-sample metadata, split and joined by rows."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class Batch:
    """Rows of samples. Tensors share the first dim (rows); response tensors are [rows, R].

    Column j of a response tensor is the j-th generated token of that row; `response_mask`
    marks the real ones. `meta` holds per-row Python values (dataset rows, finish reasons).
    """

    prompts: list[list[int]]
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    meta: dict[str, list[Any]] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.prompts)

    def __getitem__(self, key: str) -> torch.Tensor:
        return self.tensors[key]

    def __setitem__(self, key: str, value: torch.Tensor) -> None:
        if value.shape[0] != len(self):
            raise ValueError(f"tensor {key!r} has {value.shape[0]} rows, the batch has {len(self)}")
        self.tensors[key] = value

    def __contains__(self, key: str) -> bool:
        return key in self.tensors

    def select(self, rows: Sequence[int] | slice) -> "Batch":
        """A batch of the given rows (a slice or a list of indices)."""
        idx = list(range(len(self)))[rows] if isinstance(rows, slice) else list(rows)
        t = torch.tensor(idx, dtype=torch.long)
        return Batch(
            [self.prompts[i] for i in idx],
            {k: v.index_select(0, t) for k, v in self.tensors.items()},
            {k: [v[i] for i in idx] for k, v in self.meta.items()},
        )

    def chunks(self, size: int) -> list["Batch"]:
        """Consecutive pieces of at most `size` rows."""
        return [self.select(slice(s, s + size)) for s in range(0, len(self), size)]

    def split(self, parts: int) -> list["Batch"]:
        """`parts` equal consecutive pieces (rows must divide evenly, so every rank does equal work)."""
        if len(self) % parts:
            raise ValueError(f"cannot split {len(self)} rows into {parts} equal parts")
        return self.chunks(len(self) // parts)

    @staticmethod
    def concat(batches: Sequence["Batch"]) -> "Batch":
        """Join batches row-wise; response tensors of different widths are right-padded with 0."""
        prompts = [p for b in batches for p in b.prompts]
        tensors = {}
        for k in batches[0].tensors:
            parts = [b.tensors[k] for b in batches]
            if parts[0].dim() >= 2:
                width = max(p.shape[1] for p in parts)
                parts = [torch.nn.functional.pad(p, (0, width - p.shape[1])) for p in parts]
            tensors[k] = torch.cat(parts)
        meta = {k: [x for b in batches for x in b.meta[k]] for k in batches[0].meta}
        return Batch(prompts, tensors, meta)
