"""One rank of the two-rank host-optimizer test; started by test_host_optimizer_multiproc.py through runpy.

Per case: a small FSDP2 model sharded over the two ranks (one layer's rows split unevenly), trained by
`FSDPLearner` for three steps on this rank's own data with the ordinary AdamW or with the moments on the host
(chunks of 7 elements, so runs cross parameter and shard boundaries); the gathered parameters go to
<out_dir>/<case>.rank<r>.pt. Writes {case id: "ok" | error} to <out_dir>/rank<r>.json and ends with os._exit.
"""

from __future__ import annotations


def run_case(case: dict, rank: int, world: int, out_dir: str) -> str:
    import os

    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from hybridrl.training.config import TrainerConfig
    from hybridrl.training.host_optimizer import HostAdamW
    from hybridrl.training.learner import FSDPLearner

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.Tanh(), torch.nn.Linear(10, 3))
    mesh = init_device_mesh("cpu", (world,))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = TrainerConfig(lr=1e-2, weight_decay=0.1, grad_clip=0.5, optimizer_on_host=case["on_host"])
    learner = FSDPLearner(model, optim, set(), torch.device("cpu"), total_optimizer_steps=3)
    if case["on_host"]:
        assert isinstance(learner.optimizer, HostAdamW)
        learner.optimizer.chunk_elements = 7
    data = torch.Generator().manual_seed(100 + rank)
    for _ in range(3):
        x, y = torch.randn(4, 6, generator=data), torch.randn(4, 3, generator=data)
        torch.nn.functional.mse_loss(model(x), y).backward()
        learner.optimizer_step()
    full = {n: p.full_tensor().clone() for n, p in model.named_parameters()}
    torch.save(full, os.path.join(out_dir, f"{case['id']}.rank{rank}.pt"))
    return "ok"


def setup(rank: int, world: int):
    return None


if __name__ == "__dist_worker__":  # run by tests/dist_harness.py
    import sys

    sys.path[:0] = ARGS["paths"]  # noqa: F821  (ARGS comes from runpy's init_globals)
    from tests.dist_harness import worker_main

    args = dict(ARGS)  # noqa: F821
    out_dir = args["out_dir"]
    worker_main(**args, setup=setup, check=lambda case, rank, world, _ctx: run_case(case, rank, world, out_dir))
