"""The worker's entry to weight sync: trainer (FSDP) → engine, one layer at a time.

Foundation path: gather each layer's full parameters from FSDP, push them to the engine by
HF name as one group (so fused q/k/v and gate/up always travel together), optionally verify.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator

import torch

from hybridrl.engines.base import RolloutEngine
from hybridrl.errors import HybridRLError

_LAYER = re.compile(r"\.layers\.(\d+)\.")


def _layer_key(name: str) -> str:
    m = _LAYER.search(name)
    return f"layer{m.group(1)}" if m else "other"


@torch.no_grad()
def iter_layer_groups(model: torch.nn.Module) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Full (gathered) parameters grouped by decoder layer, in module order; non-layer params last."""
    groups: dict[str, list[tuple[str, torch.Tensor]]] = {}
    order: list[str] = []
    for name, p in model.named_parameters():
        key = _layer_key(name)
        if key not in groups:
            groups[key] = []
            order.append(key)
        groups[key].append((name, p))
    for key in order:
        # Gather only this group, so at most one layer of full tensors is alive at a time.
        yield [(n, p.full_tensor() if hasattr(p, "full_tensor") else p.detach()) for n, p in groups[key]]


@torch.no_grad()
def sync_weights(model: torch.nn.Module, engine: RolloutEngine, verify: bool = False) -> dict[str, float]:
    """Push every trainer parameter into the engine; with `verify`, compare afterwards."""
    t0 = time.perf_counter()
    moved = 0
    for group in iter_layer_groups(model):
        engine.load_weights(group)
        moved += sum(t.numel() * t.element_size() for _, t in group)
    stats = {"reshard/bytes": float(moved), "reshard/deliver_s": time.perf_counter() - t0}
    if verify:
        held = dict(engine.named_weights())
        for group in iter_layer_groups(model):
            for name, full in group:
                if name not in held:
                    raise HybridRLError(f"reshard.verify: engine has no tensor {name!r}")
                got = held[name].to(full.device, full.dtype)
                if not torch.equal(got, full):
                    diff = (got.float() - full.float()).abs().max().item()
                    raise HybridRLError(f"reshard.verify: {name} differs from the trainer (max |diff| {diff:.3g})")
    return stats
