"""`algorithm.*`: the knobs of the RL objective (advantages, policy loss, KL, DAPO's data pieces,
rollout correction). `algorithm.name` picks the estimator and the loss; conf/algorithm/<name>.yaml
sets the values each algorithm's paper uses."""

from __future__ import annotations

from dataclasses import dataclass

from hybridrl.algorithms.kl import KL_ALIASES, KL_ESTIMATORS, canonical_kl_estimator
from hybridrl.algorithms.losses import LOSS_AGG_MODES
from hybridrl.errors import ConfigError

ROLLOUT_CORRECTIONS: tuple[str, ...] = ("none", "tis", "seq_tis", "token_mis", "seq_mis")
"""none; tis: token TIS; seq_tis: sequence TIS; token_mis / seq_mis: masked IS of tokens / sequences."""

ALGORITHMS: tuple[str, ...] = (
    "grpo",
    "dr_grpo",
    "rloo",
    "reinforce_pp",
    "reinforce_pp_baseline",
    "gspo",
    "dapo",
    "cispo",
    "ppo",
)
KL_PLACEMENTS: tuple[str, ...] = ("loss", "reward", "none")

# name -> (advantage estimator, policy loss)
_RECIPE: dict[str, tuple[str, str]] = {
    "grpo": ("grpo", "ppo_clip"),
    "dr_grpo": ("grpo", "ppo_clip"),
    "dapo": ("grpo", "ppo_clip"),
    "gspo": ("grpo", "gspo"),
    "cispo": ("grpo", "cispo"),
    "rloo": ("rloo", "ppo_clip"),
    "reinforce_pp": ("reinforce_pp", "ppo_clip"),
    "reinforce_pp_baseline": ("reinforce_pp_baseline", "ppo_clip"),
    "ppo": ("gae", "ppo_clip"),
}
# Estimators that compare a prompt's samples with each other need at least two of them.
_GROUP_ESTIMATORS = ("grpo", "rloo", "reinforce_pp_baseline")


def _choice(key: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"algorithm.{key} must be one of {', '.join(choices)}; got {value!r}")


@dataclass
class AlgorithmConfig:
    """Config of the RL objective; validated on construction (`OmegaConf.to_object` runs it)."""

    name: str = "grpo"
    """grpo | dr_grpo | rloo | reinforce_pp | reinforce_pp_baseline | gspo | dapo | cispo | ppo (docs/algorithms.md)."""
    group_size: int = 8
    """Samples generated per prompt (>= 2 for group-relative estimators; 1 allowed for ppo and reinforce_pp)."""
    norm_adv_by_std: bool = True
    """Divide GRPO-style advantages by the group's std; dr_grpo requires false."""
    clip_ratio_low: float = 0.2
    """Ratio clipped below at 1 - clip_ratio_low; in [0, 1) (cispo: >= 0, >= 1 means no lower bound)."""
    clip_ratio_high: float = 0.2
    """Ratio clipped above at 1 + clip_ratio_high; >= 0 (DAPO's clip-higher 0.28, GSPO 4e-4)."""
    clip_ratio_c: float = 3.0
    """Dual clip for negative advantages (ppo_clip loss): their loss is capped at -A * c; > 1."""
    loss_agg_mode: str = "token-mean"
    """token-mean | seq-mean-token-sum | seq-mean-token-mean | seq-mean-token-sum-norm (gspo: seq-mean-token-mean)."""
    kl_coef: float = 0.001
    """Weight of the KL to the reference policy; >= 0, 0 means no reference model is loaded."""
    kl_estimator: str = "k3"
    """k1 | k2 | k3 | abs per token; verl's kl, mse, low_var_kl are accepted and stored as k1, k2, k3."""
    kl_in: str = "loss"
    """Where the KL goes: loss (a loss term), reward (subtracted from rewards), none (no reference model)."""
    entropy_coef: float = 0.0
    """Weight of the entropy bonus (subtracted from the loss); >= 0."""
    gamma: float = 1.0
    """Discount over response tokens (ppo's GAE, reinforce_pp's returns); in [0, 1]; verl's default."""
    lam: float = 1.0
    """GAE's lambda (ppo only); in [0, 1]; verl's default 1.0 (ppo.yaml sets 0.95)."""
    overlong_buffer: bool = False
    """DAPO's overlong shaping: penalize responses longer than max_new_tokens - overlong_buffer_len."""
    overlong_buffer_len: int = 0
    """Tokens of the soft-penalty zone before engine.max_new_tokens; 0 = a fifth of it (DAPO: 4096 of 20480), >= 3."""
    overlong_penalty_factor: float = 1.0
    """Penalty at max_new_tokens (linear from 0 over the buffer); >= 0."""
    filter_groups: bool = False
    """Dynamic sampling (DAPO): drop groups whose rewards are all equal and refill with new prompts."""
    max_resample_rounds: int = 10
    """Extra generation rounds per step to refill the batch; then it is filled with dropped groups."""
    rollout_correction: str = "none"
    """none | tis | seq_tis | token_mis | seq_mis: engine -> trainer off-policy correction (docs/algorithms.md)."""
    rollout_correction_cap: float = 2.0
    """Upper bound of the TIS weights (tis, seq_tis); >= 1."""
    rollout_correction_lower: float = 0.5
    """Masked IS (token_mis, seq_mis): tokens or sequences with a ratio below this are dropped; in [0, 1]."""
    rollout_correction_upper: float = 2.0
    """Masked IS: tokens or sequences with a ratio above this are dropped; >= 1."""

    def __post_init__(self) -> None:
        _choice("name", self.name, ALGORITHMS)
        min_group = 2 if self.adv_estimator in _GROUP_ESTIMATORS else 1
        if self.group_size < min_group:
            raise ConfigError(
                f"algorithm.group_size must be >= {min_group} for {self.name} "
                f"(its advantages compare a prompt's samples with each other), got {self.group_size}"
            )
        if self.name == "dr_grpo" and self.norm_adv_by_std:
            raise ConfigError("algorithm.norm_adv_by_std must be false for dr_grpo (Dr. GRPO drops the std)")
        if not self.norm_adv_by_std and self.adv_estimator != "grpo":
            raise ConfigError(
                f"algorithm.norm_adv_by_std applies to GRPO-style advantages only; {self.name} never divides by a std"
            )
        low_ok = self.clip_ratio_low >= 0 if self.name == "cispo" else 0 <= self.clip_ratio_low < 1
        if not low_ok:
            bound = ">= 0" if self.name == "cispo" else "in [0, 1)"
            raise ConfigError(f"algorithm.clip_ratio_low must be {bound}, got {self.clip_ratio_low}")
        if self.clip_ratio_high < 0:
            raise ConfigError(f"algorithm.clip_ratio_high must be >= 0, got {self.clip_ratio_high}")
        if not self.clip_ratio_c > 1:
            raise ConfigError(f"algorithm.clip_ratio_c must be > 1, got {self.clip_ratio_c}")
        _choice("loss_agg_mode", self.loss_agg_mode, LOSS_AGG_MODES)
        if self.name == "gspo" and self.loss_agg_mode != "seq-mean-token-mean":
            raise ConfigError(
                f"algorithm.loss_agg_mode must be seq-mean-token-mean for gspo, got {self.loss_agg_mode!r}: GSPO's "
                "objective is a mean over sequences of one sequence-level term; token-mean would weight sequences by "
                "length again and the token-sum modes would scale each by its length"
            )
        if self.kl_coef < 0:
            raise ConfigError(f"algorithm.kl_coef must be >= 0, got {self.kl_coef}")
        try:
            self.kl_estimator = canonical_kl_estimator(self.kl_estimator)
        except ValueError:
            _choice("kl_estimator", self.kl_estimator, (*KL_ESTIMATORS, *KL_ALIASES))
        _choice("kl_in", self.kl_in, KL_PLACEMENTS)
        if self.entropy_coef < 0:
            raise ConfigError(f"algorithm.entropy_coef must be >= 0, got {self.entropy_coef}")
        self._check_returns()
        self._check_dapo()
        self._check_rollout_correction()

    def _check_returns(self) -> None:
        for key in ("gamma", "lam"):
            if not 0 <= getattr(self, key) <= 1:
                raise ConfigError(f"algorithm.{key} must be in [0, 1], got {getattr(self, key)}")
        if self.gamma != 1.0 and self.adv_estimator not in ("gae", "reinforce_pp"):
            raise ConfigError(
                f"algorithm.gamma applies to ppo and reinforce_pp (token-level returns); "
                f"{self.name} uses outcome rewards"
            )
        if self.lam != 1.0 and not self.needs_critic:
            raise ConfigError(f"algorithm.lam is GAE's lambda and needs algorithm=ppo (a critic); got {self.name}")

    def _check_dapo(self) -> None:
        if self.overlong_buffer_len < 0:
            raise ConfigError(f"algorithm.overlong_buffer_len must be >= 0 (0 = auto), got {self.overlong_buffer_len}")
        if self.overlong_penalty_factor < 0:
            raise ConfigError(f"algorithm.overlong_penalty_factor must be >= 0, got {self.overlong_penalty_factor}")
        if self.filter_groups and self.group_size < 2:
            raise ConfigError("algorithm.filter_groups needs algorithm.group_size >= 2 (it drops all-equal groups)")
        if self.max_resample_rounds < 0:
            raise ConfigError(f"algorithm.max_resample_rounds must be >= 0, got {self.max_resample_rounds}")

    def _check_rollout_correction(self) -> None:
        _choice("rollout_correction", self.rollout_correction, ROLLOUT_CORRECTIONS)
        if self.rollout_correction_cap < 1:
            raise ConfigError(f"algorithm.rollout_correction_cap must be >= 1, got {self.rollout_correction_cap}")
        if not 0 <= self.rollout_correction_lower <= 1:
            raise ConfigError(
                f"algorithm.rollout_correction_lower must be in [0, 1], got {self.rollout_correction_lower}"
            )
        if self.rollout_correction_upper < 1:
            raise ConfigError(f"algorithm.rollout_correction_upper must be >= 1, got {self.rollout_correction_upper}")

    def overlong_buffer_tokens(self, max_new_tokens: int) -> int:
        """The overlong buffer in tokens for this generation limit (0 = auto: max_new_tokens // 5, at least 3 or the
        whole limit if shorter). The floor is ours: a 1-2 token buffer (a fifth of a short limit) is a cliff at the
        limit, the hard truncation penalty that DAPO's soft punishment replaces; on the 8-token CPU task it drove
        the policy to stop at once (reward/mean gained 0.16 in 150 steps, 0.56 with a 3-token ramp).

        Raises ConfigError naming the keys if the buffer exceeds the limit; call it where both are
        known (the run config) so the error comes at composition.
        """
        n = self.overlong_buffer_len or max(min(3, max_new_tokens), max_new_tokens // 5)
        if n > max_new_tokens:
            raise ConfigError(f"algorithm.overlong_buffer_len={n} must be <= engine.max_new_tokens={max_new_tokens}")
        return n

    @property
    def adv_estimator(self) -> str:
        """grpo (also dr_grpo, dapo, gspo, cispo) | rloo | reinforce_pp | reinforce_pp_baseline | gae (ppo)."""
        return _RECIPE[self.name][0]

    @property
    def policy_loss_type(self) -> str:
        """ppo_clip | gspo | cispo: which loss `policy_loss` computes."""
        return _RECIPE[self.name][1]

    @property
    def needs_critic(self) -> bool:
        """Whether a value model is trained and its values feed GAE (algorithm=ppo)."""
        return self.adv_estimator == "gae"

    @property
    def uses_reference(self) -> bool:
        """Whether a frozen reference policy is needed (a KL term that is placed and weighted)."""
        return self.kl_in != "none" and self.kl_coef > 0

    @property
    def kl_in_reward(self) -> bool:
        """Whether the KL is subtracted from the rewards before advantages (the controller needs token KL)."""
        return self.kl_in == "reward" and self.kl_coef > 0

    @property
    def kl_in_loss(self) -> bool:
        """Whether the KL is a loss term (the trainer needs reference log-probs)."""
        return self.kl_in == "loss" and self.kl_coef > 0
