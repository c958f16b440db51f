"""Sweep tooling: the run summary table, and an Optuna search through Hydra's sweeper plugin."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import yaml

from scripts.summarize_sweep import main as summarize


def fake_job(root, name, overrides, rewards):
    job = root / name
    (job / ".hydra").mkdir(parents=True)
    (job / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(overrides))
    (job / "metrics.jsonl").write_text(
        "".join(json.dumps({"step": i + 1, "reward/mean": r}) + "\n" for i, r in enumerate(rewards))
    )


def test_summary_table_ranks_jobs_by_final_reward(tmp_path):
    fake_job(tmp_path, "0", ["trainer.lr=1e-5"], [0.0, 0.1, 0.2, 0.3, 0.4])
    fake_job(tmp_path, "1", ["trainer.lr=3e-5"], [0.0, 0.3, 0.5, 0.7, 0.9])
    (tmp_path / "not-a-job").mkdir()
    assert summarize([str(tmp_path)]) == 0
    lines = (tmp_path / "summary.md").read_text().splitlines()
    assert "trainer.lr=3e-5" in lines[2] and "trainer.lr=1e-5" in lines[3]  # best first
    assert "| 0.9 | 0.9 |" in lines[2]  # last-20% mean and gain of the better job
    assert (tmp_path / "summary.csv").read_text().count("\n") == 3
    assert (tmp_path / "summary.png").stat().st_size > 1000
    assert summarize([str(tmp_path / "not-a-job")]) == 2


@pytest.mark.slow
def test_optuna_sweeper_searches_the_learning_rate(tmp_path):
    pytest.importorskip("hydra_plugins.hydra_optuna_sweeper", reason="install hybridrl[optuna]")
    args = [
        "-m",
        "hydra/sweeper=optuna",
        "hydra.sweeper.n_trials=2",
        "hydra.sweeper.direction=maximize",
        "trainer.lr=interval(1e-4,1e-2)",
        "trainer.steps=2",
        "data.train_batch_size=4",
        "algorithm.group_size=4",
        "logger.progress_bar=false",
        f"hydra.sweep.dir={tmp_path / 'sweep'}",
    ]
    r = subprocess.run(
        [sys.executable, "-m", "hybridrl", *args],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
    )
    assert r.returncode == 0, r.stderr[-3000:]
    result = yaml.safe_load((tmp_path / "sweep" / "optimization_results.yaml").read_text())
    assert 1e-4 <= result["best_params"]["trainer.lr"] <= 1e-2
    assert isinstance(result["best_value"], float)
