"""`algorithm.*`: the knobs of the RL objective (advantages, policy loss, KL, rollout correction)."""

from __future__ import annotations

from dataclasses import dataclass

from hybridrl.algorithms.kl import KL_ESTIMATORS
from hybridrl.algorithms.losses import LOSS_AGG_MODES
from hybridrl.errors import ConfigError

ALGORITHMS: tuple[str, ...] = ("grpo",)
KL_PLACEMENTS: tuple[str, ...] = ("loss", "reward", "none")
ROLLOUT_CORRECTIONS: tuple[str, ...] = ("none", "tis")


def _choice(key: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"algorithm.{key} must be one of {', '.join(choices)}; got {value!r}")


@dataclass
class AlgorithmConfig:
    """Config of the RL objective; validated on construction (`OmegaConf.to_object` runs it)."""

    name: str = "grpo"
    """Algorithm; only 'grpo' (group-relative outcome advantages, no critic) for now."""
    group_size: int = 8
    """Samples generated per prompt; advantages are relative to the prompt's group (>= 2)."""
    norm_adv_by_std: bool = True
    """Divide advantages by the group's std (GRPO); False keeps r - mean (Dr. GRPO)."""
    clip_ratio_low: float = 0.2
    """PPO clip: the ratio is clipped below at 1 - clip_ratio_low; in [0, 1)."""
    clip_ratio_high: float = 0.2
    """PPO clip: the ratio is clipped above at 1 + clip_ratio_high; >= 0 (DAPO's clip-higher uses 0.28)."""
    clip_ratio_c: float = 3.0
    """Dual clip for negative advantages: their loss is capped at -A * c; > 1 (a huge value disables it)."""
    loss_agg_mode: str = "token-mean"
    """token-mean | seq-mean-token-sum | seq-mean-token-mean | seq-mean-token-sum-norm."""
    kl_coef: float = 0.001
    """Weight of the KL to the reference policy; >= 0, 0 means no reference model is loaded."""
    kl_estimator: str = "k3"
    """KL estimator per token: k1 (log-ratio), k2 (half squared log-ratio), k3 (low-variance, >= 0)."""
    kl_in: str = "loss"
    """Where the KL goes: loss (a loss term), reward (subtracted from rewards), none (no reference model)."""
    entropy_coef: float = 0.0
    """Weight of the entropy bonus (subtracted from the loss); >= 0."""
    rollout_correction: str = "none"
    """none | tis: truncated importance sampling from engine log-probs to the trainer's old log-probs."""
    rollout_correction_cap: float = 2.0
    """Upper bound of the TIS weights; >= 1."""

    def __post_init__(self) -> None:
        _choice("name", self.name, ALGORITHMS)
        if self.group_size < 2:
            raise ConfigError(
                f"algorithm.group_size must be >= 2 (one sample per prompt has no group to compare to), "
                f"got {self.group_size}"
            )
        if not 0 <= self.clip_ratio_low < 1:
            raise ConfigError(f"algorithm.clip_ratio_low must be in [0, 1), got {self.clip_ratio_low}")
        if self.clip_ratio_high < 0:
            raise ConfigError(f"algorithm.clip_ratio_high must be >= 0, got {self.clip_ratio_high}")
        if not self.clip_ratio_c > 1:
            raise ConfigError(f"algorithm.clip_ratio_c must be > 1, got {self.clip_ratio_c}")
        _choice("loss_agg_mode", self.loss_agg_mode, LOSS_AGG_MODES)
        if self.kl_coef < 0:
            raise ConfigError(f"algorithm.kl_coef must be >= 0, got {self.kl_coef}")
        _choice("kl_estimator", self.kl_estimator, KL_ESTIMATORS)
        _choice("kl_in", self.kl_in, KL_PLACEMENTS)
        if self.entropy_coef < 0:
            raise ConfigError(f"algorithm.entropy_coef must be >= 0, got {self.entropy_coef}")
        _choice("rollout_correction", self.rollout_correction, ROLLOUT_CORRECTIONS)
        if self.rollout_correction_cap < 1:
            raise ConfigError(
                f"algorithm.rollout_correction_cap must be >= 1, got {self.rollout_correction_cap}"
            )

    @property
    def uses_reference(self) -> bool:
        """Whether a frozen reference policy is needed (a KL term that is placed and weighted)."""
        return self.kl_in != "none" and self.kl_coef > 0
