"""hybridrl.algorithms.config and conf/algorithm/: `algorithm=<name>` composes into the math its paper defines, and
the config rejects bad values and combinations naming the key."""

from __future__ import annotations

import dataclasses
import math
import re

import pytest
import torch
import yaml
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf

from hybridrl.algorithms import ALGORITHMS, AlgorithmConfig, compute_advantages, policy_loss
from hybridrl.config import register_configs, validate
from hybridrl.errors import ConfigError
from tests.paths import REPO
from tests.unit.algorithms.reference import assert_close, gae_ref, scatter, whiten_ref

register_configs()
CONF = REPO / "conf" / "algorithm"


def composed(*overrides: str):
    with initialize_config_module(config_module="hybridrl.conf", version_base="1.3"):
        return validate(compose(config_name="config", overrides=list(overrides)))


# ---------------------------------------------------------------- the YAML files


@pytest.mark.parametrize("name", ALGORITHMS)
def test_every_algorithm_composes_and_its_yaml_is_minimal(name):
    algo = composed(f"algorithm={name}").algorithm
    assert algo.name == name
    text = (CONF / f"{name}.yaml").read_text()
    header = [line for line in text.splitlines() if line.startswith("#")]
    assert any("arXiv:" in line for line in header), "the header cites the paper"
    assert any(f"python -m hybridrl algorithm={name}" in line for line in header), "the header gives the command"
    defaults = {f.name: f.default for f in dataclasses.fields(AlgorithmConfig)}
    for key, value in yaml.safe_load(text).items():
        assert key == "name" or value != defaults[key], f"{name}.yaml repeats the default {key}={value}"


# ---------------------------------------------------------------- what each name computes

# Two groups of four samples with ragged responses; the rollout's per-token KL is 0, so where the KL goes (loss or
# reward) does not move the advantages, and each algorithm's estimator shows alone.
SCORES = [1.0, 0.0, 0.0, 1.0, 0.5, 0.0, 1.0, 1.0]
LENGTHS = [3, 2, 1, 3, 2, 3, 1, 2]
MASK = [[1 if t < n else 0 for t in range(3)] for n in LENGTHS]
VALUES = [[0.1 * (i + 1) - 0.05 * t for t in range(3)] for i in range(8)]  # a critic's values, for ppo


def _per_group(fn) -> list[float]:
    return [x for g in range(0, 8, 4) for x in fn(SCORES[g : g + 4])]


def _grpo(rs: list[float]) -> list[float]:  # (r - mean) / (unbiased std + 1e-6); an all-equal group gives 0
    mean = sum(rs) / len(rs)
    std = math.sqrt(sum((r - mean) ** 2 for r in rs) / (len(rs) - 1))
    return [(r - mean) / (std + 1e-6) if std else 0.0 for r in rs]


def _centered(rs: list[float]) -> list[float]:
    return [r - sum(rs) / len(rs) for r in rs]


def _leave_one_out(rs: list[float]) -> list[float]:
    return [r - (sum(rs) - r) / (len(rs) - 1) for r in rs]


def _per_token(per_sequence: list[float]) -> list[float]:
    return [a for a, n in zip(per_sequence, LENGTHS) for _ in range(n)]


def _expected(name: str) -> list[list[float]]:
    """The advantages of each paper, written from its formula (Shao et al.; Liu et al.; Ahmadian et al.; Hu et al.;
    Schulman et al.'s GAE with γ 1, λ 0.95), independent of hybridrl.algorithms."""
    if name in ("grpo", "gspo", "dapo", "cispo"):
        return scatter(MASK, _per_token(_per_group(_grpo)))
    if name == "dr_grpo":
        return scatter(MASK, _per_token(_per_group(_centered)))
    if name == "rloo":
        return scatter(MASK, _per_token(_per_group(_leave_one_out)))
    if name == "reinforce_pp_baseline":
        return scatter(MASK, whiten_ref(_per_token(_per_group(_centered))))
    if name == "reinforce_pp":  # γ = 1: every token's return is the score
        return scatter(MASK, whiten_ref(_per_token(SCORES)))
    assert name == "ppo"
    rewards = [[s if t == n - 1 else 0.0 for t in range(3)] for s, n in zip(SCORES, LENGTHS)]
    raw, _ = gae_ref(rewards, VALUES, MASK, gamma=1.0, lam=0.95)
    return scatter(MASK, whiten_ref(raw))


@pytest.mark.parametrize("name", ALGORITHMS)
def test_each_algorithm_computes_its_papers_advantages(name):
    cfg = composed(f"algorithm={name}", "algorithm.group_size=4").algorithm
    mask = torch.tensor(MASK, dtype=torch.float32)
    adv, returns = compute_advantages(
        cfg, torch.tensor(SCORES), mask, token_kl=torch.zeros(8, 3), values=torch.tensor(VALUES)
    )
    assert_close(adv, _expected(name), atol=1e-5)
    assert (returns is not None) == (name == "ppo"), "only ppo trains a critic on returns"


def test_dapo_clips_higher_and_loads_no_reference():
    # One token with ratio 1.25 and advantage +1: GRPO clips it at 1 + 0.2 (no gradient); DAPO's clip-higher
    # (1 + 0.28, Yu et al.) keeps its gradient, -A * ratio = -1.25. DAPO drops the KL, so no reference model.
    grpo, dapo = composed("algorithm=grpo").algorithm, composed("algorithm=dapo").algorithm
    for cfg, grad in ((grpo, 0.0), (dapo, -1.25)):
        logp = torch.tensor([[math.log(1.25)]], requires_grad=True)
        loss, _ = policy_loss(cfg, logp, torch.zeros(1, 1), torch.ones(1, 1), torch.ones(1, 1))
        loss.backward()
        assert_close(logp.grad, [[grad]])
    assert grpo.uses_reference and not dapo.uses_reference


# ---------------------------------------------------------------- derived values


def test_kl_aliases_are_normalized_at_config_time():
    for alias, canonical in (("kl", "k1"), ("mse", "k2"), ("low_var_kl", "k3"), ("abs", "abs")):
        assert AlgorithmConfig(kl_estimator=alias).kl_estimator == canonical
    assert composed("algorithm.kl_estimator=low_var_kl").algorithm.kl_estimator == "k3"


@pytest.mark.parametrize(
    ("kl_in", "kl_coef", "needed"),
    # A frozen reference is needed exactly when a KL term is both placed (in the loss or the reward) and weighted.
    [
        ("loss", 0.001, True),
        ("reward", 0.05, True),
        ("none", 0.001, False),
        ("loss", 0.0, False),
        ("reward", 0.0, False),
        ("none", 0.0, False),
    ],
)
def test_config_uses_reference(kl_in, kl_coef, needed):
    assert AlgorithmConfig(kl_in=kl_in, kl_coef=kl_coef).uses_reference is needed


def test_overlong_buffer_tokens():
    assert AlgorithmConfig().overlong_buffer_tokens(8) == 3  # auto: 8 // 5 = 1 is below the 3-token floor
    assert AlgorithmConfig().overlong_buffer_tokens(2) == 2  # the floor never exceeds the limit
    assert AlgorithmConfig().overlong_buffer_tokens(20) == 4
    assert AlgorithmConfig().overlong_buffer_tokens(20480) == 4096  # DAPO's 4096 of 20480
    assert AlgorithmConfig(overlong_buffer_len=4).overlong_buffer_tokens(8) == 4
    msg = "algorithm.overlong_buffer_len=10 must be <= engine.max_new_tokens=8"
    with pytest.raises(ConfigError, match=re.escape(msg)):
        AlgorithmConfig(overlong_buffer_len=10).overlong_buffer_tokens(8)


# ---------------------------------------------------------------- errors name the key


@pytest.mark.parametrize(
    ("kwargs", "key"),
    [
        ({"name": "a2c"}, "name"),
        ({"group_size": 1}, "group_size"),
        ({"name": "rloo", "group_size": 1}, "group_size"),
        ({"name": "reinforce_pp_baseline", "group_size": 1}, "group_size"),
        ({"name": "dr_grpo"}, "norm_adv_by_std"),  # Dr. GRPO without std
        ({"name": "rloo", "norm_adv_by_std": False}, "norm_adv_by_std"),
        ({"name": "gspo"}, "loss_agg_mode"),  # token-mean default
        ({"name": "gspo", "loss_agg_mode": "seq-mean-token-sum"}, "loss_agg_mode"),
        ({"loss_agg_mode": "sum"}, "loss_agg_mode"),
        ({"clip_ratio_low": 1.0}, "clip_ratio_low"),
        ({"clip_ratio_low": 1.5}, "clip_ratio_low"),
        ({"clip_ratio_low": -0.1}, "clip_ratio_low"),
        ({"name": "cispo", "clip_ratio_low": -0.1}, "clip_ratio_low"),
        ({"clip_ratio_high": -0.1}, "clip_ratio_high"),
        ({"clip_ratio_c": 1.0}, "clip_ratio_c"),
        ({"gamma": 1.5, "name": "ppo"}, "gamma"),
        ({"gamma": 0.99}, "gamma"),  # grpo uses outcome rewards
        ({"lam": 0.95}, "lam"),  # GAE only
        ({"name": "reinforce_pp", "lam": 0.95}, "lam"),
        ({"lam": -0.1, "name": "ppo"}, "lam"),
        ({"kl_coef": -1.0}, "kl_coef"),
        ({"kl_estimator": "k4"}, "kl_estimator"),
        ({"kl_in": "ref"}, "kl_in"),
        ({"entropy_coef": -0.01}, "entropy_coef"),
        ({"overlong_buffer_len": -1}, "overlong_buffer_len"),
        ({"overlong_penalty_factor": -1.0}, "overlong_penalty_factor"),
        ({"name": "ppo", "group_size": 1, "filter_groups": True}, "filter_groups"),
        ({"max_resample_rounds": -1}, "max_resample_rounds"),
        ({"rollout_correction": "is"}, "rollout_correction"),
        ({"rollout_correction_lower": 1.5}, "rollout_correction_lower"),
        ({"rollout_correction_upper": 0.5}, "rollout_correction_upper"),
        ({"rollout_correction_cap": 0.5}, "rollout_correction_cap"),
    ],
)
def test_bad_values_and_combinations_name_the_key(kwargs, key):
    with pytest.raises(ConfigError, match=re.escape(f"algorithm.{key} ")):
        AlgorithmConfig(**kwargs)


def test_legitimate_combinations():
    AlgorithmConfig(name="ppo", group_size=1, gamma=0.99, lam=0.95)
    AlgorithmConfig(name="reinforce_pp", group_size=1, gamma=0.99)
    AlgorithmConfig(name="cispo", clip_ratio_low=10.0)
    AlgorithmConfig(name="gspo", loss_agg_mode="seq-mean-token-mean", clip_ratio_low=3e-4, clip_ratio_high=4e-4)


def test_gspo_with_token_mean_fails_at_composition():
    with pytest.raises(ConfigError, match="algorithm.loss_agg_mode must be seq-mean-token-mean for gspo"):
        composed("algorithm=gspo", "algorithm.loss_agg_mode=token-mean")


def test_config_through_omegaconf():
    base = OmegaConf.structured(AlgorithmConfig)
    cfg = OmegaConf.to_object(OmegaConf.merge(base, OmegaConf.from_dotlist(["name=ppo", "kl_estimator=kl"])))
    assert isinstance(cfg, AlgorithmConfig) and cfg.needs_critic and cfg.kl_estimator == "k1"
    cfg = OmegaConf.to_object(OmegaConf.merge(base, OmegaConf.from_dotlist(["clip_ratio_high=0.28"])))
    assert cfg.clip_ratio_high == 0.28
    bad = OmegaConf.merge(base, OmegaConf.from_dotlist(["clip_ratio_low=1.5"]))
    with pytest.raises(ConfigError, match=re.escape("algorithm.clip_ratio_low must be in [0, 1), got 1.5")):
        OmegaConf.to_object(bad)
