"""Learning-rate schedule: linear warmup, then constant or cosine decay."""

from __future__ import annotations

import math

import torch


def warmup_cosine_lambda(warmup: int, total: int, kind: str, min_ratio: float):
    """LambdaLR multiplier for optimizer step `s` (0-based)."""

    def f(s: int) -> float:
        if warmup > 0 and s < warmup:
            return (s + 1) / warmup
        if kind == "constant" or total <= warmup:
            return 1.0
        progress = min(1.0, (s - warmup) / max(1, total - warmup))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return f


def build_scheduler(optimizer: torch.optim.Optimizer, warmup: int, total: int, kind: str, min_ratio: float):
    """A LambdaLR over `total` optimizer steps."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine_lambda(warmup, total, kind, min_ratio))
