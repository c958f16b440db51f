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
        self._copying = 0  # bytes of an offload whose copies to the host may still be running
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def _side_stream(self):
        if self._stream is None:
            return contextlib.nullcontext()
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        return torch.cuda.stream(self._stream)

    @property
    def offloaded(self) -> bool:
        return bool(self._offloaded)

    def device_bytes(self) -> int:
        """Device bytes an offload would free now: those of what is on the device."""
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
        """Copy to host and free the device memory; returns the bytes moved. The copies run on the side stream and
        the memory goes back to the caching allocator at once: it hands those blocks out again only once the copies
        are done (`record_stream`), so what the caller allocates next (an update behind the reference's offload)
        can have them while the bytes travel. wait=True returns once the bytes are on the host; with wait=False
        `finish()` joins the copies (an onload needs not: its copies queue behind them on the same stream)."""
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
                host, view = self._host[key], _bytes_view(t)
                host.copy_(view, non_blocking=pin)
                if self._stream is not None:
                    view.record_stream(self._stream)
                moved += host.numel()
        for _, t in tensors:
            t.untyped_storage().resize_(0)
        self._offloaded = tensors
        self._copying = moved
        if wait:
            self.finish()
        return moved

    def finish(self) -> int:
        """Wait for the copies of an offload started with wait=False to reach the host; returns the bytes it moved
        (0 when none is in flight)."""
        moved, self._copying = self._copying, 0
        if moved and self._stream is not None:
            self._stream.synchronize()
        return moved

    def complete(self) -> int:
        """Offload now, or join the offload already in flight; returns the bytes moved."""
        return self.offload() or self.finish()

    @torch.no_grad()
    def onload(self, wait: bool = True) -> int:
        """Bring everything back to the device; returns the bytes moved. The memory is allocated on the caller's
        stream (its blocks are the caller's to reuse after the next offload), the copies run on the side stream,
        behind an offload's copies still in flight; with wait=False the caller goes on and `wait()` joins them
        before first use."""
        if not self._offloaded:
            return 0
        for key, t in self._offloaded:
            t.untyped_storage().resize_(self._host[key].numel())
        moved = 0
        with self._side_stream():
            for key, t in self._offloaded:
                host = self._host[key]
                _bytes_view(t).copy_(host, non_blocking=self._stream is not None)
                moved += host.numel()
        self._offloaded, self._copying = [], 0
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
