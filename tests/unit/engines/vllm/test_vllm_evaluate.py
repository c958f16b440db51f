"""With engine=vllm: python -m hybridrl.evaluate on a run's final checkpoint gives the run's last validation figures
(the same held-out prompts, greedy), and the console carries none of vLLM's known-harmless noise."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.vllm

STEPS = 10
SMALL = ["model.tiny.pretrain_steps=0", "data.train_batch_size=4", "algorithm.group_size=4"]
NOISE = ("Chat template warmup failed", "Failed to load weights", "Using None for EOS token id", "Traceback")


def run(module: str, args: list[str], tmp_path) -> str:
    env = dict(os.environ, PYTHONUNBUFFERED="1", VLLM_CACHE_ROOT=str(tmp_path / "vllm-cache"))
    r = subprocess.run(
        [sys.executable, "-m", module, "engine=vllm", *SMALL, *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    return out


def test_evaluate_with_vllm_equals_the_runs_last_validation(tmp_path):
    run_dir, eval_dir = tmp_path / "run", tmp_path / "eval"
    out = run(
        "hybridrl", [f"trainer.steps={STEPS}", f"trainer.eval_every={STEPS}", f"hydra.run.dir={run_dir}"], tmp_path
    )
    ckpt = run_dir / "checkpoints" / f"step_{STEPS:06d}"
    out += run("hybridrl.evaluate", [f"model.path={ckpt}", f"hydra.run.dir={eval_dir}"], tmp_path)
    val = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])
    summary = json.loads((eval_dir / "eval_summary.json").read_text())
    assert summary["engine"] == "vllm" and summary["prompts"] == 64
    assert val["val/reward_mean"] > 0, "ten steps should have moved the format reward off 0"
    assert summary["pass@1"] == pytest.approx(val["val/accuracy"], abs=1e-9)
    assert summary["reward/mean"] == pytest.approx(val["val/reward_mean"], rel=1e-6)
    for noise in NOISE:
        assert noise not in out, noise
