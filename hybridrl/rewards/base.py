"""The one call signature every reward (rule-based or a reward model) implements.

The controller scores a rollout batch like this::

    fn = resolve_reward(cfg.reward.fn or cfg.reward.name)        # a batched RewardFn
    items = [RewardInput(prompt, response, sample, finish_reason) for each completion]
    scores, extras = normalize_results(fn(items), expected=len(items))
    metrics["reward/mean"] = mean(scores)
    metrics |= {f"reward/{k}": mean(v) for k, v in extras.items()}

A reward function is batched, `fn(items: list[RewardInput]) -> list[float]`, so a reward model can score a
whole batch in one forward pass. Each result may instead be a dict of components: key "score" is the reward
and every other key (e.g. "correct", "format") is logged as the mean `reward/<key>`; all dicts of one call
must have the same keys. Rule-based rewards are easier to write per sample: decorate
`f(item: RewardInput) -> float | dict[str, float]` with `@per_sample` to get the batched form.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Union

from hybridrl.errors import HybridRLError

#: One result of a reward function: the score, or the score plus named components under "score".
RewardResult = Union[float, dict[str, float]]
#: The batched signature the controller calls.
RewardFn = Callable[[list["RewardInput"]], list[RewardResult]]
#: The per-sample signature `per_sample` lifts to a RewardFn.
PerSampleRewardFn = Callable[["RewardInput"], RewardResult]

# Set (True) on functions that already take a list of items; `resolve_reward` reads it to decide the form.
BATCHED_ATTR = "_hybridrl_reward_batched"


@dataclass
class RewardInput:
    """Everything a reward may look at for one completion."""

    prompt: str
    """The rendered prompt text (chat template applied) the policy saw."""
    response: str
    """The decoded response text, special tokens removed."""
    sample: dict[str, Any] = field(default_factory=dict)
    """The dataset row the prompt came from (e.g. with `answer` or `ground_truth`)."""
    finish_reason: str = "stop"
    """'stop' (EOS or a stop token) or 'length' (cut off at the token limit)."""


def per_sample(f: PerSampleRewardFn) -> RewardFn:
    """Turn `f(item) -> float | dict` into the batched `fn(items) -> list`; the result is marked batched."""

    @functools.wraps(f)
    def batched_fn(items: list[RewardInput]) -> list[RewardResult]:
        return [f(item) for item in items]

    setattr(batched_fn, BATCHED_ATTR, True)
    return batched_fn


def batched(f: RewardFn) -> RewardFn:
    """Mark `f` as already batched (for functions without a `list[...]` annotation); returns `f` itself."""
    setattr(f, BATCHED_ATTR, True)
    return f


def normalize_results(
    results: Sequence[RewardResult], expected: int | None = None
) -> tuple[list[float], dict[str, list[float]]]:
    """Split a reward function's results into scores and per-component lists (aligned with the items).

    Accepts a list of numbers or a list of dicts that all hold "score" and the same other keys.
    Raises HybridRLError when the length differs from `expected`, a value is not a finite number,
    or the forms are mixed — a bad reward would otherwise corrupt the advantages silently.
    A tensor or array of scores (a reward model's output) is accepted too.
    """
    if hasattr(results, "tolist") and not isinstance(results, (list, tuple)):
        results = results.tolist()
    if isinstance(results, (str, bytes, dict)) or not isinstance(results, Sequence):
        raise HybridRLError(
            f"reward function returned {type(results).__name__}; it must return a list with one result per "
            "item (check reward.fn / reward.name: a per-sample function needs @per_sample or an "
            "`item: RewardInput` annotation)"
        )
    if expected is not None and len(results) != expected:
        raise HybridRLError(
            f"reward function returned {len(results)} results for {expected} items; return one per item"
        )
    scores: list[float] = []
    extras: dict[str, list[float]] = {}
    as_dicts = bool(results) and isinstance(results[0], dict)
    if as_dicts:
        keys = set(results[0])
        if "score" not in keys:
            raise HybridRLError(f"reward result 0 is a dict without key 'score' (keys: {sorted(keys)})")
        extras = {k: [] for k in results[0] if k != "score"}
    for i, r in enumerate(results):
        if isinstance(r, dict) != as_dicts:
            raise HybridRLError(f"reward result {i} and result 0 differ in form (number vs dict); return one form")
        if not as_dicts:
            scores.append(_finite(r, i, "score"))
            continue
        if set(r) != keys:
            raise HybridRLError(
                f"reward result {i} has keys {sorted(r)}, result 0 has {sorted(keys)}; use the same keys"
            )
        scores.append(_finite(r["score"], i, "score"))
        for k in extras:
            extras[k].append(_finite(r[k], i, k))
    return scores, extras


def _finite(value: Any, i: int, key: str) -> float:
    try:
        x = float(value)
    except (TypeError, ValueError):
        raise HybridRLError(f"reward result {i}: {key!r} is {value!r}, not a number") from None
    if not math.isfinite(x):
        raise HybridRLError(f"reward result {i}: {key!r} is {x}; rewards must be finite")
    return x
