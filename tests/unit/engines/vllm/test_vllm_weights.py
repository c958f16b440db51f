"""Weight pushes into vLLM change its outputs exactly as the same weights change an HF model.

One engine for the module, built inside our own 1-rank gloo group (so vLLM's "external_launcher" path, the one
`cluster=local` workers take), which must survive the engine's shutdown.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

from hybridrl.engines.base import SamplingParams
from tests.unit.engines.vllm.vllm_helpers import TOL, hf_greedy, make_engine, max_logprob_error, perturbed

pytestmark = pytest.mark.vllm

PROMPTS = [[1, 40, 41, 42, 43, 44], [1, 90, 91, 92]]
SAMPLED = SamplingParams(n=2, temperature=1.0, max_new_tokens=10, seed=3)
GREEDY = SamplingParams(n=1, temperature=0.0, max_new_tokens=10)


@pytest.fixture(scope="module")
def engine(vllm_tiny_path, tmp_path_factory):
    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    eng = make_engine(vllm_tiny_path, tmp_path_factory.mktemp("vllm-cache"))
    assert eng.llm_kwargs["distributed_executor_backend"] == "external_launcher"
    yield eng
    eng.shutdown()
    assert dist.is_initialized(), "shutting vLLM down must leave the worker's process group alone"
    dist.barrier()
    dist.destroy_process_group()


def by_module_group(sd: dict[str, torch.Tensor]) -> list[list[tuple[str, torch.Tensor]]]:
    """The push pattern of the resharder: one call per decoder layer, plus embeddings and the final norm."""
    groups: dict[str, list] = {}
    for name, t in sd.items():
        key = ".".join(name.split(".")[:3]) if name.startswith("model.layers.") else name
        groups.setdefault(key, []).append((name, t))
    return list(groups.values())


def hf_with(model, sd):
    m = copy.deepcopy(model)
    m.load_state_dict(sd, strict=False)  # tied lm_head follows embed_tokens
    return m


def test_push_changes_outputs_like_hf_and_back(engine, vllm_hf_model, vllm_state_dict):
    base_greedy = engine.generate(PROMPTS, GREEDY)
    base_sampled = engine.generate(PROMPTS, SAMPLED)

    new = perturbed(vllm_state_dict)
    # 1) only layer 1: the modules not pushed keep their weights
    only_l1 = {k: (new[k] if k.startswith("model.layers.1.") else v) for k, v in vllm_state_dict.items()}
    engine.load_weights((k, v) for k, v in new.items() if k.startswith("model.layers.1."))
    ref = hf_with(vllm_hf_model, only_l1)
    out = engine.generate(PROMPTS, SAMPLED)
    assert max_logprob_error(ref, PROMPTS, out, 1.0) < TOL

    # 2) everything, one group per call
    for group in by_module_group(new):
        engine.load_weights(group)
    ref = hf_with(vllm_hf_model, new)
    greedy = engine.generate(PROMPTS, GREEDY)
    sampled = engine.generate(PROMPTS, SAMPLED)
    for c in greedy:
        if c.finish_reason == "length":
            assert c.token_ids == hf_greedy(ref, PROMPTS[c.prompt_index], GREEDY.max_new_tokens)
    err = max(max_logprob_error(ref, PROMPTS, greedy, 1.0), max_logprob_error(ref, PROMPTS, sampled, 1.0))
    print(f"after push: max |vLLM - HF(perturbed)| log-prob = {err:.2e}")
    assert err < TOL
    assert [c.token_ids for c in sampled] != [c.token_ids for c in base_sampled]

    # 3) the original weights back, in one call: the original outputs again
    engine.load_weights(vllm_state_dict.items())
    again_greedy = engine.generate(PROMPTS, GREEDY)
    again_sampled = engine.generate(PROMPTS, SAMPLED)
    for x, y in zip(base_greedy + base_sampled, again_greedy + again_sampled):
        assert x.token_ids == y.token_ids and x.finish_reason == y.finish_reason
        assert x.logprobs == pytest.approx(y.logprobs, abs=1e-6)


def test_partial_fused_push_is_refused(engine, vllm_state_dict):
    before = engine.generate(PROMPTS, GREEDY)
    q = "model.layers.0.self_attn.q_proj.weight"
    with pytest.raises(ValueError, match=r"partial weight push .*qkv_proj.*k_proj"):
        engine.load_weights([(q, vllm_state_dict[q] * 2)])
    gate = "model.layers.1.mlp.gate_proj.weight"
    with pytest.raises(ValueError, match=r"gate_up_proj.*up_proj"):
        engine.load_weights([(gate, vllm_state_dict[gate])])
    after = engine.generate(PROMPTS, GREEDY)
    assert [c.token_ids for c in before] == [c.token_ids for c in after]
