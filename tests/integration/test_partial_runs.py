"""Partial rollouts through the app (`rollout=partial`): with nothing over-sampled a step is the synchronous step,
a resumed run equals an uninterrupted one with samples carried across the checkpoint, nothing trained lags more than
rollout.partial.max_staleness, and every algorithm family runs with it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.integration.test_e2e import run_app
from tests.paths import REPO
from tests.unit.test_checkpoints import assert_same_metrics, kill_and_resume, volatile

# The untrained tiny model stops on any of these 30 ids (about one token in nine): responses of every length up to
# the cap of 48, so groups complete at different decode steps (4 of 8 groups of 4 after about 16), and a sample still
# running then has more of its cap left than that: a tail, carried.
STOPS = "engine.stop_token_ids=[" + ",".join(str(i) for i in range(30, 60)) + "]"
FAST = [
    "model.tiny.pretrain_steps=0",
    "data.train_batch_size=4",
    "algorithm.group_size=4",
    "logger.progress_bar=false",
    "trainer.eval_every=0",
    STOPS,
    "engine.max_new_tokens=48",
]
PARTIAL = ["rollout=partial", "rollout.partial.oversample=1.0"]


def rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def run(tmp_path: Path, name: str, *args: str, cwd: Path | None = None) -> list[dict]:
    r = run_app([*FAST, *args, f"hydra.run.dir={tmp_path / name}"], cwd or tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    return rows(tmp_path / name)


def test_nothing_over_sampled_is_the_synchronous_step(tmp_path):
    sync = run(tmp_path, "sync", "trainer.steps=3")
    partial = run(tmp_path, "partial", "trainer.steps=3", "rollout=partial", "rollout.partial.oversample=0")
    assert {r["response/length_mean"] for r in sync} != {48.0}  # lengths vary: a real test of the stop
    for a, b in zip(sync, partial, strict=True):
        for key, value in a.items():
            if not volatile(key):
                assert b[key] == value, (a["step"], key)
        assert (b["rollout/carried"], b["rollout/pending_groups"], b["rollout/staleness_max"]) == (0, 0, 0)


@pytest.mark.slow
def test_with_no_tail_an_over_sampled_step_is_the_synchronous_step(tmp_path):
    # Capped at 3 tokens, a group of 4 is rarely done before the cap: the groups complete together, nothing is left
    # with a tail, the groups not needed restart and come first next step, in the places the synchronous step gives
    # them. So every step trains the synchronous step's samples, drawn from the same streams.
    short = [a if not a.startswith("engine.max_new_tokens") else "engine.max_new_tokens=3" for a in FAST]

    def app_rows(name: str, *args: str) -> list[dict]:
        r = run_app([*short, "trainer.steps=3", *args, f"hydra.run.dir={tmp_path / name}"], tmp_path)
        assert r.returncode == 0, r.stderr[-3000:]
        return rows(tmp_path / name)

    sync, partial = app_rows("sync"), app_rows("partial", *PARTIAL)
    assert {r["response/length_mean"] for r in sync} != {3.0}  # some responses stop before the cap
    for a, b in zip(sync, partial, strict=True):
        for key, value in a.items():
            if not volatile(key):
                assert b[key] == value, (a["step"], key)
    assert [r["rollout/surplus_groups"] for r in partial] == [4, 4, 4]  # oversample=1.0: 4 groups more, restarted
    assert all(r["rollout/carried"] == 0 for r in partial)


@pytest.mark.slow
def test_resume_with_samples_carried_across_the_checkpoint_matches_an_uninterrupted_run(tmp_path):
    # trainer.seed=1: step 3 stops with tails in flight (steps alternate: one that finishes carried tails runs long
    # enough that its own unfinished samples have no tail left and finish with it), so the checkpoint holds some.
    args = [*FAST, *PARTIAL, "trainer.save_every=3", "trainer.steps=6", "trainer.seed=1"]
    a, b, _ = kill_and_resume(args, tmp_path)
    assert_same_metrics(a, b)
    pool = torch.load(tmp_path / "resumed" / "checkpoints" / "step_000003" / "rollout_pool.pt", weights_only=True)
    unfinished = [f == "" and n > 0 for f, n in zip(pool["finish"], pool["lengths"].tolist())]
    assert any(unfinished)  # the checkpoint did hold samples half-way, continued after the resume
    assert b[3]["rollout/carried"] > 0


@pytest.mark.slow
def test_nothing_trained_lags_more_than_max_staleness(tmp_path):
    out = run(tmp_path, "run", "trainer.steps=4", *PARTIAL, "rollout.partial.max_staleness=0")
    assert all(r["rollout/staleness_max"] == 0 and r["rollout/carried"] == 0 for r in out)
    assert sum(r["rollout/dropped"] for r in out) > 0  # what step 1 left half-way restarted, counted


@pytest.mark.slow
@pytest.mark.parametrize(
    "case",
    [
        ["algorithm=grpo"],
        ["algorithm=ppo", "critic.warmup_steps=0"],
        ["algorithm=dapo", "reward.fn=tests.helpers.rewards:half_the_groups_flat"],
        ["model.lora.rank=8", "trainer.lr=2e-2"],
        ["rollout=agent", "rollout.partial.enabled=true"],
    ],
    ids=["grpo", "ppo", "dapo", "lora", "agent"],
)
def test_every_algorithm_family_runs_with_partial_rollouts(tmp_path, case):
    partial = PARTIAL if "rollout=agent" not in case else ["rollout.partial.oversample=1.0"]
    out = run(tmp_path, "run", "trainer.steps=3", *partial, *case, cwd=REPO)
    assert all(r["batch/samples"] == 16 for r in out)
    assert all(r["rollout/staleness_max"] <= 1 for r in out)
    assert sum(r["rollout/oversampled_groups"] for r in out) > 0
    if "algorithm=ppo" in case:
        assert all("critic/values_mean" in r for r in out)
    if "algorithm=dapo" in case:
        assert sum(r["batch/filtered_groups"] for r in out) > 0


@pytest.mark.multiproc
def test_an_engine_tp_group_of_two_stops_where_one_worker_does(tmp_path):
    """Both ranks of one engine replica see the same completions and stop at the same decode step: two workers (FSDP
    over 2, engine TP 2) train on the samples one worker trains on."""
    from tests.integration.test_cluster import LOCAL2, AppRun
    from tests.integration.test_cluster import assert_same_metrics as assert_close_metrics

    args = [STOPS, "engine.max_new_tokens=48", "trainer.eval_every=0", *PARTIAL, "trainer.steps=3"]  # AppRun: FAST
    (tmp_path / "one").mkdir()
    (tmp_path / "two").mkdir()
    one, two = AppRun(args, tmp_path / "one"), AppRun([*LOCAL2, "engine.tp_size=2", *args], tmp_path / "two")
    assert one.wait() == 0, one.output[-3000:]
    assert two.wait() == 0, two.output[-3000:]
    assert any(r["rollout/carried"] > 0 for r in one.metrics())
    assert_close_metrics(two.metrics(), one.metrics())


@pytest.mark.multiproc
def test_two_engine_replicas_share_the_groups(tmp_path):
    out = run(tmp_path, "run", "cluster=local", "cluster.workers_per_node=2", "trainer.steps=3", *PARTIAL)
    assert all(r["batch/samples"] == 16 and r["rollout/staleness_max"] <= 1 for r in out)
    assert sum(r["rollout/carried"] for r in out) > 0
