"""`python -m benchmarks.partial_demo`: the CPU demo run synchronously and with rollout=partial, compared on
reward/correct over the last 20% of steps."""

import json
import os
import subprocess
import sys

import pytest

from benchmarks.partial_demo import same_steps, tail_mean
from tests.paths import REPO


def test_the_tail_mean_is_over_the_last_fifth_of_the_steps():
    rows = [{"r": float(i)} for i in range(10)]  # the last 20%: steps 8 and 9
    assert tail_mean(rows, "r") == pytest.approx(8.5)


def test_same_steps_counts_the_leading_steps_that_agree():
    a = [{"r": x} for x in (0.1, 0.2, 0.3, 0.4)]
    assert same_steps(a, [{"r": x} for x in (0.1, 0.2, 0.35, 0.4)], "r") == 2
    assert same_steps(a, a[:3], "r") == 3


@pytest.mark.slow
def test_the_demo_compares_one_seed_and_prints_json(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONPATH=str(REPO))
    cmd = [sys.executable, "-m", "benchmarks.partial_demo", "--seeds", "3", "--set", "trainer.steps=5"]
    r = subprocess.run(
        [
            *cmd,
            "--set",
            "trainer.eval_every=0",
            "--work-dir",
            str(tmp_path / "runs"),
            "--out",
            str(tmp_path / "o.json"),
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout)
    seed = out["seeds"]["3"]
    assert seed["sync"]["steps"] == seed["partial"]["steps"] == 5
    assert seed["difference"] == pytest.approx(
        seed["partial"]["reward_correct_last20"] - seed["sync"]["reward_correct_last20"]
    )
    assert out["max_abs_difference"] == pytest.approx(abs(seed["difference"]))
    assert out["within_0_05"] == (out["max_abs_difference"] <= 0.05)
    partial_rows = [json.loads(line) for line in (tmp_path / "runs" / "partial_3" / "metrics.jsonl").open()]
    assert seed["partial"]["steps_carrying"] == sum(row["rollout/carried"] > 0 for row in partial_rows)
    assert out["max_new_tokens"] == 16
    overrides = {
        run: (tmp_path / "runs" / run / ".hydra" / "overrides.yaml").read_text() for run in ("sync_3", "partial_3")
    }
    for run in overrides.values():  # both runs sample with room for tails
        assert "- engine.max_new_tokens=16" in run
    # The partial run masks carried tokens by how far the policy moved since they were sampled; the synchronous one
    # keeps the recipe's (no correction).
    assert out["correction"] == "token_mis"
    assert "- algorithm.rollout_correction=token_mis" in overrides["partial_3"]
    assert "rollout_correction" not in overrides["sync_3"]
