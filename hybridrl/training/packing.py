"""Padding-free inputs: a micro-batch's sequences laid end to end in one row, and its outputs put back in place.

The padded layout gives every row the longest row's length, so the model computes [rows, longest] positions; on
real RL batches (median response far below the limit, a tail at it) half of them were padding. Packed, the model
computes the real tokens plus a short tail that rounds the row up to one of a few lengths (`padded_length`), so
compiled layers and the allocator see few shapes::

    packed = pack_rows(mb.prompts, responses, loss_mask, lengths, pad_id)   # on the host, then .to(device)
    out = model(**packed.model_inputs(), use_cache=False, logits_to_keep=packed.kept)   # [1, K, V]: response only
    logp = packed.scatter(token_logprobs(out, packed.targets))                # [rows, R], 0 off the response mask

`position_ids` restart at 0 at every sequence and `cu_seqlens` hold the boundaries, so attention never crosses one
(`training/attention.py`). Only the K positions that predict a response token under the mask get logits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

#: Packed lengths are rounded up to a multiple of 2**(floor(log2 n) - this): 16 sizes per octave, so the padding
#: is at most 1/16 of the tokens and a run sees a few dozen lengths at most.
STEPS_PER_OCTAVE_LOG2 = 4
#: Shorter rows are rounded up to a multiple of this.
MIN_MULTIPLE = 8


def padded_length(n: int, cap: int = 0) -> int:
    """`n` rounded up to the next length of the ladder (16 per octave, multiples of 8); never above `cap` when
    `cap` >= n (a micro-batch filled to its token budget is padded to the budget at most)."""
    if n <= 0:
        return MIN_MULTIPLE
    step = max(MIN_MULTIPLE, 2 ** (max(0, int(math.log2(n)) - STEPS_PER_OCTAVE_LOG2)))
    out = -(-n // step) * step
    return min(out, cap) if cap >= n else out


@dataclass
class PackedRows:
    """One micro-batch packed into a single row, with what is needed to read its outputs back per row."""

    input_ids: torch.Tensor
    """[1, T] token ids: each row's prompt then response, end to end, then the padding tail."""
    position_ids: torch.Tensor
    """[1, T] position of each token within its own sequence (restarting at 0; the tail counts as one sequence)."""
    cu_seqlens: torch.Tensor
    """[S + 1] int32 sequence boundaries (S sequences, the tail included when there is one)."""
    max_length: int
    """Longest sequence, rounded up to a power of two (an upper bound the attention kernels size their grid by)."""
    kept: torch.Tensor
    """[K] positions whose next token is a response token under the mask (their logits are the only ones needed)."""
    targets: torch.Tensor
    """[K] the token each kept position predicts."""
    flat_index: torch.Tensor
    """[K_valid] where each kept position's output goes in the flattened [rows, R] result (K_valid = K unless the
    micro-batch has no masked response token, when one dummy position keeps the model in the graph)."""
    shape: tuple[int, int]
    """(rows, R) of the response-aligned results."""
    real_tokens: int
    """Tokens of the sequences (what a padded layout would call unpadded)."""
    extra: dict[str, torch.Tensor] = field(default_factory=dict)
    """More model inputs, replacing or joining those above: a vision-language micro-batch's pixel_values,
    image_grid_thw and mrope position_ids [4, 1, T] (`training/vision.py`)."""

    @property
    def computed_tokens(self) -> int:
        """Positions the model computes: the real tokens and the tail."""
        return self.input_ids.shape[1]

    def to(self, device: torch.device) -> PackedRows:
        """The index tensors on `device` (one copy each, asynchronous from pinned memory where possible)."""
        move = lambda t: t.to(device, non_blocking=True)  # noqa: E731
        return PackedRows(
            move(self.input_ids),
            move(self.position_ids),
            move(self.cu_seqlens),
            self.max_length,
            move(self.kept),
            move(self.targets),
            move(self.flat_index),
            self.shape,
            self.real_tokens,
            {k: move(v) for k, v in self.extra.items()},
        )

    def model_inputs(self) -> dict:
        """Keyword arguments of the packed forward: ids, restarting positions, and the boundaries in the names
        transformers' FlashAttentionKwargs use (read by flash_attention_2 and the varlen attention; ignored by
        sdpa and eager, which build a block-diagonal mask from the positions). The token count and the number of
        sequences vary from one micro-batch to the next: compiled layers take them as dynamic sizes from the first
        compile instead of recompiling when they first change."""
        for t, dim in ((self.input_ids, 1), (self.position_ids, 1), (self.cu_seqlens, 0)):
            torch._dynamo.maybe_mark_dynamic(t, dim)
        return {
            "input_ids": self.input_ids,
            "position_ids": self.position_ids,
            "cu_seq_lens_q": self.cu_seqlens,
            "cu_seq_lens_k": self.cu_seqlens,
            "max_length_q": self.max_length,
            "max_length_k": self.max_length,
            **self.extra,
        }

    def scatter(self, values: torch.Tensor) -> torch.Tensor:
        """Per-kept-position `values` [K] as a response-aligned [rows, R] tensor, 0 elsewhere (differentiable)."""
        rows, width = self.shape
        n = self.flat_index.shape[0]
        out = values.new_zeros(rows * width)
        return out.index_put((self.flat_index,), values[:n]).view(rows, width)


def pack_rows(
    prompts: list[list[int]],
    responses: torch.Tensor,
    response_mask: torch.Tensor,
    lengths: list[int],
    pad_id: int,
    cap: int = 0,
    multiple_of: int = 1,
) -> PackedRows:
    """Pack rows on the host: row i is `prompts[i]` and its first `lengths[i]` response tokens; outputs are kept for
    the response tokens where `response_mask` is set. `cap` bounds the tail (`padded_length`); the row's length is
    then rounded up to a multiple of `multiple_of` (the sequence-parallel degree, so it splits into equal slices)."""
    responses, response_mask = responses.cpu(), response_mask.cpu()
    rows, width = responses.shape
    ids, starts, seq_lens, kept, flat = [], [], [], [], []
    offset = 0
    for i, (prompt, r) in enumerate(zip(prompts, lengths)):
        if not prompt:
            raise ValueError(f"row {i} has an empty prompt; every sequence needs at least one prompt token")
        ids.append(torch.as_tensor(prompt, dtype=torch.long))
        ids.append(responses[i, :r].long())
        cols = torch.nonzero(response_mask[i, :r] > 0).flatten()
        kept.append(offset + len(prompt) - 1 + cols)
        flat.append(i * width + cols)
        starts.append(offset)
        seq_lens.append(len(prompt) + r)
        offset += len(prompt) + r
    real = offset
    total = -(-padded_length(real, cap) // multiple_of) * multiple_of
    tail = total - real
    if tail:
        ids.append(torch.full((tail,), pad_id, dtype=torch.long))
        seq_lens.append(tail)
    input_ids = torch.cat(ids)
    position_ids = torch.cat([torch.arange(n) for n in seq_lens])
    cu = torch.zeros(len(seq_lens) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(seq_lens), 0)
    kept_t, flat_t = torch.cat(kept), torch.cat(flat)
    if kept_t.numel() == 0:  # nothing to score: one dummy position keeps the forward in the autograd graph
        kept_t = torch.zeros(1, dtype=torch.long)
    targets = input_ids[(kept_t + 1).clamp(max=total - 1)]
    longest = max(seq_lens)
    return PackedRows(
        input_ids=input_ids[None],
        position_ids=position_ids[None],
        cu_seqlens=cu,
        max_length=min(total, 1 << (longest - 1).bit_length()),
        kept=kept_t,
        targets=targets,
        flat_index=flat_t,
        shape=(rows, width),
        real_tokens=real,
    )
