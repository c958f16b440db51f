"""Every figure a recipe header or a docs page promises, against a real run (tests/helpers/expected_figures.py says
how they are written). Each distinct run (the CPU recipes; the default run shares cpu_demo's when they compose to the
same config) runs once per test session, ~30-100 s each on 2 cores; each figure is its own test."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
from omegaconf import OmegaConf

from tests.helpers.expected_figures import Expectation, holds, measure, recipe_expectations, table_expectations
from tests.paths import REPO

pytestmark = pytest.mark.slow

RECIPES = sorted((REPO / "recipes" / "recipe").glob("*.yaml"))
PAGES = [REPO / "README.md", REPO / "recipes" / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def all_expectations() -> list[Expectation]:
    out = []
    for path in RECIPES:
        out += recipe_expectations(path, str(path.relative_to(REPO)))[0]
    for page in PAGES:
        if page.exists():
            out += table_expectations(page.read_text(), str(page.relative_to(REPO)))
    return out


def composed(overrides: tuple[str, ...]):
    from hydra import compose, initialize_config_module

    from hybridrl.config import register_configs, validate

    register_configs()
    with initialize_config_module(config_module="hybridrl.conf", version_base="1.3"):
        cfg = compose(config_name="config", overrides=list(overrides))
    return cfg, validate(cfg)


_RUNS: dict[str, tuple[list[dict], float, bool]] = {}


def run_once(overrides: tuple[str, ...], tmp_root) -> tuple[list[dict], float, bool]:
    """(metrics rows, wall seconds, whether the machine was idle) of the run `overrides` composes, run once."""
    from hybridrl.models.loading import resolve_model_path

    cfg, run_cfg = composed(overrides)
    key = OmegaConf.to_yaml(cfg)
    if key not in _RUNS:
        resolve_model_path(run_cfg.model)  # the tiny model is made before the clock starts, as the figures assume
        run_dir = tmp_root / f"run{len(_RUNS)}"
        env = dict(os.environ, PYTHONUNBUFFERED="1", WANDB_MODE="offline")
        args = [*overrides, "logger.progress_bar=false", f"hydra.run.dir={run_dir}"]
        busy = os.getloadavg()[0] > (os.cpu_count() or 1) - 0.5
        t0 = time.perf_counter()
        r = subprocess.run(
            [sys.executable, "-m", "hybridrl", *args],
            cwd=tmp_root,
            env=env,
            capture_output=True,
            text=True,
            timeout=900,
        )
        wall = time.perf_counter() - t0
        assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
        busy = busy or os.getloadavg()[0] > (os.cpu_count() or 1) + 0.5
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        _RUNS[key] = (rows, wall, not busy)
    return _RUNS[key]


@pytest.fixture(scope="session")
def runs_root(tmp_path_factory):
    return tmp_path_factory.mktemp("figure-runs")


@pytest.mark.parametrize("expectation", all_expectations(), ids=lambda e: e.label)
def test_the_figure_reproduces(expectation: Expectation, runs_root):
    rows, wall, idle = run_once(expectation.overrides, runs_root)
    if expectation.metric == "wall_s" and not idle:
        pytest.skip(f"the machine is busy (load {os.getloadavg()[0]:.1f}); a wall time is checked on an idle one")
    misses = []
    for check in expectation.checks:
        got = measure(check, rows, expectation.metric, wall)
        if not holds(check, got, expectation.tolerance):
            misses.append(f"{check.kind}{'' if check.step is None else f' {check.step}'}: {got:.4g}")
    assert not misses, (
        f"{expectation.source}: '{expectation.text}' does not hold; the run gives {', '.join(misses)}. Correct the "
        "figure if the change of behaviour is intended."
    )
