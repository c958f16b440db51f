"""Countdown reward and data generator."""

from __future__ import annotations

import json

import pytest

from hybridrl.rewards import RewardInput, resolve_reward
from hybridrl.rewards.countdown import check_equation, extract_equation
from scripts.make_countdown import main as make_main
from scripts.make_countdown import make_rows


@pytest.mark.parametrize(
    "eq, ok",
    [
        ("(25 - 5) * 2 + 1", True),  # 41 with each number once
        ("25 - 5 * 2 + 1", False),  # 16
        ("(25 - 5) * 2", False),  # 1 unused
        ("(25 - 5) * 2 + 1 + 1", False),  # 1 used twice
        ("(25 - 5) * 2 + 1.0", False),  # floats are not the given numbers
        ("__import__('os')", False),  # no calls, no names
        ("(25 - 5) * 2 + 1 / 0", False),
        ("", False),
    ],
)
def test_check_equation(eq, ok):
    assert check_equation(eq, [25, 5, 2, 1], 41) is ok


def test_extract_and_reward():
    assert extract_equation("think...\n<answer>(1 + 2) * 3 = 9</answer>") == "(1 + 2) * 3"
    assert extract_equation("so the answer is\n3 * (1 + 2)") == "3 * (1 + 2)"
    fn = resolve_reward("countdown")
    sample = {"numbers": [1, 2, 3], "target": 9}
    scores = fn(
        [RewardInput("p", r, sample) for r in ("<answer>(1+2)*3</answer>", "<answer>1+2+3</answer>", "no idea")]
    )
    assert [s["score"] for s in scores] == [1.0, 0.1, 0.0]


def test_generated_rows_are_solvable(tmp_path):
    for row in make_rows(200, seed=3):
        assert check_equation(row["solution"], row["numbers"], row["target"]), row
    out = tmp_path / "c.jsonl"
    assert make_main(["--output", str(out), "--n", "5"]) == 0
    assert len(out.read_text().splitlines()) == 5 and "numbers" in json.loads(out.read_text().splitlines()[0])
    assert make_main(["--output", str(out), "--n", "5"]) == 2  # never overwrites without --force
