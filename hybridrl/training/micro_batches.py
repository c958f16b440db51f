"""How a rank's rows become micro-batches: a row count, or a token budget (verl's use_dynamic_bsz).

With `trainer.max_tokens_per_micro_batch` = N, a pass over a rank's rows runs as k micro-batches of at most N tokens
each (prompt + response; a longer sequence runs alone), balanced so each holds about the same number of tokens.
Every rank must run the same number of forward/backward passes (each one gathers FSDP parameters), so the ranks
agree on k = the largest any of them needs, and each spreads its rows over that many::

    lengths = sequence_lengths(batch)                                # tokens of each row
    k = agree_on_count(micro_batch_count(lengths, N), device)        # max over ranks (collective)
    groups = balanced_partition(lengths, k)                          # k lists of row indices, tokens balanced

The loss is unaffected by the split: the trainer normalizes every micro-batch's loss by the whole mini-batch's
denominator (`algorithms/losses.py`), so the micro-batch gradients add up to the mini-batch's for every mode.

Under sequence parallelism (`training/sequence_parallel.py`) the budget stays per device: a micro-batch holds up to
sp × N tokens, packed into one row of a multiple of sp tokens, of which each rank of the SP group computes a slice.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import torch
import torch.distributed as dist

from hybridrl.batch import Batch
from hybridrl.training.packing import PackedRows, pack_rows
from hybridrl.training.sequence_parallel import SequenceParallel, SequenceShard


@dataclass(frozen=True)
class Batching:
    """How one kind of pass splits a rank's rows."""

    rows: int
    """Rows per micro-batch when `max_tokens` is 0."""
    max_tokens: int = 0
    """Token budget per micro-batch (prompt + response tokens); 0 = `rows` rows each."""
    padding_free: bool = True
    """Pack each micro-batch into one row (else right-pad its rows to the longest)."""


def response_lengths(batch: Batch) -> list[int]:
    """Response tokens the model reads per row: the attention mask's (agent trajectories: tool outputs included),
    else the response mask's."""
    mask = batch["response_attention_mask"] if "response_attention_mask" in batch else batch["response_mask"]
    return mask.sum(-1).long().tolist()


def sequence_lengths(batch: Batch) -> list[int]:
    """Prompt + response tokens of each row (what a packed micro-batch holds)."""
    return [len(p) + r for p, r in zip(batch.prompts, response_lengths(batch))]


def balanced_partition(lengths: list[int], k: int) -> list[list[int]]:
    """`k` non-empty groups of row indices with nearly equal token sums (longest first, each into the lightest
    group: the LPT rule), each group in ascending row order, the heaviest group first. Needs k <= len(lengths)."""
    if not 1 <= k <= len(lengths):
        raise ValueError(f"cannot spread {len(lengths)} rows over {k} micro-batches")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    heap = [(0, g) for g in range(k)]
    groups: list[list[int]] = [[] for _ in range(k)]
    for i in order:
        load, g = heapq.heappop(heap)
        groups[g].append(i)
        heapq.heappush(heap, (load + lengths[i], g))
    groups.sort(key=lambda g: (-sum(lengths[i] for i in g), g[0]))
    return [sorted(g) for g in groups]


def micro_batch_count(lengths: list[int], max_tokens: int) -> int:
    """The fewest balanced micro-batches (`balanced_partition`) in which every micro-batch of two or more rows stays
    within `max_tokens` (a row longer than the budget runs alone)."""
    if not lengths:
        return 0
    k = max(1, -(-sum(lengths) // max_tokens))
    while k < len(lengths):
        groups = balanced_partition(lengths, k)
        if all(len(g) == 1 or sum(lengths[i] for i in g) <= max_tokens for g in groups):
            return k
        k += 1
    return len(lengths)


def agree_on_count(count: int, device: torch.device) -> int:
    """The largest `count` over all ranks (collective when there is more than one)."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return count
    t = torch.tensor([count], dtype=torch.long, device=device)  # NCCL on a GPU, gloo on the CPU
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def split_rows(lengths: list[int], batching: Batching, device: torch.device, degree: int = 1) -> list[list[int]]:
    """Row groups of one pass (collective under a token budget: the ranks agree on their number); `degree` ranks
    share each micro-batch (sequence parallelism), so its budget is `degree` devices' worth."""
    n = len(lengths)
    if not batching.max_tokens:
        return [list(range(s, min(s + batching.rows, n))) for s in range(0, n, batching.rows)]
    k = agree_on_count(micro_batch_count(lengths, batching.max_tokens * degree), device)
    if k > n:  # another rank needs more micro-batches than this one has rows (uneven shards)
        raise ValueError(f"this rank has {n} rows, fewer than the {k} micro-batches another rank needs")
    return balanced_partition(lengths, k)


class MicroBatch:
    """A group of a rank's rows, with its model inputs made once on the device and read by every model that scores
    the rows (the actor, then the reference); under sequence parallelism, this rank's slice of them."""

    def __init__(
        self,
        batch: Batch,
        rows: list[int],
        batching: Batching,
        device: torch.device,
        pad_id: int,
        sequence_parallel: SequenceParallel | None = None,
        vision=None,
    ) -> None:
        self.rows, self.device, self.pad_id = rows, device, pad_id
        self.batch = batch.select(rows)
        responses, mask = self.batch["responses"], self.batch["response_mask"]
        lengths = response_lengths(self.batch)
        self.real_tokens = sum(len(p) for p in self.batch.prompts) + sum(lengths)
        self.packed: PackedRows | SequenceShard | None = None
        self.responses: torch.Tensor | None = None  # [rows, R] on the device, for the padded layout only
        if sequence_parallel is not None:  # the whole row's positions first, then this rank's slice
            degree = sequence_parallel.size
            cap = batching.max_tokens * degree
            packed = pack_rows(self.batch.prompts, responses, mask, lengths, pad_id, cap, multiple_of=degree)
            self.packed = sequence_parallel.shard(packed).to(device)
            # What this device computes (the pass meter's tokens per second are per device): its slice.
            self.real_tokens, self.computed_tokens = self.packed.real_tokens, self.packed.computed_tokens
        elif batching.padding_free:
            self.packed = pack_rows(self.batch.prompts, responses, mask, lengths, pad_id, batching.max_tokens)
            if vision is not None:  # a vision-language policy: images and mrope positions (training/vision.py)
                self.packed = vision.pack(self.packed, self.batch, lengths, pad_id)
            self.packed = self.packed.to(device)
            self.computed_tokens = self.packed.computed_tokens
        else:
            self.responses = responses.to(device)
            self.computed_tokens = len(rows) * max(len(p) + r for p, r in zip(self.batch.prompts, lengths))
        self.mask = mask.to(device)  # [rows, R]: what the losses and metrics read

    @property
    def padding(self) -> int:
        """Positions computed that hold no token of a sequence."""
        return self.computed_tokens - self.real_tokens


def make_micro_batches(
    batch: Batch,
    batching: Batching,
    device: torch.device,
    pad_id: int,
    sequence_parallel: SequenceParallel | None = None,
    vision=None,
) -> list[MicroBatch]:
    """`batch` as the micro-batches `batching` asks for (collective under a token budget); with
    `sequence_parallel`, this rank's slice of each; `vision`, a `training.vision.VisionPacker`, adds a
    vision-language policy's images to each."""
    degree = sequence_parallel.size if sequence_parallel is not None else 1
    groups = split_rows(sequence_lengths(batch), batching, device, degree)
    return [MicroBatch(batch, rows, batching, device, pad_id, sequence_parallel, vision) for rows in groups]


def scatter_rows(parts: list[torch.Tensor], micro: list[MicroBatch], n_rows: int) -> torch.Tensor:
    """Per-micro-batch results [rows_i, R] back into the rank's row order [n_rows, R]."""
    out = parts[0].new_zeros((n_rows, *parts[0].shape[1:]))
    for part, m in zip(parts, micro):
        out[m.rows] = part
    return out
