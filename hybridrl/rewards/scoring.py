"""Scoring a rollout batch with the configured reward function (the worker's "reward" phase)."""

from __future__ import annotations

from typing import Any, Callable

from hybridrl.batch import Batch
from hybridrl.rewards.base import RewardInput, RewardScores, score_rewards
from hybridrl.rewards.config import RewardConfig


def response_length(batch: Batch, i: int) -> int:
    """Tokens of row i's response (with rollout=agent every token after the prompt, tool outputs included)."""
    real = batch["response_attention_mask"] if "response_attention_mask" in batch else batch["response_mask"]
    return int(real[i].sum().item())


def response_text(batch: Batch, i: int, tokenizer: Any) -> str:
    """Row i's response decoded, special tokens dropped."""
    return tokenizer.decode(batch["responses"][i, : response_length(batch, i)].tolist(), skip_special_tokens=True)


def reward_inputs(batch: Batch, tokenizer: Any) -> list[RewardInput]:
    """What a reward function sees for each row: prompt text, the decoded response (with rollout=agent the whole
    trajectory after the prompt, tool outputs included), the dataset row, the finish, and the conversation."""
    messages = batch.meta.get("messages")
    return [
        RewardInput(
            prompt=batch.meta["prompt_text"][i],
            response=response_text(batch, i, tokenizer),
            sample=batch.meta["sample"][i],
            finish_reason=batch.meta["finish_reason"][i],
            messages=messages[i] if messages is not None else None,
        )
        for i in range(len(batch))
    ]


def score_batch(reward_fn: Callable, batch: Batch, tokenizer: Any, cfg: RewardConfig) -> RewardScores:
    """Scores and per-component values of every row of `batch` (rows the function raises on score
    `reward.error_score` and are counted; see `score_rewards`)."""
    return score_rewards(reward_fn, reward_inputs(batch, tokenizer), cfg)


def merge_scores(parts: list[RewardScores]) -> RewardScores:
    """The ranks' scores of their shards, joined in rank order."""
    extras: dict[str, list[float]] = {}
    for p in parts:
        for k, v in p.extras.items():
            extras.setdefault(k, []).extend(v)
    return RewardScores([s for p in parts for s in p.scores], extras, sum(p.errors for p in parts))
