"""Scoring a rollout batch with the configured reward function (the worker's "reward" phase)."""

from __future__ import annotations

from typing import Any, Callable

from hybridrl.batch import Batch
from hybridrl.rewards.base import RewardInput, normalize_results


def reward_inputs(batch: Batch, tokenizer: Any) -> list[RewardInput]:
    """What a reward function sees for each row: prompt text, the decoded response, the dataset row, the finish."""
    lengths = batch["response_mask"].sum(-1).tolist()
    return [
        RewardInput(
            prompt=batch.meta["prompt_text"][i],
            response=tokenizer.decode(batch["responses"][i, : int(n)].tolist(), skip_special_tokens=True),
            sample=batch.meta["sample"][i],
            finish_reason=batch.meta["finish_reason"][i],
        )
        for i, n in enumerate(lengths)
    ]


def score_batch(reward_fn: Callable, batch: Batch, tokenizer: Any) -> tuple[list[float], dict[str, list[float]]]:
    """Scores and per-component values of every row of `batch`."""
    items = reward_inputs(batch, tokenizer)
    return normalize_results(reward_fn(items), expected=len(items))
