"""Config of the critic (`critic.*`), the value model `algorithm=ppo` trains beside the actor.

Options left at None follow the actor's (`trainer.*`) value, so `python -m hybridrl algorithm=ppo` needs no
`critic.*` at all. Any option set away from its default without `algorithm=ppo` fails at composition
(`RunConfig`), naming the key: it would silently do nothing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Optional

from hybridrl.errors import ConfigError
from hybridrl.training.config import TrainerConfig
from hybridrl.training.micro_batches import Batching

OFFLOAD_PARTS = ("params", "optimizer")
"""What `critic.offload` may name (the parts `FSDPLearner` moves)."""


@dataclass
class CriticModelOptions:
    """Where the critic's weights come from (`critic.model.*`)."""

    path: Optional[str] = None
    """A Hugging Face folder (a causal LM or a saved value model); None = the policy's own folder. A causal LM gets
    a fresh scalar value head (AutoModelForTokenClassification, num_labels=1), as verl does."""


@dataclass(frozen=True)
class OptimFields:
    """The optimizer fields `FSDPLearner` reads, under the names it reads them by."""

    lr: float
    betas: list[float]
    eps: float
    weight_decay: float
    warmup_steps: int
    lr_schedule: str
    min_lr_ratio: float
    grad_clip: float
    fused_optimizer: bool
    max_nonfinite_steps: int
    max_param_norm_ratio: float
    optimizer_on_host: bool


@dataclass
class CriticConfig:
    """The value model: its weights, optimizer, batching, offload and warm-up."""

    model: CriticModelOptions = field(default_factory=CriticModelOptions)
    """Its initial weights."""
    lr: Optional[float] = None
    """Peak learning rate of its AdamW; None = trainer.lr (verl's critic default is 1e-5, 10x its actor's)."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    """AdamW betas."""
    eps: float = 1e-8
    """AdamW epsilon."""
    lr_warmup_steps: int = 0
    """Optimizer steps of linear lr warmup from 0 (not to be confused with warmup_steps below)."""
    lr_schedule: str = "constant"
    """After the lr warmup: constant or cosine (down to min_lr_ratio * lr at the last optimizer step)."""
    min_lr_ratio: float = 0.0
    """Floor of the cosine schedule as a fraction of lr."""
    grad_clip: float = 1.0
    """Clip its global gradient norm to this (<= 0 disables clipping; the norm is still logged)."""
    warmup_steps: int = 0
    """RL steps at the start that update only the critic (the actor's update is skipped and logged); verl's
    trainer.critic_warmup=N skips N-1 steps (its steps count from 1), this skips N."""
    cliprange_value: float = 0.5
    """Clip of the new values around the rollout's values in the value loss (verl's default 0.5); > 0."""
    mini_batch_size: Optional[int] = None
    """Sequences per optimizer step across all ranks; None = trainer.mini_batch_size (0 = the whole batch)."""
    micro_batch_size: Optional[int] = None
    """Sequences per forward/backward on one rank; None = trainer.micro_batch_size."""
    max_tokens_per_micro_batch: Optional[int] = None
    """Token budget of one forward/backward on one rank (values and update; 0 = micro_batch_size rows);
    None = trainer.max_tokens_per_micro_batch."""
    ppo_epochs: Optional[int] = None
    """Passes over the rollout batch per step; None = trainer.ppo_epochs."""
    offload: Optional[str] = None
    """What goes to host memory between its phases: none, params, optimizer or params,optimizer (GPU only);
    None = trainer.offload."""
    optimizer_on_host: Optional[bool] = None
    """Keep its AdamW moments in host memory and stream them through the device for each step (as
    trainer.optimizer_on_host); None = trainer.optimizer_on_host."""

    def __post_init__(self) -> None:
        if self.lr is not None and not (math.isfinite(self.lr) and self.lr > 0):
            raise ConfigError(f"critic.lr must be a finite number > 0, got {self.lr}")
        if not math.isfinite(self.eps) or self.eps < 0:
            raise ConfigError(f"critic.eps must be a finite number >= 0 (AdamW's epsilon, e.g. 1e-8), got {self.eps}")
        if not math.isfinite(self.weight_decay) or self.weight_decay < 0:
            raise ConfigError(f"critic.weight_decay must be a finite number >= 0, got {self.weight_decay}")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise ConfigError(f"critic.betas must be two numbers in [0, 1), got {list(self.betas)}")
        if self.lr_schedule not in ("constant", "cosine"):
            raise ConfigError(f"critic.lr_schedule must be constant or cosine, got {self.lr_schedule!r}")
        if self.cliprange_value <= 0:
            raise ConfigError(f"critic.cliprange_value must be > 0, got {self.cliprange_value}")
        for key in ("lr_warmup_steps", "warmup_steps"):
            if getattr(self, key) < 0:
                raise ConfigError(f"critic.{key} must be >= 0, got {getattr(self, key)}")
        for key, least in (
            ("mini_batch_size", 0),
            ("micro_batch_size", 1),
            ("ppo_epochs", 1),
            ("max_tokens_per_micro_batch", 0),
        ):
            value = getattr(self, key)
            if value is not None and value < least:
                raise ConfigError(f"critic.{key} must be >= {least}, got {value}")
        if self.optimizer_on_host is not None and not isinstance(self.optimizer_on_host, bool):
            raise ConfigError(
                f"critic.optimizer_on_host must be true, false or null (the actor's), got {self.optimizer_on_host!r}"
            )
        if self.offload is not None:
            parts = {p.strip() for p in self.offload.split(",")} - {"none"}
            if parts - set(OFFLOAD_PARTS) or (self.offload.strip() != "none" and not parts):
                raise ConfigError(
                    f"critic.offload must be none or a comma list of {OFFLOAD_PARTS}, got {self.offload!r}"
                )

    # -- what the critic uses, with the actor's values filled in ----------------------------
    def offload_parts(self, trainer: TrainerConfig) -> set[str]:
        """The parts moved to host memory (the actor's policy when `offload` is None)."""
        if self.offload is None:
            return trainer.offload_parts()
        return {p.strip() for p in self.offload.split(",")} - {"none"}

    def optim(self, trainer: TrainerConfig) -> OptimFields:
        """The optimizer fields under `FSDPLearner`'s names (the fused-kernel choice follows the actor's)."""
        return OptimFields(
            lr=trainer.lr if self.lr is None else self.lr,
            betas=list(self.betas),
            eps=self.eps,
            weight_decay=self.weight_decay,
            warmup_steps=self.lr_warmup_steps,
            lr_schedule=self.lr_schedule,
            min_lr_ratio=self.min_lr_ratio,
            grad_clip=self.grad_clip,
            fused_optimizer=trainer.fused_optimizer,
            max_nonfinite_steps=trainer.max_nonfinite_steps,
            max_param_norm_ratio=trainer.max_param_norm_ratio,
            optimizer_on_host=self.resolve_optimizer_on_host(trainer),
        )

    def resolve_optimizer_on_host(self, trainer: TrainerConfig) -> bool:
        """Whether its moments live on the host (the actor's choice when `optimizer_on_host` is None)."""
        return trainer.optimizer_on_host if self.optimizer_on_host is None else self.optimizer_on_host

    def batching(self, trainer: TrainerConfig) -> tuple[int, int, int]:
        """(mini_batch_size, micro_batch_size, ppo_epochs) in effect."""
        pick = lambda mine, theirs: theirs if mine is None else mine  # noqa: E731
        return (
            pick(self.mini_batch_size, trainer.mini_batch_size),
            pick(self.micro_batch_size, trainer.micro_batch_size),
            pick(self.ppo_epochs, trainer.ppo_epochs),
        )

    def micro_batching(self, trainer: TrainerConfig) -> Batching:
        """How its values and update passes split a rank's rows (packed when the actor's are)."""
        budget = trainer.max_tokens_per_micro_batch
        if self.max_tokens_per_micro_batch is not None:
            budget = self.max_tokens_per_micro_batch
        return Batching(self.batching(trainer)[1], budget, trainer.padding_free)

    def changed_keys(self) -> list[str]:
        """The `critic.*` keys set away from their defaults (what a run without a critic refuses)."""
        default = CriticConfig()
        out = [
            f"critic.model.{f.name}"
            for f in fields(CriticModelOptions)
            if getattr(self.model, f.name) != getattr(default.model, f.name)
        ]
        out += [
            f"critic.{f.name}"
            for f in fields(self)
            if f.name != "model" and getattr(self, f.name) != getattr(default, f.name)
        ]
        return out
