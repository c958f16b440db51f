"""vLLM's partial rollouts (`VllmEngine.generate_partial`): it stops once enough groups are complete, finished requests
are what a run to the end draws under the same seeds, unfinished ones a prefix of it with a log-prob per token, and
nothing of the call stays in the engine.

The reference is the contract's default `RolloutEngine.generate_partial` on the same engine: every request run to its
end through `generate_requests` (one `LLM.generate`), then cut to its own cap.
"""

from __future__ import annotations

import pytest

from hybridrl.engines.base import GenerationRequest, RolloutEngine, SamplingParams
from tests.unit.engines.vllm.vllm_helpers import TOL, make_engine, max_logprob_error, run_with_vllm

pytestmark = pytest.mark.vllm

PARAMS = SamplingParams(temperature=1.0, max_new_tokens=48, seed=5)
CONTEXTS = [[1, 40, 41, 42], [1, 90, 91], [7, 8, 9, 10, 11]]


@pytest.fixture(scope="module")
def engine(vllm_tiny_path, tmp_path_factory):
    eng = make_engine(vllm_tiny_path, tmp_path_factory.mktemp("vllm-cache"))
    yield eng
    eng.shutdown()


def requests_and_groups(caps: list[int | None]) -> tuple[list[GenerationRequest], list[int]]:
    """Two samples of each context, group g = context g, each sample capped at caps[g] (None: PARAMS' cap)."""
    requests, groups = [], []
    for g, (context, cap) in enumerate(zip(CONTEXTS, caps, strict=True)):
        for j in range(2):
            requests.append(GenerationRequest(context, prompt_index=10 + g, sample_index=j, max_new_tokens=cap))
            groups.append(g)
    return requests, groups


def run_to_end(engine, requests):
    return RolloutEngine.generate_partial(engine, requests, PARAMS, [0] * len(requests), 1)


def check_against_run_to_end(engine, hf_model, requests, outs, ref) -> None:
    """Finished completions equal the run to the end's; partial ones are a prefix of it, a log-prob per token."""
    assert [c.prompt_index for c in outs] == [r.prompt_index for r in requests]
    for c, full in zip(outs, ref, strict=True):
        assert len(c.logprobs) == len(c.token_ids)
        if c.finish_reason == "partial":
            assert len(c.token_ids) < len(full.token_ids)
            assert c.token_ids == full.token_ids[: len(c.token_ids)]
        else:
            assert (c.token_ids, c.finish_reason) == (full.token_ids, full.finish_reason)
        assert all(abs(a - b) < TOL for a, b in zip(c.logprobs, full.logprobs))
    contexts = {r.prompt_index: r.prompt_ids for r in requests}
    assert max_logprob_error(hf_model, contexts, [c for c in outs if c.token_ids], PARAMS.temperature) < TOL


def test_stops_once_enough_groups_are_complete(engine, vllm_hf_model):
    requests, groups = requests_and_groups([3, 6, None])  # group 2 runs to 48 tokens unless it samples EOS
    ref = run_to_end(engine, requests)
    outs = engine.generate_partial(requests, PARAMS, groups, need=2)
    check_against_run_to_end(engine, vllm_hf_model, requests, outs, ref)
    finished = [c.finish_reason != "partial" for c in outs]
    complete = {g for g in set(groups) if all(f for f, h in zip(finished, groups) if h == g)}
    assert len(complete) >= 2
    assert "partial" in {c.finish_reason for c in outs}  # it stopped before the end of the longest request
    # It stopped at the step that completed the second group: no request ran past the longest of those finished.
    longest_finished = max(len(c.token_ids) for c in outs if c.finish_reason != "partial")
    assert max(len(c.token_ids) for c in outs) <= longest_finished
    assert not engine._llm.llm_engine.has_unfinished_requests()  # the unfinished ones were aborted


def test_waits_for_the_requests_it_is_told_to(engine, vllm_hf_model):
    requests, groups = requests_and_groups([3, 6, None])
    ref = run_to_end(engine, requests)
    outs = engine.generate_partial(requests, PARAMS, groups, need=1, wait_for=[4])
    check_against_run_to_end(engine, vllm_hf_model, requests, outs, ref)
    assert outs[4].finish_reason != "partial" and outs[4].token_ids == ref[4].token_ids
    assert outs[0].finish_reason != "partial" and outs[1].finish_reason != "partial"  # group 0: 3 tokens at most


def test_each_request_keeps_its_own_cap_and_zero_means_done(engine):
    requests, groups = requests_and_groups([2, 0, 5])
    outs = engine.generate_partial(requests, PARAMS, groups, need=3)
    assert [len(c.token_ids) <= cap for c, cap in zip(outs, [2, 2, 0, 0, 5, 5])] == [True] * 6
    assert [c.finish_reason for c in outs[2:4]] == ["length", "length"] and outs[2].token_ids == []


def test_nothing_needed_returns_every_request_empty(engine):
    requests, groups = requests_and_groups([None, None, None])
    outs = engine.generate_partial(requests, PARAMS, groups, need=0)
    assert [(c.token_ids, c.logprobs, c.finish_reason) for c in outs] == [([], [], "partial")] * len(requests)
    assert not engine._llm.llm_engine.has_unfinished_requests()


def test_the_engine_serves_whole_calls_after_a_stopped_one(engine):
    requests, groups = requests_and_groups([3, None, None])
    before = engine.generate_requests(requests, PARAMS)
    engine.generate_partial(requests, PARAMS, groups, need=1)
    assert [c.token_ids for c in engine.generate_requests(requests, PARAMS)] == [c.token_ids for c in before]


def test_partial_rollout_run_with_vllm(tmp_path):
    """rollout=partial on engine=vllm end to end: vLLM stops early (no over-sample-only warning), and samples it
    stopped are carried into the next step's rollout and trained there. Responses of up to 64 tokens, most ending
    earlier, so the groups complete at different steps and a sample cut then has a tail (at a cap of 32 the groups
    complete after step 16, when no sample has more left than it has sampled, and nothing is cut)."""
    log, rows = run_with_vllm(tmp_path, "rollout=partial", "engine.max_new_tokens=64")
    assert "cannot stop a rollout early" not in log
    assert [row["step"] for row in rows] == [1, 2, 3]
    assert all(row["rollout/oversampled_groups"] == 2 for row in rows)  # ⌈0.5 · 4⌉ groups beyond the batch
    # A carried sample holds tokens of an earlier rollout: one that vLLM stopped and handed back 'partial'.
    assert sum(row["rollout/carried"] for row in rows) > 0
    assert all(row["rollout/staleness_max"] <= 1 for row in rows)
