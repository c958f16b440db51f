"""The app with engine=vllm end to end (real vLLM on CPU): a 3-step run and its mismatch metrics."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.vllm


def test_three_step_run_with_vllm(tmp_path):
    run_dir = tmp_path / "run"
    args = [
        "engine=vllm",
        "trainer.steps=3",
        "data.train_batch_size=4",
        "algorithm.group_size=4",
        "logger.progress_bar=false",
        f"hydra.run.dir={run_dir}",
    ]
    env = dict(os.environ, PYTHONUNBUFFERED="1", VLLM_CACHE_ROOT=str(tmp_path / "vllm-cache"))
    r = subprocess.run(
        [sys.executable, "-m", "hybridrl", *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900
    )
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2, 3]
    for row in rows:
        # vLLM's log-probs against the trainer's on the same tokens, every step (float32 CPU).
        assert row["mismatch/logp_abs_mean"] < 1e-4, row["mismatch/logp_abs_mean"]
        assert row["mismatch/logp_abs_max"] < 1e-3
        assert 0.0 <= row["mismatch/frac_above_threshold"] <= 0.0 + 1e-9
    # The engine followed the trainer: after steps of updates the rollouts still match the trainer's log-probs,
    # which they could not if the reshard had not reached vLLM.
    assert rows[-1]["actor/kl"] > 0


def test_two_workers_with_vllm_tensor_parallel(tmp_path):
    """cluster=local with 2 worker processes forming one vLLM TP=2 engine (external_launcher in our group)."""
    run_dir = tmp_path / "run"
    args = [
        "engine=vllm",
        "cluster=local",
        "cluster.workers_per_node=2",
        "engine.tp_size=2",
        "trainer.steps=2",
        "data.train_batch_size=4",
        "algorithm.group_size=4",
        "logger.progress_bar=false",
        f"hydra.run.dir={run_dir}",
    ]
    env = dict(os.environ, PYTHONUNBUFFERED="1", VLLM_CACHE_ROOT=str(tmp_path / "vllm-cache"))
    r = subprocess.run(
        [sys.executable, "-m", "hybridrl", *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900
    )
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2]
    assert all(row["mismatch/logp_abs_mean"] < 1e-4 for row in rows)
