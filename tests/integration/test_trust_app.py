"""App-level errors: unknown and moved keys, NaN values, unknown recipes, and one-line reports of crashes."""

from __future__ import annotations

import logging
import sys

import pytest
from hydra import compose, initialize_config_module
from hydra.errors import ConfigCompositionException, MissingConfigException

from hybridrl import config_checks
from hybridrl.app import crash_line, log_traceback
from hybridrl.config import register_configs
from hybridrl.config_checks import (
    MOVED_KEYS,
    active_moves,
    check_composed,
    composition_error_line,
    moved_key_in_overrides,
    schema_keys,
)
from hybridrl.errors import ConfigError, in_phase, phase_of
from tests.paths import REPO

register_configs()


def composed(*overrides: str):
    with initialize_config_module(config_module="hybridrl.conf", version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


def test_force_added_keys_fail_like_unknown_keys():
    with pytest.raises(ConfigError, match=r"^trainer\.lrr is not a config key \(did you mean trainer\.lr\?\)"):
        check_composed(composed("+trainer.lrr=1e-3"))
    with pytest.raises(ConfigError, match=r"^brand_new is not a config key"):
        check_composed(composed("+brand_new.x=1"))
    check_composed(composed())  # the default config is clean
    check_composed(composed("+engine.sglang.engine_kwargs.context_length=4096"))  # a free-form dict takes any key


@pytest.mark.parametrize(
    "override, key", [("trainer.lr=nan", "trainer.lr"), ("algorithm.kl_coef=nan", "algorithm.kl_coef")]
)
def test_nan_values_are_refused_naming_the_key(override, key):
    with pytest.raises(ConfigError, match=rf"^{key.replace('.', chr(92) + '.')}=nan is not a number"):
        check_composed(composed(override))


def test_an_unknown_recipe_names_the_recipes_that_exist():
    with pytest.raises(MissingConfigException) as e:
        composed("recipe=gsm8k_grop")
    assert composition_error_line(e.value) == (
        "in 'config': Could not find 'recipe/gsm8k_grop'; recipe options: "
        + ", ".join(sorted(p.stem for p in (REPO / "recipes" / "recipe").glob("*.yaml")))
    )


def test_an_unknown_key_on_the_command_line_gets_no_plus_advice():
    with pytest.raises(ConfigCompositionException) as e:
        composed("trainer.lrx=1")
    assert composition_error_line(e.value) == "trainer.lrx is not a config key (did you mean trainer.lr?)"


def test_moved_keys_take_effect_once_the_new_key_exists():
    keys = schema_keys()
    for old, new in MOVED_KEYS.items():
        assert (old in active_moves()) == (new in keys and old not in keys), old


@pytest.fixture()
def moved(monkeypatch):
    """A move that is in force for today's schema: trainer.learning_rate -> trainer.lr."""
    monkeypatch.setattr(config_checks, "MOVED_KEYS", {"trainer.learning_rate": "trainer.lr"})


@pytest.mark.parametrize(
    "args",
    [
        ["trainer.learning_rate=1e-3"],
        ["+trainer.learning_rate=1e-3"],
        ["++trainer.learning_rate=1e-3"],
        ["~trainer.learning_rate"],
        ["-m", "trainer.learning_rate=1e-3,2e-3", "trainer.steps=3"],
        ["--cfg", "job", "trainer.learning_rate=1"],
    ],
)
def test_moved_keys_on_the_command_line_name_the_new_key(moved, args):
    assert moved_key_in_overrides(args) == "trainer.learning_rate moved to trainer.lr; write trainer.lr=... instead"


def test_moved_keys_pass_untouched_when_not_used(moved):
    assert moved_key_in_overrides(["-m", "trainer.lr=1e-3", "--cfg", "job", "hydra.run.dir=x"]) is None


def test_moved_keys_in_yaml_or_the_composed_config_name_the_new_key(moved, tmp_path):
    # A user's YAML that still sets the old key: Hydra's composition error is translated.
    (tmp_path / "recipe").mkdir()
    (tmp_path / "recipe" / "old.yaml").write_text("# @package _global_\ntrainer:\n  learning_rate: 0.1\n")
    with pytest.raises(ConfigCompositionException) as e:
        composed(f"hydra.searchpath=[file://{tmp_path}]", "recipe=old")
    assert composition_error_line(e.value) == "trainer.learning_rate moved to trainer.lr; write trainer.lr=... instead"
    # A composed config that holds the old key (force-added): the composed check says the same.
    with pytest.raises(ConfigError, match=r"^trainer\.learning_rate moved to trainer\.lr"):
        check_composed(composed("+trainer.learning_rate=0.1"))


# ---------------------------------------------------------------- crash reports


def test_in_phase_tags_the_innermost_phase():
    with pytest.raises(RuntimeError) as e:
        with in_phase("train"):
            with in_phase("generate"):
                raise RuntimeError("x")
    assert phase_of(e.value) == "generate"


def test_a_crash_is_one_console_line_and_a_traceback_in_the_log_file(tmp_path, capsys):
    logger = logging.getLogger()
    file_handler = logging.FileHandler(tmp_path / "hybridrl.log")
    console = logging.StreamHandler(sys.stderr)
    logger.addHandler(file_handler)
    logger.addHandler(console)
    try:
        try:
            with in_phase("reward"):
                raise KeyError("missing")
        except KeyError as e:
            where = log_traceback(e, str(tmp_path))
            line = crash_line(e, where)
    finally:
        logger.removeHandler(file_handler)
        logger.removeHandler(console)
        file_handler.close()
    assert line == f"error in reward: KeyError: 'missing' (full traceback in {where})"
    assert where.endswith("hybridrl.log")
    text = (tmp_path / "hybridrl.log").read_text()
    assert "Traceback (most recent call last)" in text and 'raise KeyError("missing")' in text
    assert "Traceback" not in capsys.readouterr().err
