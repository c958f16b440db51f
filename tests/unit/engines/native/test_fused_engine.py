"""Native engine, fused path: parity with a transformers forward (Llama, Qwen2 bias, Qwen3 q/k norm), sampling
controls, rows leaving the batch, sleep/wake, weight loading through the resharder, and how the implementation is
chosen.

Runs on CPU; HYBRIDRL_TEST_DEVICE=cuda runs the same tests on a GPU (plus the CUDA-graph ones).
"""

from __future__ import annotations

import asyncio
import os

import pytest
import torch
import transformers

import hybridrl.engines.native.engine as fused_engine_module
import hybridrl.engines.native.prompts as prompts_module
import tests.triton_interpret  # noqa: F401  (HYBRIDRL_KERNELS_ON_CPU=1 TRITON_INTERPRET=1: the kernels on CPU)
from hybridrl.engines import build_engine
from hybridrl.engines.base import GenerationRequest, SamplingParams
from hybridrl.engines.config import EngineConfig, NativeOptions
from hybridrl.engines.native.async_engine import AsyncEngine
from hybridrl.engines.native.engine import FusedEngine
from hybridrl.engines.native.hf import HFEngine, native_impl
from hybridrl.engines.native.model import FusedDecoder
from hybridrl.engines.native.tensor_parallel import TensorParallel
from hybridrl.errors import ConfigError, HybridRLError
from hybridrl.models.config import ModelConfig
from hybridrl.models.loading import load_causal_lm
from hybridrl.reshard import ReshardConfig, Resharder, build_layout
from tests.tiny_models import KINDS, PROMPTS, reference_last_logits, reference_logprobs, tiny_model

DEVICE = torch.device(os.environ.get("HYBRIDRL_TEST_DEVICE", "cpu"))
TOL = 1e-5 if DEVICE.type == "cpu" else 5e-5  # GPU kernels differ by shape between the two forwards
EOS, PAD = 0, 1


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def fused_engine(model, **options) -> FusedEngine:
    options = NativeOptions(**{"max_batch_size": 8, **options})
    engine = FusedEngine(model.config, [EOS], PAD, device=DEVICE, dtype=torch.float32, options=options, seed=0)
    Resharder(ReshardConfig(), engine, model.config).sync(model)  # the caller fills the weights
    return engine


# Under the interpreter (CI's `-m interpreted`) the family tests run for qwen2 only, the layout of the GPU figures'
# Qwen2.5 models: one family through the kernels costs minutes there; the kernels' shapes are the same for all four.
@pytest.fixture(
    scope="module",
    params=[pytest.param(k, marks=pytest.mark.interpreted) if k == "qwen2" else k for k in (*KINDS, "tiny")],
)
def model(request, tiny_path):
    if request.param == "tiny":  # the project's own tiny Qwen2 (real checkpoint loading path)
        return load_causal_lm(tiny_path, ModelConfig(), torch.float32, DEVICE).eval()
    return tiny_model(request.param).to(DEVICE)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("tp_size", [1, 2])
def test_parameters_are_the_fused_layout(kind, tp_size):
    """The decoder allocates exactly the tensors the resharder's fused layout fills, for every TP rank."""
    config = tiny_model(kind).config
    for rank in range(tp_size):
        decoder = FusedDecoder(config, TensorParallel(None, rank, tp_size), torch.float32, torch.device("cpu"))
        got = {n: tuple(p.shape) for n, p in decoder.named_parameters()}
        assert got == {spec.name: spec.shape for spec in build_layout(config, "fused", rank, tp_size).specs()}


@pytest.mark.parametrize("path", ["packed", "flash"])
def test_prefill_logits_match_transformers(model, path, monkeypatch):
    """New prompts, through the packed path (short ones where the paged attention kernel runs) and the flash prefill
    (long ones, and every one on the torch path)."""
    if path == "flash":
        monkeypatch.setattr(prompts_module, "PACKED_PROMPT_MAX", 0)
    engine = fused_engine(model)
    if path == "packed":  # the GPU's routing on any device: the packed path's torch attention is what it checks
        monkeypatch.setattr(engine.model, "paged_attention_kernel", lambda block_size: True)
    ran = {"prefill": 0, "extend": 0}
    for name in ran:
        forward = getattr(engine.model, name)
        setattr(engine.model, name, lambda *a, _f=forward, _n=name: ran.__setitem__(_n, ran[_n] + 1) or _f(*a))
    diff = (engine.last_logits(PROMPTS).cpu() - reference_last_logits(model, PROMPTS)).abs().max().item()
    assert diff < TOL, diff
    assert ran == ({"prefill": 1, "extend": 0} if path == "flash" else {"prefill": 0, "extend": 1})


def test_continuation_logits_match_transformers(model):
    """Prompts continuing cached prefixes of any length (within a block, at a block's end, none) run packed through
    the paged attention; their logits equal one unpadded transformers forward of the whole prompt."""
    prompts = [PROMPTS[0] + PROMPTS[2] * 3, PROMPTS[1] * 20, PROMPTS[2] + [4], PROMPTS[0] * 7]
    cached = [3, 32, 0, 34]  # block size 16: mid-block, two full blocks, a fresh prompt beside them, past two blocks
    engine = fused_engine(model, kv_block_size=16)
    diff = (engine.last_logits(prompts, cached).cpu() - reference_last_logits(model, prompts)).abs().max().item()
    assert diff < TOL, diff


@pytest.mark.parametrize("temperature", [1.0, 0.7, 0.0])
def test_logprobs_match_full_forward(model, temperature):
    engine = fused_engine(model)
    outs = engine.generate(PROMPTS, SamplingParams(n=3, temperature=temperature, max_new_tokens=8, seed=0))
    assert [o.prompt_index for o in outs] == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    for o in outs:
        want = reference_logprobs(model, PROMPTS[o.prompt_index], o.token_ids, temperature)
        assert (torch.tensor(o.logprobs) - want).abs().max().item() < TOL


def test_same_samples_as_the_transformers_path(model):
    """Same seed, same logits (to rounding) → the same tokens as the HF path, stops and compaction included."""
    params = SamplingParams(n=3, max_new_tokens=10, seed=5, stop_token_ids=[3, 7, 11])
    fused = fused_engine(model).generate(PROMPTS, params)
    hf = HFEngine(model, [EOS], PAD, max_batch_size=8).generate(PROMPTS, params)
    assert [o.token_ids for o in fused] == [o.token_ids for o in hf]
    assert [o.finish_reason for o in fused] == [o.finish_reason for o in hf]


def test_gpu_bucketing_gives_the_same_samples(model):
    """The GPU schedule (steps over a bucket of rows with padding rows, the attention gathering the whole block
    table) must not change any sample."""
    params = SamplingParams(n=4, max_new_tokens=12, seed=2, stop_token_ids=list(range(2, 40)))
    want = fused_engine(model).generate(PROMPTS, params)
    engine = fused_engine(model, max_batch_size=16)
    engine.runner.on_gpu = True  # buckets and full-width attention, as on a GPU (graphs stay off on CPU)
    got = engine.generate(PROMPTS, params)
    assert [(o.token_ids, o.finish_reason) for o in got] == [(o.token_ids, o.finish_reason) for o in want]
    assert any(o.finish_reason == "stop" for o in got) and any(len(o.token_ids) > 4 for o in got)
    for o, w in zip(got, want):
        assert torch.allclose(torch.tensor(o.logprobs), torch.tensor(w.logprobs), atol=TOL)


class _Replay:
    """Stands in for a captured CUDA graph on CPU: a replay runs the captured body eagerly."""

    def __init__(self, body) -> None:
        self.replay = body


def _emulate_graphs(run) -> None:
    """Steps through `_Replay` stand-ins, with the GPU's buckets and full-width attention. Captures go through the
    runner's `GraphCache` as on a GPU (what is due, the capture counts); `run.cuda_graphs.captured` lists their keys,
    `run.cuda_graphs.used` the keys of every use counted towards a later capture."""
    run.on_gpu = run.use_graphs = True  # before the first bind: the static logits buffer is made
    run._extend_buckets = []  # packed prompts run eagerly: their graph bodies need the GPU's kernels
    graphs = run.cuda_graphs
    graphs.captured, graphs.used = [], []
    due = graphs.due

    def counted_due(key, use):
        graphs.used.append(key)
        return due(key, use)

    def capture(key, body, state):
        graphs.captures += 1
        graphs.captured.append(key)
        graphs.graphs[key] = _Replay(body)
        return graphs.graphs[key]

    graphs.due, graphs.capture = counted_due, capture


@pytest.mark.parametrize("seed", [6, pytest.param(None, marks=pytest.mark.interpreted)])
def test_the_graphed_step_gives_the_same_samples(seed):
    """What a graph replays (forward + sampling + bookkeeping for seeded rows; the forward into the static logits
    buffer, then eager sampling, for unseeded ones) samples what the eager step samples."""
    model = tiny_model("qwen3").to(DEVICE)
    params = SamplingParams(n=3, max_new_tokens=10, seed=seed, stop_token_ids=list(range(2, 30)))
    eager = fused_engine(model, max_batch_size=16)
    eager.runner.on_gpu = True
    want = eager.generate(PROMPTS, params)
    engine = fused_engine(model, max_batch_size=16)
    run = engine.runner
    _emulate_graphs(run)
    got = engine.generate(PROMPTS, params)
    assert run.graphs, "no step went through a graph"
    assert [(o.token_ids, o.finish_reason) for o in got] == [(o.token_ids, o.finish_reason) for o in want]
    for o, w in zip(got, want):
        assert torch.allclose(torch.tensor(o.logprobs), torch.tensor(w.logprobs), atol=TOL)


def test_long_contexts_step_through_their_own_split_graphs(monkeypatch):
    """A batch that fills the SMs splits its attention in two once its longest row attends `long_context_keys` keys:
    one graph per split count, the same samples as the eager step (on CPU the torch attention path ignores the split;
    under the interpreter the Triton kernel takes it)."""
    from hybridrl.engines.native.kernels import attention

    model = tiny_model("qwen3").to(DEVICE)
    params = SamplingParams(n=2, max_new_tokens=12, seed=4)
    eager = fused_engine(model, max_batch_size=16, max_model_len=256)
    eager.runner.on_gpu, eager.runner.sms = True, 1  # unsplit throughout
    want = eager.generate(PROMPTS, params)
    engine = fused_engine(model, max_batch_size=16, max_model_len=256)  # tables of 256 keys: room for 2 splits
    run = engine.runner
    _emulate_graphs(run)
    run.sms = 1  # the rows alone are never split (on CUDA they would be: a few rows on many SMs)
    threshold = max(len(p) for p in PROMPTS) + 6  # reached partway through the rollout
    monkeypatch.setattr(attention, "long_context_keys", lambda head_dim, programs, sms: threshold)
    got = engine.generate(PROMPTS, params)
    assert sorted({key[4] for key in run.graphs}) == [1, 2]  # (rows, mixed tokens, sampler, grouped, splits)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    for o, w in zip(got, want):
        assert torch.allclose(torch.tensor(o.logprobs), torch.tensor(w.logprobs), atol=TOL)


@pytest.mark.parametrize("seed", [3, pytest.param(None, marks=pytest.mark.interpreted)])
def test_a_graphed_step_with_joining_turns_gives_the_same_samples(seed, monkeypatch):
    """Turns past a cached prefix joining a running batch inside its step (mixed steps), replayed as the graphs run them
    (the prompt tokens staged in the static buffer, padded to their bucket with writes into the scratch block), sample
    what the same requests sample alone. Seeded: the same tokens; unseeded: the same shapes of run."""
    import hybridrl.engines.native.runner as runner_module

    model = tiny_model("qwen3").to(DEVICE)
    params = SamplingParams(max_new_tokens=8, seed=seed)
    engine = fused_engine(model, max_batch_size=16, kv_block_size=4, kv_blocks=64, join_wait_steps=0)
    run = engine.runner
    _emulate_graphs(run)
    monkeypatch.setattr(runner_module, "MIXED_CAPTURE_USE", 1)  # captured at first use
    firsts = engine.generate_requests([GenerationRequest(p, i) for i, p in enumerate(PROMPTS)], params)
    turns = [GenerationRequest(p + f.token_ids + [50 + i, 51], i, 1) for i, (p, f) in enumerate(zip(PROMPTS, firsts))]
    news = [GenerationRequest(PROMPTS[i], 10 + i) for i in range(2)]
    handles = {engine.submit(r, params): ("new", i) for i, r in enumerate(news)}
    got = {}
    for step in range(6):
        if 1 <= step <= len(turns):  # the new prompts run; then one turn joins them at each step
            handles[engine.submit(turns[step - 1], params)] = ("turn", step - 1)
        got.update({handles[h]: c for h, c in engine.step()})
    while engine.has_work:
        got.update({handles[h]: c for h, c in engine.step()})
    assert engine.scheduler.step_joins >= len(turns)  # with the kernels (GPU), the new prompts join in a step too
    assert any(key[1] for key in run.graphs), "no mixed step went through a graph"
    if seed is None:
        assert all(len(c.token_ids) >= 1 for c in got.values()) and len(got) == len(turns) + len(news)
        return
    solo = fused_engine(model, kv_block_size=4)
    for name, reqs in (("turn", turns), ("new", news)):
        for i, r in enumerate(reqs):
            want = solo.generate_requests([r], params)[0]
            assert got[(name, i)].token_ids == want.token_ids
            assert torch.allclose(torch.tensor(got[(name, i)].logprobs), torch.tensor(want.logprobs), atol=TOL)


@pytest.mark.interpreted
def test_chunking_and_prompt_offset_keep_samples():
    model = tiny_model("qwen2").to(DEVICE)
    params = SamplingParams(n=2, max_new_tokens=5, seed=9)
    together = [o.token_ids for o in fused_engine(model, max_batch_size=4).generate(PROMPTS, params)]  # 2 chunks
    one_by_one = []
    engine = fused_engine(model, prefill_tokens=4)  # prefill split into single prompts too
    for i, p in enumerate(PROMPTS):
        shifted = SamplingParams(**{**params.__dict__, "prompt_offset": i})
        one_by_one += [o.token_ids for o in engine.generate([p], shifted)]
    assert together == one_by_one


@pytest.mark.interpreted
def test_max_new_tokens_stop_ids_and_greedy():
    model = tiny_model("llama").to(DEVICE)
    engine = fused_engine(model)
    outs = engine.generate(PROMPTS, SamplingParams(n=2, max_new_tokens=4, seed=0))
    assert all(len(o.token_ids) <= 4 for o in outs)
    assert all(o.finish_reason == "length" for o in outs if EOS not in o.token_ids)
    outs = engine.generate(PROMPTS, SamplingParams(n=2, max_new_tokens=4, stop_token_ids=list(range(99)), seed=0))
    assert all(len(o.token_ids) == 1 and o.finish_reason == "stop" for o in outs)
    out = engine.generate(PROMPTS[:1], SamplingParams(temperature=0.0, max_new_tokens=5))[0]
    seq = list(PROMPTS[0])
    for tok in out.token_ids:
        assert tok == reference_last_logits(model, [seq])[0].argmax().item()
        seq.append(tok)


@pytest.mark.parametrize("level", [1, pytest.param(2, marks=pytest.mark.interpreted)])
def test_sleep_wake_round_trip(level):
    """A sleep frees the KV cache (and at level 2 the weights), a wake-up brings them back, the samples are those
    before. Without fixed addresses (on by default on a GPU): the fixed-address path keeps the cache and the weights'
    shapes, and has its own tests (`test_fixed_addresses_keep_the_graphs_through_sleep`, and the CUDA test below)."""
    model = tiny_model("qwen3").to(DEVICE)
    engine = fused_engine(model, fixed_addresses=False)
    params = SamplingParams(n=2, max_new_tokens=5, seed=3)
    before = [o.token_ids for o in engine.generate(PROMPTS, params)]
    assert engine.memory_stats()["engine_kv_cache_gb"] > 0
    engine.sleep(level)
    assert engine.cache is None and engine.memory_stats()["engine_kv_cache_gb"] == 0
    with pytest.raises(HybridRLError, match="asleep"):
        engine.generate(PROMPTS, params)
    if level == 2:
        assert all(p.numel() == 0 for _, p in engine.named_weights())
        with pytest.raises(HybridRLError, match="asleep"):
            engine.load_weights([("model.norm.weight", torch.ones(34))])
    engine.wake_up(["weights"])
    if level == 2:  # contents are stale: the resharder refills every tensor (and checks it did)
        Resharder(ReshardConfig(verify=True), engine, model.config).sync(model)
    engine.wake_up(["kv_cache"])
    assert engine.cache is not None  # reallocated at its last size, before the next generate
    assert [o.token_ids for o in engine.generate(PROMPTS, params)] == before


class _FakeFixedMemory:
    """Stands in for `FixedMemory` (on CPU too): views of one byte buffer on `device` that keep their storage; `release`
    overwrites it with 0xFF bytes (NaN as floats: whatever reads it while asleep, or is not rewritten after, shows),
    `restore` leaves that garbage for the engine to rewrite."""

    def __init__(self, nbytes: int, device) -> None:
        self.buf = torch.zeros(nbytes, dtype=torch.uint8, device=device)
        self.nbytes, self.used, self.mapped = nbytes, 0, True

    def view(self, shape, dtype):
        n = torch.Size(shape).numel() * dtype.itemsize
        t = self.buf[self.used : self.used + n].view(dtype).view(shape)
        self.used += -(-n // 256) * 256
        assert self.used <= self.nbytes
        return t

    def release(self) -> None:
        with torch.inference_mode():  # made inside a generate: an inference tensor
            self.buf.fill_(255)
        self.mapped = False

    def restore(self) -> None:
        self.mapped = True


def _rollout(engine: FusedEngine) -> list[tuple[list[int], list[float]]]:
    """One agent rollout as a run makes it: trajectories through the engine's `async_engine`, whose tools take a few
    engine steps each (asyncio runs the driver's steps and the tools' waits in a fixed order: a clock of engine
    steps), one long enough that its turn joins alone; so turns join the running batch inside its steps at several
    batch sizes. Every completion's tokens and log-probs, in order. The driver runs in the event loop's thread on a
    GPU too: a driver thread (what a run's agent rollout uses there) steps on its own clock, so when turns join, and
    the step shapes with them, would vary from rollout to rollout."""
    params = SamplingParams(max_new_tokens=6, seed=6, stop_token_ids=list(range(2, 12)))

    async def trajectories():
        engine.size_for(64)  # as `async_engine(64)` sizes the cache
        agent = AsyncEngine(engine, threaded=False)

        async def trajectory(t: int):
            context, done = list(PROMPTS[t % 3]), []
            for turn in range(3):
                out = await agent.generate(GenerationRequest(list(context), t % 3, 10 * turn + t // 3), params)
                done.append(out)
                for _ in range(200 if (t, turn) == (11, 1) else (t * 5 + turn * 3) % 7):  # the tool
                    await asyncio.sleep(0)
                context += out.token_ids + [50 + turn, 60 + t]
            return done

        return await asyncio.gather(*(trajectory(t) for t in range(12)))

    return [(c.token_ids, c.logprobs) for done in asyncio.run(trajectories()) for c in done]


@pytest.mark.parametrize("level", [1, 2])
@pytest.mark.parametrize("fixed", [True, False])
def test_fixed_addresses_keep_the_graphs_through_sleep(level, fixed, monkeypatch):
    """engine.native.fixed_addresses: a sleep gives the weights' and the KV cache's memory back but keeps their
    addresses, so the (emulated) graphs stay. Agent rollouts as a run makes them (`_rollout`): the first captures each
    of its graphs once (none is dropped before it ends: the block tables are sized for the call first); the next two
    capture none, not even a key the first met once and left eager (it is due at its second use within one rollout);
    the samples are the first rollout's. Without fixed addresses a sleep drops the graphs and the next rollout
    captures them again."""
    monkeypatch.setattr(fused_engine_module, "fixed_memory", lambda n, device: _FakeFixedMemory(n, device))
    model = tiny_model("qwen3").to(DEVICE)
    engine = fused_engine(model, max_batch_size=16, kv_block_size=4, fixed_addresses=fixed)
    run = engine.runner
    _emulate_graphs(run)
    first = _rollout(engine)
    captured, used = list(run.cuda_graphs.captured), run.cuda_graphs.used
    assert captured and len(set(captured)) == len(captured), captured
    assert any(used.count(k) == 1 and k not in run.graphs for k in used), "no key was met once and left eager"
    graphs = dict(run.graphs)
    run.take_capture_stats()
    for _ in range(2 if fixed else 1):
        cache, k_ptr = engine.cache, engine.cache.k.data_ptr()
        w_ptrs = [p.data_ptr() for _, p in engine.named_weights()]
        engine.sleep(level)
        assert engine.memory_stats()["engine_kv_cache_gb"] == 0
        with pytest.raises(HybridRLError, match="asleep"):
            engine.generate(PROMPTS, SamplingParams(max_new_tokens=2))
        engine.wake_up(["weights"])
        if level == 2:
            Resharder(ReshardConfig(verify=True), engine, model.config).sync(model)
        engine.wake_up(["kv_cache"])
        if fixed:
            assert run.graphs == graphs and engine.cache is cache and engine.cache.k.data_ptr() == k_ptr
            assert [p.data_ptr() for _, p in engine.named_weights()] == w_ptrs
            assert engine.cache.allocator.cached == 0  # what the pool held is gone, its prefix entries too
        else:
            assert not run.graphs
        got = _rollout(engine)
        assert [ids for ids, _ in got] == [ids for ids, _ in first]
        for (_, lp), (_, want) in zip(got, first):
            assert torch.allclose(torch.tensor(lp), torch.tensor(want), atol=TOL)
        captures, _ = run.take_capture_stats()
        if fixed:
            assert captures == 0 and all(run.graphs[k] is g for k, g in graphs.items())  # replayed, none captured
        else:
            assert captures == len(captured)


@pytest.mark.skipif(DEVICE.type != "cuda", reason="CUDA virtual memory needs a GPU")
def test_fixed_memory_keeps_its_address_and_gives_memory_back():
    from hybridrl.engines.native.fixed_memory import fixed_memory, mapped_bytes, peak_mapped_bytes, reset_peak_mapped
    from hybridrl.workers.dist import memory_snapshot

    before = mapped_bytes(DEVICE)
    reset_peak_mapped(DEVICE)
    mem = fixed_memory(64 << 20, DEVICE)
    assert mem is not None, "the driver refused fixed-address memory"
    # torch's allocator does not see this memory; the worker's memory figures add what the engine reports mapped
    assert mapped_bytes(DEVICE) - before == mem.nbytes
    assert memory_snapshot(DEVICE, mapped_bytes(DEVICE))["fixed_gb"] == (before + mem.nbytes) / 2**30
    a, b = mem.view((1024, 1024), torch.float32), mem.view((7,), torch.bfloat16)
    a.fill_(3.0)
    b.fill_(-1.0)
    assert a.sum().item() == 3.0 * 2**20 and b.sum().item() == -7.0
    ptr = a.data_ptr()
    free = torch.cuda.mem_get_info(DEVICE)[0]
    mem.release()
    assert torch.cuda.mem_get_info(DEVICE)[0] - free >= 60 << 20
    assert mapped_bytes(DEVICE) == before and peak_mapped_bytes(DEVICE) == before + mem.nbytes
    mem.restore()
    a.fill_(2.0)
    assert a.data_ptr() == ptr and a.sum().item() == 2.0 * 2**20


@pytest.mark.skipif(DEVICE.type != "cuda", reason="CUDA graphs need a GPU")
def test_cuda_graphs_survive_sleep_at_fixed_addresses():
    """The real thing: graphs captured before a sleep replay after it (no capture), the samples equal the eager
    path's, and the sleep really gave the memory back."""
    model = tiny_model("qwen3").to(DEVICE)
    params = SamplingParams(n=4, max_new_tokens=40, seed=4, stop_token_ids=list(range(2, 12)))
    eager = fused_engine(model, cuda_graphs=False).generate(PROMPTS, params)
    engine = fused_engine(model, fixed_addresses=True)
    assert engine._weight_offload.memory is not None
    for i in range(3):
        got = engine.generate(PROMPTS, params)
        captures, _ = engine.runner.take_capture_stats()
        assert captures > 0 if i == 0 else captures == 0
        assert [o.token_ids for o in got] == [o.token_ids for o in eager]
        for o, w in zip(got, eager):
            assert torch.allclose(torch.tensor(o.logprobs), torch.tensor(w.logprobs), atol=TOL)
        held = sum(engine.memory_stats().values()) * 2**30
        free, mapped = torch.cuda.mem_get_info(DEVICE)[0], engine.mapped_bytes()
        engine.sleep(2)
        assert engine.runner.graphs
        assert torch.cuda.mem_get_info(DEVICE)[0] - free >= 0.9 * held
        # outside torch's allocator: the engine reports it (the worker adds it to its memory figures)
        assert mapped - engine.mapped_bytes() >= 0.999 * held and engine.take_peak_mapped_bytes() >= mapped
        engine.wake_up(["weights"])
        Resharder(ReshardConfig(), engine, model.config).sync(model)
        engine.wake_up(["kv_cache"])


@pytest.mark.skipif(DEVICE.type != "cuda", reason="CUDA graphs need a GPU")
def test_cuda_graphs_survive_sleep_in_agent_rollouts():
    """The real thing for agent rollouts (`_rollout`: turns joining inside decode steps, packed prompts, graphs due at
    their second use): after the first rollout, the next two capture nothing and sample the first's tokens."""
    model = tiny_model("qwen3").to(DEVICE)
    engine = fused_engine(model, max_batch_size=16, kv_block_size=4, fixed_addresses=True)
    first = _rollout(engine)
    assert engine.runner.take_capture_stats()[0] > 0 and engine.scheduler.step_joins > 0
    # Every mixed step's key runs eagerly at its first use; later rollouts only the keys no rollout used twice.
    eager = [engine.runner.cuda_graphs.take_eager_steps()]
    for _ in range(2):
        engine.sleep(2)
        engine.wake_up(["weights"])
        Resharder(ReshardConfig(), engine, model.config).sync(model)
        engine.wake_up(["kv_cache"])
        got = _rollout(engine)
        assert engine.runner.take_capture_stats()[0] == 0
        eager.append(engine.runner.cuda_graphs.take_eager_steps())
        assert [ids for ids, _ in got] == [ids for ids, _ in first]
        for (_, lp), (_, want) in zip(got, first):
            assert torch.allclose(torch.tensor(lp), torch.tensor(want), atol=TOL)
    assert eager[0] > 0 and eager[0] >= eager[1] == eager[2]


@pytest.mark.skipif(DEVICE.type != "cuda", reason="CUDA graphs need a GPU")
def test_pdl_launches_sample_what_plain_launches_sample(monkeypatch):
    """engine.native.pdl on and off: the same tokens and log-probs, graphed and eager; with off no launch of the
    engine's asks for PDL."""
    from hybridrl.engines.native.kernels import pdl

    model = tiny_model("qwen3").to(DEVICE)
    params = SamplingParams(n=4, max_new_tokens=40, seed=4, stop_token_ids=list(range(2, 12)))
    asked = []
    launch = pdl.launch
    with monkeypatch.context() as m:
        m.setattr(pdl, "launch", lambda x: asked.append(launch(x)["PDL"]) or launch(x))
        want = fused_engine(model, pdl=False).generate(PROMPTS, params)
    assert asked and not any(asked)
    for graphs in (True, False):
        engine = fused_engine(model, pdl=True, cuda_graphs=graphs)
        got = engine.generate(PROMPTS, params)
        assert [o.token_ids for o in got] == [o.token_ids for o in want]
        for o, w in zip(got, want):
            assert torch.allclose(torch.tensor(o.logprobs), torch.tensor(w.logprobs), atol=TOL)


def test_pdl_setting_holds_inside_the_engines_calls_only(monkeypatch):
    """Each engine launches with its own engine.native.pdl, inside its own calls: two engines of one process keep
    their settings, and nothing is left set after a call."""
    from hybridrl.engines.native.kernels import pdl

    model = tiny_model("qwen2").to(DEVICE)
    # Eager steps (no graphs), so that every step calls the decoder's forward.
    off, on = fused_engine(model, pdl="off", cuda_graphs=False), fused_engine(model, pdl="on", cuda_graphs=False)
    seen = []
    forward = FusedDecoder.decode
    monkeypatch.setattr(FusedDecoder, "decode", lambda *a, **k: seen.append(pdl.wanted()) or forward(*a, **k))
    params = SamplingParams(n=2, max_new_tokens=3, seed=0)
    off.generate(PROMPTS, params)
    on.generate(PROMPTS, params)
    off.generate(PROMPTS, params)
    steps = len(seen) // 3
    assert steps > 0 and seen == [False] * steps + [True] * steps + [False] * steps
    assert pdl.wanted()  # outside any engine's call: the default


def test_resharder_fills_the_engine_from_fsdp(process_group):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = tiny_model("llama")
    ref = tiny_model("llama").to(DEVICE)
    mesh = init_device_mesh("cpu", (1,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    engine = FusedEngine(ref.config, [EOS], PAD, device=DEVICE, dtype=torch.float32)
    assert engine.weight_layout_style == "fused"
    Resharder(ReshardConfig(verify=True), engine, model.config).sync(model)
    assert (engine.last_logits(PROMPTS).cpu() - reference_last_logits(ref, PROMPTS)).abs().max().item() < TOL


def test_load_weights_rejects_unknown_names_and_shapes():
    engine = fused_engine(tiny_model("qwen2").to(DEVICE))
    with pytest.raises(HybridRLError, match="no parameter named"):
        engine.load_weights([("model.layers.0.self_attn.q_proj.weight", torch.zeros(1))])
    with pytest.raises(HybridRLError, match="shape"):
        engine.load_weights([("model.norm.weight", torch.zeros(3))])
    assert "lm_head.weight" not in dict(engine.named_weights())  # tied: the embedding serves as lm_head


def test_max_model_len_preallocates_and_bounds_the_cache():
    engine = fused_engine(tiny_model("qwen2").to(DEVICE), max_model_len=16, kv_block_size=4)
    engine.sleep(1)
    engine.wake_up()
    # Allocated at wake-up: max_batch_size sequences of 16 tokens (4 blocks of 4), plus the scratch block.
    assert engine.cache is not None and engine.cache.num_blocks == 1 + 8 * 4 and engine.runner.width == 4
    with pytest.raises(HybridRLError, match="max_model_len"):
        engine.generate(PROMPTS, SamplingParams(max_new_tokens=8))


@pytest.mark.interpreted
def test_llama_with_attention_and_mlp_biases():
    """o_proj/down_proj biases are added once, after the row-parallel sum; gate_up gets a fused bias."""
    model = tiny_model("llama", attention_bias=True, mlp_bias=True).to(DEVICE)
    engine = fused_engine(model)
    assert (engine.last_logits(PROMPTS).cpu() - reference_last_logits(model, PROMPTS)).abs().max().item() < TOL
    for o in engine.generate(PROMPTS, SamplingParams(n=2, max_new_tokens=5, seed=0)):
        want = reference_logprobs(model, PROMPTS[o.prompt_index], o.token_ids)
        assert (torch.tensor(o.logprobs) - want).abs().max().item() < TOL


@pytest.mark.interpreted
def test_rope_scaling_and_unsupported_features():
    model = tiny_model("llama", rope_scaling={"rope_type": "linear", "factor": 2.0}).to(DEVICE)
    diff = (fused_engine(model).last_logits(PROMPTS).cpu() - reference_last_logits(model, PROMPTS)).abs().max()
    assert diff.item() < TOL
    dynamic = transformers.LlamaConfig(rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    assert native_impl(EngineConfig(), dynamic) == "hf"
    with pytest.raises(ConfigError, match="rope_type 'dynamic'"):
        native_impl(EngineConfig(native=NativeOptions(impl="fused")), dynamic)
    assert native_impl(EngineConfig(), transformers.GPT2Config()) == "hf"
    assert native_impl(EngineConfig(), transformers.GPT2Config(), tp_size=2) == "hf"  # replicated on each rank
    assert native_impl(EngineConfig(), transformers.Qwen2Config(), tp_size=2) == "fused"  # the caller's TP group
    assert native_impl(EngineConfig(native=NativeOptions(impl="hf")), transformers.Qwen2Config()) == "hf"
    assert native_impl(EngineConfig(), transformers.Qwen3Config()) == "fused"


def test_build_engine_picks_the_implementation(tiny_path, tokenizer):
    from hybridrl.models.loading import load_causal_lm
    from hybridrl.topology import Topology

    fused = build_engine(EngineConfig(), ModelConfig(), tiny_path, tokenizer, DEVICE, Topology(1))
    assert isinstance(fused, FusedEngine) and fused.weight_layout_style == "fused" and fused.starts_empty
    model = load_causal_lm(tiny_path, ModelConfig(), torch.float32, DEVICE)
    Resharder(ReshardConfig(), fused, model.config).sync(model)  # what the builder's first weight sync does
    hf = build_engine(
        EngineConfig(native=NativeOptions(impl="hf")), ModelConfig(), tiny_path, tokenizer, DEVICE, Topology(1)
    )
    assert not isinstance(hf, FusedEngine) and hf.weight_layout_style == "hf"
    params = SamplingParams(n=2, max_new_tokens=6, seed=1)
    assert [o.token_ids for o in fused.generate(PROMPTS, params)] == [o.token_ids for o in hf.generate(PROMPTS, params)]


@pytest.mark.skipif(DEVICE.type != "cuda", reason="CUDA graphs need a GPU")
def test_cuda_graphs_match_eager_and_survive_sleep():
    model = tiny_model("qwen3").to(DEVICE)
    params = SamplingParams(n=4, max_new_tokens=40, seed=4, stop_token_ids=list(range(2, 12)))
    eager = fused_engine(model, cuda_graphs=False).generate(PROMPTS, params)
    engine = fused_engine(model, fixed_addresses=False)  # graphs dropped at sleep: the path without fixed addresses
    for _ in range(2):
        got = engine.generate(PROMPTS, params)
        assert engine.runner.use_graphs and engine.runner.graphs, "no graph was captured"
        assert [o.token_ids for o in got] == [o.token_ids for o in eager]
        for o, w in zip(got, eager):
            assert torch.allclose(torch.tensor(o.logprobs), torch.tensor(w.logprobs), atol=TOL)
        held = sum(engine.memory_stats().values()) * 2**30
        before = torch.cuda.memory_allocated(DEVICE)
        engine.sleep(2)
        assert not engine.runner.graphs
        assert before - torch.cuda.memory_allocated(DEVICE) >= 0.9 * held  # weights and KV cache really freed
        engine.wake_up(["weights"])
        Resharder(ReshardConfig(), engine, model.config).sync(model)
        engine.wake_up(["kv_cache"])


@pytest.mark.skipif(DEVICE.type != "cuda", reason="CUDA graphs need a GPU")
def test_graphed_extends_match_eager():
    """Packed prompts (new, and continuing cached prefixes) run eagerly at a token bucket's first use and through
    its CUDA graph from the second; the logits equal the eager engine's, and a transformers forward's, each time."""
    model = tiny_model("qwen3").to(DEVICE)
    prompts = [PROMPTS[0] + PROMPTS[2] * 3, PROMPTS[1] * 20, PROMPTS[2] + [4], PROMPTS[0] * 7]
    cached = [3, 32, 0, 34]
    want = reference_last_logits(model, prompts)
    eager = fused_engine(model, cuda_graphs=False, kv_block_size=16).last_logits(prompts, cached).cpu()
    engine = fused_engine(model, kv_block_size=16)
    for use in range(3):
        got = engine.last_logits(prompts, cached).cpu()
        assert any(k[0] == "extend" for k in engine.runner.graphs) == (use > 0)
        assert (got - eager).abs().max().item() < TOL
        assert (got - want).abs().max().item() < TOL
