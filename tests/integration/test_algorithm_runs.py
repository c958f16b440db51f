"""The algorithm family through the app: each name runs end to end, DAPO's dynamic sampling keeps the batch full,
rollout corrections log their weights."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.integration.test_e2e import run_app
from tests.paths import REPO

FAST = [
    "model.tiny.pretrain_steps=0",
    "trainer.steps=2",
    "data.train_batch_size=4",
    "algorithm.group_size=4",
    "logger.progress_bar=false",
    "trainer.eval_every=0",
]


def _rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "gspo", "cispo"])
def test_every_algorithm_runs(tmp_path, name):
    r = run_app([f"algorithm={name}", *FAST, f"hydra.run.dir={tmp_path / 'run'}"], tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = _rows(tmp_path / "run")
    assert [row["step"] for row in rows] == [1, 2]
    assert all(row["batch/samples"] == 16 for row in rows)


def test_dapo_refills_the_batch_and_logs_it(tmp_path):
    run_dir = tmp_path / "run"
    r = run_app(
        ["algorithm=dapo", "reward.fn=tests.helpers.rewards:half_the_groups_flat", *FAST, f"hydra.run.dir={run_dir}"],
        REPO,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    rows = _rows(run_dir)
    # Flat groups were dropped and new prompts generated, yet every update saw 4 prompts x 4 samples.
    assert sum(row["batch/filtered_groups"] for row in rows) > 0
    assert all(row["batch/resample_rounds"] >= 1 for row in rows)
    assert all(row["batch/samples"] == 16 for row in rows)
    assert all("reward/overlong_penalty_mean" in row and "reward/generated_mean" in row for row in rows)


def test_masked_importance_sampling_logs_its_weights(tmp_path):
    run_dir = tmp_path / "run"
    r = run_app(["algorithm.rollout_correction=seq_mis", *FAST, f"hydra.run.dir={run_dir}"], tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    for row in _rows(run_dir):
        # float32 CPU: engine and trainer agree to ~1e-7, so every weight is ~1 and nothing is masked.
        assert row["rollout_corr/masked_frac"] == 0.0
        assert abs(row["rollout_corr/weight_mean"] - 1.0) < 1e-4


@pytest.mark.parametrize(
    "args, needle",
    [
        (["algorithm=gspo", "algorithm.loss_agg_mode=token-mean"], "algorithm.loss_agg_mode"),
        (["engine.temperature=0"], "engine.temperature=0 with algorithm.group_size=8"),
        (
            ["algorithm=dapo", "algorithm.overlong_buffer_len=64"],
            "algorithm.overlong_buffer_len=64 must be <= engine.max_new_tokens=8",
        ),
    ],
)
def test_bad_combinations_fail_at_composition(tmp_path, args, needle):
    r = run_app([*args, f"hydra.run.dir={tmp_path / 'run'}"], tmp_path, timeout=120)
    assert r.returncode != 0
    assert needle in r.stdout + r.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
