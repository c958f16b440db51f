"""One rank of the multi-process SGLang choreography test; started by test_sglang_multiproc.py through runpy.

Every rank drives an SglangEngine (stand-in engine on the leader) through one scenario, checks its own completions
against the stand-in's pure generation function, and writes what the test inspects to <out_dir>/rank<r>.json:
its checks ("ok" or the error), timestamps, and on leaders the engine's call log and received weight payloads.
Ends with os._exit (see shared/reference/PLATFORM_FACTS.md: interpreter exit after distributed work can abort).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import sys
import time
import traceback


def scenario(rank: int, world: int, tp: int, model_dir: str, result: dict) -> None:
    import torch

    from hybridrl.engines.base import GenerationRequest, SamplingParams
    from hybridrl.engines.config import EngineConfig
    from hybridrl.engines.sglang.engine import SglangEngine
    from hybridrl.errors import HybridRLError
    from hybridrl.topology import Topology
    from tests.unit.engines.sglang._fake_sglang import (
        FAIL_NAME,
        FakeSglangEngine,
        expected_completions,
        expected_turns,
    )

    topology = Topology(world, tp, rank)
    tp_rank, leader = topology.engine_tp_rank, topology.engine_tp_ranks[0]
    eng = SglangEngine(
        model_dir,
        EngineConfig(name="sglang", tp_size=tp),
        topology=topology,
        seed=7,
        device="cpu",
        engine_factory=FakeSglangEngine,
    )
    fake = eng._engine
    checks = result["checks"] = {}
    stop_ids = [2]

    def check(name: str, got, want) -> None:
        checks[name] = "ok" if got == want else f"rank {rank}: {name}: got {got!r}, want {want!r}"

    # 1. Each rank its own prompts (and its own prompt_offset): it must get exactly its completions back.
    mine = [[rank + 1, 2, 3], [10 * rank + 4]]
    params = SamplingParams(n=2, temperature=0.7, max_new_tokens=4, seed=11, prompt_offset=2 * rank)
    check("distinct", eng.generate(mine, params), expected_completions(mine, params, stop_ids))
    # 2. The same call on every rank (what WorkerGroup does): generated once, everyone gets it.
    same = [[5, 6], [7]]
    params = SamplingParams(n=3, temperature=0.0, max_new_tokens=3, seed=11, prompt_offset=0)
    check("identical", eng.generate(same, params), expected_completions(same, params, stop_ids))
    # 2b. Agent turns at TP > 1: no request stream (the ranks' tools finish apart); one batch per turn through the
    # leader, each rank its own requests.
    turns = [GenerationRequest([rank + 1, 2, 3, 4], 2 * rank, 1), GenerationRequest([9, rank], 2 * rank + 1, 0)]
    params = SamplingParams(temperature=0.7, max_new_tokens=4, seed=11)
    check(
        "turns",
        (eng.async_engine(), eng.generate_requests(turns, params)),
        (None, expected_turns(turns, params, stop_ids)),
    )
    # 2c. ... unless the leader leads the rollout (the worker's generate phase): its turns then go one by one through
    # SGLang's request API, and the other ranks have nothing to do.
    if tp_rank == 0:
        with eng.lead():
            stream = eng.async_engine()

            async def together():
                return await asyncio.gather(*(stream.generate(r, params) for r in turns))

            got = stream.event_loop.run_until_complete(together())
        check("streamed", got, expected_turns(turns, params, stop_ids))
    else:
        check("streamed", eng.follow(), None)
    # 2d. A partial rollout: every rank of the group passes the same requests, the leader's engine runs them once and
    # aborts the unfinished ones; every rank gets the same completions: group 0 (1 token each) whole, group 1 cut.
    partial = [GenerationRequest([6, g], g, j, max_new_tokens=1 if g == 0 else 40) for g in range(2) for j in range(2)]
    got = eng.generate_partial(partial, params, [r.prompt_index for r in partial], need=1)
    whole = expected_turns(partial[:2], dataclasses.replace(params, max_new_tokens=1), stop_ids)
    check("partial", (got[:2], [c.finish_reason for c in got[2:]]), (whole, ["partial", "partial"]))
    # 3. Sleep: no rank may return before the leader's release finished (the stand-in takes 0.3 s).
    eng.sleep(2)
    result["sleep_returned"] = time.time()
    # 4. Wake weights: the leader may resume only after every rank arrived (non-leaders come 0.3 s late).
    if tp_rank:
        time.sleep(0.3)
    result["wake_entered"] = time.time()
    eng.wake_up(["weights"])
    # 5. Two pushes of rank-specific values, then the explicit end of the session, then the KV cache.
    eng.load_weights(
        [
            ("model.layers.0.self_attn.q_proj.weight", torch.full((4, 3), float(rank))),
            ("model.layers.0.self_attn.k_proj.weight", torch.full((2, 3), float(rank), dtype=torch.bfloat16)),
        ]
    )
    eng.load_weights([("model.norm.weight", torch.full((3,), rank + 0.5))])
    eng.finish_weight_update()
    eng.wake_up(["kv_cache"])
    check(
        "after_sync",
        eng.generate(mine, SamplingParams(n=1, max_new_tokens=2)),
        expected_completions(mine, SamplingParams(n=1, max_new_tokens=2), stop_ids),
    )
    # 6. A refused push raises on every rank with the engine's message; the next push works; wake closes it.
    eng.sleep(2)
    eng.wake_up(["weights"])
    try:
        eng.load_weights([(FAIL_NAME, torch.zeros(2))])
        checks["refused"] = f"rank {rank}: a refused push did not raise"
    except HybridRLError as exc:
        check("refused", f"refused {FAIL_NAME}" in str(exc), True)
    eng.load_weights([("model.norm.weight", torch.full((3,), rank + 0.25))])
    eng.wake_up(["weights", "kv_cache"])
    check("final", len(eng.generate(mine, SamplingParams(n=1, max_new_tokens=2))), 2)
    check("leader", fake is not None, rank == leader)
    eng.shutdown()
    if fake is not None:
        result["calls"] = [(name, _jsonable(args), t0, t1) for name, args, t0, t1 in fake.calls]
        result["pushes"] = fake.pushes


def _jsonable(args: dict) -> dict:
    out = {}
    for k, v in args.items():
        if k == "named_tensors":
            v = f"{len(v)} payloads"
        out[k] = v
    return out


def main(rank: int, world: int, tp: int, store_path: str, out_dir: str, model_dir: str, paths: list[str]) -> None:
    sys.path[:0] = paths
    result: dict = {}
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)  # several ranks share 2 cores
        dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world)
        scenario(rank, world, tp, model_dir, result)
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:
        result["__fatal__"] = f"rank {rank}: " + traceback.format_exc()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__dist_worker__":  # run by tests/dist_harness.py
    main(**ARGS)  # noqa: F821  (ARGS comes from runpy's init_globals)
