"""One rank of the TP=2 test (test_vllm_tp.py): our gloo group first, then a VllmEngine with tp_size=2 in it.

python _tp_worker.py RANK WORLD PORT MODEL_DIR OUT_JSON
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist


def lead_or_follow(eng, rank: int) -> list:
    """Agent turns at TP 2 as the worker's generate phase runs them: rank 0 leads (its requests join vLLM's running
    batch one by one, a few engine steps apart), rank 1 replays the leader's requests and steps; the leader's
    completions, as (prompt index, tokens, log-probs, finish), ordered by request."""
    import asyncio

    from hybridrl.engines.base import GenerationRequest, SamplingParams

    if rank:
        eng.follow(dist.group.WORLD)
        return []
    prompts = json.loads(os.environ["TP_TEST_PROMPTS"])
    requests = [GenerationRequest(prompts[i % 2][: 3 + i], i % 2, i) for i in range(4)]
    params = SamplingParams(temperature=1.0, max_new_tokens=6, seed=3)

    async def staggered(stream):
        async def one(i: int):
            for _ in range(2 * i):  # 2 i engine steps later
                await asyncio.sleep(0)
            return await stream.generate(requests[i], params)

        return await asyncio.gather(*(one(i) for i in range(len(requests))))

    with eng.lead(dist.group.WORLD):
        outs = asyncio.run(staggered(eng.async_engine()))
    return [[r.prompt_ids, c.token_ids, c.logprobs, c.finish_reason] for r, c in zip(requests, outs)]


def stopped_early(eng, prompts: list) -> list:
    """A partial rollout at TP 2: two samples of each prompt (group = prompt), prompt 0's capped at 3 tokens, stopped
    once one group is complete; every rank steps its own engine and must stop after the same step."""
    from hybridrl.engines.base import GenerationRequest, SamplingParams

    requests = [
        GenerationRequest(p, g, j, max_new_tokens=3 if g == 0 else None)
        for g, p in enumerate(prompts)
        for j in range(2)
    ]
    params = SamplingParams(temperature=1.0, max_new_tokens=24, seed=3)
    return eng.generate_partial(requests, params, [r.prompt_index for r in requests], need=1)


def main() -> None:
    rank, world, port = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    model, out_path = sys.argv[4], sys.argv[5]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    from safetensors.torch import load_file

    from hybridrl.engines.base import SamplingParams
    from hybridrl.engines.config import EngineConfig
    from hybridrl.engines.vllm.engine import VllmEngine
    from hybridrl.topology import Topology
    from tests.unit.engines.vllm.vllm_helpers import perturbed

    eng = VllmEngine(
        model,
        EngineConfig(name="vllm", tp_size=world),
        topology=Topology(world, world, rank),
        seed=0,
        cache_root=os.path.join(os.path.dirname(out_path), f"vllm-cache-{rank}"),
    )
    prompts = json.loads(os.environ["TP_TEST_PROMPTS"])
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=10, seed=3)
    sd = load_file(os.path.join(model, "model.safetensors"))
    runs = {"original": eng.generate(prompts, params)}
    eng.load_weights(perturbed(sd).items())
    runs["perturbed"] = eng.generate(prompts, params)
    eng.load_weights(sd.items())
    runs["restored"] = eng.generate(prompts, params)
    runs["partial"] = stopped_early(eng, prompts)
    turn_batched = eng.async_engine() is None  # outside `lead`: one batch per turn (the ranks' tools finish apart)
    runs["streamed"] = lead_or_follow(eng, rank)
    eng.shutdown()
    result = {
        "group_alive_after_shutdown": dist.is_initialized(),
        "agent_turns_batched_per_turn": turn_batched,
        "runs": {
            k: v if k == "streamed" else [[c.prompt_index, c.token_ids, c.logprobs, c.finish_reason] for c in v]
            for k, v in runs.items()
        },
    }
    with open(out_path, "w") as f:
        json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # FSDP/gloo processes can abort at interpreter exit (PLATFORM_FACTS); skip it


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
