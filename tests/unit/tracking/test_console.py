"""What the console says: the no-learning-signal warning, validation lines, the end-of-run summary."""

from __future__ import annotations

from hybridrl.tracking.console import LearningSignalWatch, validation_line
from hybridrl.tracking.summary import run_summary


def flat(mean: float = 0.0, top: float = 0.0) -> dict:
    return {"reward/zero_std_frac": 1.0, "reward/mean": mean, "reward/max": top}


def test_the_watch_warns_on_the_fifth_step_in_a_row_without_signal_then_every_fifty():
    watch = LearningSignalWatch(patience=5, remind_every=50)
    said = [step for step in range(1, 120) if watch.update(step, flat())]
    assert said == [5, 55, 105]


def test_one_step_with_signal_restarts_the_count():
    watch = LearningSignalWatch(patience=5)
    steps = [flat()] * 4 + [{"reward/zero_std_frac": 0.9}] + [flat()] * 5
    said = [i + 1 for i, m in enumerate(steps) if watch.update(i + 1, m)]
    assert said == [10]


def test_no_metric_no_warning():
    watch = LearningSignalWatch(patience=1)
    assert watch.update(1, {"reward/mean": 0.0}) is None


def test_the_warning_says_why_and_what_to_try():
    watch = LearningSignalWatch(patience=2)
    watch.update(1, flat())
    nothing_right = watch.update(2, flat())
    assert "step 2: no learning signal for 2 steps" in nothing_right
    assert "no answer earns any reward" in nothing_right and "samples.jsonl" in nothing_right
    watch = LearningSignalWatch(patience=1)
    all_right = watch.update(7, flat(mean=1.0, top=1.0))
    assert "every answer earns the same reward (1.000)" in all_right and "harder data" in all_right


def test_validation_line():
    line = validation_line(
        25, {"val/accuracy": 0.078125, "val/reward_mean": 0.8261, "val/response_length_mean": 5.0, "val/pass@4": 0.25}
    )
    assert line == "step 25 validation: accuracy 0.078 reward 0.826 len 5.0 pass@4 0.250"


def test_the_summary_gives_first_and_last_fifths_validation_paths_and_the_objective(tmp_path):
    rows = [
        {
            "step": s,
            "reward/mean": s / 10,
            "reward/correct": 1.0 if s > 5 else 0.0,
            "reward/std": 0.5,  # a statistic, not a component: not listed
            "time/step": 0.2,
            "time/generate": 0.05,
            "time/update": 0.1,
            **({"val/accuracy": s / 20, "val/reward_mean": s / 10} if s % 5 == 0 else {}),
        }
        for s in range(1, 11)
    ]
    plot = tmp_path / "plots.png"
    plot.write_bytes(b"png")
    text = run_summary(rows, 0.95, tmp_path / "checkpoints" / "step_000010", plot)
    lines = text.splitlines()
    # 10 steps: the first and last 20% are 2 steps each; (0.1 + 0.2) / 2 and (0.9 + 1.0) / 2.
    assert lines[0].startswith("summary: 10 steps, 0.20 s per step (update 0.10, generate 0.05)")
    assert "reward/mean     0.150 -> 0.950" in text
    assert "reward/correct  0.000 -> 1.000" in text and "reward/std" not in text
    assert "val/accuracy    0.250 (step 5) -> 0.500 (step 10); val/reward_mean 0.500 -> 1.000" in text
    assert "step_000010" in text and "python -m hybridrl.export --checkpoint" in text and "plots.png" in text
    assert "objective       0.9500 = reward/mean over the last 20% of steps" in text


def test_a_summary_without_steps():
    assert run_summary([], float("nan")) == "summary: no step was logged"
