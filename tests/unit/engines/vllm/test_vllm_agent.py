"""The agent loop on real vLLM: turns join vLLM's running batch one by one (`VllmEngine.async_engine`, the request
stream of `engines/vllm/stream.py`) and draw what the same requests draw batched; a trajectory whose tool answers at
once gets its next turn while another's tool is held; the trainer's log-probs on every model token equal vLLM's
(float32 CPU, 1e-4)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from hybridrl.agent import AgentConfig, AgentLoop, as_async_engine
from hybridrl.agent.parsers import ParsedTurn, ToolCall
from hybridrl.engines.base import GenerationRequest, SamplingParams
from hybridrl.engines.vllm.stream import VllmRequestStream
from hybridrl.models.chat_template import install_chat_template
from tests.unit.agent.test_agent_continuous import RELEASED, Gate, gate_answer
from tests.unit.engines.vllm.vllm_helpers import TOL, make_engine

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def engine(vllm_tiny_path, tmp_path_factory):
    eng = make_engine(vllm_tiny_path, tmp_path_factory.mktemp("vllm-cache"))
    yield eng
    eng.shutdown()


def test_requests_are_seeded_by_prompt_and_sample_index(engine):
    params = SamplingParams(temperature=1.0, max_new_tokens=8, seed=3)
    a = engine.generate_requests([GenerationRequest([1, 40, 41], 5, 0), GenerationRequest([1, 40, 41], 5, 1)], params)
    b = engine.generate_requests([GenerationRequest([1, 40, 41], 5, 1)], params)
    assert a[1].token_ids == b[0].token_ids  # the same request draws the same tokens alone or batched
    assert [c.prompt_index for c in a] == [5, 5]


def test_turns_joining_the_running_batch_draw_what_they_draw_batched(engine):
    """Requests through the stream, each submitted a few engine steps after the last (so they join a running batch
    at different steps), with different token caps: the tokens and log-probs `generate_requests` gives them."""
    params = SamplingParams(temperature=1.0, max_new_tokens=8, seed=3)
    requests = [GenerationRequest([1, 40 + i, 41, 42][: 2 + i % 3], i % 2, i) for i in range(6)]
    stream = as_async_engine(engine, 64)
    assert isinstance(stream, VllmRequestStream)

    async def staggered():
        async def one(i: int):
            for _ in range(3 * i):  # i * 3 engine steps later
                await asyncio.sleep(0)
            return await stream.generate(requests[i], params)

        return await asyncio.gather(*(one(i) for i in range(len(requests))))

    got = asyncio.run(staggered())
    assert stream.steps > 8  # later requests arrived while earlier ones ran
    want = engine.generate_requests(requests, params)
    assert [c.token_ids for c in got] == [c.token_ids for c in want]
    assert [c.prompt_index for c in got] == [r.prompt_index for r in requests]
    for c, w in zip(got, want):
        assert torch.allclose(torch.tensor(c.logprobs), torch.tensor(w.logprobs), atol=TOL)


def test_a_quick_tools_trajectory_is_not_held_by_a_slow_one(engine, vllm_tiny_path):
    """As tests/unit/agent/test_agent_continuous.py does for the native engine: the gate's held first call is
    released by the other trajectory's second call, which needs its next turn generated meanwhile."""
    from hybridrl.models.loading import load_tokenizer

    tok = load_tokenizer(str(vllm_tiny_path))
    install_chat_template(tok, add_tokens=False)
    gate = Gate(deadline_s=60.0)
    loop = AgentLoop(AgentConfig(max_turns=4, tool_timeout_s=120), tok, {"gate": gate})
    loop.parse = lambda text: ParsedTurn(text, [ToolCall("gate", {})])
    params = SamplingParams(max_new_tokens=4, stop_token_ids=list(range(len(tok))), seed=1)
    trajs = loop.generate_sync(engine, [[1, 40, 41], [1, 90, 91, 92]], params)
    assert [(t.turns, t.tool_calls) for t in trajs] == [(4, 4)] * 2
    assert gate_answer(trajs) == RELEASED, "the held tool call ran out its deadline: turns were batched per turn"


def test_trainer_logprobs_equal_vllm_on_every_model_token(engine, vllm_tiny_path, vllm_hf_model):
    from hybridrl.models.loading import load_tokenizer
    from hybridrl.training.logprobs import response_logprobs

    tok = load_tokenizer(str(vllm_tiny_path))
    install_chat_template(tok, add_tokens=False)  # the model's vocabulary stays as built
    loop = AgentLoop(AgentConfig(max_turns=4, max_total_tokens=400), tok)
    # A random model writes no tool calls: read every turn as one, and end turns often, so trajectories alternate
    # model turns and tool results (what the alignment check needs).
    loop.parse = lambda text: ParsedTurn(text, [ToolCall("calculator", {"expression": "1+1"})])
    prompts = [
        tok(
            tok.apply_chat_template(
                [{"role": "user", "content": f"Compute {k}*7"}], tokenize=False, add_generation_prompt=True
            ),
            add_special_tokens=False,
        )["input_ids"]
        for k in (12, 345)
    ]
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=10, stop_token_ids=list(range(3, len(tok), 3)), seed=5)
    trajs = loop.generate_sync(engine, prompts, params)
    assert all(t.turns >= 2 and 0 in t.response_mask for t in trajs)
    width = max(len(t.response_ids) for t in trajs)
    resp, real, model_tokens = (
        torch.zeros((len(trajs), width), dtype=d) for d in (torch.long, torch.float32, torch.float32)
    )
    for i, t in enumerate(trajs):
        n = len(t.response_ids)
        resp[i, :n], real[i, :n] = torch.tensor(t.response_ids), 1
        model_tokens[i, :n] = torch.tensor(t.response_mask, dtype=torch.float32)
    with torch.no_grad():
        lp, _ = response_logprobs(
            vllm_hf_model, [t.prompt_ids for t in trajs], resp, model_tokens, 1.0, tok.pad_token_id, attention_mask=real
        )
    compared = 0
    for i, t in enumerate(trajs):
        for k, m in enumerate(t.response_mask):
            if m:
                assert abs(lp[i, k].item() - t.logprobs[k]) <= TOL, (i, k)
                compared += 1
    assert compared == sum(t.model_tokens for t in trajs) and compared > 10


def test_trust_remote_code_is_forwarded_as_set(vllm_tiny_path, engine):
    from hybridrl.engines.config import EngineConfig
    from hybridrl.engines.vllm.construction import llm_kwargs

    assert engine.llm_kwargs["trust_remote_code"] is False  # the default
    kw = llm_kwargs(
        str(vllm_tiny_path),
        EngineConfig(name="vllm"),
        tp_size=1,
        seed=0,
        on_cpu=True,
        backend="uni",
        cache_root=None,
        trust_remote_code=True,
    )
    assert kw["trust_remote_code"] is True
