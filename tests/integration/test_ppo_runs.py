"""algorithm=ppo and reward models through the app: the metrics a run writes, warm-up, setup errors, resume."""

from __future__ import annotations

import json
import signal

import pytest

from tests.integration.test_e2e import run_app
from tests.unit.test_checkpoints import app, rows, volatile

FAST = ["data.train_batch_size=4", "algorithm.group_size=4", "logger.progress_bar=false", "trainer.eval_every=0"]
PHASES = (
    "wake",
    "generate",
    "sleep",
    "logprob",
    "values",
    "reward",
    "advantages",
    "update_critic",
    "update",
    "reshard",
)


def test_ppo_run_with_two_reward_models(tmp_path):
    run_dir = tmp_path / "run"
    r = run_app(
        [
            "algorithm=ppo",
            "reward_model=two_tiny",
            "critic.warmup_steps=1",
            "trainer.steps=2",
            *FAST,
            f"hydra.run.dir={run_dir}",
        ],
        tmp_path,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    first, second = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    for row in (first, second):
        for key in (
            "critic/value_loss",
            "critic/vf_clipfrac",
            "critic/values_mean",
            "critic/explained_var",
            "critic/grad_norm",
            "critic/lr",
            "reward/tiny_rm_a",
            "reward/tiny_rm_b",
            "reward/function",
            "time/reward_model/tiny_rm_a",
            "time/reward_model/tiny_rm_b",
            "memory/values/rss_gb",
            *(f"time/{p}" for p in PHASES),
        ):
            assert key in row, (row["step"], key)
        # The combined score is the weighted sum of the logged sources (conf/reward_model/two_tiny.yaml).
        want = row["reward/function"] + 0.05 * row["reward/tiny_rm_a"] + 0.05 * row["reward/tiny_rm_b"]
        assert row["reward/mean"] == pytest.approx(want, rel=1e-5)
    # Step 1 is the critic's warm-up: the actor's update is skipped, and logged so.
    assert first["critic/warmup"] == 1.0 and first["time/update"] == 0.0 and "actor/pg_loss" not in first
    assert second["critic/warmup"] == 0.0 and second["time/update"] > 0 and "actor/pg_loss" in second
    log = (run_dir / "hybridrl.log").read_text()
    assert "step 1: critic warm-up (1 of critic.warmup_steps=1): the actor's update is skipped" in log


def test_a_reward_model_that_fails_to_load_stops_the_run_at_setup(tmp_path):
    missing = tmp_path / "no-such-rm"
    r = run_app(
        ["reward_model=hf", f"reward_model.models.0.path={missing}", *FAST, f"hydra.run.dir={tmp_path / 'run'}"],
        tmp_path,
        timeout=180,
    )
    out = r.stdout + r.stderr
    assert r.returncode != 0
    assert f"reward_model.models[0] (rm): cannot load the reward model at '{missing}'" in out, out[-2000:]
    assert "Traceback" not in out, out[-2000:]
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.mark.slow
def test_ppo_resume_after_sigkill_matches_an_uninterrupted_run(tmp_path):
    """The critic's weights, Adam state and schedule come back from `checkpoints/step_N/critic/`: the resumed run's
    metrics (critic/* included) equal an uninterrupted run's."""
    args = [
        "algorithm=ppo",
        "critic.lr=5e-3",
        "data.train_batch_size=4",
        "algorithm.group_size=4",
        "logger.progress_bar=false",
        "trainer.save_every=2",
        "trainer.steps=4",
    ]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    p = app([*args, f"hydra.run.dir={straight}"], tmp_path)
    assert p.wait(timeout=600) == 0, p.stdout.read()[-3000:]

    p = app([*args, f"hydra.run.dir={resumed}"], tmp_path, fault="0:wake:4:kill")  # killed after step 3 is logged
    assert p.wait(timeout=600) == -signal.SIGKILL, p.stdout.read()[-3000:]
    assert len(rows(resumed)) == 3 and not (resumed / "checkpoints" / "step_000004").exists()
    ckpt = resumed / "checkpoints" / "step_000002"
    assert (ckpt / "meta.json").exists() and (ckpt / "critic" / "dcp").is_dir()

    p = app([*args, "trainer.resume=auto", f"hydra.run.dir={resumed}"], tmp_path)
    out, _ = p.communicate(timeout=600)
    assert p.returncode == 0, out[-3000:]
    assert "resumed from" in out and "at step 2" in out
    a, b = rows(straight), rows(resumed)
    assert [r["step"] for r in b] == [1, 2, 3, 4]
    assert any(k.startswith("critic/") for k in a[-1])
    for x, y in zip(a, b):
        for key, value in x.items():
            if volatile(key) or value is None:
                continue
            assert y[key] == pytest.approx(value, rel=1e-5, abs=1e-6), (x["step"], key)
