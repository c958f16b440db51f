"""The pool's rules (expiry, taking complete groups in order), its checkpoint form, and the replicas' quotas."""

from __future__ import annotations

import pytest
import torch

from hybridrl.errors import CheckpointError, ConfigError
from hybridrl.rollout.config import PartialConfig
from hybridrl.rollout.dispatch import quotas
from hybridrl.rollout.pool import POOL_FILE, PoolSample, RolloutPool, load_pool, save_pool


def pool_of(*groups) -> RolloutPool:
    """groups: per group, per sample (tokens' versions, finished?)."""
    pool = RolloutPool(len(groups[0]))
    for i, samples in enumerate(groups):
        pool.add(i)
        for s, (versions, finished) in zip(pool.groups[-1].samples, samples):
            s.tokens, s.logprobs, s.versions = list(range(len(versions))), [-0.25] * len(versions), list(versions)
            s.finish_reason = "stop" if finished else None
            s.finished_at = max(versions, default=0) if finished else 0
    return pool


def test_expire_restarts_samples_whose_oldest_token_lags_too_far():
    pool = pool_of([([1, 2, 3], False), ([2], True)], [([3, 3], False), ([], False)])
    assert pool.expire(step=4, max_staleness=2) == 1  # only the sample started at step 1 lags 3 > 2
    assert pool.groups[0].samples[0].tokens == [] and not pool.groups[0].samples[0].finished
    assert pool.groups[0].samples[1].finished  # lag 2: kept
    assert pool.expire(step=5, max_staleness=2) == 1  # the finished one (step 2) lags 3; [3, 3] lags 2
    assert pool.expire(step=6, max_staleness=2) == 1  # now [3, 3] too


def test_restart_complete_restarts_whole_complete_groups_only():
    done, open_ = ([1, 1], True), ([1], False)
    pool = pool_of([done, done], [done, open_], [open_, ([], False)], [done, done])
    assert pool.restart_complete() == 4  # groups 0 and 3, two samples each
    assert [g.prompt for g in pool.groups] == [0, 1, 2, 3]  # in place, in order
    assert not any(s.tokens for i in (0, 3) for s in pool.groups[i].samples)
    assert pool.groups[1].samples[0].finished and pool.groups[2].samples[0].tokens == [0]  # the others untouched


def test_take_complete_takes_this_steps_first_in_order_and_keeps_the_rest_in_order():
    done, open_ = ([1], True), ([1], False)
    pool = pool_of([done, open_], [done, done], [open_, open_], [done, done], [done, done], [done, done])
    for g, when in zip(pool.groups, [0, 2, 0, 3, 3, 2]):
        for s in g.samples:
            s.finished_at = when if s.finished else 0
    # Step 3 completed groups 3 and 4; 1 and 5 completed at step 2 (kept): they fill in, in order.
    assert [g.prompt for g in pool.take_complete(3, step=3)] == [1, 3, 4]
    assert [g.prompt for g in pool.groups] == [0, 2, 5]


def test_state_dict_round_trips_through_a_weights_only_load(tmp_path):
    pool = pool_of([([1, 2, 3], False), ([2], True)], [([3, 3], True), ([], False)])
    pool.groups[1].samples[0].trajectory = {"response_mask": [1, 0], "messages": [{"role": "tool", "content": "4"}]}
    pool.groups[0].samples[0].logprobs = [-0.1, -1 / 3, -2.0]  # float64 survives exactly
    save_pool(pool, tmp_path)
    back = RolloutPool(2)
    assert load_pool(back, tmp_path)
    assert back.groups == pool.groups
    assert not load_pool(RolloutPool(2), tmp_path / "elsewhere")  # a checkpoint without a pool: empty, False


def test_a_pool_of_another_shape_or_a_damaged_file_is_refused_naming_the_file(tmp_path):
    save_pool(pool_of([([1], True), ([1], True)]), tmp_path)
    with pytest.raises(CheckpointError, match=f"{POOL_FILE}.*groups of 2, this run's are of 4"):
        load_pool(RolloutPool(4), tmp_path)
    (tmp_path / POOL_FILE).write_bytes(b"not a pool")
    with pytest.raises(CheckpointError, match=POOL_FILE):
        load_pool(RolloutPool(2), tmp_path)
    torch.save({"format": 99}, tmp_path / POOL_FILE)
    with pytest.raises(CheckpointError, match="format 99"):
        load_pool(RolloutPool(2), tmp_path)


def test_reset_reports_whether_anything_was_dropped():
    assert not PoolSample().reset()
    assert PoolSample([4], [-1.0], [2]).reset()


@pytest.mark.parametrize(
    "sizes, need, want",
    [
        ([2, 1], 2, [1, 1]),  # 4/3 and 2/3: the larger remainder gets the spare
        ([3, 3], 3, [2, 1]),  # equal remainders: the earlier replica
        ([4, 0, 4], 8, [4, 0, 4]),  # everything
        ([1, 5], 5, [1, 4]),
        ([0, 0], 0, [0, 0]),
    ],
)
def test_quotas_add_up_and_never_exceed_a_replicas_groups(sizes, need, want):
    assert quotas(sizes, need) == want


def test_quotas_refuse_more_than_there_is():
    with pytest.raises(ValueError, match="cannot complete 3 groups out of 2"):
        quotas([1, 1], 3)


@pytest.mark.parametrize(
    "kw, key",
    [
        ({"oversample": -0.1}, "rollout.partial.oversample"),
        ({"mode": "keep"}, "rollout.partial.mode"),
        ({"max_staleness": -1}, "rollout.partial.max_staleness"),
        ({"oversample": float("nan")}, "oversample"),
    ],
)
def test_bad_values_name_their_key(kw, key):
    with pytest.raises(ConfigError, match=key):
        PartialConfig(**kw)


def test_extra_groups_round_up():
    assert [PartialConfig(oversample=f).extra_groups(32) for f in (0, 0.25, 0.01, 1.0)] == [0, 8, 1, 32]
