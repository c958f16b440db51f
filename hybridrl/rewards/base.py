"""The one call signature every reward (rule-based or a reward model) implements.

The controller scores a rollout batch like this::

    fn = resolve_reward(cfg.reward.fn or cfg.reward.name)        # a batched RewardFn
    items = [RewardInput(prompt, response, sample, finish_reason) for each completion]
    out = score_rewards(fn, items, cfg.reward)   # fn(items), checked; samples it raises on get reward.error_score
    metrics["reward/mean"] = mean(out.scores)
    metrics |= {f"reward/{k}": mean(v) for k, v in out.extras.items()}
    metrics["reward/errors"] = out.errors        # summed over workers

A reward function is batched, `fn(items: list[RewardInput]) -> list[float]`, so a reward model can score a
whole batch in one forward pass. Each result may instead be a dict of components: key "score" is the reward
and every other key (e.g. "correct", "format") is logged as the mean `reward/<key>`; all dicts of one call
must have the same keys. Rule-based rewards are easier to write per sample: decorate
`f(item: RewardInput) -> float | dict[str, float]` with `@per_sample` to get the batched form.

A value that is not a real number (a string "0.5", a bool, None), not finite, or beyond float32's range
stops the run naming the function and the sample: it is a bug in the function, and would corrupt the
advantages silently. An exception raised by the function is different: a crash on some odd completion
should not end a long run, so `score_rewards` scores those samples `reward.error_score`, counts them,
and stops only when more than `reward.max_error_frac` of a batch fails.

Every call has a deadline, `reward.timeout_s` per batch (`rewards/deadline.py`): a per-sample function runs on
`reward.num_workers` threads, one sample per call, so one slow sample holds one thread and the others go on; a sample
with no result by the deadline counts like one the function raised on. A batched function's call is bounded as a
whole: past the deadline every sample of the batch counts as failed.
"""

from __future__ import annotations

import functools
import logging
import math
import numbers
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Union

from hybridrl.errors import HybridRLError
from hybridrl.rewards.config import RewardConfig
from hybridrl.rewards.deadline import call_with_deadline

log = logging.getLogger(__name__)
FLOAT32_MAX = 3.4028234663852886e38

#: One result of a reward function: the score, or the score plus named components under "score".
RewardResult = Union[float, dict[str, float]]
#: The batched signature the controller calls.
RewardFn = Callable[[list["RewardInput"]], list[RewardResult]]
#: The per-sample signature `per_sample` lifts to a RewardFn.
PerSampleRewardFn = Callable[["RewardInput"], RewardResult]

# Set (True) on functions that already take a list of items; `resolve_reward` reads it to decide the form.
BATCHED_ATTR = "_hybridrl_reward_batched"
# Set by `per_sample` to the one-item function it wraps: `score_rewards` calls it sample by sample, each call bounded.
PER_SAMPLE_ATTR = "_hybridrl_reward_per_sample"


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
    messages: list[dict[str, Any]] | None = None
    """With rollout=agent: the trajectory's conversation (assistant turns, tool calls and tool results); else None."""


def per_sample(f: PerSampleRewardFn) -> RewardFn:
    """Turn `f(item) -> float | dict` into the batched `fn(items) -> list`; the result is marked batched."""

    @functools.wraps(f)
    def batched_fn(items: list[RewardInput]) -> list[RewardResult]:
        return [f(item) for item in items]

    setattr(batched_fn, BATCHED_ATTR, True)
    setattr(batched_fn, PER_SAMPLE_ATTR, f)
    return batched_fn


def batched(f: RewardFn) -> RewardFn:
    """Mark `f` as already batched (for functions without a `list[...]` annotation); returns `f` itself."""
    setattr(f, BATCHED_ATTR, True)
    return f


def normalize_results(
    results: Sequence[RewardResult],
    expected: int | None = None,
    name: str | None = None,
    items: Sequence[RewardInput] | None = None,
) -> tuple[list[float], dict[str, list[float]]]:
    """Split a reward function's results into scores and per-component lists (aligned with the items).

    Accepts a list of numbers or a list of dicts that all hold "score" and the same other keys.
    Raises HybridRLError when the length differs from `expected`, a value is not a real number (a
    string, a bool), not finite or out of float32's range, or the forms are mixed — a bad reward would
    otherwise corrupt the advantages silently. The message names the function (`name`) and, given
    `items`, the sample. A tensor or array of scores (a reward model's output) is accepted too.
    """
    who = f"reward function {name}" if name else "reward function"
    if hasattr(results, "tolist") and not isinstance(results, (list, tuple)):
        results = results.tolist()
    if isinstance(results, (str, bytes, dict)) or not isinstance(results, Sequence):
        raise HybridRLError(
            f"{who} returned {type(results).__name__}; it must return a list with one result per "
            "item (check reward.fn / reward.name: a per-sample function needs @per_sample or an "
            "`item: RewardInput` annotation)"
        )
    if expected is not None and len(results) != expected:
        raise HybridRLError(f"{who} returned {len(results)} results for {expected} items; return one per item")
    scores: list[float] = []
    extras: dict[str, list[float]] = {}
    as_dicts = bool(results) and isinstance(results[0], dict)
    if as_dicts:
        keys = set(results[0])
        if "score" not in keys:
            raise HybridRLError(f"{who}: result 0 is a dict without key 'score' (keys: {sorted(keys)})")
        extras = {k: [] for k in results[0] if k != "score"}
    for i, r in enumerate(results):
        at = f"{who}: result {i}"
        sample = f"; sample: {describe_item(items[i])}" if items is not None and i < len(items) else ""
        if isinstance(r, dict) != as_dicts:
            raise HybridRLError(f"{at} and result 0 differ in form (number vs dict); return one form{sample}")
        if not as_dicts:
            scores.append(_real(r, at, "score", sample))
            continue
        if set(r) != keys:
            raise HybridRLError(f"{at} has keys {sorted(r)}, result 0 has {sorted(keys)}; use the same keys{sample}")
        scores.append(_real(r["score"], at, "score", sample))
        for k in extras:
            extras[k].append(_real(r[k], at, k, sample))
    return scores, extras


def _real(value: Any, at: str, key: str, sample: str) -> float:
    """`value` as a float when it is a real number within float32's range; else a HybridRLError."""
    if getattr(value, "ndim", None) == 0 and hasattr(value, "item"):  # a 0-d tensor or array
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise HybridRLError(
            f"{at}: {key!r} is {value!r} (a {type(value).__name__}), not a real number; return a float{sample}"
        )
    if isinstance(value, numbers.Integral) and abs(int(value)) > FLOAT32_MAX:  # exact: no float() overflow first
        n = abs(int(value))
        digits = max(1, int(n.bit_length() * 0.30102999566398120))  # log10(2): no str(n), which refuses 4300+ digits
        digits += 10**digits <= n
        raise HybridRLError(
            f"{at}: {key!r} is an integer of {digits} digits, beyond float32's range (advantages are float32){sample}"
        )
    x = float(value)
    if not math.isfinite(x):
        raise HybridRLError(f"{at}: {key!r} is {x}; rewards must be finite{sample}")
    if abs(x) > FLOAT32_MAX:
        raise HybridRLError(f"{at}: {key!r} is {x:g}, beyond float32's range (advantages are float32){sample}")
    return x


def describe_item(item: RewardInput, n: int = 80) -> str:
    """One line naming a sample: its response, prompt and row, each cut to `n` characters."""

    def cut(v: Any) -> str:
        text = repr(v)
        return text if len(text) <= n else text[: n - 3] + "..."

    return f"response={cut(item.response)} prompt={cut(item.prompt)} row={cut(item.sample)}"


@dataclass
class RewardScores:
    """What `score_rewards` returns: one score per item, the components, and how many samples failed."""

    scores: list[float]
    """One reward per item."""
    extras: dict[str, list[float]]
    """Each component the function returned besides "score", one value per item."""
    errors: int = 0
    """Items on which the function raised; they scored reward.error_score (components 0)."""


def score_rewards(fn: RewardFn, items: list[RewardInput], cfg: RewardConfig, name: str | None = None) -> RewardScores:
    """Call `fn` on `items` within `cfg.timeout_s` and check the results; samples the function raises on, or gives no
    result for by the deadline, get `cfg.error_score`.

    A per-sample function (`per_sample`, or a plain `f(item)`) is called once per sample on `cfg.num_workers`
    threads. A batched function is called on the whole batch; if it raises, the batch is retried one item at a time
    to find the samples that fail. A HybridRLError raised by the function (a user error, e.g. a missing answer
    column) stops the run as it is. Failed samples score `cfg.error_score` (their components 0.0) and are counted;
    more than `cfg.max_error_frac` of the batch failing stops the run, naming the function, the first failure and
    its input.
    """
    name = name or cfg.spec
    if not items:
        return RewardScores([], {})
    one = getattr(fn, PER_SAMPLE_ATTR, None)
    if one is not None:
        return _score_one_by_one(lambda batch: [one(batch[0])], items, cfg, name, cfg.num_workers, cfg.timeout_s)
    start = time.monotonic()
    [outcome] = call_with_deadline(fn, [(items,)], 1, cfg.timeout_s, name)
    if outcome.late:
        failed = [(i, _late(cfg)) for i in range(len(items))]
        return _collect(items, [], failed, cfg, name)
    if outcome.error is not None:  # one at a time, as the function was written for batches, in the time left
        left = max(0.0, cfg.timeout_s - (time.monotonic() - start))
        return _score_one_by_one(fn, items, cfg, name, 1, left)
    scores, extras = normalize_results(outcome.value, expected=len(items), name=name, items=items)
    return RewardScores(scores, extras)


class RewardTimeout(Exception):
    """A sample the reward function gave no result for within `reward.timeout_s`."""


def _late(cfg: RewardConfig) -> RewardTimeout:
    return RewardTimeout(f"no result within reward.timeout_s={cfg.timeout_s:g} s")


def _score_one_by_one(
    fn: Callable[[list[RewardInput]], Any],
    items: list[RewardInput],
    cfg: RewardConfig,
    name: str,
    workers: int,
    timeout_s: float,
) -> RewardScores:
    """`fn([item])` for every item on `workers` threads, all within `timeout_s`; failures recorded per sample."""
    outcomes = call_with_deadline(fn, [([item],) for item in items], workers, timeout_s, name)
    good: list[tuple[int, RewardResult]] = []
    failed: list[tuple[int, BaseException]] = []
    for i, (item, o) in enumerate(zip(items, outcomes)):
        if o.late:
            failed.append((i, _late(cfg)))
            continue
        if o.error is not None:
            failed.append((i, o.error))
            continue
        out = o.value
        if hasattr(out, "tolist") and not isinstance(out, (list, tuple)):
            out = out.tolist()
        if isinstance(out, (str, bytes, dict)) or not isinstance(out, Sequence) or len(out) != 1:
            normalize_results(out, expected=1, name=name, items=[item])  # raises, naming the problem
        good.append((i, out[0]))
    return _collect(items, good, failed, cfg, name)


def _collect(
    items: list[RewardInput],
    good: list[tuple[int, RewardResult]],
    failed: list[tuple[int, BaseException]],
    cfg: RewardConfig,
    name: str,
) -> RewardScores:
    """Scores of the samples that succeeded; `cfg.error_score` for the failed ones, or a stop past max_error_frac."""
    if failed:
        raised = sum(not isinstance(e, RewardTimeout) for _, e in failed)
        parts = [f"raised on {raised}"] if raised else []
        if raised < len(failed):
            parts.append(f"did not return within reward.timeout_s={cfg.timeout_s:g} s on {len(failed) - raised}")
        i, e = failed[0]
        summary = (
            f"reward function {name} {' and '.join(parts)} of {len(items)} samples; first: "
            f"{type(e).__name__}: {_first_line(e)}; on {describe_item(items[i])}"
        )
        if len(failed) > cfg.max_error_frac * len(items):
            raise HybridRLError(
                f"{summary}. That is more than reward.max_error_frac={cfg.max_error_frac}: fix the function"
            )
        log.warning("%s (scored reward.error_score=%s)", summary, cfg.error_score)
    scores = [cfg.error_score] * len(items)
    extras: dict[str, list[float]] = {}
    if good:
        ok_scores, ok_extras = normalize_results([r for _, r in good], name=name, items=[items[i] for i, _ in good])
        extras = {k: [0.0] * len(items) for k in ok_extras}
        for j, (i, _) in enumerate(good):
            scores[i] = ok_scores[j]
            for k, v in ok_extras.items():
                extras[k][i] = v[j]
    return RewardScores(scores, extras, errors=len(failed))


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else "(no message)"
