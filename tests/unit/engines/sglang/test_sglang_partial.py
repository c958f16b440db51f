"""SglangEngine.generate_partial against the stand-in engine (tokens arrive one by one; an aborted request answers
after its next token with finish_reason "abort" and what it sampled, as SGLang does): it stops once enough groups are
complete, aborts exactly the unfinished requests by id, and returns finished requests whole and unfinished ones as a
prefix with a log-prob per token.

The reference is the contract's default `RolloutEngine.generate_partial` on the same engine: every request run to its
end (`generate_requests`), then cut to its own cap.
"""

from __future__ import annotations

import json

import pytest

from hybridrl.engines.base import Completion, GenerationRequest, RolloutEngine, SamplingParams
from hybridrl.engines.config import EngineConfig
from hybridrl.engines.sglang.engine import SglangEngine
from hybridrl.engines.sglang.requests import parse_turn_outputs
from tests.unit.engines.sglang._fake_sglang import FakeSglangEngine

PARAMS = SamplingParams(temperature=0.8, max_new_tokens=64, seed=5)


@pytest.fixture
def eng(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 2}))
    engine = SglangEngine(
        str(tmp_path), EngineConfig(name="sglang"), seed=3, device="cpu", engine_factory=FakeSglangEngine
    )
    engine._engine.token_delay = 0.002  # tokens arrive over time, so a long request is still running at the stop
    return engine


def requests_and_groups(caps: list[int | None]) -> tuple[list[GenerationRequest], list[int]]:
    """Two samples per group g, each capped at caps[g] (None: PARAMS' cap)."""
    requests, groups = [], []
    for g, cap in enumerate(caps):
        for j in range(2):
            requests.append(GenerationRequest([7, 8, 9 + g], prompt_index=20 + g, sample_index=j, max_new_tokens=cap))
            groups.append(g)
    return requests, groups


def check_against_run_to_end(outs: list[Completion], ref: list[Completion]) -> None:
    for c, full in zip(outs, ref, strict=True):
        assert c.prompt_index == full.prompt_index and len(c.logprobs) == len(c.token_ids)
        if c.finish_reason == "partial":
            assert len(c.token_ids) < len(full.token_ids)
            assert (c.token_ids, c.logprobs) == (full.token_ids[: len(c.token_ids)], full.logprobs[: len(c.logprobs)])
        else:
            assert c == full


def test_sglang_and_vllm_engines_say_they_stop_early():
    from hybridrl.engines.vllm.engine import VllmEngine

    assert SglangEngine.stops_early and VllmEngine.stops_early and not RolloutEngine.stops_early


def test_stops_once_enough_groups_are_complete(eng):
    requests, groups = requests_and_groups([2, 3, None])
    ref = RolloutEngine.generate_partial(eng, requests, PARAMS, groups, 3)
    outs = eng.generate_partial(requests, PARAMS, groups, need=2)
    check_against_run_to_end(outs, ref)
    assert [c.finish_reason for c in outs] == ["length"] * 4 + ["partial"] * 2
    sent = [c[1]["rid"] for c in eng._engine.calls if c[0] == "async_generate"]
    assert sorted(eng._engine.aborted) == sorted(sent[4:])  # group 2's requests, by their ids
    assert not eng._engine.running  # nothing of the call is left in the engine
    calls = [c[1] for c in eng._engine.calls if c[0] == "async_generate"]
    assert sorted(sp["sampling_params"]["max_new_tokens"] for sp in calls) == [2, 2, 3, 3, 64, 64]  # own caps


def test_waits_for_the_requests_it_is_told_to(eng):
    requests, groups = requests_and_groups([2, 30, None])
    ref = RolloutEngine.generate_partial(eng, requests, PARAMS, groups, 3)
    outs = eng.generate_partial(requests, PARAMS, groups, need=1, wait_for=[3])
    check_against_run_to_end(outs, ref)
    assert outs[3] == ref[3] and outs[4].finish_reason == outs[5].finish_reason == "partial"


def test_a_request_with_nothing_left_is_done_without_a_call(eng):
    requests, groups = requests_and_groups([0, 1])
    outs = eng.generate_partial(requests, PARAMS, groups, need=2)
    assert [(c.token_ids, c.finish_reason) for c in outs[:2]] == [([], "length")] * 2
    assert [len(c.token_ids) for c in outs[2:]] == [1, 1]
    assert len([c for c in eng._engine.calls if c[0] == "async_generate"]) == 2


def test_an_abort_before_the_first_token_is_an_empty_partial():
    """SGLang answers a request aborted in its waiting queue with no tokens and, where it kept none, no log-probs."""
    aborted = {"output_ids": [], "meta_info": {"finish_reason": {"type": "abort", "message": "Abort in waiting queue"}}}
    (c,) = parse_turn_outputs([aborted], [GenerationRequest([1], 4, 0)], abort_as="partial")
    assert c == Completion(4, [], [], "partial")
    with pytest.raises(RuntimeError, match="abort"):  # outside a partial rollout an abort stays an error
        parse_turn_outputs([aborted], [GenerationRequest([1], 4, 0)])


def test_no_request_id_is_a_prefix_of_another(eng):
    """SGLang aborts every request whose id starts with the id given, so one abort must reach one request only."""
    requests = [GenerationRequest([7, i], i, 0, max_new_tokens=2 if i != 1 else 30) for i in range(12)]
    outs = eng.generate_partial(requests, PARAMS, list(range(12)), need=11)
    rids = [c[1]["rid"] for c in eng._engine.calls if c[0] == "async_generate"]
    assert len(set(rids)) == 12 and not any(a != b and b.startswith(a) for a in rids for b in rids)
    assert [c.finish_reason for c in outs] == ["length", "partial"] + ["length"] * 10
