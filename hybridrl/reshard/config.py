"""Configuration of the resharding manager (`reshard.*`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridrl.errors import ConfigError

BACKENDS = ("auto", "copy", "broadcast")


@dataclass
class ReshardConfig:
    """How updated trainer weights reach the rollout engine after every update."""

    bucket_mb: int = 256
    """Largest push to the engine in MiB; whole fused groups only, so one group may exceed it alone."""
    verify: bool = False
    """After each push, compare the engine's tensors with an independently computed reference shard (slow)."""
    backend: str = "auto"
    """'copy': engine.load_weights in-process; 'broadcast': a source rank broadcasts buckets to its engine TP
    group; 'auto': broadcast when a process group is given, else copy."""
    dtype: str | None = None
    """Cast weights to this torch dtype (e.g. 'bfloat16') before gathering, halving the bytes moved for fp32
    masters; None keeps the trainer's dtype."""

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ConfigError(f"reshard.backend={self.backend!r}: expected one of {', '.join(BACKENDS)}")
        if self.bucket_mb < 1:
            raise ConfigError(f"reshard.bucket_mb={self.bucket_mb}: must be at least 1")
        if self.dtype is not None and not isinstance(getattr(torch, self.dtype, None), torch.dtype):
            raise ConfigError(f"reshard.dtype={self.dtype!r}: not a torch dtype name (e.g. 'bfloat16')")

    def torch_dtype(self) -> torch.dtype | None:
        """`dtype` as a torch.dtype, or None."""
        return None if self.dtype is None else getattr(torch, self.dtype)
