"""What the console says besides the per-step line: validation results, and a warning when the run has no learning
signal.

    watch = LearningSignalWatch(patience=5)
    for step ...:
        message = watch.update(step, metrics)     # a warning once 5 steps in a row had no signal, else None
        if message: log.warning(message)
        if "val/accuracy" in metrics: log.info(validation_line(step, metrics))
"""

from __future__ import annotations

from typing import Any

ZERO_STD = "reward/zero_std_frac"


class LearningSignalWatch:
    """Notices steps on which no group has a learning signal: every prompt's samples got the same reward
    (`reward/zero_std_frac` = 1), so every group-baseline advantage is 0 and the update changes nothing.

    Warns when `patience` such steps come in a row, and again every `remind_every` steps while it lasts."""

    def __init__(self, patience: int = 5, remind_every: int = 50) -> None:
        self.patience, self.remind_every = patience, remind_every
        self.streak = 0

    def update(self, step: int, metrics: dict[str, Any]) -> str | None:
        """The warning to log after `step`, or None."""
        if metrics.get(ZERO_STD) is None or metrics[ZERO_STD] < 1.0:
            self.streak = 0
            return None
        self.streak += 1
        due = self.streak == self.patience or (
            self.streak > self.patience and (self.streak - self.patience) % self.remind_every == 0
        )
        return no_signal_message(step, self.streak, metrics) if due else None


def no_signal_message(step: int, streak: int, metrics: dict[str, Any]) -> str:
    """Why the run is not learning, and what to try, from the step's reward figures."""
    mean, top = metrics.get("reward/mean"), metrics.get("reward/max")
    if top is not None and top <= 0:
        why = "no answer earns any reward (reward/max 0)"
        tries = (
            "check samples.jsonl: are the answers scored as you expect (reward, prompt_key, answer_key)? "
            "Use data the model can solve sometimes, a larger model, a reward with partial credit (e.g. "
            "reward=math_with_format), or more samples per prompt (algorithm.group_size)"
        )
    elif mean is not None and top is not None and mean >= top:
        why = f"every answer earns the same reward ({mean:.3f})"
        tries = (
            "the task may be solved or too easy (harder data), or the reward may not tell answers apart "
            "(check samples.jsonl); a higher engine.temperature or larger algorithm.group_size draws more "
            "varied answers"
        )
    else:
        why = "each prompt's answers all earn the same reward"
        tries = (
            "raise engine.temperature or algorithm.group_size for more varied answers, or use a reward with "
            "partial credit; samples.jsonl shows what the model writes"
        )
    return (
        f"step {step}: no learning signal for {streak} steps in a row: {why}, so reward/zero_std_frac is 1.0 and "
        f"every advantage is 0 (the policy does not change). Try: {tries}"
    )


def validation_line(step: int, metrics: dict[str, Any]) -> str:
    """`step 25 validation: accuracy 0.078 reward 0.826 len 5.0 pass@4 0.22` from the step's val/* metrics."""
    parts = [f"step {step} validation:"]
    for key, short, fmt in (
        ("val/accuracy", "accuracy", "{:.3f}"),
        ("val/reward_mean", "reward", "{:.3f}"),
        ("val/response_length_mean", "len", "{:.1f}"),
    ):
        if metrics.get(key) is not None:
            parts.append(f"{short} {fmt.format(metrics[key])}")
    for key in sorted(k for k in metrics if k.startswith(("val/pass@", "val/mean@"))):
        parts.append(f"{key[4:]} {metrics[key]:.3f}")
    return " ".join(parts)
