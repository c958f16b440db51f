"""The request-level API partial rollouts use: `generate_partial` stops once enough groups are complete and hands
back the rest as they are; a request's own `max_new_tokens` caps it. The reference everywhere is the same requests
run to their end through `generate_requests` (a token depends only on its context and its stream, so a stopped
request's tokens are a prefix of its uninterrupted ones)."""

from __future__ import annotations

import pytest
import torch

from hybridrl.engines.base import GenerationRequest, GroupCountdown, SamplingParams
from hybridrl.engines.native.hf import HFEngine
from tests.tiny_models import tiny_model
from tests.unit.engines.native.test_fused_engine import EOS, PAD, fused_engine

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# Stops on a fifth of the vocabulary: lengths spread from 1 to the cap, as real responses do.
PARAMS = SamplingParams(temperature=1.0, max_new_tokens=24, stop_token_ids=list(range(2, 99, 5)), seed=7)
PROMPTS = [[5, 17, 3, 9, 11], [21, 2, 30], [7, 8, 9, 10, 11, 12, 13], [40, 41], [60, 3, 3, 3]]
GROUP = 3


def requests() -> tuple[list[GenerationRequest], list[int]]:
    reqs = [GenerationRequest(p, i, j) for i, p in enumerate(PROMPTS) for j in range(GROUP)]
    return reqs, [r.prompt_index for r in reqs]


@pytest.fixture(scope="module")
def model():
    return tiny_model("qwen2")


def complete_groups(outs, groups) -> set[int]:
    unfinished = {g for o, g in zip(outs, groups) if o.finish_reason == "partial"}
    return set(groups) - unfinished


def test_countdown_counts_a_group_once_all_its_requests_finish():
    c = GroupCountdown(["a", "a", "b", "c", "c"], need=2)
    assert [c.finish(i) for i in (0, 2, 3)] == [False, False, False]  # a half done, b complete, c half done
    assert c.complete == 1 and c.finish(4) and c.done  # c complete: 2 groups
    assert GroupCountdown([], 0).done
    wait = GroupCountdown(["a", "b", "b"], need=1, wait_for=[2])
    assert not wait.finish(0) and not wait.finish(1) and wait.finish(2)  # a complete, but request 2 ran on


@pytest.mark.parametrize("gpu_schedule", [False, True], ids=["cpu", "gpu_schedule"])
def test_stops_once_enough_groups_are_complete_and_returns_prefixes(model, gpu_schedule):
    """On a GPU the scheduler reads each step's tokens one step behind its launch: the stop reads what was launched
    first (the GPU's schedule runs here on the CPU: buckets, full-width attention, outputs read a step late)."""
    engine = fused_engine(model, max_batch_size=16)
    engine.runner.on_gpu = gpu_schedule
    reqs, groups = requests()
    full = engine.generate_requests(reqs, PARAMS)
    assert len({len(o.token_ids) for o in full}) > 3  # the stop ids give lengths that differ
    outs = engine.generate_partial(reqs, PARAMS, groups, need=2)
    done = complete_groups(outs, groups)
    assert 2 <= len(done) < len(PROMPTS)  # stopped early, with at least the groups asked for
    for o, f, g in zip(outs, full, groups):
        if o.finish_reason == "partial":
            assert o.token_ids == f.token_ids[: len(o.token_ids)] and len(o.token_ids) < len(f.token_ids)
            assert o.logprobs == pytest.approx(f.logprobs[: len(o.logprobs)], abs=1e-5)
        else:  # finished: exactly the uninterrupted completion
            assert (o.token_ids, o.finish_reason) == (f.token_ids, f.finish_reason)
            assert o.logprobs == pytest.approx(f.logprobs, abs=1e-5)
    # Nothing is left running or holding KV blocks: the next call starts clean.
    assert not engine.has_work and not engine.cache.allocator.held
    assert [o.token_ids for o in engine.generate_requests(reqs, PARAMS)] == [f.token_ids for f in full]


def test_requests_it_must_wait_for_finish_before_it_stops(model):
    engine = fused_engine(model)
    reqs, groups = requests()
    full = engine.generate_requests(reqs, PARAMS)
    longest = max(range(len(reqs)), key=lambda i: len(full[i].token_ids))
    early = engine.generate_partial(reqs, PARAMS, groups, need=1)
    assert early[longest].finish_reason == "partial"  # without waiting, the longest is cut
    outs = engine.generate_partial(reqs, PARAMS, groups, need=1, wait_for=[longest])
    assert (outs[longest].token_ids, outs[longest].finish_reason) == (
        full[longest].token_ids,
        full[longest].finish_reason,
    )


def test_asking_for_every_group_is_generate_requests(model):
    engine = fused_engine(model)
    reqs, groups = requests()
    full = engine.generate_requests(reqs, PARAMS)
    outs = engine.generate_partial(reqs, PARAMS, groups, need=len(PROMPTS))
    assert [(o.token_ids, o.finish_reason) for o in outs] == [(f.token_ids, f.finish_reason) for f in full]


def test_more_requests_than_rows_still_stop_and_waiting_ones_come_back_empty(model):
    engine = fused_engine(model, max_batch_size=4)
    reqs, groups = requests()
    outs = engine.generate_partial(reqs, PARAMS, groups, need=1)
    assert len(complete_groups(outs, groups)) >= 1
    assert any(o.finish_reason == "partial" and not o.token_ids for o in outs)  # never admitted
    assert not engine.has_work and not engine.cache.allocator.held


def test_a_request_cap_limits_it_as_max_new_tokens_would(model):
    engine = fused_engine(model)
    reqs, _ = requests()
    short = SamplingParams(**{**PARAMS.__dict__, "max_new_tokens": 3})
    want = engine.generate_requests(reqs, short)
    capped = [GenerationRequest(r.prompt_ids, r.prompt_index, r.sample_index, max_new_tokens=3) for r in reqs]
    got = engine.generate_requests(capped, PARAMS)
    assert [(o.token_ids, o.finish_reason) for o in got] == [(w.token_ids, w.finish_reason) for w in want]


def test_an_engine_that_cannot_stop_runs_everything_and_cuts_each_to_its_cap(model):
    engine = HFEngine(model, [EOS], PAD)
    assert not engine.stops_early
    reqs, groups = requests()
    full = engine.generate_requests(reqs, PARAMS)
    capped = [GenerationRequest(r.prompt_ids, r.prompt_index, r.sample_index, max_new_tokens=2) for r in reqs[:3]]
    outs = engine.generate_partial(capped + reqs[3:], PARAMS, groups, need=1)
    assert all(o.finish_reason != "partial" for o in outs)
    for o, f in zip(outs[:3], full[:3]):
        assert o.token_ids == f.token_ids[:2]
        assert o.finish_reason == (f.finish_reason if len(f.token_ids) <= 2 else "length")
    assert [o.token_ids for o in outs[3:]] == [f.token_ids for f in full[3:]]


def test_a_stopped_sample_continued_with_its_tokens_stays_within_its_cap(model):
    engine = fused_engine(model)
    reqs, groups = requests()
    outs = engine.generate_partial(reqs, PARAMS, groups, need=1)
    stopped = [(r, o) for r, o in zip(reqs, outs) if o.finish_reason == "partial" and o.token_ids]
    assert stopped
    more = [
        GenerationRequest(r.prompt_ids + o.token_ids, 100 + k, 0, PARAMS.max_new_tokens - len(o.token_ids))
        for k, (r, o) in enumerate(stopped)
    ]
    for (_, o), c in zip(stopped, engine.generate_requests(more, PARAMS)):
        total = len(o.token_ids) + len(c.token_ids)
        if c.finish_reason == "stop":
            assert c.token_ids[-1] in PARAMS.stop_token_ids and total <= PARAMS.max_new_tokens
        else:
            assert c.finish_reason == "length" and total == PARAMS.max_new_tokens
    assert torch.isfinite(torch.tensor([x for _, o in stopped for x in o.logprobs])).all()


@pytest.mark.parametrize("rest_cap, stops", [(4, False), (5, True)])
def test_it_stops_only_where_a_request_has_a_tail(model, rest_cap, stops):
    """Group 0 is capped at 1 token: it is complete after the first step, when every other request has sampled 2
    (the prefill's token and one decode step's). Capped at 4, what they have left (2) is no more than that: no tail,
    so the call runs on and samples what generate_requests does; capped at 5 (3 left) it stops there."""
    engine = fused_engine(model, max_batch_size=16)
    reqs = [
        GenerationRequest(p, i, j, max_new_tokens=1 if i == 0 else rest_cap)
        for i, p in enumerate(PROMPTS)
        for j in range(GROUP)
    ]
    groups = [r.prompt_index for r in reqs]
    full = engine.generate_requests(reqs, PARAMS)
    outs = engine.generate_partial(reqs, PARAMS, groups, need=1)
    if stops:
        assert max(len(o.token_ids) for o in outs) == 2 and any(o.finish_reason == "partial" for o in outs)
        assert all(o.token_ids == f.token_ids[: len(o.token_ids)] for o, f in zip(outs, full))
    else:
        assert [(o.token_ids, o.finish_reason) for o in outs] == [(f.token_ids, f.finish_reason) for f in full]
        assert max(len(o.token_ids) for o in outs) == rest_cap
