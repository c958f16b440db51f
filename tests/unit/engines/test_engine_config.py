"""engine.native.*: composed through Hydra like every option, bad values fail naming the key."""

from __future__ import annotations

import pytest
from hydra import compose, initialize_config_module

from hybridrl.config import register_configs, validate
from hybridrl.engines.config import NativeOptions
from hybridrl.errors import ConfigError

register_configs()


def composed(*overrides: str):
    with initialize_config_module(config_module="hybridrl.conf", version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


def test_native_options_compose():
    rc = validate(
        composed(
            "engine.native.max_batch_size=32",
            "engine.native.kv_block_size=32",
            "engine.native.impl=hf",
            "engine.native.prefix_cache=false",
        )
    )
    n = rc.engine.native
    assert isinstance(n, NativeOptions) and (n.max_batch_size, n.kv_block_size, n.impl, n.prefix_cache) == (
        32,
        32,
        "hf",
        False,
    )


@pytest.mark.parametrize(
    "override, key",
    [
        ("engine.native.impl=cuda", "engine.native.impl"),
        ("engine.native.max_batch_size=0", "engine.native.max_batch_size"),
        ("engine.native.max_model_len=-1", "engine.native.max_model_len"),
        ("engine.native.prefill_tokens=0", "engine.native.prefill_tokens"),
        ("engine.native.kv_block_size=12", "engine.native.kv_block_size"),
        ("engine.native.kv_blocks=-2", "engine.native.kv_blocks"),
        ("engine.native.kv_memory_fraction=1.0", "engine.native.kv_memory_fraction"),
        ("engine.native.shared_prefix_tokens=-1", "engine.native.shared_prefix_tokens"),
        ("engine.native.pdl=auto", "engine.native.pdl"),
        ("engine.native.join_step_tokens=-1", "engine.native.join_step_tokens"),
    ],
)
def test_bad_native_values_fail_naming_the_key(override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        validate(composed(override))


def test_pdl_is_on_or_off():
    assert validate(composed()).engine.native.pdl == "on"
    assert validate(composed("engine.native.pdl=false")).engine.native.pdl == "off"
    assert validate(composed("engine.native.pdl=on")).engine.native.pdl == "on"
