"""The benchmarks' response-length mixes (`benchmarks/lengths.py`): the draws, and the engine stopping each request
at its drawn length."""

from __future__ import annotations

import statistics

import pytest
import torch

from benchmarks.lengths import LENGTHS, cap_engine_lengths, draw_lengths, request_length, sample_length


def test_the_mixes_have_the_shapes_they_are_named_for():
    n, limit = 4000, 1024
    assert draw_lengths("fixed", limit, 5) == [limit] * 5
    uniform = draw_lengths("uniform", limit, n)
    assert min(uniform) >= 32 and max(uniform) <= limit
    assert statistics.mean(uniform) == pytest.approx((32 + limit) / 2, rel=0.03)
    lognormal = draw_lengths("lognormal", limit, n)
    assert statistics.median(lognormal) == pytest.approx(256, rel=0.08) and max(lognormal) == limit
    truncated = draw_lengths("truncated", limit, n)
    assert sum(x == limit for x in truncated) / n == pytest.approx(0.3, abs=0.03)
    assert all(32 <= x <= limit for x in truncated)
    heavy = draw_lengths("heavy", 4096, n)
    assert sum(x == 4096 for x in heavy) / n == pytest.approx(0.1, abs=0.02)
    assert all(64 <= x <= 512 for x in heavy if x != 4096)
    assert statistics.mean(x for x in heavy if x != 4096) == pytest.approx((64 + 512) / 2, rel=0.03)
    assert set(LENGTHS) == {"fixed", "uniform", "lognormal", "truncated", "heavy"}


def test_the_engine_stops_each_request_at_its_drawn_length(tiny_path, tokenizer, monkeypatch):
    from hybridrl.engines import build_engine
    from hybridrl.engines.base import SamplingParams
    from hybridrl.engines.config import EngineConfig
    from hybridrl.engines.native import scheduler
    from hybridrl.models.config import ModelConfig
    from hybridrl.models.loading import load_causal_lm
    from hybridrl.reshard import ReshardConfig, Resharder
    from hybridrl.topology import Topology

    monkeypatch.setattr(scheduler.Scheduler, "_sequence", scheduler.Scheduler._sequence)  # restored afterwards
    cap_engine_lengths("uniform")
    engine = build_engine(EngineConfig(), ModelConfig(), tiny_path, tokenizer, torch.device("cpu"), Topology(1))
    model = load_causal_lm(tiny_path, ModelConfig(), torch.float32)
    Resharder(ReshardConfig(), engine, model.config).sync(model)
    params = SamplingParams(n=4, max_new_tokens=64, seed=3)
    prompts = [[5, 6, 7], [8, 9]]
    out = engine.generate(prompts, params)
    drawn = [request_length("uniform", 64, 3, c.prompt_index, j % 4) for j, c in enumerate(out)]
    assert len(set(drawn)) > 1
    for c, want in zip(out, drawn):
        assert len(c.token_ids) <= want
        assert c.finish_reason == "stop" or len(c.token_ids) == want


def test_a_carried_sample_stops_where_it_would_have_uninterrupted(monkeypatch):
    """With the prompt length given, a request's length belongs to its sample: a request continuing k tokens of it
    (its context the prompt and those tokens) is capped at the sample's length less k."""
    from hybridrl.engines.base import GenerationRequest, SamplingParams
    from hybridrl.engines.native import scheduler

    monkeypatch.setattr(scheduler.Scheduler, "_sequence", scheduler.Scheduler._sequence)  # restored afterwards
    cap_engine_lengths("heavy", prompt_len=3)
    sched = scheduler.Scheduler(backend=None, max_rows=4, eos_token_ids=[0])
    params = SamplingParams(max_new_tokens=256, seed=5)
    prompt = [7, 8, 9]
    total = sample_length("heavy", 256, prompt, 1)
    assert sched._sequence(GenerationRequest(prompt, 0, 1), params).max_new == total
    carried = GenerationRequest(prompt + [1] * (total - 2), 9, 1, max_new_tokens=256 - (total - 2))
    assert sched._sequence(carried, params).max_new == 2
    assert len({sample_length("heavy", 256, prompt, j) for j in range(40)}) > 5  # each sample its own length
