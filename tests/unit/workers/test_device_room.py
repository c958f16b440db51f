"""Lazy offload (workers/device_room.py): which deferred offloads are freed for an engine allocation, and that the
fused engine asks before each large allocation with the bytes it is about to take."""

from __future__ import annotations

import pytest
import torch

from hybridrl.engines.base import SamplingParams
from hybridrl.engines.config import NativeOptions
from hybridrl.engines.native.engine import FusedEngine
from hybridrl.engines.native.kv_cache import PagedKVCache
from hybridrl.reshard import ReshardConfig, Resharder
from hybridrl.training.offload import HostOffloader
from hybridrl.workers.device_room import DeviceRoom
from tests.tiny_models import PROMPTS, tiny_model

CPU = torch.device("cpu")


def offloader(nbytes: int, in_flight: bool = False) -> tuple[HostOffloader, torch.Tensor]:
    t = torch.zeros(nbytes, dtype=torch.uint8)
    off = HostOffloader(lambda: [t], CPU, enabled=True)
    if in_flight:
        off.offload(wait=False)
    return off, t


def test_moves_largest_first_until_the_allocation_fits():
    free = {"bytes": 100}
    room = DeviceRoom(CPU, headroom_bytes=10, free_bytes=lambda: free["bytes"])
    (small, ts), (big, tb), (mid, tm) = offloader(30), offloader(300), offloader(60, in_flight=True)
    for name, off in (("small", small), ("big", big), ("mid", mid)):
        room.defer(name, off)

    room.defer("mid", mid)  # held already (a part deferred again in the same step): counted once
    room.make_room(80)  # 100 free >= 80 + 10: nothing moves
    assert not small.offloaded and not big.offloaded and mid.in_flight
    assert room.kept_bytes() == 30 + 300 + 60  # all of it still on the device, by choice
    assert tb.untyped_storage().nbytes() == 300

    def offload_big():  # moving the big one out gives its bytes back to the device
        free["bytes"] += 300
        return HostOffloader.offload(big)

    big.offload = offload_big
    room.make_room(200)  # 100 < 210: the largest goes first, then 400 >= 210 is enough
    assert tb.untyped_storage().nbytes() == 0 and big.offloaded and not big.in_flight
    assert not small.offloaded and mid.in_flight
    assert room.kept_bytes() == 30 + 60  # the big one left
    stats = room.take_stats()
    assert stats["offload/big/offload_gb"] == pytest.approx(300 / 1e9)
    assert room.take_stats() == {}

    assert mid.onload() == 0  # an onload in between cancels the copy in flight: it is on the device, deferred again
    room.make_room(None)  # None moves whatever is left: mid (60) then small (30)
    assert ts.untyped_storage().nbytes() == 0 and tm.untyped_storage().nbytes() == 0
    assert big.onload() == 300 and torch.equal(tb, torch.zeros(300, dtype=torch.uint8))
    assert set(room.take_stats()) == {f"offload/{n}/offload_{k}" for n in ("mid", "small") for k in ("s", "gb", "gbps")}


def test_no_free_memory_figure_moves_nothing_for_bytes():
    room = DeviceRoom(CPU, headroom_bytes=0)  # off CUDA: device_free_bytes is None
    off, t = offloader(16)
    room.defer("actor", off)
    room.make_room(1)
    assert not off.offloaded and t.untyped_storage().nbytes() == 16
    room.defer("disabled", HostOffloader(lambda: [t], CPU, enabled=False))  # never moves: nothing to hold
    assert len(room.pending) == 1


def test_a_part_the_engine_offloaded_inside_inference_mode_moves_again_outside_it():
    # The engine's gate runs inside its generate (inference mode); the reference's next offload, behind the update,
    # runs outside it, into the same host buffers, which must not be inference tensors.
    t = torch.arange(64, dtype=torch.float32)
    off = HostOffloader(lambda: [t], CPU, enabled=True)
    room = DeviceRoom(CPU, headroom_bytes=0)
    room.defer("ref", off)
    with torch.inference_mode():
        room.make_room(None)
    assert off.offloaded and t.untyped_storage().nbytes() == 0
    off.onload()
    t.mul_(2)  # the buffers must take the new values
    off.offload(wait=False)
    assert off.finish() == 64 * 4 and off.onload() == 64 * 4
    assert torch.equal(t, torch.arange(64, dtype=torch.float32) * 2)


def test_fused_engine_asks_before_its_allocations():
    model = tiny_model("qwen2")
    engine = FusedEngine(
        model.config, [0], 1, device=CPU, dtype=torch.float32, options=NativeOptions(max_batch_size=4), seed=0
    )
    Resharder(ReshardConfig(), engine, model.config).sync(model)
    asked: list[int | None] = []
    assert engine.gates_memory
    engine.set_memory_gate(asked.append)
    params = SamplingParams(n=2, max_new_tokens=5, seed=3)
    engine.generate(PROMPTS, params)
    m = engine.model
    per_block = PagedKVCache.bytes_per_block(m.shape.num_layers, engine.block_size, m.kv_heads, m.head_dim, m.dtype)
    # The KV cache, by demand, before it exists, with room for a prefill's activations beside it (hand count: the
    # states 4 × 32 wide (residual, normed, q/k/v, attention out) and the MLP's 3 × 48 (gate, up, SiLU·up) per token,
    # float32, 16384 tokens: 16384 · (128 + 144) · 4 bytes).
    workspace = 16384 * (128 + 144) * 4
    assert asked == [engine.cache.num_blocks * per_block + workspace]
    engine.sleep(2)
    asked.clear()
    engine.wake_up(["weights", "kv_cache"])
    weights = sum(p.numel() * p.element_size() for p in engine._unique.values())  # each tensor once (tied too)
    assert weights > 0 and asked == [weights, engine.cache.num_blocks * per_block + workspace]
