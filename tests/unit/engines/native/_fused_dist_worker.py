"""One rank of the multi-process fused-engine tests; started by test_fused_multiproc.py through runpy.

Per case, all ranks together: an FSDP2 model over all ranks feeds an engine TP group of `tp` consecutive ranks
through `Resharder(verify=True)`; then the engine's prefill logits and generated log-probs are compared with an
unsharded transformers copy, and its tokens with the other ranks'. Writes {case id: "ok" | error} to
<out_dir>/rank<r>.json and ends with os._exit (processes that used DeviceMesh sometimes abort at exit).
"""

from __future__ import annotations

import copy

TOL = 1e-5


def check(case: dict, rank: int, world: int, mesh, groups: dict) -> str:
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from hybridrl.engines.base import SamplingParams
    from hybridrl.engines.config import NativeOptions
    from hybridrl.engines.native.engine import FusedEngine
    from hybridrl.reshard import ReshardConfig, Resharder
    from tests.tiny_models import PROMPTS, reference_last_logits, reference_logprobs, tiny_model

    kind, tp = case["kind"], case["tp"]
    model = tiny_model(kind, **(dict(attention_bias=True, mlp_bias=True) if case.get("biases") else {}))
    ref = copy.deepcopy(model)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    engine = FusedEngine(
        model.config,
        [0],
        1,
        device="cpu",
        dtype=torch.float32,
        options=NativeOptions(max_batch_size=8),
        tp_group=groups[tp],
        seed=0,
    )
    sync = Resharder(ReshardConfig(verify=True), engine, model.config, tp_rank=rank % tp, tp_size=tp)
    sync.sync(model)
    if case.get("lockstep"):
        return check_lockstep(engine, ref, groups[tp], rank, world)
    rounds = 2 if case.get("sleep") else 1
    for round_ in range(rounds):
        if round_:  # level-2 round trip: weights dropped, reallocated, refilled by the resharder
            engine.sleep(2)
            if any(p.numel() for _, p in engine.named_weights()):
                return f"rank {rank}: sleep(2) kept weights"
            engine.wake_up(["weights"])
            sync.sync(model)
            engine.wake_up(["kv_cache"])
        got = engine.last_logits(PROMPTS)
        diff = (got - reference_last_logits(ref, PROMPTS)).abs().max().item()
        if diff > TOL:
            return f"rank {rank}: prefill logits differ from the unsharded model by {diff:.3g}"
        outs = engine.generate(PROMPTS, SamplingParams(n=2, max_new_tokens=6, seed=3, stop_token_ids=[4]))
        for o in outs:
            want = reference_logprobs(ref, PROMPTS[o.prompt_index], o.token_ids)
            diff = (torch.tensor(o.logprobs) - want).abs().max().item()
            if diff > TOL:
                return f"rank {rank}: generated log-probs differ from the unsharded model by {diff:.3g}"
        mine = [o.token_ids for o in outs]
        every = [None] * world
        dist.all_gather_object(every, mine)
        if any(every[r] != mine for r in range(world)):  # same prompts everywhere: every engine agrees
            return f"rank {rank}: tokens differ across ranks: {every}"
    return "ok"


def check_lockstep(engine, ref, group, rank: int, world: int) -> str:
    """Agent turns at TP 2: the leader's trajectories join its running batch one by one (tools of a few engine steps
    each, one long), the other rank replays the leader's schedule (`lead`/`follow`). Every turn's log-probs equal the
    unsharded model's on its context, turns joined inside decode steps, and both ranks took the same steps; then a
    leader failing inside `lead` fails the other rank's `follow` with its error."""
    import asyncio

    import torch
    import torch.distributed as dist

    from hybridrl.engines.base import GenerationRequest, SamplingParams
    from tests.tiny_models import PROMPTS, reference_logprobs

    params = SamplingParams(max_new_tokens=5, seed=6, stop_token_ids=list(range(2, 12)))

    async def trajectories(stream):
        async def one(t: int):
            context, turns = list(PROMPTS[t % 3]), []
            for turn in range(3):
                out = await stream.generate(GenerationRequest(list(context), t % 3, 10 * turn + t // 3), params)
                turns.append((list(context), out))
                for _ in range(40 if (t, turn) == (5, 0) else (t * 5 + turn * 3) % 7):  # the tool
                    await asyncio.sleep(0)
                context += out.token_ids + [50 + turn, 60 + t]
            return turns

        return await asyncio.gather(*(one(t) for t in range(6)))

    if rank == 0:
        with engine.lead(group):
            results = asyncio.run(trajectories(engine.async_engine(64)))
        for turns in results:
            for context, out in turns:
                diff = (torch.tensor(out.logprobs) - reference_logprobs(ref, context, out.token_ids)).abs().max().item()
                if diff > TOL:
                    return f"rank {rank}: a turn's log-probs differ from the unsharded model by {diff:.3g}"
    else:
        engine.follow(group)
    sched = engine.scheduler
    mine = (sched.steps, sched.row_steps, sched.step_joins, sched.prefills, sched.prefilled_tokens)
    every = [None] * world
    dist.all_gather_object(every, mine)
    if len(set(every)) != 1:
        return f"rank {rank}: the ranks' schedules differ (steps, row steps, joins, prefills, prefilled): {every}"
    if sched.step_joins == 0 or engine.has_work:
        return f"rank {rank}: no turn joined inside a step ({mine}), or work was left ({engine.has_work})"
    # A leader that fails inside its phase fails the other rank's too, with its error, instead of leaving it waiting.
    from hybridrl.errors import HybridRLError

    try:
        if rank == 0:
            with engine.lead(group):
                engine.async_engine(64)
                raise RuntimeError("a tool took the worker down")
        else:
            engine.follow(group)
    except (RuntimeError, HybridRLError) as e:
        if "a tool took the worker down" not in str(e):
            return f"rank {rank}: the leader's failure came through as {e!r}"
    else:
        return f"rank {rank}: the leader's failure did not end the phase with an error"
    return "ok"


def tp_group(tp: int, rank: int, world: int):
    """This rank's group of `tp` consecutive ranks (None for 1); every rank makes every group, in the same order,
    as dist.new_group requires (the run's topology does this in the product)."""
    import torch.distributed as dist

    if tp == 1:
        return None
    mine = None
    for start in range(0, world, tp):
        group = dist.new_group(list(range(start, start + tp)))
        if start <= rank < start + tp:
            mine = group
    return mine


def setup(rank: int, world: int):
    """(mesh, TP groups) for every case."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    return mesh, {tp: tp_group(tp, rank, world) for tp in (1, 2, 4) if tp <= world}  # every rank, same order


if __name__ == "__dist_worker__":  # run by tests/dist_harness.py
    import sys

    sys.path[:0] = ARGS["paths"]  # noqa: F821  (ARGS comes from runpy's init_globals)
    from tests.dist_harness import worker_main

    worker_main(**ARGS, setup=setup, check=lambda case, rank, world, ctx: check(case, rank, world, *ctx))  # noqa: F821
