"""A short run's saved model, then what a user does with it: evaluate it (the same figures as the run's last
validation), generate from it, resume the finished run; and what the console says along the way. The fast suite
keeps the acceptance checks; the rest (more subprocesses) run with -m slow."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.test_e2e import FAST, run_app

STEPS = 10  # with the random-weight tiny model (FAST), enough for the format reward to move off 0


def run_module(module: str, args: list[str], cwd: Path, timeout: int = 240) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONUNBUFFERED="1", WANDB_MODE="offline")
    return subprocess.run(
        [sys.executable, "-m", module, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A 10-step run with validation at its end, logged to wandb offline; its dir and console output."""
    tmp = tmp_path_factory.mktemp("trained")
    run_dir = tmp / "run"
    args = [f"trainer.steps={STEPS}", f"trainer.eval_every={STEPS}", "logger=wandb", f"hydra.run.dir={run_dir}"]
    r = run_app([*args, *FAST], tmp)
    assert r.returncode == 0, r.stderr[-3000:]
    return run_dir, r.stdout + r.stderr


def last_validation(run_dir: Path) -> dict:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return rows[-1]


def test_the_final_model_is_saved_and_the_console_ends_with_a_summary(trained):
    run_dir, out = trained
    ckpt = run_dir / "checkpoints" / f"step_{STEPS:06d}"
    assert (ckpt / "meta.json").is_file()
    summary = out[out.index("summary: ") :]
    assert f"summary: {STEPS} steps" in summary and "s per step" in summary
    assert "reward/mean" in summary and "reward/format" in summary and "val/accuracy" in summary
    assert f"checkpoints/step_{STEPS:06d}" in summary and "plots.png" in summary and "objective" in summary
    assert f"step {STEPS} validation: accuracy" in out  # validation on the console (and so in hybridrl.log)
    assert "validation: accuracy" in (run_dir / "hybridrl.log").read_text()
    # Output to a pipe: no progress bar, no transformers bars, no wandb listing hiding the reward behind "+64".
    for noise in ("%|", "Loading weights", "Writing model shards", "Run summary", "Run history"):
        assert noise not in out, noise


def test_evaluate_on_the_final_checkpoint_equals_the_last_validation(trained, tmp_path):
    run_dir, _ = trained
    ckpt = run_dir / "checkpoints" / f"step_{STEPS:06d}"
    r = run_module("hybridrl.evaluate", [f"model.path={ckpt}", f"hydra.run.dir={tmp_path / 'eval'}"], tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads((tmp_path / "eval" / "eval_summary.json").read_text())
    val = last_validation(run_dir)
    assert val["val/reward_mean"] > 0, "a run this short should have moved the format reward off 0"
    assert summary["split"] == "val" and summary["prompts"] == 64 and summary["n"] == 1
    assert summary["pass@1"] == pytest.approx(val["val/accuracy"], abs=1e-9)
    assert summary["reward/mean"] == pytest.approx(val["val/reward_mean"], rel=1e-6)
    assert summary["response/length_mean"] == pytest.approx(val["val/response_length_mean"], rel=1e-6)
    samples = [json.loads(line) for line in (tmp_path / "eval" / "eval_samples.jsonl").read_text().splitlines()]
    assert len(samples) == 64 and {"prompt", "response", "answer", "reward", "reward/format", "correct"} <= set(
        samples[0]
    )
    assert "pass@1" in r.stdout + r.stderr and "response/length_mean" in r.stdout + r.stderr  # the table


@pytest.mark.slow
def test_evaluate_samples_n_answers_per_prompt_from_an_hf_dataset(trained, tmp_path):
    datasets = pytest.importorskip("datasets")
    rows = [{"q": f"copy: {n}", "a": str(n)} for n in (12, 345, 6789)]
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "data"))
    run_dir, _ = trained
    args = [
        f"model.path={run_dir / 'checkpoints' / f'step_{STEPS:06d}'}",
        "data=hf",
        f"data.path={tmp_path / 'data'}",
        "data.prompt_key=q",
        "data.answer_key=a",
        "eval.n=4",
        "eval.temperature=1.0",
        f"hydra.run.dir={tmp_path / 'eval'}",
    ]
    r = run_module("hybridrl.evaluate", args, tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads((tmp_path / "eval" / "eval_summary.json").read_text())
    assert summary["split"] == "train" and summary["prompts"] == 3 and summary["samples"] == 12
    assert {"pass@1", "pass@2", "pass@4"} <= set(summary) and summary["pass@1"] <= summary["pass@4"]
    samples = [json.loads(line) for line in (tmp_path / "eval" / "eval_samples.jsonl").read_text().splitlines()]
    assert [s["answer"] for s in samples] == [r["a"] for r in rows for _ in range(4)]


@pytest.mark.slow
def test_generate_prints_completions(trained, tmp_path):
    run_dir, _ = trained
    args = [
        f"model.path={run_dir / 'checkpoints' / f'step_{STEPS:06d}'}",
        'prompts=["copy: 4172", "copy: 93"]',
        "eval.n=2",
        "eval.temperature=1.0",
        f"hydra.run.dir={tmp_path / 'gen'}",
    ]
    r = run_module("hybridrl.generate", args, tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    out = r.stdout + r.stderr
    assert "prompt 0: copy: 4172" in out and "prompt 1: copy: 93" in out and out.count("  [1] ") == 2
    rows = [json.loads(line) for line in (tmp_path / "gen" / "generations.jsonl").read_text().splitlines()]
    assert len(rows) == 4 and {r["prompt"] for r in rows} == {"copy: 4172", "copy: 93"}


def test_resuming_a_finished_run_says_so_in_one_line(trained, tmp_path):
    run_dir, _ = trained
    ckpt = run_dir / "checkpoints" / f"step_{STEPS:06d}"
    args = [f"trainer.resume={ckpt}", f"trainer.steps={STEPS}", f"hydra.run.dir={tmp_path / 'again'}"]
    r = run_app([*args, *FAST], tmp_path)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-3000:]
    assert "Traceback" not in out
    assert len([line for line in out.splitlines() if "the run is finished" in line]) == 1


@pytest.mark.slow
def test_resuming_with_fewer_steps_than_the_checkpoint_is_refused(trained, tmp_path):
    run_dir, _ = trained
    ckpt = run_dir / "checkpoints" / f"step_{STEPS:06d}"
    args = [f"trainer.resume={ckpt}", f"trainer.steps={STEPS - 1}", f"hydra.run.dir={tmp_path / 'again'}"]
    r = run_app([*args, *FAST], tmp_path)
    assert r.returncode == 2 and f"set trainer.steps >= {STEPS}" in r.stdout + r.stderr


@pytest.mark.slow
def test_a_run_that_cannot_learn_warns_within_10_steps(tmp_path):
    """Long sums the random-weight model never gets right, scored 0/1 (reward=math): every group is flat."""
    args = [
        "data.synthetic.task=add",
        "data.synthetic.min_digits=8",
        "data.synthetic.max_digits=8",
        "reward=math",
        "trainer.steps=10",
        "trainer.eval_every=0",
        f"hydra.run.dir={tmp_path / 'run'}",
    ]
    r = run_app([*args, *FAST], tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    warnings = [line for line in (r.stdout + r.stderr).splitlines() if "no learning signal" in line]
    assert warnings and "step 5: no learning signal for 5 steps in a row" in warnings[0], warnings
    assert "Try:" in warnings[0]


@pytest.mark.slow
def test_evaluate_refuses_what_it_cannot_score_in_one_line(tmp_path):
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"prompt": "copy: 12", "answer": "12"}\n')
    for args, needle in [
        (["model.path=/nonexistent/model"], "model.path='/nonexistent/model': no such folder"),
        (["eval.n=4"], "eval.n=4 with eval.temperature=0"),
        (["eval.split=val", "data=jsonl", f"data.path={rows}"], "eval.split=val, but the data has no held-out"),
        (["eval.nn=4"], "eval.nn"),
    ]:
        args = [*args, "model.tiny.pretrain_steps=0", f"hydra.run.dir={tmp_path / 'eval'}"]
        r = run_module("hybridrl.evaluate", args, tmp_path, timeout=120)
        out = r.stdout + r.stderr
        assert r.returncode == 2 and needle in out and "Traceback" not in out, (args, out[-2000:])
