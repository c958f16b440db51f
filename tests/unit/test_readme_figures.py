"""The README's GPU figures are quoted from benchmarks/RESULTS.md, where each has its command, commit, date and GPU:
a figure edited in one place and not the other fails here (CI has no GPU to re-measure them)."""

from __future__ import annotations

import re

from tests.paths import REPO

NUMBER = re.compile(r"\d+(?:\.\d+)?")


def unsourced(readme: str, results: str) -> list[str]:
    """Numbers in the README's paragraphs (or list items) citing RESULTS.md that RESULTS.md does not hold."""
    known = set(NUMBER.findall(results))
    missing = []
    for block in re.split(r"\n(?=- )|\n\n", readme):
        if "benchmarks/RESULTS.md" in block:
            prose = re.sub(r"\[[^\]]*\]\([^)]*\)", "", block)  # links are not figures
            missing += [n for n in NUMBER.findall(prose) if n not in known]
    return missing


def test_every_gpu_figure_in_the_readme_is_in_results():
    readme = (REPO / "README.md").read_text()
    assert "92.4" in readme, "the README quotes the 1.5B rollout figure from benchmarks/RESULTS.md"
    assert unsourced(readme, (REPO / "benchmarks" / "RESULTS.md").read_text()) == []


def test_an_edited_figure_is_caught():
    readme = (REPO / "README.md").read_text()
    results = (REPO / "benchmarks" / "RESULTS.md").read_text()
    assert unsourced(readme.replace("92.4", "95.1"), results) == ["95.1"]
