"""One rank of a multi-process resharding test; started by test_reshard_multiproc.py through runpy.

Runs every case in order (all ranks together), checks each engine shard against `reference_shard` of an
unsharded copy of the weights, writes {case id: "ok" | error} to <out_dir>/rank<r>.json, and ends with
os._exit (processes that used DeviceMesh sometimes abort at interpreter exit).
"""

from __future__ import annotations

import json
import os
import sys
import traceback


def run_case(case: dict, rank: int, world: int, meshes: dict, groups: dict) -> str:
    import torch
    from tests.tiny_models import tiny_config, tiny_model
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard

    from hybridrl.reshard import ReshardConfig, Resharder, build_layout, reference_shard
    from hybridrl.reshard.testing import TensorDictEngine

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
    rs = Resharder(ReshardConfig(backend=backend, verify=True, dtype=case.get("dtype")), engine, config,
                   tp_rank=tp_rank, tp_size=tp, style=style, group=group)
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


def main(rank: int, world: int, store_path: str, out_dir: str, cases: list[dict], paths: list[str]) -> None:
    sys.path[:0] = paths
    results: dict[str, str] = {}
    try:
        import torch
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        torch.set_num_threads(1)  # 2-4 ranks share 2 cores
        dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world)
        meshes = {"fsdp": init_device_mesh("cpu", (world,))}
        if world == 4:  # HSDP: replicate over 2, shard over 2 → placements (Replicate(), Shard(0))
            meshes["hsdp"] = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        groups = {tp: [dist.new_group(list(range(s, s + tp))) for s in range(0, world, tp)]
                  for tp in (1, 2, 4) if tp <= world}
        for case in cases:
            try:
                results[case["id"]] = run_case(case, rank, world, meshes, groups)
            except Exception:
                results[case["id"]] = f"rank {rank}: " + traceback.format_exc()
        dist.barrier()
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(results, f)
        dist.destroy_process_group()
    except BaseException:
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump({**results, "__fatal__": traceback.format_exc()}, f)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__dist_worker__":  # run by tests/dist_harness.py
    main(**ARGS)  # noqa: F821  (ARGS comes from runpy's init_globals)
