"""Move the trainer's device tensors (parameter shards, optimizer state) to pinned host memory and back.

The tensors stay the same Python objects: their storage is copied to a pinned host buffer and then
resized to zero bytes, which returns the memory to the caching allocator; onload resizes the
storage back and copies the bytes in. FSDP2's views into the parameter storage stay valid, so no
module or optimizer needs rebuilding. Copies run on a side stream and the pinned buffers are
allocated once and reused, so each switch is one pass at host-link bandwidth. The buffers are carved from a few
large pinned blocks (`training/pinned_arena.py`): one pinned allocation per tensor would be rounded up to a power
of two, up to twice the host memory.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterable

import torch
from torch.distributed.tensor import DTensor

from hybridrl.training.pinned_arena import PinnedArena

log = logging.getLogger(__name__)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The tensor holding this rank's bytes (a DTensor's local shard, or the tensor itself)."""
    return t.to_local() if isinstance(t, DTensor) else t


def _bytes_view(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 tensor over the whole storage of `t`."""
    return torch.tensor([], dtype=torch.uint8, device=t.device).set_(t.untyped_storage())


class HostOffloader:
    """Offloads whatever tensors `collect()` yields. On a CPU device there is nothing to gain, so it
    is off unless `enabled=True` (tests use that to check the mechanism)."""

    def __init__(
        self, collect: Callable[[], Iterable[torch.Tensor]], device: torch.device, enabled: bool | None = None
    ) -> None:
        if device.type == "cuda" and device.index is None:  # tensors name their index: "cuda" would match none
            device = torch.device("cuda", torch.cuda.current_device())
        self.collect, self.device = collect, device
        self.enabled = device.type == "cuda" if enabled is None else enabled
        self._host: dict[int, torch.Tensor] = {}  # pinned buffers, kept across offloads
        self._arena = PinnedArena(pin=device.type == "cuda")
        self._offloaded: list[tuple[int, torch.Tensor]] = []
        self._pending = False  # an onload's copies may still be running
        self._freeing = False  # an offload's copies may still be running; the storage is not freed yet
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def _side_stream(self):
        if self._stream is None:
            return contextlib.nullcontext()
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        return torch.cuda.stream(self._stream)

    @property
    def offloaded(self) -> bool:
        return bool(self._offloaded)

    @property
    def in_flight(self) -> bool:
        """Whether an offload was started (its bytes are, or will be, on the host) and its device memory not freed."""
        return self._freeing

    def device_bytes(self) -> int:
        """Device bytes an offload would free now: those of the offload in flight, else of what is on the device."""
        if self._freeing:
            return sum(t.untyped_storage().nbytes() for _, t in self._offloaded)
        return (
            0 if self._offloaded or not self.enabled else sum(t.untyped_storage().nbytes() for _, t in self._unique())
        )

    def _unique(self) -> list[tuple[int, torch.Tensor]]:
        """(key, local tensor) per distinct storage. The key is the id of the collected tensor (a parameter
        or optimizer state, which persist), not of its local view (a new object on every `to_local()`),
        so each pinned buffer is found again at the next offload instead of being allocated anew."""
        seen, out = set(), []
        for t in self.collect():
            loc = local_tensor(t)
            ptr = loc.untyped_storage().data_ptr()
            if loc.device != self.device or ptr in seen or loc.untyped_storage().nbytes() == 0:
                continue
            seen.add(ptr)
            out.append((id(t), loc))
        return out

    @torch.no_grad()
    def offload(self, wait: bool = True) -> int:
        """Copy to host and free device memory; returns the bytes moved. With wait=False the copies run on
        the side stream while the caller goes on, and the device memory is freed by `finish()` (or by the
        next offload/onload), once the bytes are on the host."""
        if not self.enabled or self._offloaded:
            return 0
        tensors = self._unique()
        moved = 0
        pin = self.device.type == "cuda"
        missing = [
            (key, t.untyped_storage().nbytes())
            for key, t in tensors
            if key not in self._host or self._host[key].numel() != t.untyped_storage().nbytes()
        ]
        for (key, _), host in zip(missing, self._arena.empty([((n,), torch.uint8) for _, n in missing])):
            self._host[key] = host
        with self._side_stream():
            for key, t in tensors:
                host = self._host[key]
                host.copy_(_bytes_view(t), non_blocking=pin)
                moved += host.numel()
        self._offloaded = tensors
        self._freeing = True
        if wait:
            self.finish()
        return moved

    def finish(self) -> int:
        """Complete an offload started with wait=False: wait for its copies, then free the device storage.
        Returns the bytes that offload moved (0 when none was in flight)."""
        if not self._freeing:
            return 0
        if self._stream is not None:
            self._stream.synchronize()  # the bytes must be on the host before the storage goes
        moved = 0
        for _, t in self._offloaded:
            moved += t.untyped_storage().nbytes()
            t.untyped_storage().resize_(0)
        self._freeing = False
        return moved

    def complete(self) -> int:
        """Offload now, or complete the offload already in flight; returns the bytes moved."""
        return self.offload() or self.finish()

    @torch.no_grad()
    def onload(self, wait: bool = True) -> int:
        """Bring everything back to the device; returns the bytes moved. With wait=False the copies
        run on the side stream while the caller goes on; `wait()` joins them before first use."""
        if not self._offloaded:
            return 0
        if self._freeing:  # an offload not yet finished: the tensors are still whole on the device
            if self._stream is not None:
                self._stream.synchronize()
            self._offloaded, self._freeing = [], False
            return 0
        moved = 0
        with self._side_stream():
            for key, t in self._offloaded:
                host = self._host[key]
                t.untyped_storage().resize_(host.numel())
                _bytes_view(t).copy_(host, non_blocking=self._stream is not None)
                moved += host.numel()
        self._offloaded = []
        self._pending = True
        if wait:
            self.wait()
        return moved

    def wait(self) -> None:
        """Make the current stream wait for an onload started with wait=False."""
        if self._stream is not None and self._pending:
            torch.cuda.current_stream(self.device).wait_stream(self._stream)
        self._pending = False

    def stats(self, part: str) -> dict[str, float]:
        """GiB of the collected tensors held on the device and in this offloader's host buffers, as
        `<part>_device_gb` / `<part>_host_gb` (a memory report; no copy, no sync)."""
        on_device, seen = 0, set()
        for t in self.collect():
            storage = local_tensor(t).untyped_storage()
            if storage.data_ptr() not in seen and storage.device == self.device:
                seen.add(storage.data_ptr())
                on_device += storage.nbytes()
        held = sum(h.numel() for h in self._host.values()) if self._offloaded else 0
        return {f"{part}_device_gb": on_device / 2**30, f"{part}_host_gb": held / 2**30}


def timed_moves(what: str, device: torch.device, *moves: Callable[[], int]) -> dict[str, float]:
    """Run offload/onload calls (each returns the bytes it moved) and time them together: `<what>_s`, `_gb`, `_gbps`;
    no figures when nothing moved."""
    t0 = time.perf_counter()
    moved = sum(m() for m in moves)
    if moved and device.type == "cuda":
        torch.cuda.synchronize(device)
    dt = time.perf_counter() - t0
    if not moved:
        return {}
    # No empty_cache here: the engine allocates from the same caching allocator, and releasing
    # tens of GB of cached blocks to the driver took seconds (seen: 3.4 s at 1.5B).
    return {f"{what}_s": dt, f"{what}_gb": moved / 1e9, f"{what}_gbps": moved / 1e9 / max(dt, 1e-9)}
