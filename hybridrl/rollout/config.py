"""Config of the `rollout` group (`conf/rollout/*.yaml`): how rollouts are produced (`rollout=single|agent`), and
partial rollouts (`rollout.partial.*`): over-sample, stop when enough groups are complete, carry the rest.

    python -m hybridrl rollout.partial.enabled=true rollout.partial.oversample=0.5 rollout.partial.max_staleness=1
    python -m hybridrl rollout=partial                                   # the same switch, as a config group entry

Checks run in `__post_init__` and name the key they reject.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from hybridrl.errors import ConfigError

ROLLOUT_NAMES = ("single", "agent")
PARTIAL_MODES = ("carry", "drop")


@dataclass
class PartialConfig:
    """Over-sampled, partial rollouts (APRIL, slime's `--partial-rollout`): see docs/partial-rollouts.md."""

    enabled: bool = False
    """Start more groups than a step trains on and stop generating once data.train_batch_size groups are complete."""
    oversample: float = 0.5
    """Groups started beyond data.train_batch_size, as a fraction of it (rounded up); 0 = none: only carried samples."""
    mode: str = "carry"
    """carry: unfinished samples keep their tokens and continue next step under the new weights; drop: they restart."""
    max_staleness: int = 1
    """Most weight versions a trained token may lag the policy being updated; a sample that would lag more restarts."""

    def __post_init__(self) -> None:
        if not (math.isfinite(self.oversample) and self.oversample >= 0):
            raise ConfigError(
                f"rollout.partial.oversample must be a fraction >= 0 of data.train_batch_size, got {self.oversample}"
            )
        if self.mode not in PARTIAL_MODES:
            raise ConfigError(f"rollout.partial.mode must be one of {', '.join(PARTIAL_MODES)}, got {self.mode!r}")
        if self.max_staleness < 0:
            raise ConfigError(
                f"rollout.partial.max_staleness must be >= 0 (0: nothing carried past its step), got "
                f"{self.max_staleness}"
            )

    def extra_groups(self, train_batch_size: int) -> int:
        """Groups started beyond the `train_batch_size` a step trains on."""
        return math.ceil(self.oversample * train_batch_size - 1e-9)


@dataclass
class RolloutConfig:
    """How rollouts are produced (`rollout=single` is one generation per sample, `rollout=agent` the agent loop)."""

    name: str = "single"
    """single (one generation per sample) or agent (multi-turn tool calling, configured by `agent.*`)."""
    partial: PartialConfig = field(default_factory=PartialConfig)
    """Over-sampled, partial rollouts: stop once enough groups are complete, carry the rest (hybridrl/rollout/)."""

    def __post_init__(self) -> None:
        if self.name not in ROLLOUT_NAMES:
            raise ConfigError(f"rollout.name must be one of {', '.join(ROLLOUT_NAMES)}, got {self.name!r}")
