"""Reward of the built-in visual task (`data=synthetic_vl`, hybridrl/data/shapes.py): the first word of the answer,
and its format."""

from __future__ import annotations

from hybridrl.data.shapes import COLOURS, KINDS
from hybridrl.rewards.base import RewardInput, per_sample
from hybridrl.rewards.registry import register_reward


def valid_answers(task: str | None) -> set[str] | None:
    """The words an answer of `task` can be (colour names for colour and lower, digits for count); None: any word."""
    if task in ("colour", "lower"):
        return set(COLOURS)
    if task == "count":
        return set("0123456789")
    if task == "shape":
        return set(KINDS)
    return None


@register_reward("shapes")
@per_sample
def shapes_reward(item: RewardInput) -> dict[str, float]:
    """Three quarters correctness, one quarter format: correct is 1 when the response's first word is the answer
    (case and punctuation aside: "blue circle" answers "What colour is the shape?"); format is 1 for one word that is
    a possible answer of the task (a colour, a digit) and nothing more, ended by EOS (0.5 when cut off). A format
    that any short word met was learned first and cut the answers short ("blu"); correctness outweighs format so that
    a wrong bare answer never beats a right one with more words. Logged as reward/correct, reward/format and
    reward/exact (the answer alone)."""
    got = item.response.strip()
    answer = str(item.sample["answer"]).lower()
    words = got.lower().replace(",", " ").replace(".", " ").split()
    correct = float(bool(words) and words[0] == answer)
    valid = valid_answers(item.sample.get("task"))
    one_answer = len(words) == 1 and (valid is None or words[0] in valid)
    fmt = float(one_answer) * (1.0 if item.finish_reason == "stop" else 0.5)
    exact = float(one_answer and correct == 1.0 and item.finish_reason == "stop")
    return {"score": 0.75 * correct + 0.25 * fmt, "format": fmt, "correct": correct, "exact": exact}
