"""Native engine: sampling controls, log-prob parity with a full forward, sleep/wake, weight loading."""

from __future__ import annotations

import pytest
import torch

from hybridrl.engines.base import SamplingParams
from hybridrl.engines.native.hf import HFEngine
from hybridrl.engines.sampling import sample_tokens
from hybridrl.errors import HybridRLError
from hybridrl.models.config import ModelConfig
from hybridrl.models.loading import load_causal_lm
from tests.conftest import chat_prompt


@pytest.fixture()
def engine(tiny_path, tokenizer):
    model = load_causal_lm(tiny_path, ModelConfig(), torch.float32)
    return HFEngine(model, [tokenizer.eos_token_id], tokenizer.pad_token_id, max_batch_size=8)


@pytest.fixture()
def prompts(tokenizer):
    return [chat_prompt(tokenizer, t) for t in ("copy: 12", "sort: 4321", "add: 7+5")]


def reference_logprobs(model, prompt, tokens, temperature):
    seq = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logits = model(seq).logits[0, len(prompt) - 1 : -1].float()
    t = temperature if temperature > 0 else 1.0
    return torch.log_softmax(logits / t, -1).gather(-1, torch.tensor(tokens)[:, None]).squeeze(-1)


@pytest.mark.parametrize("temperature", [1.0, 0.7, 0.0])
def test_logprobs_match_full_forward(engine, prompts, tiny_path, temperature):
    ref = load_causal_lm(tiny_path, ModelConfig(), torch.float32).eval()
    outs = engine.generate(prompts, SamplingParams(n=3, temperature=temperature, max_new_tokens=6, seed=0))
    assert len(outs) == 9 and [o.prompt_index for o in outs] == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    for o in outs:
        expected = reference_logprobs(ref, prompts[o.prompt_index], o.token_ids, temperature)
        assert torch.allclose(torch.tensor(o.logprobs), expected, atol=1e-4), (o.logprobs, expected)


def test_chunking_over_max_batch_size_keeps_order(engine, prompts):
    # 3 prompts x n=4 = 12 rows > max_batch_size=8: generated in two chunks.
    outs = engine.generate(prompts, SamplingParams(n=4, max_new_tokens=3, seed=1))
    assert [o.prompt_index for o in outs] == [i for i in range(3) for _ in range(4)]


def test_seed_makes_sampling_reproducible(engine, prompts):
    p = SamplingParams(n=2, max_new_tokens=5, seed=7)
    a = [o.token_ids for o in engine.generate(prompts, p)]
    b = [o.token_ids for o in engine.generate(prompts, p)]
    assert a == b


def test_max_new_tokens_and_stop_ids(engine, prompts):
    outs = engine.generate(prompts, SamplingParams(n=2, max_new_tokens=4, seed=0))
    eos = set(engine.eos_token_ids)
    for o in outs:  # each sample either ended on EOS (stop, any length up to 4) or ran to the limit (length, 4)
        ended = bool(o.token_ids) and o.token_ids[-1] in eos
        assert (o.finish_reason, len(o.token_ids) if not ended else None) == (
            ("stop", None) if ended else ("length", 4)
        )
        assert not eos & set(o.token_ids[:-1])  # nothing generated after an EOS
    assert any(
        o.finish_reason == "length" for o in outs
    )  # the limit branch really ran (a random tiny model rarely ends)
    # Make every token a stop token: each sample stops after exactly one token.
    everything = list(range(engine.model.config.vocab_size))
    outs = engine.generate(prompts, SamplingParams(n=2, max_new_tokens=4, stop_token_ids=everything, seed=0))
    assert all(len(o.token_ids) == 1 and o.finish_reason == "stop" for o in outs)


def test_greedy_is_argmax(engine, prompts, tiny_path):
    ref = load_causal_lm(tiny_path, ModelConfig(), torch.float32).eval()
    out = engine.generate(prompts[:1], SamplingParams(temperature=0.0, max_new_tokens=4))[0]
    seq = list(prompts[0])
    for tok in out.token_ids:
        with torch.no_grad():
            nxt = ref(torch.tensor([seq])).logits[0, -1].argmax().item()
        assert tok == nxt
        seq.append(tok)


def test_top_k_one_is_greedy():
    logits = torch.randn(64, 50)
    tokens, lp = sample_tokens(logits, temperature=1.0, top_k=1, generator=torch.Generator().manual_seed(0))
    assert torch.equal(tokens, logits.argmax(-1))
    # The log-prob stays the unfiltered log_softmax(logits / T) of the token.
    assert torch.allclose(lp, torch.log_softmax(logits, -1).gather(-1, tokens[:, None]).squeeze(-1))


def test_top_k_and_top_p_restrict_the_support():
    g = torch.Generator().manual_seed(0)
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]]).repeat(2000, 1)
    tokens, _ = sample_tokens(logits, temperature=1.0, top_k=2, generator=g)
    assert set(tokens.tolist()) == {0, 1}
    probs = torch.softmax(logits[0], -1)  # 0.636, 0.234, 0.086, ...
    tokens, _ = sample_tokens(logits, temperature=1.0, top_p=0.8, generator=g)
    assert set(tokens.tolist()) == {0, 1}  # 0.636 < 0.8 <= 0.636 + 0.234
    tokens, _ = sample_tokens(logits, temperature=1.0, top_p=0.5, generator=g)
    assert set(tokens.tolist()) == {0}
    # Without filtering the sampled frequencies follow the softmax.
    tokens, _ = sample_tokens(logits, temperature=1.0, generator=g)
    freq = torch.bincount(tokens, minlength=5).float() / len(tokens)
    assert torch.allclose(freq, probs, atol=0.04)


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_wake_and_reload_keep_outputs(engine, prompts, tiny_path, level):
    params = SamplingParams(n=2, max_new_tokens=5, seed=3)
    before = [o.token_ids for o in engine.generate(prompts, params)]
    engine.sleep(level)
    if level == 2:
        assert all(p.numel() == 0 for _, p in engine.named_weights())
        with pytest.raises(HybridRLError, match="asleep"):
            engine.generate(prompts, params)
    engine.wake_up(["weights"])
    if level == 2:  # level 2 dropped the weights: they must be pushed again
        ref = load_causal_lm(tiny_path, ModelConfig(), torch.float32)
        engine.load_weights(ref.named_parameters())
    engine.wake_up(["kv_cache"])
    assert [o.token_ids for o in engine.generate(prompts, params)] == before


def test_load_weights_changes_outputs(engine, prompts, tiny_path):
    params = SamplingParams(temperature=0.0, max_new_tokens=5)
    before = engine.generate(prompts, params)
    ref = load_causal_lm(tiny_path, ModelConfig(), torch.float32).eval()
    # Make the pad-free vocabulary favour token 40 ('E') everywhere through the tied embedding.
    with torch.no_grad():
        ref.model.embed_tokens.weight[40] += 50 * ref.model.norm.weight.sign()
    engine.load_weights([("model.embed_tokens.weight", ref.model.embed_tokens.weight)])
    after = engine.generate(prompts, params)
    assert all(o.token_ids == [40] * 5 for o in after)
    assert [o.token_ids for o in before] != [o.token_ids for o in after]
    for o in after:
        expected = reference_logprobs(ref, prompts[o.prompt_index], o.token_ids, 1.0)
        assert torch.allclose(torch.tensor(o.logprobs), expected, atol=1e-4)


def test_load_weights_rejects_unknown_names_and_shapes(engine):
    with pytest.raises(HybridRLError, match="no parameter named"):
        engine.load_weights([("model.nope.weight", torch.zeros(1))])
    with pytest.raises(HybridRLError, match="shape"):
        engine.load_weights([("model.norm.weight", torch.zeros(3))])


def test_an_engine_that_does_not_gate_its_memory_ignores_the_gate(engine, prompts):
    """The transformers path allocates per call through torch: the worker offloads the trainer eagerly for it (no
    gate), a gate handed to it is never called, and it maps no memory of its own."""
    called = []
    assert not engine.gates_memory
    engine.set_memory_gate(called.append)
    engine.sleep(2)
    engine.wake_up(["weights"])
    engine.wake_up(["kv_cache"])
    assert called == [] and engine.mapped_bytes() == 0 and engine.take_peak_mapped_bytes() == 0


def test_stale_vllm_cpu_shm_segments_are_removed_and_live_ones_kept(tmp_path):
    """vLLM-CPU's TP segments outlive workers that leave with os._exit; the next engine removes only unmapped ones."""
    import mmap

    from hybridrl.engines.vllm.shm import remove_stale_cpu_shm

    stale, live, other = tmp_path / "-tp:0-[0-1]-cpushm_0", tmp_path / "-tp:0-[0-1]-cpushm_1", tmp_path / "not-ours"
    for f in (stale, live, other):
        f.write_bytes(b"\0" * 4096)
    with live.open("r+b") as fh, mmap.mmap(fh.fileno(), 4096):  # mapped by this (running) process
        assert remove_stale_cpu_shm(str(tmp_path)) == [stale.name]
    assert not stale.exists() and live.exists() and other.exists()
