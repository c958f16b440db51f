"""Packaging: every subpackage is listed in pyproject, and the config files ship inside the package."""

from __future__ import annotations

import tomllib

from tests.paths import REPO


def test_every_package_is_listed():
    listed = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(REPO).parts) for p in (REPO / "hybridrl").rglob("__init__.py")}
    assert found <= listed, f"add to pyproject [tool.setuptools] packages: {sorted(found - listed)}"


def test_config_groups_are_importable_as_package_data():
    from importlib.resources import files

    conf = files("hybridrl.conf")
    for group in ("model", "engine", "trainer", "algorithm", "data", "reward", "reward_model", "logger", "cluster"):
        assert any(f.name.endswith(".yaml") for f in conf.joinpath(group).iterdir()), group
    assert conf.joinpath("config.yaml").is_file()
