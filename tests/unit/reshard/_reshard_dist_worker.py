"""One rank of a multi-process resharding test; started by test_reshard_multiproc.py through runpy.

Runs every case in order (all ranks together), checks each engine shard against `reference_shard` of an
unsharded copy of the weights, writes {case id: "ok" | error} to <out_dir>/rank<r>.json, and ends with
os._exit (processes that used DeviceMesh sometimes abort at interpreter exit).
"""

from __future__ import annotations


def run_case(case: dict, rank: int, world: int, meshes: dict, groups: dict) -> str:
    import torch
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard

    from hybridrl.reshard import ReshardConfig, Resharder, build_layout, reference_shard
    from hybridrl.reshard.testing import TensorDictEngine
    from tests.tiny_models import tiny_config, tiny_model

    kind, style, tp, backend = case["kind"], case["style"], case["tp"], case["backend"]
    config, model = tiny_config(kind), tiny_model(kind)
    full = {n: p.detach().clone() for n, p in model.named_parameters()}
    fsdp = case.get("fsdp", "shard0")
    if fsdp:
        kw = dict(mesh=meshes["hsdp" if fsdp == "hsdp" else "fsdp"])
        if fsdp == "shard1":  # placements the packed gather does not handle: .full_tensor() fallback
            kw["shard_placement_fn"] = lambda p: Shard(1) if p.ndim == 2 else Shard(0)
        for layer in model.model.layers:
            fully_shard(layer, **kw)
        fully_shard(model, **kw)
        placements = {tuple(map(str, p.placements)) for p in model.parameters()}
        want = {"shard1": ("S(1)",), "hsdp": ("R", "S(0)"), "shard0": ("S(0)",)}[fsdp]
        if want not in placements:
            return f"rank {rank}: FSDP placements {placements} lack {want}: the case tests nothing"
    tp_rank = rank % tp
    dtype = getattr(torch, case.get("dtype") or "float32")
    engine = TensorDictEngine.from_layout(build_layout(config, style, tp_rank, tp), dtype=dtype)
    group = groups[tp][rank // tp] if backend == "broadcast" else None
    rs = Resharder(
        ReshardConfig(backend=backend, verify=True, dtype=case.get("dtype")),
        engine,
        config,
        tp_rank=tp_rank,
        tp_size=tp,
        style=style,
        group=group,
    )
    rs.bucket_bytes = 8192  # several buckets per sync, so bucketing and broadcast plans are exercised
    without_model = case.get("receivers_without_model") and tp_rank != 0
    stats = rs.sync(None if without_model else model)
    for name, held in engine.tensors.items():
        ref = reference_shard(config, name, full, style=style, tp_rank=tp_rank, tp_size=tp).to(dtype)
        if not torch.equal(held, ref):
            return f"rank {rank}: {name} differs (max abs diff {(held.double() - ref.double()).abs().max().item():.3g})"
    if backend == "broadcast" and stats.bytes_broadcast == 0:
        return f"rank {rank}: nothing was broadcast"
    if stats.tensors != len(engine.tensors):
        return f"rank {rank}: delivered {stats.tensors} tensors, engine holds {len(engine.tensors)}"
    return "ok"


def setup(rank: int, world: int):
    """(meshes, TP groups) for every case: FSDP over all ranks, HSDP 2 × 2 on 4 ranks."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    meshes = {"fsdp": init_device_mesh("cpu", (world,))}
    if world == 4:  # HSDP: replicate over 2, shard over 2 → placements (Replicate(), Shard(0))
        meshes["hsdp"] = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    groups = {
        tp: [dist.new_group(list(range(s, s + tp))) for s in range(0, world, tp)] for tp in (1, 2, 4) if tp <= world
    }
    return meshes, groups


if __name__ == "__dist_worker__":  # run by tests/dist_harness.py
    import sys

    sys.path[:0] = ARGS["paths"]  # noqa: F821  (ARGS comes from runpy's init_globals)
    from tests.dist_harness import worker_main

    worker_main(**ARGS, setup=setup, check=lambda case, rank, world, ctx: run_case(case, rank, world, *ctx))  # noqa: F821
