"""Format reward, and math correctness combined with it.

"format" asks only that the response ended on its own (not cut off at the token limit) and gave a final
answer where the verifier looks first: `#### <number>` or a non-empty `\\boxed{...}`. A small weight on it in
"math_with_format" (0.9 * correct + 0.1 * format) teaches the answer format early, before answers are right.
"""

from __future__ import annotations

from hybridrl.rewards.base import RewardInput
from hybridrl.rewards.math_answer import extract_boxed, extract_marker, math_reward
from hybridrl.rewards.registry import register_reward

CORRECT_WEIGHT = 0.9
"""Weight of correctness in "math_with_format"; format gets the rest."""


@register_reward("format")
def format_reward(item: RewardInput) -> float:
    """1.0 when `finish_reason == "stop"` and the response has a `#### <number>` or `\\boxed{...}` answer."""
    if item.finish_reason != "stop" or not isinstance(item.response, str):
        return 0.0
    text = item.response
    return 1.0 if extract_marker(text) is not None or extract_boxed(text) is not None else 0.0


@register_reward("math_with_format")
def math_with_format_reward(item: RewardInput) -> dict[str, float]:
    """`{"score": 0.9*correct + 0.1*format, "correct": ..., "format": ...}`; components log as reward/<key>."""
    correct = math_reward(item)
    fmt = format_reward(item)
    return {"score": CORRECT_WEIGHT * correct + (1.0 - CORRECT_WEIGHT) * fmt, "correct": correct, "format": fmt}
