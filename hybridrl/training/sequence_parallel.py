"""Ulysses sequence parallelism, the input side: each rank of a sequence-parallel (SP) group computes one slice of
every packed micro-batch, and the per-token results are summed back over the group.

The attention side (the all-to-all between tokens and heads around attention) is `training/ulysses.py`. One pass on
every rank of an SP group, which all hold the same rows::

    packed = pack_rows(..., multiple_of=sp.size)      # position_ids and cu_seqlens of the whole row, T tokens
    shard = sp.shard(packed)                          # this rank's T/sp tokens and the kept positions among them
    out = model(**shard.model_inputs(), logits_to_keep=shard.kept)   # attention sees all T tokens, H/sp heads
    logp = shard.scatter(token_logprobs(out, shard.targets))         # [rows, R], the same on every rank

Why the objective is the sp=1 one: each response token is predicted at exactly one position, on exactly one rank,
so the sum over the group of the ranks' [rows, R] partial results is the whole micro-batch's (exactly: the others
add zeros), on every rank. Each rank then computes the same loss over its group's rows, normalised as at sp=1 over
the data-parallel ranks (`Trainer.update`). The sum's backward sums the gradient over the group (every rank's loss
reads the sum), so each rank's parameters get sp × its slice's part of the group's gradient; FSDP averages over all
dp × sp ranks, so the step applies the mean over dp ranks of each group's gradient, as sp=1 does over its ranks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from hybridrl.training.packing import PackedRows


@dataclass(frozen=True)
class SequenceParallel:
    """This rank's place in its SP group (`Topology.sequence_parallel_group`)."""

    group: Any
    """The SP group's process group (consecutive ranks)."""
    rank: int
    """This rank's slice of each packed row."""
    size: int
    """Ranks in the group (`trainer.sequence_parallel_size`)."""

    def shard(self, packed: PackedRows) -> SequenceShard:
        """This rank's slice of `packed` (packed with `multiple_of=size`), on the host."""
        total = packed.computed_tokens
        if total % self.size:
            raise ValueError(
                f"a packed row of {total} tokens does not split over {self.size} ranks; pack with "
                f"multiple_of={self.size}"
            )
        n = total // self.size
        start = self.rank * n
        mine = (packed.kept >= start) & (packed.kept < start + n)
        kept, targets = packed.kept[mine] - start, packed.targets[mine]
        flat = packed.flat_index[mine[: packed.flat_index.shape[0]]]
        if kept.numel() == 0:  # nothing of this slice is scored: one dummy position keeps the forward in the graph
            kept = torch.zeros(1, dtype=torch.long)
            targets = packed.input_ids[0, start : start + 1].clone()
        local = PackedRows(
            input_ids=packed.input_ids[:, start : start + n],
            position_ids=packed.position_ids[:, start : start + n],
            cu_seqlens=packed.cu_seqlens,  # the whole row's: attention runs over all of it after the all-to-all
            max_length=packed.max_length,
            kept=kept,
            targets=targets,
            flat_index=flat,
            shape=packed.shape,
            real_tokens=min(max(packed.real_tokens - start, 0), n),  # sequences fill the row's first real_tokens
        )
        return SequenceShard(local, self.group)


@dataclass
class SequenceShard:
    """One rank's slice of a packed micro-batch, read like `PackedRows` by the trainer's passes: its ids and
    positions are the slice's, its boundaries the whole row's; `scatter` returns the whole micro-batch's results."""

    local: PackedRows
    """The slice: input_ids, position_ids, kept, targets and flat_index of this rank's tokens only."""
    group: Any
    """The SP group the slice's results are summed over."""

    @property
    def kept(self) -> torch.Tensor:
        """[K_local] positions of the slice whose logits are needed."""
        return self.local.kept

    @property
    def targets(self) -> torch.Tensor:
        """[K_local] the token each kept position predicts."""
        return self.local.targets

    @property
    def computed_tokens(self) -> int:
        """Positions this rank computes: T / sp."""
        return self.local.computed_tokens

    @property
    def real_tokens(self) -> int:
        """Tokens of sequences among this rank's positions."""
        return self.local.real_tokens

    def to(self, device: torch.device) -> SequenceShard:
        """The slice's tensors on `device`."""
        return SequenceShard(self.local.to(device), self.group)

    def model_inputs(self) -> dict:
        """The slice's forward arguments, with the SP group for the Ulysses attention (`training/ulysses.py`), which
        transformers hands through to the attention function."""
        return {**self.local.model_inputs(), "sequence_parallel_group": self.group}

    def scatter(self, values: torch.Tensor) -> torch.Tensor:
        """Per-kept-position `values` [K_local] as the whole micro-batch's response-aligned [rows, R] tensor, on
        every rank of the group (differentiable: the backward sums the gradient over the group)."""
        return group_sum(self.local.scatter(values), self.group)


def group_sum(partial: torch.Tensor, group: Any) -> torch.Tensor:
    """The sum of `partial` over `group`, differentiable (its gradient is the sum of the ranks' gradients)."""
    from torch.distributed.nn.functional import all_reduce

    return all_reduce(partial, group=group)
