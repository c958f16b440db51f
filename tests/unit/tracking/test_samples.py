"""Rollout samples: which rows are picked, what a row holds, samples.jsonl on resume, the wandb Table (offline),
and the reward components in plots.png."""

from __future__ import annotations

import json

import pytest
import torch

from hybridrl.batch import Batch
from hybridrl.errors import ConfigError
from hybridrl.tracking.config import LoggerConfig
from hybridrl.tracking.plot import first_last_means, plot_run, reward_components
from hybridrl.tracking.samples import SampleLog, pick_samples, sample_rows
from hybridrl.tracking.tracker import Tracker


@pytest.mark.parametrize(
    "n_rows,k,group,expected",
    [
        (128, 4, 8, [0, 32, 64, 96]),  # first sample of prompts 0, 4, 8, 12 of 16
        (16, 2, 8, [0, 8]),
        (16, 3, 8, [0, 5, 10]),  # more samples than prompts: spread over rows
        (16, 0, 8, []),
        (0, 4, 8, []),
        (3, 5, 1, [0, 1, 2]),
    ],
)
def test_pick_samples(n_rows: int, k: int, group: int, expected: list[int]) -> None:
    assert pick_samples(n_rows, k, group) == expected


class CharTokenizer:
    """Token i is chr(ord('a') + i); 99 is a special token."""

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return "".join("" if (i == 99 and skip_special_tokens) else chr(ord("a") + i) for i in ids)


def test_sample_rows_decode_only_the_real_tokens_and_carry_every_component() -> None:
    batch = Batch(
        prompts=[[1], [2]],
        tensors={
            "responses": torch.tensor([[0, 1, 99, 5], [2, 3, 4, 5]]),
            "response_mask": torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]], dtype=torch.float32),
        },
        meta={
            "prompt_text": ["copy: 12", "copy: 34"],
            "sample": [{"answer": "12"}, {"question": "q"}],
            "finish_reason": ["stop", "length"],
        },
    )
    rows = sample_rows(batch, [0, 1], CharTokenizer(), [0.75, 0.0], {"format": [1.0, 0.5], "correct": [0.5, 0.0]})
    assert rows == [
        {
            "prompt": "copy: 12",
            "response": "ab",
            "answer": "12",
            "reward": 0.75,
            "reward/format": 1.0,
            "reward/correct": 0.5,
            "finish_reason": "stop",
        },
        {
            "prompt": "copy: 34",
            "response": "cdef",
            "reward": 0.0,
            "reward/format": 0.5,
            "reward/correct": 0.0,
            "finish_reason": "length",
        },
    ]


def test_sample_log_schedule_cap_and_resume(tmp_path) -> None:
    log = SampleLog(tmp_path, every=5, per_step=2)
    assert [s for s in range(1, 16) if log.due(s)] == [1, 5, 10, 15]
    assert not SampleLog(tmp_path, every=0, per_step=2).due(1)
    assert not SampleLog(tmp_path, every=5, per_step=0).due(5)
    for step in (1, 5, 10):
        log.write(step, [{"prompt": "p", "response": str(step), "reward": float("nan")}] * 3)
    lines = [json.loads(x) for x in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [1, 1, 5, 5, 10, 10]  # at most per_step rows a step
    assert list(lines[0]) == ["step", "prompt", "response", "reward"] and lines[0]["reward"] is None
    log.resume_at(5)
    assert [json.loads(x)["step"] for x in (tmp_path / "samples.jsonl").read_text().splitlines()] == [1, 1, 5, 5]


def test_logger_config_rejects_negative_sample_settings() -> None:
    with pytest.raises(ConfigError, match="logger.samples_every"):
        LoggerConfig(samples_every=-1)
    with pytest.raises(ConfigError, match="logger.samples_per_step"):
        LoggerConfig(samples_per_step=-2)


def test_tracker_resume_drops_samples_after_the_checkpoint(tmp_path) -> None:
    tracker = Tracker(LoggerConfig(samples_every=1, plot=False), tmp_path, {}, "job", None)
    for step in (1, 2, 3):
        tracker.log(step, {"reward/mean": 0.1})
        tracker.log_samples(step, [{"prompt": "p", "response": "r", "reward": 0.1}])
    tracker.resume_at(2)
    steps = [json.loads(x)["step"] for x in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert steps == [1, 2]


def test_wandb_offline_run_holds_the_samples_table(tmp_path, monkeypatch) -> None:
    pytest.importorskip("wandb")
    for var in ("WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = LoggerConfig(name="wandb", mode="offline", plot=False, samples_every=1)
    tracker = Tracker(cfg, tmp_path, {"trainer": {"lr": 1e-3}}, "job", None)
    try:
        tracker.log(1, {"reward/mean": 0.5})
        tracker.log_samples(
            1,
            [
                {
                    "prompt": "copy: 4172",
                    "response": "4172",
                    "answer": "4172",
                    "reward": 1.0,
                    "reward/correct": 1.0,
                    "finish_reason": "stop",
                }
            ],
        )
    finally:
        tracker.finish()
    tables = list(tmp_path.glob("wandb/offline-run-*/files/media/table/samples_*.table.json"))
    assert len(tables) == 1, sorted(str(p) for p in tmp_path.rglob("*"))
    table = json.loads(tables[0].read_text())
    assert table["columns"] == ["step", "prompt", "response", "answer", "reward", "reward/correct", "finish_reason"]
    assert table["data"] == [[1, "copy: 4172", "4172", "4172", 1.0, 1.0, "stop"]]
    assert json.loads((tmp_path / "samples.jsonl").read_text())["response"] == "4172"


def test_plot_shows_each_reward_component(tmp_path) -> None:
    rows = [
        {
            "step": s,
            "reward/mean": s / 10,
            "reward/std": 0.1,
            "reward/format": 1.0,
            "reward/correct": s / 10,
            "reward/zero_std_frac": 0.0,
            "response/length_mean": 4.0,
        }
        for s in range(1, 11)
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert reward_components(rows) == ["reward/format", "reward/correct"]
    assert first_last_means([r["reward/correct"] for r in rows]) == pytest.approx((0.15, 0.95))  # 2 of 10 steps
    out = plot_run(tmp_path / "metrics.jsonl", tmp_path / "plots.png")
    assert out.stat().st_size > 1000
