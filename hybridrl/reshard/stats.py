"""What one weight sync cost: bytes, seconds per phase, extra memory."""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass

import torch


@dataclass
class ReshardStats:
    """Figures of one `Resharder.sync` on this rank."""

    bytes_moved: int = 0
    """Bytes of shards delivered to this rank's engine."""
    bytes_broadcast: int = 0
    """Bytes sent (source) or received (others) by the broadcast backend."""
    tensors: int = 0
    """Engine tensors delivered."""
    pushes: int = 0
    """`engine.load_weights` calls (buckets)."""
    gather_s: float = 0.0
    """Seconds gathering full layers from the trainer's shards."""
    merge_s: float = 0.0
    """Seconds merging LoRA factors into the gathered weights (0 without adapters)."""
    lora_merged: int = 0
    """Weights delivered as W + (alpha/rank)·B·A (0 without adapters)."""
    fuse_split_s: float = 0.0
    """Seconds fusing sources and cutting this rank's TP shard."""
    broadcast_s: float = 0.0
    """Seconds in bucket broadcasts (packing included)."""
    deliver_s: float = 0.0
    """Seconds inside `engine.load_weights`."""
    verify_s: float = 0.0
    """Seconds comparing the engine's tensors with reference shards."""
    total_s: float = 0.0
    """Wall time of the whole sync."""
    peak_extra_bytes: int = 0
    """Most bytes of full/fused tensors and buckets this sync held at once (not counting the trainer's own)."""
    cuda_peak_delta_bytes: int | None = None
    """On CUDA: torch.cuda.max_memory_allocated during the sync minus the allocation before it."""

    def as_dict(self) -> dict:
        """Plain dict, for logs and JSON."""
        return asdict(self)

    def metrics(self, prefix: str = "reshard/") -> dict[str, float]:
        """Numeric fields as floats under `prefix` (e.g. ``reshard/gather_s``), for metrics.jsonl."""
        return {prefix + k: float(v) for k, v in asdict(self).items() if v is not None}


class PeakTracker:
    """Peak of the extra bytes a sync holds: its full/fused tensors and buckets, plus short-lived buffers.

    Tensors are held and released explicitly; bytes are counted per storage, once however many views share it,
    and storages of the trainer's own parameters are excluded (a view of them costs nothing extra).
    """

    def __init__(self, exclude: Iterable[torch.Tensor] = ()) -> None:
        self._exclude = {t.untyped_storage().data_ptr() for t in exclude}
        self._held: dict[int, list[int]] = {}  # storage pointer -> [holders, nbytes]
        self.live = 0
        self.peak = 0

    def hold(self, tensors: Iterable[torch.Tensor]) -> None:
        """Count `tensors` as alive until released."""
        for t in tensors:
            s = t.untyped_storage()
            ptr, nbytes = s.data_ptr(), s.nbytes()
            if ptr in self._exclude or not nbytes:
                continue
            if entry := self._held.get(ptr):
                entry[0] += 1
            else:
                self._held[ptr] = [1, nbytes]
                self.live += nbytes
        self.peak = max(self.peak, self.live)

    def release(self, tensors: Iterable[torch.Tensor]) -> None:
        """Undo one `hold` of each tensor."""
        for t in tensors:
            entry = self._held.get(t.untyped_storage().data_ptr())
            if entry is None:
                continue
            entry[0] -= 1
            if entry[0] == 0:
                del self._held[t.untyped_storage().data_ptr()]
                self.live -= entry[1]

    def observe(self, transient_bytes: int = 0) -> None:
        """Record a moment when `transient_bytes` more than the held tensors are alive."""
        self.peak = max(self.peak, self.live + transient_bytes)


class PhaseClock:
    """Adds elapsed seconds to a stats field; synchronizes CUDA first so async kernels are charged correctly."""

    def __init__(self, stats: ReshardStats, cuda: bool) -> None:
        self.stats, self.cuda = stats, cuda

    def now(self) -> float:
        """A timestamp after pending device work finished."""
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

    def add(self, field: str, since: float) -> float:
        """Charge the time since `since` to `field`; returns the new timestamp."""
        t = self.now()
        setattr(self.stats, field, getattr(self.stats, field) + t - since)
        return t
