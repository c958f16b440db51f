"""docs/reference.md is what `python -m hybridrl.config_reference` writes from the dataclasses, every key in it has a
meaning, and `--help` lists every group (recipe included) and points to it."""

from __future__ import annotations

import subprocess
import sys

from hybridrl.config_reference import field_docs, group_options, reference
from tests.paths import REPO

REFERENCE = REPO / "docs" / "reference.md"


def test_the_reference_page_is_up_to_date():
    assert REFERENCE.read_text() == reference(), (
        "docs/reference.md is stale: python -m hybridrl.config_reference > docs/reference.md"
    )


def test_every_key_has_a_meaning():
    missing = [
        line.split("|")[1].strip()
        for line in reference().splitlines()
        if line.startswith("| `") and line.rstrip().endswith("|  |")
    ]
    assert missing == [], f"fields without a docstring: {missing}"


def test_field_docs_reads_the_string_under_each_field():
    from hybridrl.eval_config import EvalConfig, EvaluateConfig

    docs = field_docs(EvalConfig)
    assert docs["n"].startswith("Samples per prompt")
    assert field_docs(EvaluateConfig)["model"] == "The policy model."  # inherited from RunConfig


def test_groups_include_recipes_and_every_conf_folder():
    groups = group_options()
    assert "cpu_demo" in groups["recipe"] and "hf" in groups["data"]
    folders = {p.name for p in (REPO / "conf").iterdir() if p.is_dir() and not p.name.startswith("_")}
    assert folders | {"recipe"} == set(groups)


def test_help_lists_every_group_and_points_to_the_reference():
    r = subprocess.run(
        [sys.executable, "-m", "hybridrl", "--help"], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stderr
    from hybridrl.cli import help_text

    for text in (r.stdout, help_text("hybridrl.evaluate"), help_text("hybridrl.generate")):
        for group, options in group_options().items():
            assert f"  {group} " in text and ", ".join(options) in text, group
        assert "docs/reference.md" in text


def test_the_plan_answers_help_instead_of_composing_it_as_an_override(capsys):
    from hybridrl.cli import help_text
    from hybridrl.plan import main

    assert main(["--help"]) == 0
    assert capsys.readouterr().out.strip() == help_text("hybridrl.plan").strip()
    assert help_text("hybridrl.plan").startswith("usage: python -m hybridrl.plan")


def test_a_sweep_without_multirun_gets_hydras_whole_hint(tmp_path):
    r = subprocess.run(
        [sys.executable, "-m", "hybridrl", "trainer.lr=1e-3,3e-3", f"hydra.run.dir={tmp_path}"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Ambiguous value for argument 'trainer.lr=1e-3,3e-3'" in lines[0], r.stderr
    assert "add --multirun" in lines[0] and "key=[value1,value2]" in lines[0]
