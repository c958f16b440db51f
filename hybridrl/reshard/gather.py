"""Full (unsharded) parameters of an HF causal LM, one layer group at a time.

Works on FSDP2 models (`fully_shard` per decoder layer + root: parameters are DTensors sharded on dim 0) and on
plain modules. All ranks of the FSDP mesh must iterate together: each step runs collectives, in the same order.

Gathering: the DTensor shards of one layer group are packed into one flat buffer and gathered with a single
`all_gather_into_tensor` per group (what FSDP2 itself does in forward), instead of one `.full_tensor()`
collective per parameter: a decoder layer has 9-14 parameters, and per-call latency dominates small layers.
Unusual placements (not Shard(0) on one mesh dimension) fall back to `.full_tensor()` per parameter.

A model with LoRA adapters (PEFT) streams under the same HF names: each group's adapted weights come out merged,
W + (alpha/rank)·B·A, computed right after the group's gather (`reshard/lora_merge.py`).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Collection, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from hybridrl.errors import HybridRLError
from hybridrl.models.vision import checkpoint_name, is_vision_param
from hybridrl.reshard.lora_merge import LoraMerge, hf_name

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
# torch 2.13 renamed all_gather_into_tensor (deprecated there, a FutureWarning per call) to all_gather_single.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

NamedTensors = list[tuple[str, torch.Tensor]]


def layer_params(model: nn.Module, skip: Collection[str] = ()) -> list[tuple[str, list[tuple[str, torch.Tensor]]]]:
    """The model's parameters under their HF names, grouped: ``embed``, ``layers.0`` … ``layers.{L-1}``, ``final``,
    and for a vision-language model ``vision`` (its tower, first), each under its checkpoint name
    (`hybridrl.models.vision.checkpoint_name`: the decoder's as a causal LM's). Groups named in `skip` are left out.

    Tied parameters appear once (``named_parameters`` drops the duplicate, so a tied ``lm_head`` is absent). LoRA
    factors appear in their layer's group under names `LoraMerge.merge` recognizes.
    """
    vision: list[tuple[str, torch.Tensor]] = []
    embed: list[tuple[str, torch.Tensor]] = []
    layers: dict[int, list[tuple[str, torch.Tensor]]] = {}
    final: list[tuple[str, torch.Tensor]] = []
    for raw_name, p in model.named_parameters():
        name = checkpoint_name(hf_name(raw_name))
        if is_vision_param(name):
            vision.append((name, p))
        elif m := _LAYER.search(name):
            layers.setdefault(int(m.group(1)), []).append((name, p))
        elif "embed" in name:
            embed.append((name, p))
        else:
            final.append((name, p))
    groups = [("vision", vision)] if vision else []
    groups += [("embed", embed)] if embed else []
    groups += [(f"layers.{i}", layers[i]) for i in sorted(layers)]
    groups += [("final", final)] if final else []
    return [(name, params) for name, params in groups if name not in skip]


def iter_full_layers(
    model: nn.Module,
    *,
    dtype: torch.dtype | None = None,
    on_transient: Callable[[int], None] | None = None,
    merge_lora: bool = True,
    skip: Collection[str] = (),
) -> Iterator[tuple[str, NamedTensors]]:
    """Yield (group name, [(hf_name, full tensor)]) per layer group, in streaming order.

    A yielded tensor is fresh memory when it had to be gathered or cast, else a detached view of the trainer's
    parameter (plain modules, world size 1): callers must not write to it. The generator drops its references
    before gathering the next group, so one group's full tensors are alive at a time unless the caller keeps them.
    `dtype` casts shards before the collective (fewer bytes); `on_transient(nbytes)` reports the short-lived
    gather buffers at their peak, for memory accounting. With `merge_lora` (and a LoRA model) each group comes
    merged; without, its LoRA factors come as they are, for the caller to merge (`LoraMerge`). Groups named in
    `skip` are neither gathered nor yielded (a frozen vision tower the engine already holds).
    """
    merger = LoraMerge.from_model(model) if merge_lora else None
    for group, params in layer_params(model, skip):
        full = _gather_group(params, dtype, on_transient)
        if merger is not None:
            full = merger.merge(full)
        yield group, full
        del full


def _cast(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    return t if dtype is None or t.dtype == dtype else t.to(dtype)


def _shard_dim(p: DTensor) -> int | None:
    """The mesh dimension that shards tensor dim 0 when every other mesh dim replicates; -1 if all replicate."""
    sharded = [i for i, pl in enumerate(p.placements) if isinstance(pl, Shard) and pl.dim == 0]
    others_replicate = all(isinstance(pl, Replicate) for i, pl in enumerate(p.placements) if i not in sharded)
    if not others_replicate or len(sharded) > 1 or p.ndim == 0:
        return None
    return sharded[0] if sharded else -1


@torch.no_grad()  # to_local() then returns the local tensor as is, without an autograd node
def _gather_group(
    params: list[tuple[str, torch.Tensor]],
    dtype: torch.dtype | None,
    on_transient: Callable[[int], None] | None,
) -> NamedTensors:
    out: list[torch.Tensor | None] = [None] * len(params)
    batches: dict[tuple, list[int]] = {}  # (mesh, mesh dim, dtype) -> param indices gathered in one collective
    for i, (_, p) in enumerate(params):
        if not isinstance(p, DTensor):
            out[i] = _cast(p.detach(), dtype)
            continue
        dim = _shard_dim(p)
        if dim is None:
            out[i] = _cast(p, dtype).full_tensor()
        elif dim == -1 or p.device_mesh.size(dim) == 1:
            out[i] = _cast(p.to_local(), dtype)
        else:
            batches.setdefault((p.device_mesh, dim, dtype or p.dtype), []).append(i)
    for (mesh, dim, dt), idxs in batches.items():
        fulls = _all_gather_packed([params[i] for i in idxs], mesh, dim, dt, on_transient)
        for i, full in zip(idxs, fulls):
            out[i] = full
    return [(name, t) for (name, _), t in zip(params, out)]


def _comm_device(mesh) -> torch.device:
    if mesh.device_type == "cpu":
        return torch.device("cpu")
    return torch.device(mesh.device_type, torch.get_device_module(mesh.device_type).current_device())


def _all_gather_packed(
    params: list[tuple[str, torch.Tensor]],
    mesh,
    mesh_dim: int,
    dtype: torch.dtype,
    on_transient: Callable[[int], None] | None,
) -> list[torch.Tensor]:
    """Gather dim-0 shards (torch.chunk split, as DTensor and FSDP2 cut them) of several params in one collective."""
    ws, rank = mesh.size(mesh_dim), mesh.get_local_rank(mesh_dim)
    device = _comm_device(mesh)
    layout = []  # (offset, rows per rank, elements per row) of each param in a rank's packed buffer
    total = 0
    for name, p in params:
        chunk = -(-p.shape[0] // ws)
        row = math.prod(p.shape[1:])
        layout.append((total, chunk, row))
        total += chunk * row
    send = torch.zeros(total, dtype=dtype, device=device)  # zeros: pad rows of uneven shards are deterministic
    for (name, p), (off, chunk, row) in zip(params, layout):
        local = p.to_local()
        expected = max(0, min(chunk, p.shape[0] - rank * chunk))
        if local.shape[0] != expected:
            raise HybridRLError(
                f"reshard gather: {name} has {local.shape[0]} local rows on rank {rank}, expected "
                f"{expected} (torch.chunk split of {p.shape[0]} over {ws})"
            )
        send[off : off + local.numel()].copy_(local.reshape(-1))  # copy_ casts and moves (CPU-offloaded shards)
    gathered = torch.empty(ws * total, dtype=dtype, device=device)
    _all_gather(gathered, send, group=mesh.get_group(mesh_dim))
    del send
    by_rank = gathered.view(ws, total)
    fulls = []
    for (name, p), (off, chunk, row) in zip(params, layout):
        full = torch.empty((ws * chunk, *p.shape[1:]), dtype=dtype, device=device)
        full.view(ws, chunk * row).copy_(by_rank[:, off : off + chunk * row])
        fulls.append(full[: p.shape[0]])
    if on_transient is not None:
        on_transient(gathered.nbytes + sum(f.untyped_storage().nbytes() for f in fulls))
    return fulls
