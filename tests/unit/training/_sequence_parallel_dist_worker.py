"""One rank of the sequence-parallel test; started by test_sequence_parallel_multiproc.py through runpy.

Per case (all ranks together): the run's roles built by `build_components` with `trainer.sequence_parallel_size`
on a world of 2 or 4 (gloo), this rank's data-parallel shard of a ragged rollout, its log-probs (actor and
reference) or values, and one update's gradient (gathered to full tensors). Each rank saves what it computed to
<out_dir>/<case>.rank<r>.pt for the test to compare with sequence parallel 1; writes {case id: "ok" | error} to
<out_dir>/rank<r>.json and ends with os._exit.
"""

from __future__ import annotations


def run_case(case: dict, rank: int, world: int, paths: dict, out_dir: str) -> str:
    import os

    import torch

    from hybridrl.workers.build import build_components
    from tests.unit.training.test_sequence_parallel_multiproc import case_config, role_pass, rollout

    cfg = case_config(case, paths, world)
    topology = cfg.topology(rank)
    roles = build_components(cfg, topology, torch.device("cpu"), with_engine=False)
    if topology.sequence_parallel_size > 1 and roles.actor.sequence_parallel is None:
        return f"rank {rank}: the actor got no sequence-parallel group"
    shard = rollout().select(topology.dp_row_slices(8)[topology.dp_rank])
    out = role_pass(case, roles, shard)
    torch.save(out, os.path.join(out_dir, f"{case['id']}.rank{rank}.pt"))
    return "ok"


def setup(rank: int, world: int):
    return None


if __name__ == "__dist_worker__":  # run by tests/dist_harness.py
    import sys

    sys.path[:0] = ARGS["paths"]  # noqa: F821  (ARGS comes from runpy's init_globals)
    from tests.dist_harness import worker_main

    args = dict(ARGS)  # noqa: F821
    models, out_dir = args.pop("models"), args["out_dir"]
    worker_main(
        **args,
        setup=setup,
        check=lambda case, rank, world, _ctx: run_case(case, rank, world, models, out_dir),
    )
