"""The expected figures of the recipes and docs parse, every recipe states them (or why it cannot), and a check
fails once a figure moves by more than its tolerance (the slow test, tests/integration/test_expected_figures.py,
compares them with real runs)."""

from __future__ import annotations

import pytest

from tests.helpers.expected_figures import (
    Check,
    holds,
    measure,
    parse_figure,
    recipe_expectations,
    table_expectations,
)
from tests.paths import REPO

RECIPES = sorted((REPO / "recipes" / "recipe").glob("*.yaml"))
PAGES = [REPO / "README.md", REPO / "recipes" / "README.md", *sorted((REPO / "docs").glob("*.md"))]


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.stem)
def test_every_recipe_states_its_figures_or_why_not(path):
    figures, none_reason = recipe_expectations(path, str(path))
    text = path.read_text()
    runs_on_cpu = "override /model: tiny" in text
    if runs_on_cpu:
        assert figures and none_reason is None, f"{path.name}: a CPU recipe needs '# expect:' lines"
    else:
        assert not figures and none_reason, f"{path.name}: say '# expect: none (why)' for a recipe CI cannot run"


def test_the_docs_tables_parse():
    rows = [e for page in PAGES if page.exists() for e in table_expectations(page.read_text(), page.name)]
    assert any(e.overrides == () and e.metric == "reward/correct" for e in rows), "the default run's figures"


def test_the_grammar():
    e = parse_figure("reward/correct first 0.10 last 0.80 ±0.05", "x", ("recipe=cpu_demo",))
    assert e.checks == [Check("first", 0.10), Check("last", 0.80)] and e.tolerance == 0.05
    e = parse_figure("val/accuracy step 100 0.09, step 150 0.86 ±0.10", "x", ())
    assert e.checks == [Check("step", 0.09, 100), Check("step", 0.86, 150)]
    assert parse_figure("mismatch/logp_abs_max all < 1e-4", "x", ()).checks == [Check("all_below", 1e-4, op="<")]
    bounds = parse_figure("critic/explained_var first -0.47 last > 0.10 ±0.05", "x", ())
    assert bounds.checks == [Check("first", -0.47), Check("last", 0.10, op=">")] and bounds.tolerance == 0.05
    e = parse_figure("val/accuracy step 150 > 0.5, first < 0.1", "x", ())
    assert e.checks == [Check("step", 0.5, 150, ">"), Check("first", 0.1, op="<")]
    e = parse_figure("reward/correct first < 0.35 last > 0.60 gain > 0.30", "x", ())
    assert e.checks == [Check("first", 0.35, op="<"), Check("last", 0.60, op=">"), Check("gain", 0.30, op=">")]
    wall = parse_figure("wall_s 40 x2", "x", ())
    assert wall.checks == [Check("wall", 40.0)] and wall.tolerance == 2.0
    bad_lines = (
        "reward/mean 0.5 ±0.1",
        "reward/mean first 0.5",
        "reward/mean last > 0.5 first 0.1",
        "reward/mean last >",
        "reward/mean all > 0.5",
        "reward/mean gain < 0.5",
        "reward/mean gain 0.5 ±0.1",
        "wall_s 40 ±2",
        "reward/mean",
    )
    for bad in bad_lines:
        with pytest.raises(ValueError):
            parse_figure(bad, "x", ())


def test_a_figure_moved_past_its_tolerance_fails():
    rows = [{"step": s, "r": s / 10} for s in range(1, 11)]  # first 20%: 0.15, last 20%: 0.95, step 5: 0.5
    assert measure(Check("first", 0), rows, "r") == pytest.approx(0.15)
    assert measure(Check("last", 0), rows, "r") == pytest.approx(0.95)
    assert measure(Check("step", 0, 5), rows, "r") == pytest.approx(0.5)
    assert measure(Check("gain", 0, op=">"), rows, "r") == pytest.approx(0.8)  # 0.95 - 0.15
    assert holds(Check("gain", 0.7, op=">"), 0.8, 0) and not holds(Check("gain", 0.85, op=">"), 0.8, 0)
    assert holds(Check("last", 0.90), 0.95, 0.05) and not holds(Check("last", 0.89), 0.95, 0.05)
    assert holds(Check("step", 0.5, 5), 0.5, 0.0)
    assert holds(Check("all_below", 1.01, op="<"), measure(Check("all_below", 1.01), rows, "r"), 0)
    assert not holds(Check("all_below", 0.9, op="<"), measure(Check("all_below", 0.9), rows, "r"), 0)
    assert holds(Check("last", 0.9, op=">"), 0.95, 0) and not holds(Check("last", 0.96, op=">"), 0.95, 0)
    assert holds(Check("first", 0.2, op="<"), 0.15, 0) and not holds(Check("first", 0.1, op="<"), 0.15, 0)
    assert (
        holds(Check("wall", 40), 79, 2) and not holds(Check("wall", 40), 81, 2) and not holds(Check("wall", 40), 19, 2)
    )
    with pytest.raises(AssertionError, match="no r at step 11"):
        measure(Check("step", 0, 11), rows, "r")
