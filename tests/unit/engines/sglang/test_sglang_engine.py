"""SglangEngine in one process (TP 1) against a stand-in engine: request building, seeds, the request form (agent
turns, one batch or one by one through SGLang's request API), the weight-update session and the sleep/wake call
order. The multi-rank choreography is in test_sglang_multiproc.py."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from hybridrl.engines.base import Completion, GenerationRequest, SamplingParams
from hybridrl.engines.config import EngineConfig, SglangOptions
from hybridrl.engines.sglang.engine import SglangEngine
from hybridrl.errors import HybridRLError
from tests.unit.engines.sglang._fake_sglang import FAIL_NAME, FakeSglangEngine, fake_sample

EOS = [2, 5]


@pytest.fixture
def model_dir(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 2}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 5]}))
    return tmp_path


def make(model_dir, **opts) -> SglangEngine:
    cfg = EngineConfig(name="sglang", sglang=SglangOptions(**opts))
    return SglangEngine(str(model_dir), cfg, seed=3, device="cpu", engine_factory=FakeSglangEngine)


def names(eng: SglangEngine) -> list[str]:
    return [c[0] for c in eng._engine.calls if c[0] != "__init__"]


def layer(value: float) -> list[tuple[str, torch.Tensor]]:
    return [
        ("model.layers.0.self_attn.q_proj.weight", torch.full((4, 3), value)),
        ("model.layers.0.self_attn.k_proj.bias", torch.full((3,), value, dtype=torch.bfloat16)),
        ("model.layers.0.mlp.gate_proj.weight", torch.arange(6, dtype=torch.float16).reshape(2, 3) + value),
    ]


def test_engine_kwargs(model_dir):
    eng = make(model_dir, mem_fraction_static=0.4, engine_kwargs={"context_length": 64})
    assert eng._engine.kwargs == dict(
        model_path=str(model_dir),
        tp_size=1,
        base_gpu_id=0,
        mem_fraction_static=0.4,
        enable_memory_saver=True,
        enable_weights_cpu_backup=False,
        enable_deterministic_inference=False,
        skip_tokenizer_init=True,
        random_seed=3,
        dtype="float32",
        context_length=64,
    )
    assert eng.stop_ids == EOS and eng.weight_layout_style == "hf"


def _splitmix64_mix(z: int) -> int:
    """splitmix64's output function (Steele, Lea & Flood 2014), written out here as the reference."""
    m = 2**64 - 1
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & m
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & m
    return z ^ (z >> 31)


def _hand_seed(seed: int, global_prompt: int, sample: int) -> int:
    """The per-sample stream key all engines share, mix(mix(seed * 1000003 + prompt) + sample * golden), in 63 bits."""
    m = 2**64 - 1
    return _splitmix64_mix(
        (_splitmix64_mix((seed * 1_000_003 + global_prompt) & m) + sample * 0x9E3779B97F4A7C15) & m
    ) & (2**63 - 1)


def test_generate_is_prompt_major_with_one_seed_per_sample(model_dir):
    eng = make(model_dir)
    prompts = [[7, 8, 9], [10], [11, 12]]
    params = SamplingParams(
        n=3, temperature=0.8, top_p=0.9, max_new_tokens=5, stop_token_ids=[103], seed=5, prompt_offset=10
    )
    out = eng.generate(prompts, params)
    # What the stand-in engine answers to each request, computed from requests built here by hand (not by the adapter).
    want = []
    for i, p in enumerate(prompts):
        for j in range(3):
            sp = dict(
                temperature=0.8, max_new_tokens=5, stop_token_ids=[2, 5, 103], sampling_seed=_hand_seed(5, 10 + i, j)
            )
            want.append(Completion(i, *fake_sample(p, sp)))
    assert out == want
    call = eng._engine.calls[-1][1]
    assert call["return_logprob"] is True
    assert call["input_ids"] == [p for p in prompts for _ in range(3)]
    seeds = [sp["sampling_seed"] for sp in call["sampling_params"]]
    assert seeds == [_hand_seed(5, 10 + i, j) for i in range(3) for j in range(3)]
    # The reference mixer itself against splitmix64's published sequence for state 0: mix(golden), mix(2 * golden).
    assert _splitmix64_mix(0x9E3779B97F4A7C15) == 0xE220A8397B1DCDAF
    assert _splitmix64_mix((2 * 0x9E3779B97F4A7C15) & (2**64 - 1)) == 0x6E789E6AA1B965F4
    assert len(set(seeds)) == 9 and all(0 <= s < 2**63 for s in seeds)
    sp = call["sampling_params"][0]
    assert {k: v for k, v in sp.items() if k != "sampling_seed"} == dict(
        max_new_tokens=5, temperature=0.8, top_p=0.9, top_k=-1, n=1, stop_token_ids=[2, 5, 103]
    )


def test_requests_are_seeded_by_prompt_and_sample_index(model_dir):
    eng = make(model_dir)
    params = SamplingParams(temperature=0.8, max_new_tokens=5, seed=5, prompt_offset=99)  # requests carry global ids
    requests = [GenerationRequest([7, 8, 9], 12, 1), GenerationRequest([10], 3, 0)]
    out = eng.generate_requests(requests, params)
    want = []
    for r in requests:  # the stand-in's answer to each request, built here by hand
        seed = _hand_seed(5, r.prompt_index, r.sample_index)
        sp = dict(temperature=0.8, max_new_tokens=5, stop_token_ids=[2, 5], sampling_seed=seed)
        want.append(Completion(r.prompt_index, *fake_sample(r.prompt_ids, sp)))
    assert out == want
    call = eng._engine.calls[-1][1]
    assert call["input_ids"] == [r.prompt_ids for r in requests] and all(sp["n"] == 1 for sp in call["sampling_params"])


def test_agent_turns_go_through_the_request_api_one_by_one(model_dir):
    """TP 1: the loop's turns go to `Engine.async_generate` one request at a time on the engine's own event loop, and
    draw what the same requests draw in one batch."""
    from hybridrl.agent import as_async_engine
    from hybridrl.engines.sglang.stream import SglangRequestStream

    eng = make(model_dir)
    stream = as_async_engine(eng, 64)
    assert isinstance(stream, SglangRequestStream) and stream.event_loop is eng._engine.loop
    params = SamplingParams(temperature=0.8, max_new_tokens=5, seed=5)
    requests = [GenerationRequest([7, 8, 9], 12, 1), GenerationRequest([10], 3, 0), GenerationRequest([10], 3, 1)]

    async def turns():
        return [await stream.generate(r, params) for r in requests]

    got = stream.event_loop.run_until_complete(turns())
    assert [c[0] for c in eng._engine.calls[-3:]] == ["async_generate"] * 3
    assert got == eng.generate_requests(requests, params)


def test_a_quick_tools_trajectory_is_not_held_by_a_slow_one(model_dir, tokenizer):
    """As tests/unit/agent/test_agent_continuous.py does for the native engine, with the agent loop on the stand-in."""
    from hybridrl.agent import AgentConfig, AgentLoop
    from hybridrl.agent.parsers import ParsedTurn, ToolCall
    from tests.unit.agent.test_agent_continuous import RELEASED, Gate, gate_answer

    eng = make(model_dir)
    eng._engine.async_delay = 0.01  # a request runs a while before it answers
    gate = Gate(deadline_s=60.0)
    loop = AgentLoop(AgentConfig(max_turns=4, tool_timeout_s=120), tokenizer, {"gate": gate})
    loop.parse = lambda text: ParsedTurn(text, [ToolCall("gate", {})])
    params = SamplingParams(max_new_tokens=4, stop_token_ids=list(range(100, 150)), seed=1)  # every token stops
    trajs = loop.generate_sync(eng, [[1, 40, 41], [1, 90, 91, 92]], params)
    assert [(t.turns, t.tool_calls) for t in trajs] == [(4, 4)] * 2
    assert gate_answer(trajs) == RELEASED, "the held tool call ran out its deadline: turns were batched per turn"


def test_greedy_and_unseeded_requests(model_dir):
    eng = make(model_dir)
    params = SamplingParams(n=1, temperature=0.0, top_k=4, max_new_tokens=3)
    out = eng.generate([[1, 2]], params)
    # The stand-in's greedy rule by hand: base = 31 * (1 + 2) = 93; token k = (93 + 7k) % 50 + 100.
    assert out == [Completion(0, [143, 100, 107], [-0.1, -0.2, -0.3], "length")]
    sp = eng._engine.calls[-1][1]["sampling_params"][0]
    assert sp["temperature"] == 0.0 and sp["top_k"] == 4 and "sampling_seed" not in sp


def test_stop_token_finishes_with_stop(model_dir):
    eng = make(model_dir)
    params = SamplingParams(n=2, max_new_tokens=8, seed=1)
    first = eng.generate([[4]], params)
    stop = first[0].token_ids[2]  # make the third token a stop id
    out = eng.generate([[4]], SamplingParams(n=2, max_new_tokens=8, seed=1, stop_token_ids=[stop]))
    assert (
        out[0].finish_reason == "stop"
        and out[0].token_ids[-1] == stop
        and len(out[0].logprobs) == len(out[0].token_ids)
    )


def test_weight_update_session_and_wake_order(model_dir):
    eng = make(model_dir)
    eng.wake_up()  # nothing released yet: no resume (SGLang raises KeyError for a tag not released)
    eng.sleep(2)
    eng.wake_up(["weights"])
    with pytest.raises(RuntimeError, match="released"):
        eng.generate([[1]], SamplingParams())
    eng.load_weights(layer(1.0))
    eng.load_weights([("model.norm.weight", torch.ones(3))])
    eng.finish_weight_update()
    eng.finish_weight_update()  # nothing open: a no-op
    eng.wake_up(["kv_cache"])
    eng.generate([[1]], SamplingParams())
    assert names(eng) == [
        "release_memory_occupation",
        "resume_memory_occupation",
        "begin_weight_update",
        "update_weights_from_tensor",
        "update_weights_from_tensor",
        "end_weight_update",
        "flush_cache",
        "resume_memory_occupation",
        "generate",
    ]
    calls = eng._engine.calls
    assert calls[1][1] == {"tags": None}  # release: every tag
    assert calls[2][1] == {"tags": ["weights"]}
    assert calls[-2][1] == {"tags": ["kv_cache", "cuda_graph"]}
    push = calls[4][1]
    assert (
        push["load_format"] == "flattened_bucket" and push["flush_cache"] is False and len(push["named_tensors"]) == 1
    )
    got = eng._engine.received[0][0]
    for (n0, t0), (n1, t1) in zip(layer(1.0), got, strict=True):
        assert n0 == n1 and t0.dtype == t1.dtype and torch.equal(t0, t1)


def test_wake_kv_cache_closes_an_open_session(model_dir):
    eng = make(model_dir)
    eng.sleep(2)
    eng.wake_up(["weights"])
    eng.load_weights(layer(2.0))
    eng.wake_up(["weights", "kv_cache"])
    assert names(eng)[-4:] == [
        "update_weights_from_tensor",
        "end_weight_update",
        "flush_cache",
        "resume_memory_occupation",
    ]


def test_released_weights_must_be_loaded_before_generate(model_dir):
    eng = make(model_dir)
    eng.sleep(2)
    eng.wake_up()
    with pytest.raises(RuntimeError, match="load_weights"):
        eng.generate([[1]], SamplingParams())
    with pytest.raises(RuntimeError, match="wake_up"):
        eng.sleep(2), eng.load_weights(layer(0.0))


def test_level1_keeps_weights_unless_backed_up(model_dir):
    eng = make(model_dir)
    eng.sleep(1)
    eng.wake_up()
    eng.generate([[1]], SamplingParams())  # weights were never released
    assert [c[1] for c in eng._engine.calls if c[0].endswith("memory_occupation")] == [
        {"tags": ["kv_cache", "cuda_graph"]},
        {"tags": ["kv_cache", "cuda_graph"]},
    ]
    backed = make(model_dir, enable_weights_cpu_backup=True)
    backed.sleep(1)
    backed.wake_up()
    backed.generate([[1]], SamplingParams())  # host copy kept the contents: no load needed
    assert [c[1] for c in backed._engine.calls if c[0].endswith("memory_occupation")] == [
        {"tags": None},
        {"tags": ["weights"]},
        {"tags": ["kv_cache", "cuda_graph"]},
    ]


def test_refused_push_raises_with_the_engine_message(model_dir):
    eng = make(model_dir)
    eng.sleep(2)
    eng.wake_up(["weights"])
    with pytest.raises(HybridRLError, match=f"refused {FAIL_NAME}"):
        eng.load_weights([(FAIL_NAME, torch.zeros(2))])
    assert names(eng)[-3:] == ["begin_weight_update", "update_weights_from_tensor", "end_weight_update"]
    eng.load_weights(layer(3.0))  # a fresh session opens
    eng.wake_up(["kv_cache"])
    assert names(eng)[-5:] == [
        "begin_weight_update",
        "update_weights_from_tensor",
        "end_weight_update",
        "flush_cache",
        "resume_memory_occupation",
    ]


def test_fused_names_are_refused(model_dir):
    eng = make(model_dir)
    with pytest.raises(ValueError, match="HF names"):
        eng.load_weights([("model.layers.0.self_attn.qkv_proj.weight", torch.zeros(2))])


def test_abort_is_an_error(model_dir, monkeypatch):
    eng = make(model_dir)
    abort = [
        {
            "output_ids": [],
            "meta_info": {"finish_reason": {"type": "abort", "message": "oom"}, "output_token_logprobs": []},
        }
    ]
    monkeypatch.setattr(eng._engine, "generate", lambda **kw: abort)
    with pytest.raises(RuntimeError, match="abort"):
        eng.generate([[1]], SamplingParams())


def test_missing_sglang_says_how_to_install(model_dir, monkeypatch):
    monkeypatch.setitem(sys.modules, "sglang", None)
    with pytest.raises(HybridRLError, match=r'pip install "hybridrl\[sglang\]"'):
        SglangEngine(str(model_dir), EngineConfig(name="sglang"), device="cpu")


def test_original_logprob_env_is_refused(model_dir, monkeypatch):
    monkeypatch.setenv("SGLANG_RETURN_ORIGINAL_LOGPROB", "1")
    with pytest.raises(HybridRLError, match="SGLANG_RETURN_ORIGINAL_LOGPROB"):
        make(model_dir)
