"""Config composition: defaults, overrides, recipes, and errors that name the key."""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra import compose, initialize_config_module
from hydra.errors import ConfigCompositionException, MissingConfigException
from omegaconf import OmegaConf

from hybridrl.config import RunConfig, register_configs, validate
from hybridrl.errors import ConfigError
from tests.paths import REPO

register_configs()


def composed(*overrides: str):
    with initialize_config_module(config_module="hybridrl.conf", version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


def test_default_is_the_cpu_demo():
    rc = validate(composed())
    assert isinstance(rc, RunConfig)
    assert rc.model.path is None and rc.engine.name == "native" and rc.cluster.name == "inline"
    assert rc.data.name == "synthetic" and rc.reward.name == "synthetic" and rc.algorithm.name == "grpo"


def test_group_and_value_overrides():
    rc = validate(
        composed("engine=vllm", "trainer.lr=1e-6", "cluster=local", "cluster.workers_per_node=2", "engine.tp_size=2")
    )
    assert rc.engine.name == "vllm" and rc.trainer.lr == 1e-6
    assert rc.cluster.world_size == 2 and rc.engine.tp_size == 2


def yaml_leaves(path: Path, prefix: str = "") -> dict[str, object]:
    """Every value a YAML file sets, by dotted key, read straight from the file (not through Hydra)."""
    raw = OmegaConf.to_container(OmegaConf.load(path))
    raw.pop("defaults", None)

    def walk(d: dict, pre: str) -> dict[str, object]:
        out: dict[str, object] = {}
        for k, v in d.items():
            out.update(walk(v, f"{pre}{k}.") if isinstance(v, dict) and v else {f"{pre}{k}": v})
        return out

    return walk(raw, prefix)


def assert_applied(cfg, expected: dict[str, object]) -> None:
    for key, value in expected.items():
        got = OmegaConf.select(cfg, key)
        assert got == (float(value) if isinstance(got, float) and isinstance(value, str) else value), key


@pytest.mark.parametrize(
    "override",
    [
        "engine=sglang",
        "logger=wandb",
        "reward=math",
        "cluster=ray",
        "cluster=local",
        "model=hf model.path=/x",
        "data=jsonl data.path=/x.jsonl",
    ],
)
def test_every_group_option_composes_with_its_file_values(override):
    args = override.split()
    cfg = composed(*args)
    group, option = args[0].split("=")
    expected = yaml_leaves(REPO / "conf" / group / f"{option}.yaml", f"{group}.")
    expected.update(dict(a.split("=", 1) for a in args[1:]))
    assert expected  # every option file sets at least its name
    assert_applied(cfg, expected)
    validate(cfg)


def test_wrong_type_fails_at_composition_naming_the_key():
    with pytest.raises(ConfigCompositionException) as e:
        composed("trainer.lr=abc")
    assert "trainer.lr" in str(e.value.__cause__ or e.value)


def test_unknown_key_fails():
    with pytest.raises(ConfigCompositionException) as e:
        composed("trainer.learning_rate=1e-5")
    assert "learning_rate" in str(e.value.__cause__ or e.value)


def test_unknown_group_option_fails():
    with pytest.raises(MissingConfigException, match="engine/nonexistent"):
        composed("engine=nonexistent")


@pytest.mark.parametrize(
    "override, key",
    [
        ("engine.top_p=1.5", "engine.top_p"),
        ("engine.sleep_level=3", "engine.sleep_level"),
        ("trainer.lr=-1", "trainer.lr"),
        ("trainer.offload=gradients", "trainer.offload"),
        ("algorithm.clip_ratio_low=1.5", "algorithm.clip_ratio_low"),
        ("algorithm.group_size=1", "algorithm.group_size"),
        ("data.overlong_prompts=truncate", "data.overlong_prompts"),
        ("cluster.workers_per_node=2", "cluster=inline"),
        ("reward.fn=not-a-path", "reward.fn"),
        ("cluster=local engine.tp_size=3", "engine.tp_size"),
        ("engine.native.pdl=sometimes", "engine.native.pdl"),
    ],
)
def test_bad_values_fail_validation_naming_the_key(override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        validate(composed(*override.split()))


def test_engine_native_pdl_takes_a_boolean_from_the_command_line():
    assert validate(composed("engine.native.pdl=true")).engine.native.pdl == "on"
    assert validate(composed("engine.native.pdl=off")).engine.native.pdl == "off"
    assert validate(composed()).engine.native.pdl == "on"


def test_missing_model_path_is_reported():
    with pytest.raises(ConfigError, match="model.path is required"):
        validate(composed("model=hf"))
    with pytest.raises(ConfigError, match="data.path is required"):
        validate(composed("data=jsonl"))


RECIPES = sorted(p.stem for p in (REPO / "recipes" / "recipe").glob("*.yaml"))


@pytest.mark.parametrize("name", RECIPES)
def test_recipes_compose_to_their_own_values_and_state_their_command(name):
    path = REPO / "recipes" / "recipe" / f"{name}.yaml"
    text = path.read_text()
    assert text.startswith("# @package _global_")
    assert f"python -m hybridrl recipe={name}" in text and "Expected" in text
    cli = {"model.path": "/some/model", "data.path": "/some/train.jsonl"}
    cfg = composed(f"recipe={name}", *(f"{k}={v}" for k, v in cli.items()))
    # What the recipe's defaults select (override /group: option), then what it sets itself, then the command line.
    expected: dict[str, object] = {}
    for entry in OmegaConf.to_container(OmegaConf.load(path)).get("defaults", []):
        for group, option in entry.items():
            group = group.split()[-1].strip("/")
            expected.update(yaml_leaves(REPO / "conf" / group / f"{option}.yaml", f"{group}."))
    expected.update(yaml_leaves(path))
    expected.update(cli)
    assert_applied(cfg, expected)
    validate(cfg)
