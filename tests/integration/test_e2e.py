"""The app end to end in subprocesses: a short run's outputs, user errors, and a multirun sweep."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.paths import REPO

REQUIRED_METRICS = [
    "step",
    "reward/mean",
    "response/length_mean",
    "perf/tokens_per_s",
    "actor/kl",
    "actor/entropy",
    "actor/clip_frac",
    "actor/grad_norm",
    "mismatch/logp_abs_mean",
] + [f"time/{p}" for p in ("wake", "generate", "sleep", "logprob", "reward", "advantages", "update", "reshard")]

# The recipes a user can pick: the YAML files in recipes/recipe/.
RECIPES = sorted(p.stem for p in (REPO / "recipes" / "recipe").glob("*.yaml"))

# Small and quick: 4 prompts x 4 samples, 2 steps.
FAST = ["model.tiny.pretrain_steps=0", "data.train_batch_size=4", "algorithm.group_size=4", "logger.progress_bar=false"]


def run_app(args: list[str], cwd: Path, timeout: int = 240) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONUNBUFFERED="1", WANDB_MODE="offline")
    return subprocess.run(
        [sys.executable, "-m", "hybridrl", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )


def test_two_step_run_writes_everything(tmp_path):
    run_dir = tmp_path / "run"
    r = run_app(["trainer.steps=2", "trainer.eval_every=2", f"hydra.run.dir={run_dir}", *FAST], tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2]
    for key in REQUIRED_METRICS:
        assert key in rows[0], key
    assert "val/reward_mean" in rows[1] and "val/reward_mean" not in rows[0]
    assert (run_dir / ".hydra" / "config.yaml").exists() and (run_dir / ".hydra" / "overrides.yaml").exists()
    assert (run_dir / "plots.png").stat().st_size > 1000
    log = (run_dir / "hybridrl.log").read_text()
    assert "step 1 reward" in log and "generate" in log and "reshard" in log
    # The engine's and the trainer's log-probs agree (float32 CPU).
    assert all(row["mismatch/logp_abs_max"] < 1e-4 for row in rows)


@pytest.mark.parametrize(
    "args, needle",
    [
        (["trainer.lr=abc"], "trainer.lr"),
        (["engine=nonexistent"], "engine/nonexistent"),
        (["data=jsonl", "data.path=/nonexistent/train.jsonl"], "data.path='/nonexistent/train.jsonl': file not found"),
        (["data.max_prompt_tokens=5"], "data.max_prompt_tokens=5"),
        (["+trainer.lrr=1e-3"], "trainer.lrr is not a config key (did you mean trainer.lr?)"),
        (["recipe=gsm8k_grop"], "recipe options: " + ", ".join(RECIPES)),
        (["engine.impl=hf"], "engine.native.impl"),
        (["+engine.max_batch_size=8"], "engine.native.max_batch_size"),
        (["trainer.lr=nan"], "trainer.lr=nan is not a number"),
    ],
)
def test_user_errors_exit_nonzero_with_a_short_message(tmp_path, args, needle):
    # A deadline, not a speed check: a case that fails after the model is built (data.max_prompt_tokens) makes the
    # default tiny model first where no earlier test has, pre-training included (over 120 s on a loaded 2-core CPU).
    r = run_app([f"hydra.run.dir={tmp_path / 'run'}", *args], tmp_path, timeout=300)
    assert r.returncode != 0
    out = r.stdout + r.stderr
    assert needle in out, out[-2000:]
    assert "Traceback" not in out, out[-2000:]
    assert len([line for line in out.splitlines() if "error" in line.lower()]) == 1, out[-2000:]


def test_multirun_sweep_runs_each_job_in_its_own_dir_and_groups_wandb_runs(tmp_path):
    sweep = tmp_path / "2026-01-01" / "12-00-00"
    r = run_app(
        [
            "-m",
            "recipe=cpu_demo",
            "trainer.lr=1e-5,3e-5",
            "logger=wandb",
            "trainer.steps=1",
            "trainer.eval_every=0",
            f"hydra.sweep.dir={sweep}",
            *FAST,
        ],
        tmp_path,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    dirs = sorted(p for p in sweep.iterdir() if p.is_dir())
    assert [d.name for d in dirs] == ["0", "1"]
    lrs = sorted(json.loads((d / "metrics.jsonl").read_text().splitlines()[0])["actor/lr"] for d in dirs)
    assert lrs == pytest.approx([1e-5, 3e-5])
    for d, lr in zip(dirs, ("1e-05", "3e-05")):
        runs = list((d / "wandb").glob("offline-run-*/run-*.wandb"))
        assert len(runs) == 1, list(d.rglob("*"))
        record = runs[0].read_bytes()
        # One group for the sweep, the job named by the swept value, and the full config with it.
        assert b"2026-01-01_12-00-00" in record
        assert f"trainer.lr={lr}".encode() in record
        for section in (b"reshard", b'"kl_estimator"', b'"micro_batch_size"', b'"sleep_level"'):
            assert section in record
