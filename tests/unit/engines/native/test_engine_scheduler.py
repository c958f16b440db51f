"""The native engines' request form, the paged KV cache's sharing, and continuous batching (the scheduler and the
asyncio adapter): a request's tokens must not depend on when it started or what it shared a batch with.

Runs on CPU in float32 (HYBRIDRL_TEST_DEVICE=cuda runs the same on a GPU).
"""

from __future__ import annotations

import asyncio
import os

import pytest
import torch

import tests.triton_interpret  # noqa: F401  (HYBRIDRL_KERNELS_ON_CPU=1 TRITON_INTERPRET=1: the kernels on CPU)
from hybridrl.engines.base import GenerationRequest, SamplingParams
from hybridrl.engines.config import NativeOptions
from hybridrl.engines.native.async_engine import AsyncEngine
from hybridrl.engines.native.engine import FusedEngine
from hybridrl.engines.native.hf import HFEngine
from hybridrl.errors import HybridRLError
from hybridrl.reshard import ReshardConfig, Resharder
from tests.tiny_models import PROMPTS, reference_logprobs, tiny_model

DEVICE = torch.device(os.environ.get("HYBRIDRL_TEST_DEVICE", "cpu"))
TOL = 1e-5 if DEVICE.type == "cpu" else 5e-5
EOS, PAD = 0, 1


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def model():
    return tiny_model("qwen3").to(DEVICE)  # GQA, q/k norm, head_dim 16


def fused(model, eos: tuple[int, ...] = (EOS,), **options) -> FusedEngine:
    engine = FusedEngine(
        model.config,
        list(eos),
        PAD,
        device=DEVICE,
        dtype=torch.float32,
        options=NativeOptions(**{"max_batch_size": 8, **options}),
        seed=0,
    )
    Resharder(ReshardConfig(), engine, model.config).sync(model)
    return engine


def same(got, want) -> None:
    """Identical tokens and finish reasons; log-probs within TOL."""
    assert [(o.token_ids, o.finish_reason) for o in got] == [(o.token_ids, o.finish_reason) for o in want]
    for o, w in zip(got, want):
        assert torch.allclose(torch.tensor(o.logprobs), torch.tensor(w.logprobs), atol=TOL)


PARAMS = SamplingParams(max_new_tokens=10, seed=11, stop_token_ids=[3, 7])


def requests(n_prompts: int = 3, samples: int = 2, offset: int = 0) -> list[GenerationRequest]:
    return [GenerationRequest(PROMPTS[i], offset + i, j) for i in range(n_prompts) for j in range(samples)]


@pytest.mark.parametrize("kind", ["fused", "hf"])
def test_generate_is_generate_requests(model, kind):
    engine = fused(model) if kind == "fused" else HFEngine(model, [EOS], PAD, max_batch_size=8)
    params = SamplingParams(n=2, max_new_tokens=8, seed=4, prompt_offset=5)
    outs = engine.generate(PROMPTS, params)
    reqs = engine.generate_requests(requests(samples=2, offset=5), params)
    same(outs, reqs)
    assert [o.prompt_index for o in outs] == [0, 0, 1, 1, 2, 2]  # local to the call
    assert [o.prompt_index for o in reqs] == [5, 5, 6, 6, 7, 7]  # the requests' own


@pytest.mark.parametrize("kind", ["fused", "hf"])
def test_a_request_draws_the_same_alone_or_batched(model, kind):
    engine = fused(model) if kind == "fused" else HFEngine(model, [EOS], PAD, max_batch_size=8)
    reqs = requests()
    together = engine.generate_requests(reqs, PARAMS)
    reordered = engine.generate_requests(reqs[::-1], PARAMS)[::-1]
    alone = [engine.generate_requests([r], PARAMS)[0] for r in reqs]
    same(reordered, together)
    same(alone, together)
    for r, o in zip(reqs, together):
        want = reference_logprobs(model, r.prompt_ids, o.token_ids)
        assert (torch.tensor(o.logprobs) - want).abs().max().item() < TOL


@pytest.mark.parametrize("block_size", [1, pytest.param(4, marks=pytest.mark.interpreted), 16])
def test_shared_prompt_blocks_give_each_sample_the_right_context(model, block_size):
    """Prompts of 2, 5, 8 and 9 tokens (with 4-token blocks: no full block, one, two exactly, two plus a tail)."""
    prompts = [[21, 2], [5, 17, 3, 9, 11], [4, 8, 15, 16, 23, 42, 5, 6], PROMPTS[2]]
    engine = fused(model, kv_block_size=block_size, max_batch_size=12)  # all 12 samples in one batch
    outs = engine.generate(prompts, SamplingParams(n=3, max_new_tokens=7, seed=2))
    for o in outs:
        want = reference_logprobs(model, prompts[o.prompt_index], o.token_ids)
        assert (torch.tensor(o.logprobs) - want).abs().max().item() < TOL
    assert engine.scheduler.prefilled_tokens == sum(len(p) for p in prompts)  # once per prompt, not per sample
    assert engine.cache.allocator.held == 0  # every block came back


@pytest.mark.parametrize("block_size,gpu_schedule", [pytest.param(1, False, marks=pytest.mark.interpreted), (4, True)])
def test_shared_prompt_blocks_read_once_per_group(model, block_size, gpu_schedule, monkeypatch):
    """Attention reading a group's shared prompt blocks once for all its rows (`kernels/shared_prefix.py`) gives the
    tokens of attention reading them per row, and the reference log-probs: groups of 3 samples, a prompt alone, rows
    finishing at different steps (stop tokens) so the grouping changes as rows leave; also on the GPU's schedule
    (steps over a bucket of rows, padding rows in no group)."""
    import hybridrl.engines.native.model as fused_model

    prompts = [[21, 2, 6, 30], [5, 17, 3, 9, 11], [4, 8, 15, 16, 23, 42, 5, 6], PROMPTS[2]]
    reqs = [GenerationRequest(p, i, j) for i, p in enumerate(prompts) for j in range(3 if i != 1 else 1)]
    params = SamplingParams(max_new_tokens=9, seed=5, stop_token_ids=[3, 7])
    plain = fused(model, kv_block_size=block_size, max_batch_size=12, shared_prefix_tokens=0)
    want = plain.generate_requests(reqs, params)
    grouped = fused(model, kv_block_size=block_size, max_batch_size=12, shared_prefix_tokens=1)
    if not grouped.model.paged_attention_kernel(block_size):
        pytest.skip("grouped attention runs in the Triton kernels only (CUDA, or HYBRIDRL_KERNELS_ON_CPU=1)")
    # Small batches take the one-kernel attention, which reads every row's keys: keep to the two-kernel form here.
    grouped.model.one_kernel_attention = lambda rows, n_splits: False
    grouped.runner.on_gpu = gpu_schedule
    calls = []
    real = fused_model.shared_prefix_attention
    monkeypatch.setattr(fused_model, "shared_prefix_attention", lambda *a: calls.append(a[-1]) or real(*a))
    handles = [grouped.submit(r, params) for r in reqs]
    done = {}
    while grouped.has_work:
        done.update(grouped.step())
    got = [done[h] for h in handles]
    same(got, want)
    for r, o in zip(reqs, got):
        ref = reference_logprobs(model, r.prompt_ids, o.token_ids)
        assert (torch.tensor(o.logprobs) - ref).abs().max().item() < TOL
    assert calls, "no step read shared blocks once per group"
    slots = calls[0].slots[calls[0].slots[:, -1] > 0]
    assert len(slots) == 3 and sorted(slots[:, -1].tolist()) == sorted(
        len(p) // block_size for p in prompts[::2] + prompts[3:]
    )


def test_the_runner_hears_of_tables_only_where_rows_may_share_blocks(model, monkeypatch):
    """`DecodeRunner.share_rows` gets the rows' tables after rows change only where some may share leading blocks: a
    group of samples, or a prompt found in the prefix table while the row that wrote it still runs; distinct prompts
    (an agent's trajectories) or too short a shared prompt cost no pass over the rows."""
    engine = fused(model, kv_block_size=4, shared_prefix_tokens=1)
    heard: list[list[list[int]] | None] = []
    real = engine.runner.share_rows
    monkeypatch.setattr(
        engine.runner, "share_rows", lambda tables, attended=None: heard.append(tables) or real(tables, attended)
    )
    params = SamplingParams(max_new_tokens=6, seed=1)

    def run(reqs, later=()):
        heard.clear()
        for r in reqs:
            engine.submit(r, params)
        engine.step()
        for r in later:  # joins while the first rows run
            engine.submit(r, params)
        while engine.has_work:
            engine.step()
        return heard

    distinct = [GenerationRequest(p, i) for i, p in enumerate(PROMPTS)]
    assert run(distinct) and all(t is None for t in heard)
    group = [GenerationRequest(PROMPTS[2], 0, j) for j in range(3)]
    assert any(t is not None and len(t) == 3 for t in run(group))
    long_prompt = PROMPTS[2] + PROMPTS[1]
    found = run([GenerationRequest(long_prompt, 0)], [GenerationRequest(long_prompt, 1)])
    assert any(t is not None and len(t) == 2 and t[0][:2] == t[1][:2] for t in found)
    engine.runner.shared_prefix_tokens = 10**6  # no prompt is that long: not worth a pass
    assert all(t is None for t in run(group))


@pytest.mark.interpreted
def test_block_accounting_of_a_group(model):
    """9-token prompt, 4-token blocks, 3 samples of ≤ 4 new tokens: positions 0..11 are ever written (the last
    token is never fed back), so each sample spans 3 blocks: 2 shared full prompt blocks + 1 of its own. No EOS: a
    sample that drew it first would leave after one step."""
    engine = fused(model, eos=(), kv_block_size=4)
    for j in range(3):
        engine.submit(GenerationRequest(PROMPTS[2], 0, j), SamplingParams(max_new_tokens=4, seed=0))
    engine.step()
    assert engine.cache.allocator.held == 2 + 3 * 1
    tables = [s.blocks for s in engine.scheduler.rows]
    assert len({tuple(t[:2]) for t in tables}) == 1 and len({t[2] for t in tables}) == 3
    while engine.has_work:
        engine.step()
    assert engine.cache.allocator.held == 0


@pytest.mark.parametrize("join_wait", [0, 3])
def test_staggered_starts_equal_solo_generation(model, join_wait):
    """Sequences that join a running batch at different steps (at once, or after waiting to share a prefill), wait
    for a free row or for KV blocks, and leave at stops, each equal their solo generation under the same seed."""
    reqs = [GenerationRequest(PROMPTS[i % 3] + [40 + i], i, i % 2) for i in range(7)]
    params = SamplingParams(max_new_tokens=9, seed=3, stop_token_ids=[5, 9, 13])
    solo = [fused(model).generate_requests([r], params)[0] for r in reqs]
    same(solo, HFEngine(model, [EOS], PAD).generate_requests(reqs, params))  # an independent anchor
    # 3 rows, and blocks for about 3 sequences of 4-token blocks: later requests wait for earlier ones to leave.
    engine = fused(model, max_batch_size=3, kv_block_size=4, kv_blocks=1 + 3 * 5, join_wait_steps=join_wait)
    start_at = {0: [0, 1], 2: [2], 3: [3, 4], 6: [5], 9: [6]}  # step → requests submitted before it
    got, handles, step = {}, {}, 0
    while step <= max(start_at) or engine.has_work:
        for i in start_at.get(step, []):
            handles[engine.submit(reqs[i], params)] = i
        for h, c in engine.step():
            got[handles[h]] = c
        step += 1
    assert sorted(got) == list(range(7))
    same([got[i] for i in range(7)], solo)
    assert any(o.finish_reason == "stop" for o in solo) and any(o.finish_reason == "length" for o in solo)
    assert engine.cache.allocator.held == 0


def test_requests_arriving_steps_apart_share_one_prefill(model):
    """With join_wait_steps=4, a request that arrives while a batch runs waits until two can join (an eighth of the
    rows, at least 2) or it has waited 4 steps with a row free; with 0 each joins at the next step (a prefill each:
    join_step_tokens=0, so that every device counts the same steps). Tokens are the same either way."""
    params = SamplingParams(max_new_tokens=12, seed=5)
    reqs = [GenerationRequest(PROMPTS[i % 3] + [50 + i], i, 0) for i in range(4)]
    runs = {}
    for wait, rows in ((0, 8), (4, 8), (4, 3), (4, 32)):
        engine = fused(model, max_batch_size=rows, join_wait_steps=wait, join_step_tokens=0)
        handles = {engine.submit(reqs[0], params): 0}  # the running batch
        got, step = {}, 0
        joined_at = {}
        while engine.has_work or step < 4:
            if 1 <= step <= 3:
                handles[engine.submit(reqs[step], params)] = step
            for h, c in engine.step():
                got[handles[h]] = c
            for s_ in engine.scheduler.rows:
                joined_at.setdefault(handles[s_.handle], step)
            step += 1
        runs[(wait, rows)] = (engine.scheduler.prefills, joined_at, [got[i] for i in range(4)])
    assert runs[(0, 8)][0] == 4 and runs[(0, 8)][1] == {0: 0, 1: 1, 2: 2, 3: 3}
    # 8 rows: requests 1 and 2 join together when the second arrives; request 3 waits 4 steps alone.
    assert runs[(4, 8)][0] == 3 and runs[(4, 8)][1] == {0: 0, 1: 2, 2: 2, 3: 7}
    # 3 rows: the same; then no row is free for request 3 until request 0 leaves (step 11). Its wait counts from there,
    # not from its arrival: it waits for company until the batch drains (step 13), then joins at once.
    assert runs[(4, 3)][0] == 3 and runs[(4, 3)][1] == {0: 0, 1: 2, 2: 2, 3: 13}
    # 32 rows: 4 must be able to join at once; requests 1-3 wait until request 1 has waited 4 steps.
    assert runs[(4, 32)][0] == 2 and runs[(4, 32)][1] == {0: 0, 1: 5, 2: 5, 3: 5}
    for key in ((4, 8), (4, 3), (4, 32)):
        same(runs[key][2], runs[(0, 8)][2])


@pytest.mark.interpreted
def test_requests_that_sample_differently_wait_for_the_batch(model):
    engine = fused(model)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=6)
    a, b = GenerationRequest(PROMPTS[0], 0), GenerationRequest(PROMPTS[1], 1)
    ha = engine.submit(a, PARAMS)
    engine.step()
    hb = engine.submit(b, greedy)
    got = {}
    while engine.has_work:
        got.update(engine.step())
    same(
        [got[ha], got[hb]],
        [fused(model).generate_requests([a], PARAMS)[0], fused(model).generate_requests([b], greedy)[0]],
    )


@pytest.mark.interpreted
def test_cache_limits_fail_clearly(model):
    with pytest.raises(HybridRLError, match="engine.native.kv_blocks"):
        fused(model, kv_blocks=3, kv_block_size=4).generate(PROMPTS, SamplingParams(max_new_tokens=8))
    engine = fused(model, max_model_len=12)
    with pytest.raises(HybridRLError, match="engine.native.max_model_len"):
        engine.generate(PROMPTS, SamplingParams(max_new_tokens=8))
    assert not engine.has_work  # nothing half-queued stays behind
    with pytest.raises(HybridRLError, match="empty prompt"):
        engine.generate([[]], SamplingParams(max_new_tokens=2))


def _conversations(engine_like, params, turns: int = 3, trajectories: int = 6, threaded: bool = False):
    """Multi-turn loops: generate, 'run a tool' (sleep a random-ish while), append tool tokens, generate again."""

    async def trajectory(t: int, agent: AsyncEngine) -> list:
        context, outs = list(PROMPTS[t % 3]), []
        for turn in range(turns):
            out = await agent.generate(GenerationRequest(list(context), t, turn), params)
            outs.append((list(context), out))
            await asyncio.sleep(0.001 * ((t * 7 + turn * 3) % 5))  # the tool
            context += out.token_ids + [50 + turn, 60 + t]
        return outs

    async def main():
        agent = AsyncEngine(engine_like, threaded=threaded)
        try:  # a lost completion fails here, with what was left, rather than hanging the run
            out = await asyncio.wait_for(asyncio.gather(*(trajectory(t, agent) for t in range(trajectories))), 120)
        except TimeoutError:
            sched = getattr(engine_like, "scheduler", None)
            left = None if sched is None else (len(sched.waiting), len(sched.rows), len(sched.pending))
            thread = agent._thread
            raise AssertionError(
                f"trajectories unfinished after 120 s: (waiting, rows, pending) {left}, inbox {len(agent._inbox)}, "
                f"futures {len(agent._futures)}, driver alive {thread is not None and thread.is_alive()}"
            ) from None
        await agent.idle()
        return out

    return asyncio.run(main())


@pytest.mark.parametrize("kind", ["fused", "fused-threaded", "hf"])
def test_async_engine_serves_concurrent_trajectories(model, kind):
    """Every turn of every trajectory equals the same request generated alone (continuous batching for the fused
    engine, stepped in the event loop's thread or in a driver thread as on a GPU; per-arrival batches for the HF
    one)."""
    params = SamplingParams(max_new_tokens=6, seed=8, stop_token_ids=[4, 12])
    engine = fused(model, max_batch_size=4) if kind != "hf" else HFEngine(model, [EOS], PAD, max_batch_size=4)
    results = _conversations(engine, params, threaded=kind == "fused-threaded")
    solo = fused(model)
    for t, turns in enumerate(results):
        for turn, (context, out) in enumerate(turns):
            same([out], solo.generate_requests([GenerationRequest(context, t, turn)], params))
    if kind != "hf":
        assert not engine.has_work and engine.cache.allocator.held == 0


def test_the_driver_thread_steps_while_the_loop_is_busy(model):
    """Threaded, the engine keeps stepping while the event loop's thread is held (as by a turn's host work): a
    request's completion arrives without the loop doing anything for it, and `idle` returns once the driver ended."""
    import time

    engine = fused(model)
    params = SamplingParams(max_new_tokens=6, seed=3)

    async def main():
        agent = AsyncEngine(engine, threaded=True)
        task = asyncio.ensure_future(agent.generate(GenerationRequest(PROMPTS[0], 0), params))
        await asyncio.sleep(0)  # the request is handed over
        deadline = time.monotonic() + 30
        while engine.has_work or agent._inbox:  # the loop's thread busy: no await
            assert time.monotonic() < deadline, "the driver did not step"
            time.sleep(0.001)
        out = await task
        await agent.idle()
        return out, agent._thread

    out, thread = asyncio.run(main())
    assert thread is None
    same([out], fused(model).generate_requests([GenerationRequest(PROMPTS[0], 0)], params))


def test_a_failed_rollout_stops_the_driver_thread(model):
    """A trajectory that raises ends the rollout: the driver stops at its next step instead of serving the rest, so
    nothing steps the engine once the phase has failed (its next sleep drops what was left)."""
    from hybridrl.agent.engine import gather_settled

    engine = fused(model)
    params = SamplingParams(max_new_tokens=400)  # unseeded, no stop ids: runs long unless stopped

    async def failing(agent):
        await agent.generate(GenerationRequest(PROMPTS[1], 1), SamplingParams(max_new_tokens=2))
        raise ValueError("a tool broke")

    async def main():
        agent = AsyncEngine(engine, threaded=True)
        with pytest.raises(ValueError, match="a tool broke"):
            await gather_settled(agent, [agent.generate(GenerationRequest(PROMPTS[0], 0), params), failing(agent)])
        return agent._thread

    assert asyncio.run(main()) is None
    assert engine.has_work  # the long request was left, not finished


def test_a_driver_thread_that_cannot_set_its_device_fails_every_waiter(model, monkeypatch):
    """The driver thread sets the engine's CUDA device first (the current device is per thread); if that fails, every
    waiter hears it instead of waiting for a driver that never stepped."""
    from hybridrl.engines.native import async_engine

    engine = fused(model)
    monkeypatch.setattr(async_engine, "_device_of", lambda engine: 0)

    def no_device(device):
        raise RuntimeError(f"no CUDA device {device}")

    monkeypatch.setattr(torch.cuda, "set_device", no_device)

    async def main():
        agent = AsyncEngine(engine, threaded=True)
        requests = [
            agent.generate(GenerationRequest(PROMPTS[i], i), SamplingParams(max_new_tokens=4)) for i in range(3)
        ]
        got = await asyncio.wait_for(asyncio.gather(*requests, return_exceptions=True), 30)
        await agent.idle()
        return got

    got = asyncio.run(main())
    assert all(isinstance(e, RuntimeError) and "no CUDA device 0" in str(e) for e in got)


def test_the_driver_thread_runs_on_the_callers_device_when_the_engine_names_no_index(monkeypatch):
    """`torch.device("cuda")` means the current device of the thread that made the request; a new thread's current
    device is device 0 whatever the caller's, so the index is resolved before the thread starts."""
    from types import SimpleNamespace

    from hybridrl.engines.native.async_engine import _device_of

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert _device_of(SimpleNamespace(device=torch.device("cuda"))) == 3
    assert _device_of(SimpleNamespace(device=torch.device("cuda", 1))) == 1
    assert _device_of(SimpleNamespace(device=torch.device("cpu"))) is None
    assert _device_of(SimpleNamespace()) is None


def test_the_driver_thread_reports_a_failed_step_to_every_waiter(model, monkeypatch):
    engine = fused(model)
    params = SamplingParams(max_new_tokens=6, seed=3)

    def broken():
        raise RuntimeError("device lost")

    monkeypatch.setattr(engine, "step", broken)

    async def main():
        agent = AsyncEngine(engine, threaded=True)
        got = await asyncio.gather(
            *(agent.generate(GenerationRequest(PROMPTS[i], i), params) for i in range(3)), return_exceptions=True
        )
        await agent.idle()
        return got

    got = asyncio.run(main())
    assert all(isinstance(e, RuntimeError) and "device lost" in str(e) for e in got)


@pytest.mark.interpreted
@pytest.mark.parametrize("threaded", [False, True])
def test_async_engine_reports_engine_errors_to_every_waiter(model, threaded):
    engine = fused(model, max_model_len=10)
    params = SamplingParams(max_new_tokens=8, seed=0)

    async def main():
        agent = AsyncEngine(engine, threaded=threaded)
        return await asyncio.gather(
            agent.generate(GenerationRequest(PROMPTS[1], 0), params),
            agent.generate(GenerationRequest(PROMPTS[2], 1), params),
            return_exceptions=True,
        )

    ok, failed = asyncio.run(main())
    assert len(ok.token_ids) >= 1 and isinstance(failed, HybridRLError)  # 9 + 8 > 10: refused at submit


def test_turns_join_inside_the_running_step(model):
    """Agent turns past a cached prefix join the running batch inside its next step (a mixed step: their new prompt
    tokens run as extra rows, the step samples their first tokens): every turn equals the same conversation with every
    join prefilled apart (join_step_tokens=0), and a full forward's log-probs."""
    params = SamplingParams(max_new_tokens=6, seed=8, stop_token_ids=[4, 12])
    inside = fused(model, max_batch_size=4, kv_block_size=4)
    apart = fused(model, max_batch_size=4, kv_block_size=4, join_step_tokens=0)
    got, want = _conversations(inside, params), _conversations(apart, params)
    assert inside.scheduler.step_joins > 0 and apart.scheduler.step_joins == 0
    for turns, turns_apart in zip(got, want):
        for (context, out), (context_apart, out_apart) in zip(turns, turns_apart):
            assert context == context_apart
            same([out], [out_apart])
            ref = reference_logprobs(model, context, out.token_ids)
            assert (torch.tensor(out.logprobs) - ref).abs().max().item() < TOL
    assert not inside.has_work and inside.cache.allocator.held == 0


@pytest.mark.parametrize("cap", [pytest.param(512, marks=pytest.mark.interpreted), 2])
def test_a_turn_joins_a_running_batch_in_its_step(model, cap):
    """A turn continuing a cached 16-token prefix (4 new tokens: 3 computed inside the step, the last is the row's
    input) joins two running rows in their next step, and equals its solo generation, as do the rows it joined; with
    fewer tokens allowed per step (cap 2) it prefills apart instead."""
    params = SamplingParams(max_new_tokens=8, seed=7)  # no sequence stops early
    engine = fused(model, kv_block_size=4, join_wait_steps=0, join_step_tokens=cap)
    first = engine.generate_requests([GenerationRequest(PROMPTS[2], 0)], params)[0]
    assert len(first.token_ids) == 8  # 9 + 8 - 1 = 16 positions written: 4 full blocks cached
    reqs = [
        GenerationRequest(PROMPTS[0], 1),
        GenerationRequest(PROMPTS[1], 2),
        GenerationRequest(PROMPTS[2] + first.token_ids + [50, 51, 52], 0, 1),
    ]
    solo = [fused(model, kv_block_size=4).generate_requests([r], params)[0] for r in reqs]
    sch = engine.scheduler
    handles = {engine.submit(r, params): i for i, r in enumerate(reqs[:2])}
    got = {}
    for _ in range(3):
        got.update({handles[h]: c for h, c in engine.step()})
    assert len(sch.rows) == 2  # the batch it joins
    before = (sch.step_joins, sch.prefills, sch.prefilled_tokens)
    handles[engine.submit(reqs[2], params)] = 2
    while engine.has_work:
        got.update({handles[h]: c for h, c in engine.step()})
    same([got[i] for i in range(3)], solo)
    inside = cap >= 3
    assert (sch.step_joins - before[0], sch.prefills - before[1]) == ((1, 0) if inside else (0, 1))
    assert sch.prefilled_tokens - before[2] == 4


@pytest.mark.parametrize("cap", [512, 0])
def test_only_joins_that_prefill_apart_wait_for_company(model, cap):
    """join_wait_steps=8: a lone turn that can join inside a step joins the running batch at the next step; with
    join_step_tokens=0 it would prefill apart, so it waits 8 steps for company first. Tokens are the same."""
    params = SamplingParams(max_new_tokens=14, seed=7)
    engine = fused(model, kv_block_size=4, join_wait_steps=8, join_step_tokens=cap)
    first = engine.generate_requests([GenerationRequest(PROMPTS[2], 0)], params)[0]
    reqs = [
        GenerationRequest(PROMPTS[0], 1),
        GenerationRequest(PROMPTS[1], 2),
        GenerationRequest(PROMPTS[2] + first.token_ids + [50, 51, 52], 0, 1),
    ]
    handles = {engine.submit(r, params): i for i, r in enumerate(reqs[:2])}
    got, joined_at = {}, {}
    for step in range(60):
        if step == 2:
            handles[engine.submit(reqs[2], params)] = 2
        got.update({handles[h]: c for h, c in engine.step()})
        for s_ in engine.scheduler.rows:
            joined_at.setdefault(handles[s_.handle], step)
    assert not engine.has_work and joined_at[2] == (2 if cap else 10)
    solo = fused(model, kv_block_size=4)
    same([got[i] for i in range(3)], [solo.generate_requests([r], params)[0] for r in reqs])


@pytest.mark.parametrize("turns", [(0, 2), (0, 1, 2)])
def test_joins_past_a_step_budget(model, turns):
    """Turns arriving together at a running batch with join_step_tokens=3 (the turns of prompts 0, 1, 2 compute 3, 4 and
    3 tokens inside a step): of turns 0 and 2, the first joins inside the next step and the other, alone left over,
    waits one step and joins inside the one after; of turns 0, 1 and 2 two are left over (an eighth of 8 rows, at least
    2): all prefill apart at once. Each equals its solo generation."""
    params = SamplingParams(max_new_tokens=8, seed=7)  # no sequence stops early
    engine = fused(model, kv_block_size=4, join_wait_steps=0, join_step_tokens=3)
    firsts = engine.generate_requests([GenerationRequest(p, i) for i, p in enumerate(PROMPTS)], params)
    reqs = [GenerationRequest([30, 31, 32], 10), GenerationRequest([40, 41, 42, 43, 44, 45], 11)]  # the batch
    reqs += [GenerationRequest(PROMPTS[i] + firsts[i].token_ids + [50, 51, 52], i, 1) for i in turns]
    solo = [fused(model, kv_block_size=4).generate_requests([r], params)[0] for r in reqs]
    sch = engine.scheduler
    handles = {engine.submit(r, params): i for i, r in enumerate(reqs[:2])}
    got, joined_at = {}, {}
    for step in range(40):
        if step == 2:
            before = (sch.step_joins, sch.prefills)
            handles.update({engine.submit(r, params): 2 + i for i, r in enumerate(reqs[2:])})
        got.update({handles[h]: c for h, c in engine.step()})
        for s_ in sch.rows:
            joined_at.setdefault(handles[s_.handle], step)
    assert not engine.has_work
    same([got[i] for i in range(len(reqs))], solo)
    if len(turns) == 2:
        assert (sch.step_joins - before[0], sch.prefills - before[1]) == (2, 0)
        assert (joined_at[2], joined_at[3]) == (2, 3)
    else:
        assert (sch.step_joins - before[0], sch.prefills - before[1]) == (0, 1)
        assert joined_at[2] == joined_at[3] == joined_at[4] == 2


@pytest.mark.interpreted
def test_a_failed_step_leaves_no_prefix_entry_for_a_joining_turn(model):
    """A turn whose new tokens fill two more blocks joins inside a step whose launch fails: those blocks were never
    written, so they must not be found by their tokens afterwards (the next try computes them again, and equals its
    solo generation)."""
    params = SamplingParams(max_new_tokens=8, seed=7)
    engine = fused(model, kv_block_size=4, join_wait_steps=0)
    first = engine.generate_requests([GenerationRequest(PROMPTS[2], 0)], params)[0]
    assert len(first.token_ids) == 8  # 9 + 8 - 1 = 16 positions written: 4 full blocks cached
    turn = GenerationRequest(PROMPTS[2] + first.token_ids + [50, 51, 52, 53, 54, 55, 56], 0, 1)  # 24 tokens
    launch = engine.runner.launch

    def failing(*args, **kwargs):
        raise RuntimeError("device lost")

    engine.runner.launch = failing
    with pytest.raises(RuntimeError, match="device lost"):
        engine.generate_requests([turn], params)
    engine.runner.launch = launch
    before = engine.scheduler.prefilled_tokens
    got = engine.generate_requests([turn], params)
    assert engine.scheduler.prefilled_tokens - before == 24 - 16
    same(got, fused(model, kv_block_size=4).generate_requests([turn], params))


@pytest.mark.interpreted
def test_the_next_turn_prefills_only_what_is_new(model):
    """Turn 2 continues turn 1's context: the full blocks turn 1 wrote (prompt and generated tokens) come from the
    prefix table, only the rest is prefilled, and the log-probs still match a full forward."""
    engine = fused(model, kv_block_size=4)
    params = SamplingParams(max_new_tokens=8, seed=1)  # stop ids none but EOS
    first = engine.generate_requests([GenerationRequest(PROMPTS[2], 0)], params)[0]
    context = PROMPTS[2] + first.token_ids + [50, 51]
    before = engine.scheduler.prefilled_tokens
    second = engine.generate_requests([GenerationRequest(context, 0, 1)], params)[0]
    # K/V exist for 9 + n - 1 positions (the last sampled token is never fed); their full blocks are reused.
    reused = (9 + len(first.token_ids) - 1) // 4 * 4
    assert engine.scheduler.prefilled_tokens - before == len(context) - reused
    want = reference_logprobs(model, context, second.token_ids)
    assert (torch.tensor(second.logprobs) - want).abs().max().item() < TOL
    same(
        [second],
        fused(model, kv_block_size=4, prefix_cache=False).generate_requests([GenerationRequest(context, 0, 1)], params),
    )
    # New weights make every cached block stale: the whole context is prefilled again.
    Resharder(ReshardConfig(), engine, model.config).sync(model)
    before = engine.scheduler.prefilled_tokens
    engine.generate_requests([GenerationRequest(context, 0, 1)], params)
    assert engine.scheduler.prefilled_tokens - before == len(context)


def test_one_prefill_of_a_long_cached_prefix_and_a_long_new_part(model):
    """Two continuations prefilled together: one has a long cached prefix and few new tokens, the other a short
    prefix and many. The padding tokens of the first must not take positions past the RoPE tables (seen on the GPU:
    an out-of-bounds gather), and both equal their solo generation."""
    params = SamplingParams(max_new_tokens=2, seed=4)
    long_prompt, short_prompt = [10 + i % 80 for i in range(60)], [5, 6, 7, 8, 9]
    turn_2 = [
        GenerationRequest(long_prompt + [80], 0, 1),
        GenerationRequest(short_prompt + [20 + i % 70 for i in range(50)], 1, 1),
    ]
    solo = [fused(model, kv_block_size=16).generate_requests([r], params)[0] for r in turn_2]
    engine = fused(model, kv_block_size=16)
    engine.generate_requests([GenerationRequest(long_prompt, 0), GenerationRequest(short_prompt, 1)], params)
    before = engine.scheduler.prefilled_tokens
    got = engine.generate_requests(turn_2, params)
    assert engine.scheduler.prefilled_tokens - before == (61 - 48) + (55 - 0)  # the long prefix's 3 blocks reused
    assert engine.model.cos.shape[0] < 48 + 55  # the padded positions would have run past the tables
    same(got, solo)


def test_a_short_prompt_with_many_new_tokens_beside_a_long_prompt(model):
    """Admitted together, a long prompt with few new tokens and a short one with many: the short one's positions
    stay within the block tables while the long prompt's length plus its steps would not (the CPU attention width
    once ran past the tables), and each equals its solo generation."""
    reqs = [
        (GenerationRequest([10 + i % 80 for i in range(60)], 0), SamplingParams(max_new_tokens=2, seed=3)),
        (GenerationRequest(PROMPTS[0], 1), SamplingParams(max_new_tokens=40, seed=3)),
    ]
    solo = [fused(model, kv_block_size=16).generate_requests([r], p)[0] for r, p in reqs]
    engine = fused(model, kv_block_size=16)
    handles = {engine.submit(r, p): i for i, (r, p) in enumerate(reqs)}
    got = {}
    while engine.has_work:
        got.update({handles[h]: c for h, c in engine.step()})
    assert engine.runner.width * 16 < 60 + 40  # the cohort's longest prompt plus the short one's steps
    same([got[0], got[1]], solo)


def test_a_full_cache_evicts_prefixes_and_keeps_serving(model):
    engine = fused(model, kv_block_size=4, kv_blocks=1 + 12, max_batch_size=2)
    params = SamplingParams(max_new_tokens=6, seed=5)
    reqs = [GenerationRequest([30 + i] + PROMPTS[2], i) for i in range(6)]  # 10 tokens: 2 full blocks each
    got = engine.generate_requests(reqs, params)
    same(got, fused(model, prefix_cache=False).generate_requests(reqs, params))
    alloc = engine.cache.allocator
    assert alloc.held == 0 and 0 < alloc.cached <= 12 and alloc.free == 12


def test_each_request_stops_at_its_own_stop_ids(model):
    """Requests share their stop-id sets where their lists are equal (the engine builds one per distinct list); a list
    changed between requests is read anew."""
    engine = fused(model)
    r = GenerationRequest(PROMPTS[0], 0, 0)
    free = engine.generate_requests([r], SamplingParams(max_new_tokens=10, seed=11))[0]
    stops = [free.token_ids[2]]
    cut = engine.generate_requests([r], SamplingParams(max_new_tokens=10, seed=11, stop_token_ids=stops))[0]
    assert cut.token_ids == free.token_ids[: free.token_ids.index(stops[0]) + 1] and cut.finish_reason == "stop"
    stops[0] = next(t for t in range(2, 1000) if t not in free.token_ids)  # the same list, now naming another id
    again = engine.generate_requests([r], SamplingParams(max_new_tokens=10, seed=11, stop_token_ids=stops))[0]
    assert again.token_ids == free.token_ids and again.finish_reason == free.finish_reason
