"""Every `python -m hybridrl.evaluate` / `.generate` / `hybridrl` command docs/evaluate.md prints composes and
validates with its app's config (placeholders such as `<date>/<time>` are fine: composing opens no path)."""

from __future__ import annotations

import re

import pytest

from tests.integration.test_readme_commands import _joined_lines, expand, overrides_of
from tests.paths import REPO

PAGE = REPO / "docs" / "evaluate.md"
CMD = re.compile(r"python3?\s+-m\s+hybridrl(?P<module>\.evaluate|\.generate)?(?![.\w])(?P<args>.*)$")
CONFIG = {None: "config", ".evaluate": "evaluate", ".generate": "generate"}


def page_commands() -> list[tuple[str, str]]:
    out, block, fenced = [], [], False
    for line in PAGE.read_text().splitlines():
        if line.lstrip().startswith("```"):
            if fenced:
                for joined in _joined_lines(block):
                    m = CMD.search(joined)
                    if m:
                        out.append((CONFIG[m.group("module")], m.group("args").strip()))
                block = []
            fenced = not fenced
        elif fenced:
            block.append(line)
    return out


COMMANDS = page_commands()


def test_the_page_has_commands_of_each_app():
    assert {name for name, _ in COMMANDS} == {"config", "evaluate", "generate"}


@pytest.mark.parametrize("config_name, args", COMMANDS)
def test_command_composes(config_name, args):
    from hydra import compose, initialize_config_module

    from hybridrl.config import validate
    from hybridrl.eval_config import register_eval_configs

    register_eval_configs()
    overrides, multirun = overrides_of(args)
    for job in expand(overrides, multirun):
        with initialize_config_module(config_module="hybridrl.conf", version_base="1.3"):
            validate(compose(config_name=config_name, overrides=job))
