"""vLLM generation from token ids: log-probs against an HF forward, n, stop ids, max tokens, seeds, sleep/wake.

One engine for the module, built with no process group (vLLM's "uni" executor, in-process).
"""

from __future__ import annotations

import logging

import pytest
import torch.distributed as dist

from hybridrl.engines.base import SamplingParams
from tests.unit.engines.vllm.vllm_helpers import TOL, hf_greedy, make_engine, max_logprob_error

pytestmark = pytest.mark.vllm

PROMPTS = [[1, 40, 41, 42, 43, 44], [1, 90, 91], [7, 8, 9, 10, 11, 12, 13, 14, 15]]


@pytest.fixture(scope="module")
def engine(vllm_tiny_path, tmp_path_factory):
    assert not dist.is_initialized()
    eng = make_engine(vllm_tiny_path, tmp_path_factory.mktemp("vllm-cache"))
    assert eng.llm_kwargs["distributed_executor_backend"] == "uni"
    yield eng
    eng.shutdown()
    assert not dist.is_initialized(), "the group vLLM made for itself must be gone after shutdown"


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_match_hf(engine, vllm_hf_model, temperature):
    n, max_new = 3, 12
    outs = engine.generate(PROMPTS, SamplingParams(n=n, temperature=temperature, max_new_tokens=max_new, seed=11))
    assert [c.prompt_index for c in outs] == [i for i in range(len(PROMPTS)) for _ in range(n)]
    for c in outs:
        assert 1 <= len(c.token_ids) <= max_new and len(c.logprobs) == len(c.token_ids)
        assert c.finish_reason == ("length" if len(c.token_ids) == max_new else "stop")
    for i in range(len(PROMPTS)):  # the n samples of a prompt are different draws
        samples = {tuple(c.token_ids) for c in outs if c.prompt_index == i}
        assert len(samples) == n
    err = max_logprob_error(vllm_hf_model, PROMPTS, outs, temperature)
    print(f"T={temperature}: max |vLLM - HF| log-prob = {err:.2e}")
    assert err < TOL


def test_greedy_is_argmax_and_logprobs_at_t1(engine, vllm_hf_model):
    outs = engine.generate(PROMPTS, SamplingParams(n=1, temperature=0.0, max_new_tokens=10))
    for c in outs:
        if c.finish_reason == "length":
            assert c.token_ids == hf_greedy(vllm_hf_model, PROMPTS[c.prompt_index], 10)
    assert max_logprob_error(vllm_hf_model, PROMPTS, outs, 1.0) < TOL


def test_max_tokens_and_stop_ids(engine):
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=16, seed=5)
    free = engine.generate(PROMPTS[:2], params)
    assert all(len(c.token_ids) == 16 and c.finish_reason == "length" for c in free)

    stop = free[0].token_ids[3]
    params.stop_token_ids = [stop]
    stopped = engine.generate(PROMPTS[:2], params)  # same seeds: same draws until the stop
    for f, s in zip(free, stopped):
        if stop in f.token_ids:
            cut = f.token_ids.index(stop) + 1
            assert s.token_ids == f.token_ids[:cut] and s.finish_reason == "stop"  # the stop id is kept
            assert s.logprobs == pytest.approx(f.logprobs[:cut], abs=1e-6)
        else:
            assert s.token_ids == f.token_ids and s.finish_reason == "length"
    assert stopped[0].finish_reason == "stop" and len(stopped[0].token_ids) <= 4


def test_eos_from_model_folder(engine):
    assert engine.eos_token_ids == [2]  # <|im_end|>, from generation_config.json and the tokenizer files


def test_seeds_distinct_across_prompts_and_reproducible(engine):
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=8, seed=123)
    a = engine.generate([PROMPTS[0], PROMPTS[0]], params)
    b = engine.generate([PROMPTS[0], PROMPTS[0]], params)
    assert [c.token_ids for c in a] == [c.token_ids for c in b]
    assert len({tuple(c.token_ids) for c in a}) == 4  # same prompt twice still gets 4 different streams


def test_sleep_wake_round_trip_keeps_generation(engine, vllm_state_dict, caplog, monkeypatch):
    from hybridrl.engines.vllm import engine as vllm_engine

    monkeypatch.setattr(vllm_engine, "_warned_no_sleep", False)
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=8, seed=7)
    before = engine.generate(PROMPTS, params)

    with caplog.at_level(logging.WARNING, logger="hybridrl.engines.vllm.engine"):
        engine.sleep(level=1)
        with pytest.raises(RuntimeError, match="wake_up"):
            engine.generate(PROMPTS, params)
        engine.wake_up()
        after1 = engine.generate(PROMPTS, params)

        engine.sleep(level=2)  # the colocated order: sleep(2) → train → wake weights → load → wake kv_cache
        engine.wake_up(["weights"])
        with pytest.raises(RuntimeError):
            engine.generate(PROMPTS, params)
        engine.load_weights(vllm_state_dict.items())
        engine.wake_up(["kv_cache"])
        after2 = engine.generate(PROMPTS, params)
    warnings = [r for r in caplog.records if r.name == "hybridrl.engines.vllm.engine"]
    assert len(warnings) == 1 and "free no memory" in warnings[0].getMessage()

    for x, y, z in zip(before, after1, after2):
        assert x.token_ids == y.token_ids == z.token_ids
        assert x.logprobs == pytest.approx(y.logprobs, abs=1e-6) and x.logprobs == pytest.approx(z.logprobs, abs=1e-6)


def test_named_weights_and_memory_stats(engine):
    with pytest.raises(NotImplementedError, match="oneDNN"):
        engine.named_weights()
    stats = engine.memory_stats()
    assert stats["rss_gb"] > 0 and stats["kv_cache_gb"] == 1.0
