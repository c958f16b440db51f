"""One rank of the TP=2 test (test_vllm_tp.py): our gloo group first, then a VllmEngine with tp_size=2 in it.

python _tp_worker.py RANK WORLD PORT MODEL_DIR OUT_JSON
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist


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
    turn_batched = eng.async_engine() is None  # agent turns go one batch per turn: the ranks' tools finish apart
    eng.shutdown()
    result = {
        "group_alive_after_shutdown": dist.is_initialized(),
        "agent_turns_batched_per_turn": turn_batched,
        "runs": {k: [[c.prompt_index, c.token_ids, c.logprobs, c.finish_reason] for c in v] for k, v in runs.items()},
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
