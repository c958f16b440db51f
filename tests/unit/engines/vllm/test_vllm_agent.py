"""The agent loop on real vLLM: multi-turn trajectories through `VllmEngine.generate_requests` (batched per turn by
the loop's fallback adapter), and the trainer's log-probs on every model token equal vLLM's (float32 CPU, 1e-4)."""

from __future__ import annotations

import pytest
import torch

from hybridrl.agent import AgentConfig, AgentLoop
from hybridrl.agent.parsers import ParsedTurn, ToolCall
from hybridrl.engines.base import GenerationRequest, SamplingParams
from hybridrl.models.chat_template import install_chat_template
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
