"""One step's partial rollout, counted by hand on a token clock (tests/unit/rollout/fakes.py): one engine step gives
every running request one token; samples stop at fixed targets. Groups of 2, 2 trained per step, 1 over-sampled,
responses capped at 10; prompt 0's first sample needs 8 tokens, every other sample 2, so each step's engines stop
after two engine steps and prompt 0's long sample gains 2 tokens per step."""

from __future__ import annotations

from collections import defaultdict

import pytest

from hybridrl.engines.base import SamplingParams
from hybridrl.rollout.pool import load_pool, save_pool
from tests.unit.rollout.fakes import ClockGroup, make_prompts, partial_rollout, run_config

LONG = defaultdict(lambda: 2, {(0, 0): 8})


def trained_ids(batch) -> list[int]:
    return [s["id"] for s in batch.meta["sample"]]


def run(rollout, steps, sampling=None):
    sampling = sampling or SamplingParams(n=2, max_new_tokens=10)
    return [rollout.rollout(step, sampling) for step in steps]


def test_a_long_sample_is_carried_until_it_finishes_and_its_staleness_counted():
    group = ClockGroup(LONG)
    r = partial_rollout(run_config("rollout.partial.max_staleness=3"), group, make_prompts(40))
    out = run(r, range(1, 6))
    assert [trained_ids(b)[::2] for b, *_ in out] == [[1, 2], [3, 4], [5, 6], [0, 7], [8, 9]]
    m1, m4, m5 = out[0][3], out[3][3], out[4][3]
    assert (m1["rollout/carried"], m1["rollout/staleness_max"], m1["rollout/dropped"]) == (0, 0, 0)
    assert (m1["rollout/oversampled_groups"], m1["rollout/pending_groups"], m1["rollout/generated_tokens"]) == (
        1,
        2,
        12,
    )
    # Step 4 trains prompt 0: its long sample's tokens were sampled at steps 1,1,2,2,3,3,4,4 (lags 3,3,2,2,1,1,0,0),
    # its short one's at step 1 (3,3); prompt 7's four tokens lag 0. 14 tokens, lags summing to 18, 8 of them <= 1.
    assert m4["rollout/carried"] == 2
    assert m4["rollout/staleness_mean"] == pytest.approx(18 / 14)
    assert m4["rollout/staleness_max"] == 3
    assert m4["rollout/staleness_le1_frac"] == pytest.approx(8 / 14)
    long_row = out[3][0]["response_mask"][0]
    assert int(long_row.sum()) == 8 and out[3][0].meta["finish_reason"][:2] == ["stop", "stop"]
    # Step 4 completed prompt 8 too, not needed: it restarts (a surplus group; no sample of it is dropped for its
    # staleness) and comes first in step 5, whose window is 8, 9, 10, all complete in the same engine step: 8 and 9
    # are trained, 10 restarts.
    assert (m4["rollout/surplus_groups"], m1["rollout/surplus_groups"], m4["rollout/dropped"]) == (1, 0, 0)
    assert [c["need"] for c in group.calls if c["step"] == 5] == [2]
    assert (m5["rollout/carried"], m5["rollout/staleness_max"], m5["rollout/surplus_groups"]) == (0, 0, 1)
    assert [g.prompt for g in r.pool.groups] == [10, 11]  # 11: the rest of the loader's last batch
    assert not any(s.tokens for g in r.pool.groups for s in g.samples)


def test_carried_tokens_continue_from_their_context_with_the_cap_they_have_left():
    group = ClockGroup(LONG)
    r = partial_rollout(run_config("rollout.partial.max_staleness=3"), group, make_prompts(40))
    run(r, range(1, 3))
    step2 = [c for c in group.calls if c["step"] == 2][0]
    carried = step2["requests"][0]
    assert carried.prompt_ids == [1000] * 3 + [0, 1] and carried.max_new_tokens == 8 and carried.sample_index == 0
    # Streams are keyed by the group's place in this step's rollout: prompt 0 first, then 3 and 4.
    assert [q.prompt_index for q in step2["requests"]] == [0, 1, 1, 2, 2]
    # The response the batch trains is the whole sample: positions 0..7, in order.
    out = run(r, range(3, 5))
    assert out[-1][0]["responses"][0, :8].tolist() == list(range(8))
    # Each token keeps the engine log-prob of the rollout that sampled it: two per step, steps 1 to 4.
    want = [-(step + k / 100) for k, step in enumerate([1, 1, 2, 2, 3, 3, 4, 4])]
    assert out[-1][0]["engine_logprobs"][0, :8].tolist() == pytest.approx(want)


def test_a_sample_with_no_tail_left_finishes_in_its_own_step():
    # Cap 4, prompt 0's first sample needs 3 tokens: the rollout stops after 2 engine steps (groups 1 and 2 done),
    # when that sample's cap leaves 2 tokens, no more than the 2 the rollout ran. It finishes in the same step, one
    # token more, in a stream past the window's 3 places; nothing is carried and step 1 trains prompts 0 and 1.
    group = ClockGroup(defaultdict(lambda: 2, {(0, 0): 3}))
    r = partial_rollout(run_config("engine.max_new_tokens=4"), group, make_prompts(40))
    ((batch, _, _, m),) = run(r, [1], SamplingParams(n=2, max_new_tokens=4))
    assert [c["need"] for c in group.calls] == [2, 0]
    tail = group.calls[1]
    assert tail["wait_for"] == [0] and len(tail["requests"]) == 1
    req = tail["requests"][0]
    assert (req.prompt_ids, req.max_new_tokens, req.prompt_index, req.sample_index) == ([1000] * 3 + [0, 1], 2, 3, 0)
    assert trained_ids(batch)[::2] == [0, 1]
    assert batch["responses"][0, :3].tolist() == [0, 1, 2] and batch.meta["finish_reason"][0] == "stop"
    assert (m["rollout/tails_finished"], m["rollout/carried"], m["rollout/staleness_max"]) == (1, 0, 0)
    assert m["rollout/generated_tokens"] == 6 * 2 + 1


def test_a_sample_in_its_last_rollout_within_the_bound_is_waited_for():
    group = ClockGroup(LONG)
    r = partial_rollout(run_config("rollout.partial.max_staleness=1"), group, make_prompts(40))
    out = run(r, range(1, 3))
    # Step 2 is the last rollout in which prompt 0's long sample (2 tokens from step 1) may lag only 1: the engine
    # waits for its 6 tokens more, and step 2 trains prompt 0 with 3 (done after 2 engine steps, in pool order).
    assert [c["wait_for"] for c in group.calls] == [[], [0]]
    assert [trained_ids(b)[::2] for b, *_ in out] == [[1, 2], [0, 3]]
    assert out[1][3]["rollout/staleness_max"] == 1 and out[1][3]["rollout/carried"] == 2


def test_a_sample_carried_past_max_staleness_restarts_and_is_counted():
    r = partial_rollout(run_config("rollout.partial.max_staleness=0"), ClockGroup(LONG), make_prompts(40))
    out = run(r, range(1, 4))
    # With max_staleness=0 nothing may lag: at steps 2 and 3 prompt 0's samples (the long one unfinished after 2
    # tokens, its sibling finished) would lag 1, so both restart, counted; in 2 engine steps prompt 0 never completes.
    assert [m["rollout/dropped"] for *_, m in out] == [0, 2, 2]
    assert all(m["rollout/staleness_max"] == 0 for *_, m in out)
    assert [trained_ids(b)[::2] for b, *_ in out] == [[1, 2], [3, 4], [5, 6]]


def test_mode_drop_restarts_unfinished_samples_at_the_end_of_the_step():
    r = partial_rollout(run_config("rollout.partial.mode=drop"), ClockGroup(LONG), make_prompts(40))
    ((_, _, _, m1),) = run(r, [1])
    assert m1["rollout/dropped"] == 1
    first = r.pool.groups[0]
    assert first.prompt == 0 and first.samples[0].tokens == [] and first.samples[1].finished


def test_every_prompt_is_trained_once_in_the_loaders_order():
    targets = {(i, j): 1 + (7 * i + 3 * j) % 10 for i in range(60) for j in range(2)}
    r = partial_rollout(run_config("rollout.partial.max_staleness=9"), ClockGroup(targets), make_prompts(60))
    out = run(r, range(1, 16))
    trained = [i for b, *_ in out for i in trained_ids(b)[::2]]
    assert len(trained) == len(set(trained)) == 30
    for b, *_ in out:  # each batch follows the pool's order, which is the loader's (no shuffle: ascending)
        assert trained_ids(b)[::2] == sorted(trained_ids(b)[::2])
    pending = [g.prompt for g in r.pool.groups]
    assert sorted(trained + pending) == list(range(r.loader.offset))  # nothing skipped, nothing twice


def test_the_pool_and_the_loader_position_resume_exactly(tmp_path):
    targets = {(i, j): 1 + (5 * i + 3 * j) % 10 for i in range(60) for j in range(2)}
    cfg = run_config("rollout.partial.max_staleness=2")
    straight = partial_rollout(cfg, ClockGroup(targets), make_prompts(60))
    resumed = partial_rollout(cfg, ClockGroup(targets), make_prompts(60))
    run(straight, range(1, 4))
    run(resumed, range(1, 4))
    save_pool(resumed.pool, tmp_path)
    state = resumed.loader.state_dict()
    fresh = partial_rollout(cfg, ClockGroup(targets), make_prompts(60))
    assert load_pool(fresh.pool, tmp_path)
    fresh.loader.load_state_dict(state)
    assert any(s.tokens and not s.finished for g in fresh.pool.groups for s in g.samples)  # something is carried
    for (b1, _, _, m1), (b2, _, _, m2) in zip(run(straight, range(4, 9)), run(fresh, range(4, 9))):
        assert trained_ids(b1) == trained_ids(b2) and m1 == m2
        assert b1["responses"].tolist() == b2["responses"].tolist()
        assert b1["engine_logprobs"].tolist() == b2["engine_logprobs"].tolist()


def test_two_engine_replicas_share_the_groups_in_turn():
    one, two = ClockGroup(LONG), ClockGroup(LONG, world=2)
    cfg = run_config("rollout.partial.max_staleness=3", "cluster.name=local", "cluster.workers_per_node=2")
    a = run(partial_rollout(run_config("rollout.partial.max_staleness=3"), one, make_prompts(40)), range(1, 5))
    b = run(partial_rollout(cfg, two, make_prompts(40)), range(1, 5))
    # (Replicas stop on their own quotas, so where the quota is less than a replica's groups the two may part: from
    # step 5 here, where one group is needed and the two replicas hold one each.)
    assert [trained_ids(x[0]) for x in a] == [trained_ids(x[0]) for x in b]
    # Step 1: groups 0 and 2 on replica 0 (quota 1), group 1 on replica 1 (quota 1).
    first = [c for c in two.calls if c["step"] == 1]
    assert [(c["need"], sorted({q.prompt_index for q in c["requests"]})) for c in first] == [(1, [0, 2]), (1, [1])]


def test_dynamic_sampling_rounds_complete_the_missing_groups():
    flat_even = lambda batch: ([float(s["id"] % 2) * j for s, j in zip(batch.meta["sample"], [0, 1] * 99)], {})  # noqa: E731
    cfg = run_config("algorithm.filter_groups=true", "algorithm.max_resample_rounds=2")
    group = ClockGroup(defaultdict(lambda: 2))
    r = partial_rollout(cfg, group, make_prompts(40), score=flat_even)
    ((batch, scores, _, m),) = run(r, [1])
    # Round 1 takes prompts 0 (flat) and 1; round 2 finds prompt 2 complete already (flat); round 3 completes 3.
    assert trained_ids(batch)[::2] == [1, 3] and scores == [0.0, 1.0, 0.0, 1.0]
    assert (m["batch/resample_rounds"], m["batch/filtered_groups"], m["batch/filled_groups"]) == (2, 2, 0)
    assert m["rollout/oversampled_groups"] == 3
    assert [(c["need"], [q.prompt_index for q in c["requests"]]) for c in group.calls] == [
        (2, [0, 0, 1, 1, 2, 2]),  # round 1: places 0-2 (3-5 are for its short tails)
        (1, [10, 10, 11, 11]),  # round 3: after round 1's 2 x 3 streams and round 2's 2 x 2 (it generated nothing)
    ]
    # Round 3 completed prompt 4 too: not needed, it restarts (a surplus group, not dropped) and comes first next step.
    assert [g.prompt for g in r.pool.groups] == [4, 5] and not any(g.complete for g in r.pool.groups)
    assert (m["rollout/surplus_groups"], m["rollout/dropped"]) == (1, 0)


def test_no_more_groups_are_carried_than_the_next_step_trains_and_that_step_starts_no_others():
    # Over-sampling 2.0: six groups in flight for two trained. Prompts 0-3 each have one sample of 8 tokens, the rest
    # stop at 2, so step 1 trains 4 and 5 and stops with 0-3 unfinished, all due in step 2 (max_staleness=1).
    group = ClockGroup(defaultdict(lambda: 2, {(p, 0): 8 for p in range(4)}))
    cfg = run_config("rollout.partial.max_staleness=1", "rollout.partial.oversample=2.0")
    r = partial_rollout(cfg, group, make_prompts(40))
    (b1, _, _, m1), (b2, _, _, m2) = run(r, [1, 2])
    assert trained_ids(b1)[::2] == [4, 5] and m1["rollout/oversampled_groups"] == 4
    # Step 2 trains two of them: 2 and 3 would finish beside 0 and 1 and then restart with their 8-token samples, so
    # they restart now, each holding two samples' tokens (4 dropped).
    assert m1["rollout/dropped"] == 4 and m1["rollout/pending_groups"] == 4
    # Step 2 must finish 0 and 1 anyway: it starts no other group, and runs their long samples' last 6 tokens alone.
    (call,) = [c for c in group.calls if c["step"] == 2]
    assert [(q.prompt_index, q.sample_index) for q in call["requests"]] == [(0, 0), (1, 0)]
    assert call["need"] == 2 and call["wait_for"] == [0, 1]
    assert trained_ids(b2)[::2] == [0, 1] and m2["rollout/oversampled_groups"] == 0
    assert (m2["rollout/carried"], m2["rollout/staleness_max"], m2["rollout/dropped"]) == (4, 1, 0)
    # 2 and 3 come first in step 3, from their prompts again.
    assert [g.prompt for g in r.pool.groups][:2] == [2, 3] and not any(
        s.tokens for g in r.pool.groups for s in g.samples
    )
