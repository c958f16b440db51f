"""Partial rollouts of the agent loop against the scripted engines: once enough groups are complete no trajectory
starts another turn; the unfinished come back 'partial' (to restart), the finished exactly as the loop makes them."""

from __future__ import annotations

import pytest

from hybridrl.agent import AgentConfig, AgentLoop
from hybridrl.agent.testing import ScriptedAsyncEngine, ScriptedEngine
from hybridrl.engines.base import GenerationRequest, SamplingParams
from hybridrl.rollout.agent import generate_agent_partial
from tests.unit.agent.test_agent_loop import call_ids, ids, prompt_ids, tok  # noqa: F401  (tok: the fixture)


def script(tok):  # noqa: F811
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    calls = call_ids(tok, "1+1") + [eos]

    def stream(prompt_index, sample_index, turn):
        if prompt_index == 0 and turn < 3:
            return calls  # prompt 0 calls the calculator three times before it answers
        return ids(tok, "2") + [eos]

    return stream, eos


@pytest.mark.parametrize("Engine", [ScriptedAsyncEngine, ScriptedEngine])
def test_no_new_turn_once_enough_groups_are_complete(tok, Engine):  # noqa: F811
    stream, eos = script(tok)
    engine = Engine(stream, [eos])
    loop = AgentLoop(AgentConfig(max_turns=6), tok)
    p = prompt_ids(tok, "x")
    requests = [GenerationRequest(p, i, j) for i in (0, 1) for j in (0, 1)]
    outs = generate_agent_partial(loop, engine, requests, [0, 0, 1, 1], 1, SamplingParams(seed=3, max_new_tokens=200))
    assert [o.finish_reason for o in outs] == ["partial", "partial", "stop", "stop"]
    assert [o.turns for o in outs] == [1, 1, 1, 1]  # prompt 0's trajectories had started: their turn is dropped
    assert [o.response_ids for o in outs[:2]] == [[], []]
    assert outs[2].response_ids == ids(tok, "2") + [eos] and outs[2].end_reason == "done"
    # Prompt 0 asked for one turn each and no more: the stop came before their second.
    assert sorted(turn for r, _, turn in engine.requests if r.prompt_index == 0) == [0, 0]
    loop.close()


def test_asking_for_every_group_is_the_loops_own_trajectories(tok):  # noqa: F811
    stream, eos = script(tok)
    loop = AgentLoop(AgentConfig(max_turns=6), tok)
    p = prompt_ids(tok, "x")
    params = SamplingParams(seed=3, max_new_tokens=200)
    requests = [GenerationRequest(p, i, j) for i in (0, 1) for j in (0, 1)]
    outs = generate_agent_partial(loop, ScriptedAsyncEngine(stream, [eos]), requests, [0, 0, 1, 1], 2, params)
    want = loop.generate_sync(ScriptedAsyncEngine(stream, [eos]), [p, p], SamplingParams(n=2, **params_kw(params)))
    assert [(o.response_ids, o.response_mask, o.logprobs, o.turns) for o in outs] == [
        (w.response_ids, w.response_mask, w.logprobs, w.turns) for w in want
    ]
    assert outs[0].turns == 4 and outs[0].tool_calls == 3
    loop.close()


def params_kw(params: SamplingParams) -> dict:
    return {"seed": params.seed, "max_new_tokens": params.max_new_tokens}
