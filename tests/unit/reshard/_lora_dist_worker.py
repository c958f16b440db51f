"""One rank of the multi-process LoRA resharding test; started by test_lora_multiproc.py through runpy.

Per case (all ranks together): a tiny model of the case's family with PEFT adapters, sharded with FSDP2 over the
world (gloo), one AdamW step on its adapters, then `Resharder.sync` into this rank's engine tensors (TP 1 or 2).
The expected engine shards come from PEFT's own `merge_and_unload` applied to an unsharded copy that is given the
trainer's parameters after the step, cut by `reference_shard`: nothing of the resharder's merge is reused.
Writes {case id: "ok" | error} to <out_dir>/rank<r>.json and ends with os._exit.
"""

from __future__ import annotations

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _peft(kind: str):
    from peft import LoraConfig, get_peft_model

    from tests.tiny_models import tiny_model

    model = tiny_model(kind)
    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS))


def run_case(case: dict, rank: int, world: int, mesh, groups: dict) -> str:
    import torch
    from torch.distributed.fsdp import fully_shard

    from hybridrl.reshard import ReshardConfig, Resharder, build_layout, reference_shard
    from hybridrl.reshard.testing import TensorDictEngine

    kind, style, tp, backend = case["kind"], case["style"], case["tp"], case["backend"]
    torch.manual_seed(0)  # the same adapters (A) on every rank, as the trainer's seeded wrap gives
    peft = _peft(kind)
    inner = peft.get_base_model()
    for layer in inner.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(inner, mesh=mesh)
    trainable = [p for p in inner.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=0.05)
    ids = torch.randint(0, inner.config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(rank))
    inner(ids).logits.square().mean().backward()  # a different batch per rank: FSDP averages the gradients
    opt.step()
    full = {n: p.full_tensor().detach().clone() for n, p in inner.named_parameters()}
    if not any(n.endswith("lora_B.default.weight") and full[n].abs().max() > 0 for n in full):
        return f"rank {rank}: the step left every B at zero: the case tests nothing"

    reference = _peft(kind)  # unsharded, then PEFT's own merge of the trainer's parameters
    reference.get_base_model().load_state_dict(full, strict=False)
    expected = reference.merge_and_unload().state_dict()

    tp_rank = rank % tp
    dtype = getattr(torch, case.get("dtype") or "float32")
    engine = TensorDictEngine.from_layout(build_layout(inner.config, style, tp_rank, tp), dtype=dtype)
    group = groups[tp][rank // tp] if backend == "broadcast" else None
    rs = Resharder(
        ReshardConfig(backend=backend, dtype=case.get("dtype")),
        engine,
        inner.config,
        tp_rank=tp_rank,
        tp_size=tp,
        style=style,
        group=group,
    )
    rs.bucket_bytes = 8192  # several buckets per sync
    stats = rs.sync(inner)
    tol = 1e-6 if dtype == torch.float32 else 2e-2
    for name, held in engine.tensors.items():
        want = reference_shard(inner.config, name, expected, style=style, tp_rank=tp_rank, tp_size=tp).to(dtype)
        diff = (held.double() - want.double()).abs().max().item()
        if diff > tol:
            return f"rank {rank}: {name} differs from PEFT's merge by {diff:.3g}"
    if stats.lora_merged != 2 * len(TARGETS):  # every rank gathers (FSDP), so every rank merges
        return f"rank {rank}: merged {stats.lora_merged} weights, expected {2 * len(TARGETS)}"
    return "ok"


def setup(rank: int, world: int):
    """(mesh, TP groups) for every case."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    return mesh, {
        tp: [dist.new_group(list(range(s, s + tp))) for s in range(0, world, tp)] for tp in (1, 2) if tp <= world
    }


if __name__ == "__dist_worker__":  # run by tests/dist_harness.py
    import sys

    sys.path[:0] = ARGS["paths"]  # noqa: F821  (ARGS comes from runpy's init_globals)
    from tests.dist_harness import worker_main

    worker_main(**ARGS, setup=setup, check=lambda case, rank, world, ctx: run_case(case, rank, world, *ctx))  # noqa: F821
