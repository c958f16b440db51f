"""Composition of algorithm=ppo, critic.*, reward_model=... and reward=remote: what composes, what fails and how."""

from __future__ import annotations

import pytest
from hydra import compose, initialize_config_module

from hybridrl.config import register_configs, validate
from hybridrl.errors import ConfigError

register_configs()


def composed(*overrides: str):
    with initialize_config_module(config_module="hybridrl.conf", version_base="1.3"):
        return validate(compose(config_name="config", overrides=list(overrides)))


def test_ppo_composes_with_a_critic_that_follows_the_actor():
    rc = composed("algorithm=ppo", "trainer.lr=3e-3", "trainer.micro_batch_size=4", "trainer.offload=params")
    c, t = rc.critic, rc.trainer
    assert rc.algorithm.needs_critic and c.model.path is None and c.cliprange_value == 0.5
    assert c.optim(t).lr == 3e-3 and c.batching(t) == (0, 4, 1) and c.offload_parts(t) == {"params"}
    c2 = composed("algorithm=ppo", "critic.lr=1e-2", "critic.micro_batch_size=2", "critic.offload=none").critic
    assert c2.optim(t).lr == 1e-2 and c2.batching(t)[1] == 2 and c2.offload_parts(t) == set()


@pytest.mark.parametrize(
    "override, key",
    [
        ("critic.lr=1e-3", "critic.lr"),
        ("critic.model.path=/x", "critic.model.path"),
        ("critic.warmup_steps=3", "critic.warmup_steps"),
    ],
)
def test_critic_options_without_a_critic_fail_naming_the_key(override, key):
    with pytest.raises(ConfigError, match=f"{key} is set, but algorithm=grpo trains no critic"):
        composed(override)


@pytest.mark.parametrize(
    "overrides, key",
    [
        (["critic.cliprange_value=0"], "critic.cliprange_value"),
        (["critic.lr=-1"], "critic.lr"),
        (["critic.offload=gpu"], "critic.offload"),
        (["critic.micro_batch_size=0"], "critic.micro_batch_size"),
        (["critic.mini_batch_size=48"], "critic.mini_batch_size=48 must divide the 128 samples"),
        (["trainer.mini_batch_size=48"], "trainer.mini_batch_size=48"),
    ],
)
def test_bad_critic_values_fail_naming_the_key(overrides, key):
    with pytest.raises(ConfigError, match=key):
        composed("algorithm=ppo", *overrides)


def test_reward_model_options_compose():
    assert composed().reward_model.models == []
    tiny = composed("reward_model=tiny").reward_model.models
    assert [(m.name, m.path, m.weight) for m in tiny] == [("tiny_rm", "tiny", 0.1)]
    assert [m.seed for m in composed("reward_model=two_tiny").reward_model.models] == [1, 2]
    hf = composed("reward_model=hf", "reward_model.models.0.path=/models/rm").reward_model.models
    assert hf[0].path == "/models/rm"
    two = composed("reward_model.models=[{name: a, path: /p/a, weight: 0.5}, {name: b, path: tiny}]")
    two = two.reward_model.models
    assert [(m.name, m.weight) for m in two] == [("a", 0.5), ("b", 1.0)]
    with pytest.raises(ConfigError, match=r"reward_model.models\[0\].path is required: .*reward_model.models.0.path="):
        composed("reward_model=hf")  # the path is required
    with pytest.raises(ConfigError, match="is used twice"):
        composed("reward_model.models=[{name: a, path: tiny}, {name: a, path: tiny}]")


def test_remote_reward_composes_and_needs_its_url():
    rc = composed("reward=remote", "reward.remote.url=http://127.0.0.1:9/score", "reward.remote.max_retries=1")
    assert rc.reward.name == "remote" and rc.reward.remote.max_retries == 1
    with pytest.raises(ConfigError, match="reward.remote.url"):
        composed("reward=remote")
    with pytest.raises(ConfigError, match="reward.combine"):
        composed("reward.combine= ")


def test_ppo_recipe_composes():
    rc = composed("recipe=cpu_ppo")
    assert rc.algorithm.name == "ppo" and rc.critic.lr is not None
