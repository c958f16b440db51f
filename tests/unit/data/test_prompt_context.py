"""A prompt that, with the tokens generated after it, does not fit the model's context is refused at the data
check, naming the row (or dropped with data.overlong_prompts=drop)."""

from __future__ import annotations

import json

import pytest

from hybridrl.data.config import DataConfig
from hybridrl.data.prompts import ContextLimit, load_prompts
from hybridrl.errors import HybridRLError


def rows_file(tmp_path, tokenizer, lengths: list[int]):
    """A JSONL file of prompts; row i holds lengths[i] words (the chat template adds a few tokens)."""
    path = tmp_path / "train.jsonl"
    with path.open("w") as f:
        for n in lengths:
            f.write(json.dumps({"prompt": " ".join(["7"] * n), "answer": "1"}) + "\n")
    return str(path)


def test_a_prompt_past_the_context_is_refused_naming_the_row(tmp_path, tokenizer):
    path = rows_file(tmp_path, tokenizer, [10, 600, 10])
    cfg = DataConfig(name="jsonl", path=path, max_prompt_tokens=4096)
    with pytest.raises(HybridRLError) as e:
        load_prompts(cfg, tokenizer, ContextLimit(512, 8))
    msg = str(e.value)
    assert msg.startswith(f"data.path={path}: row 1 (from 0) has ")
    assert "prompt tokens plus engine.max_new_tokens=8, more than the model's context of 512 tokens" in msg
    train, _ = load_prompts(cfg, tokenizer)  # no limit given: what the loader did before
    assert len(train) == 3


def test_the_generated_tokens_count_and_drop_mode_drops(tmp_path, tokenizer):
    path = rows_file(tmp_path, tokenizer, [10, 10])
    cfg = DataConfig(name="jsonl", path=path, max_prompt_tokens=4096)
    train, _ = load_prompts(cfg, tokenizer, ContextLimit(4096, 0))
    n = len(train[0].token_ids)
    assert len(load_prompts(cfg, tokenizer, ContextLimit(n + 8, 8))[0]) == 2  # exactly fits
    with pytest.raises(HybridRLError, match="row 0 "):
        load_prompts(cfg, tokenizer, ContextLimit(n + 7, 8))
    path = rows_file(tmp_path, tokenizer, [10, 600])
    drop = DataConfig(name="jsonl", path=path, max_prompt_tokens=4096, overlong_prompts="drop")
    assert len(load_prompts(drop, tokenizer, ContextLimit(512, 8))[0]) == 1


def test_the_controller_reads_the_context_from_the_models_config(tiny_path, tmp_path):
    from hybridrl.config import RunConfig
    from hybridrl.controller import Controller
    from hybridrl.engines.config import EngineConfig
    from hybridrl.models.config import ModelConfig
    from hybridrl.rollout.config import RolloutConfig

    model = ModelConfig(name="hf", path=tiny_path)  # its config.json: max_position_embeddings 512
    single = RunConfig(model=model, engine=EngineConfig(max_new_tokens=24))
    assert Controller(single, tmp_path, {}, "job")._context_limit() == ContextLimit(512, 24)
    agent = RunConfig(model=model, rollout=RolloutConfig(name="agent"), engine=EngineConfig(max_new_tokens=24))
    assert Controller(agent, tmp_path, {}, "job")._context_limit() == ContextLimit(512, 0)
