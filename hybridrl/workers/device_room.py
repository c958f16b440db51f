"""Lazy offload: the trainer roles' state leaves the device only when the engine asks for room it does not find.

    room = DeviceRoom(device, headroom_bytes)
    room.defer("actor", actor.param_offload)      # wake: what trainer.offload names, not moved yet
    engine.set_memory_gate(room.make_room)        # the engine calls it before it allocates (weights, KV cache)
    ...                                           # logprob: the onload of what never left moves nothing

Only an engine that gates its allocations (`RolloutEngine.gates_memory`) calls it; for the others the worker offloads
everything at wake-up. `make_room(n)` offloads deferred parts, largest first, until the device has `n` bytes plus the
headroom free (`None`: all of them). When the device has room for the engine beside the trainer's state, nothing moves,
out or back: the step skips both copies. When it has not, the engine waits for exactly the parts it needs, as an eager
offload at wake-up would have made it wait. A copy already in flight (the reference's, started after its log-prob
pass) is completed instead. `trainer.offload_lazy=false` offloads everything at wake-up.

The worker holds the same way, between their passes and the update, the parts whose copy to host starts right after
their pass (the reference, the critic): before the update it asks for the bytes the memory plan says the update adds
(`HybridWorker.update`), so they stay through it where it has room and leave first where it has not.

Why not copy to host in the background and free on demand: the decode steps' small device-to-host token copies queue
behind the offload's copies on the copy engine; on the H200 a 7B step's generate phase took 0.9 s longer (the whole
45.7 GB transfer) with the offload running behind it.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from hybridrl.training.offload import HostOffloader


def device_free_bytes(device: torch.device) -> int | None:
    """Bytes an allocation on `device` can still get: the driver's free memory plus what the caching allocator holds
    unused. None off CUDA (no figure to go by)."""
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


class DeviceRoom:
    """Offloadable parts still on the device, and the rule that moves them out on demand."""

    def __init__(
        self, device: torch.device, headroom_bytes: int, free_bytes: Callable[[], int | None] | None = None
    ) -> None:
        self.device, self.headroom = device, headroom_bytes
        self.free_bytes = free_bytes or (lambda: device_free_bytes(device))
        self.pending: list[tuple[str, HostOffloader]] = []
        self.stats: dict[str, float] = {}
        """`offload/<role>/offload_{s,gb,gbps}` of the offloads freed since the last `take_stats`."""

    def defer(self, role: str, *offloaders: HostOffloader) -> None:
        """Hold a role's parts (each on the device, or its copy in flight) until their room is needed."""
        for offloader in offloaders:
            held = any(o is offloader for _, o in self.pending)  # deferred again in the same step: counted once
            if not held and offloader.enabled and (offloader.in_flight or not offloader.offloaded):
                self.pending.append((role, offloader))

    def make_room(self, nbytes: int | None) -> None:
        """Free deferred offloads, largest first, until `nbytes` plus the headroom are free (None: free them all).
        Off CUDA there is no free-memory figure, so a request for bytes moves nothing."""

        def enough() -> bool:
            if nbytes is None:
                return False
            free = self.free_bytes()
            return free is None or free >= nbytes + self.headroom

        if not self.pending or enough():
            return
        self.pending = [(r, o) for r, o in self.pending if o.in_flight or not o.offloaded]  # not onloaded since
        self.pending.sort(key=lambda p: -p[1].device_bytes())
        while self.pending and not enough():
            role, offloader = self.pending.pop(0)
            self._free(role, offloader)

    def make_room_for_phase(self, peak_bytes: float | None) -> None:
        """Free deferred parts where a phase of estimated peak `peak_bytes` would not fit beside them: it adds that
        peak less what is allocated now outside them. None (no estimate): free them all."""
        if peak_bytes is None:
            return self.make_room(None)
        allocated = torch.cuda.memory_allocated(self.device) if self.device.type == "cuda" else 0
        self.make_room(max(0, int(peak_bytes - allocated + self.kept_bytes())))

    def _free(self, role: str, offloader: HostOffloader) -> None:
        t0 = time.perf_counter()
        moved = offloader.finish() if offloader.in_flight else offloader.offload()
        if not moved:
            return
        prefix = f"offload/{role}/offload"
        seconds = self.stats.get(f"{prefix}_s", 0.0) + time.perf_counter() - t0
        gb = self.stats.get(f"{prefix}_gb", 0.0) + moved / 1e9
        self.stats.update({f"{prefix}_s": seconds, f"{prefix}_gb": gb, f"{prefix}_gbps": gb / max(seconds, 1e-9)})

    def kept_bytes(self) -> int:
        """Device bytes of deferred parts still on the device (in flight included): state the engine never needed
        moved, kept there by choice rather than by need."""
        return sum(o.device_bytes() for _, o in self.pending if o.in_flight or not o.offloaded)

    def take_stats(self) -> dict[str, float]:
        """The figures of the offloads freed since the last call (then forgotten)."""
        out, self.stats = self.stats, {}
        return out

    def clear(self) -> None:
        """Forget every deferred part (each stays as it is: on the device, or in flight until an onload or `finish`)."""
        self.pending.clear()
