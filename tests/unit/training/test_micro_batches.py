"""Token-budget micro-batches: how rows are spread, by hand."""

from __future__ import annotations

import pytest
import torch

from hybridrl.training.micro_batches import Batching, balanced_partition, micro_batch_count, split_rows

CPU = torch.device("cpu")


def test_balanced_partition_by_hand():
    # Longest first into the lightest group: 10→a, 9→b, 8→b (9 < 10), 2→a, 2→a, 1→a: a = 15, b = 17.
    assert balanced_partition([10, 9, 8, 2, 2, 1], 2) == [[1, 2], [0, 3, 4, 5]]
    assert balanced_partition([5, 5, 5], 3) == [[0], [1], [2]]


def test_the_fewest_micro_batches_within_the_budget():
    # 32 tokens fit two 16-token budgets only by count: the balanced split is 15 + 17, so three.
    assert micro_batch_count([10, 9, 8, 2, 2, 1], 16) == 3
    assert micro_batch_count([10, 9, 8, 2, 2, 1], 17) == 2
    # A row over the budget runs alone; it is never cut.
    assert micro_batch_count([30, 5, 5], 16) == 3
    assert micro_batch_count([4] * 10, 1000) == 1


def test_rows_mode_keeps_consecutive_chunks():
    assert split_rows([3, 1, 4, 1, 5], Batching(rows=2), CPU) == [[0, 1], [2, 3], [4]]


def test_budget_mode_spreads_every_row_once_within_the_budget():
    g = torch.Generator().manual_seed(1)
    lengths = torch.randint(20, 300, (64,), generator=g).tolist()
    groups = split_rows(lengths, Batching(rows=16, max_tokens=1024), CPU)
    assert sorted(i for grp in groups for i in grp) == list(range(64))
    loads = [sum(lengths[i] for i in grp) for grp in groups]
    assert max(loads) <= 1024 and len(groups) >= -(-sum(lengths) // 1024)
    assert max(loads) - min(loads) <= max(lengths)


def test_more_micro_batches_than_rows_is_refused():
    with pytest.raises(ValueError, match="3 rows"):
        balanced_partition([1, 2, 3], 4)
