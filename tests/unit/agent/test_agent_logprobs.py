"""Token in, token out with a real engine: multi-turn trajectories of the tiny model through the native engine,
then the trainer's log-prob pass over prompt + response; on every model token the two must agree (float32 CPU).

A random-weight model writes no tool calls, so the parser is replaced by one that reads every turn as a call
(the calculator on "1+1"), and a third of the byte tokens end a turn: each trajectory alternates short model
turns with tool turns, which is what the alignment check needs.
"""

from __future__ import annotations

import pytest
import torch

from hybridrl.agent import AgentConfig, AgentLoop
from hybridrl.agent.parsers import ParsedTurn, ToolCall
from hybridrl.engines.base import SamplingParams
from hybridrl.models.chat_template import install_chat_template


def test_engine_logprobs_equal_the_trainers_on_model_tokens(tiny_path, process_group):
    from hybridrl.config import RunConfig
    from hybridrl.models.config import ModelConfig
    from hybridrl.models.loading import load_causal_lm, load_tokenizer
    from hybridrl.training.logprobs import response_logprobs
    from hybridrl.workers.build import build_components

    tok = load_tokenizer(tiny_path)
    install_chat_template(tok, add_tokens=False)  # the model's vocabulary stays as built
    device = torch.device("cpu")
    cfg = RunConfig(model=ModelConfig(name="hf", path=tiny_path))
    engine = build_components(cfg, cfg.topology(), device).rollout.engine  # the run's engine, as the run builds it
    loop = AgentLoop(AgentConfig(max_turns=4, max_total_tokens=400), tok)
    loop.parse = lambda text: ParsedTurn(text, [ToolCall("calculator", {"expression": "1+1"})])
    stops = list(range(3, len(tok), 3))
    prompts = [
        tok(
            tok.apply_chat_template(
                [{"role": "user", "content": f"Compute {k}*7"}], tokenize=False, add_generation_prompt=True
            ),
            add_special_tokens=False,
        )["input_ids"]
        for k in (12, 345)
    ]
    params = SamplingParams(n=3, temperature=1.0, max_new_tokens=12, stop_token_ids=stops, seed=5)
    trajs = loop.generate_sync(engine, prompts, params)
    assert all(t.turns >= 2 and 0 in t.response_mask for t in trajs)  # multi-turn, with tool tokens in between

    model = load_causal_lm(tiny_path, ModelConfig(), torch.float32, device)
    width = max(len(t.response_ids) for t in trajs)
    resp = torch.zeros((len(trajs), width), dtype=torch.long)
    real = torch.zeros((len(trajs), width))
    model_tokens = torch.zeros((len(trajs), width))
    for i, t in enumerate(trajs):
        resp[i, : len(t.response_ids)] = torch.tensor(t.response_ids)
        real[i, : len(t.response_ids)] = 1
        model_tokens[i, : len(t.response_ids)] = torch.tensor(t.response_mask, dtype=torch.float32)
    with torch.no_grad():
        # The trainer's call: the model reads every real response token (tool outputs too), the loss mask keeps the
        # model's own; compare on those.
        lp, _ = response_logprobs(
            model, [t.prompt_ids for t in trajs], resp, model_tokens, 1.0, tok.pad_token_id, attention_mask=real
        )
    compared = 0
    for i, t in enumerate(trajs):
        for k, m in enumerate(t.response_mask):
            if m:
                assert lp[i, k].item() == pytest.approx(t.logprobs[k], abs=1e-4), (i, k)
                compared += 1
            else:
                assert t.logprobs[k] == 0.0
    assert compared == sum(t.model_tokens for t in trajs) and compared > 20
