"""Config of experiment tracking (`logger=console|wandb`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from hybridrl.errors import ConfigError


@dataclass
class LoggerConfig:
    """Where metrics go besides metrics.jsonl in the run dir (always written)."""

    name: str = "console"
    """console (log lines + progress bar) or wandb (also a Weights & Biases run)."""
    project: str = "hybridrl"
    """wandb project."""
    entity: Optional[str] = None
    """wandb entity (team or user); None = your default."""
    group: Optional[str] = None
    """wandb group; None = the sweep's name/time under -m, else no group."""
    run_name: Optional[str] = None
    """wandb run name; None = the job's overrides (under -m) or the run dir's name."""
    tags: list[str] = field(default_factory=list)
    """wandb tags."""
    mode: Optional[str] = None
    """wandb mode: online, offline or disabled; None = $WANDB_MODE or online."""
    progress_bar: bool = True
    """Show a progress bar over steps on the console."""
    plot: bool = True
    """Write reward and response-length curves to plots.png in the run dir at the end (and each checkpoint)."""
    samples_every: int = 10
    """Write rollout samples (prompt, response, reward, components) to samples.jsonl at step 1 and every N
    steps, and as a wandb Table with logger=wandb; 0 = never."""
    samples_per_step: int = 4
    """Samples written on such a step (from different prompts)."""

    def __post_init__(self) -> None:
        if self.name not in ("console", "wandb"):
            raise ConfigError(f"logger.name must be console or wandb, got {self.name!r}")
        for key in ("samples_every", "samples_per_step"):
            if getattr(self, key) < 0:
                raise ConfigError(f"logger.{key} must be >= 0, got {getattr(self, key)}")
        if self.mode not in (None, "online", "offline", "disabled"):
            raise ConfigError(f"logger.mode must be online, offline or disabled, got {self.mode!r}")
