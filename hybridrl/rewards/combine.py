"""The reward phase on one worker: the reward function and the local reward models, combined into one score.

    scorer = RewardScorer(reward_fn, tokenizer, cfg.reward, reward_models)
    out, stats = scorer(batch)          # out.scores, out.extras, out.errors (samples the function raised on)

Sources are named: "function" (the reward function: a registered one, `reward.fn`, or `reward=remote`) and each
reward model by its name. `reward.combine=sum` (the default) is the weighted sum, `reward.weight` for the function
and `reward_model.models[i].weight` for each model; `reward.combine=pkg.module:func` calls
`func({source: [score per item]}) -> [score per item]` instead. Each source's raw score is logged as
`reward/<source>`. With no reward model, weight 1 and the sum, the function's scores pass through unchanged.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Sequence
from typing import Any

from hybridrl.batch import Batch
from hybridrl.errors import ConfigError, HybridRLError
from hybridrl.import_path import load_import_path
from hybridrl.rewards.base import RewardFn, RewardScores, normalize_results, score_rewards
from hybridrl.rewards.config import RewardConfig
from hybridrl.rewards.scoring import reward_inputs

FUNCTION_SOURCE = "function"
"""The reward function's name among the sources."""

CombineFn = Callable[[dict[str, list[float]]], Sequence[float]]
_SPEC_RE = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*$")


def weighted_sum(sources: dict[str, list[float]], weights: dict[str, float]) -> list[float]:
    """Per item, the sum over sources of weight * score (sources in `weights` order)."""
    n = len(next(iter(sources.values())))
    return [sum(weights[k] * sources[k][i] for k in weights) for i in range(n)]


def load_combine(spec: str) -> CombineFn | None:
    """None for "sum"; else the function `pkg.module:func` names (ConfigError naming reward.combine)."""
    spec = spec.strip()
    if spec == "sum":
        return None
    if not _SPEC_RE.match(spec):
        raise ConfigError(f"reward.combine={spec!r} must be sum or 'pkg.module:func'")
    fn = load_import_path(spec, "reward.combine")
    if not callable(fn):
        raise ConfigError(f"reward.combine={spec!r} is not callable")
    return fn


class RewardScorer:
    """Scores a batch with every source, reward models one at a time on the device, and combines them."""

    def __init__(self, fn: RewardFn, tokenizer: Any, cfg: RewardConfig, models: Sequence[Any] = ()) -> None:
        self.fn, self.tokenizer, self.cfg, self.models, self.weight = fn, tokenizer, cfg, list(models), cfg.weight
        self.combine = load_combine(cfg.combine)

    @property
    def combined(self) -> bool:
        """Whether scores are combined from sources (else the function's pass through as they are)."""
        return bool(self.models) or self.combine is not None or self.weight != 1.0

    def __call__(self, batch: Batch) -> tuple[RewardScores, dict[str, float]]:
        """(combined score and components per row, with the function's error count; this rank's timings and memory
        moves). Samples the function raises on score `reward.error_score` (`score_rewards`)."""
        items = reward_inputs(batch, self.tokenizer)
        stats: dict[str, float] = {}
        if self.models:  # the first model comes in behind the reward function's work
            stats.update(self.models[0].onload(wait=False))
        fn_out = score_rewards(self.fn, items, self.cfg)
        if not self.combined:
            return fn_out, stats
        extras = fn_out.extras
        sources = {FUNCTION_SOURCE: fn_out.scores}
        for rm in self.models:
            t0 = time.perf_counter()
            stats.update(rm.onload())  # joins the early copy for the first one
            sources[rm.cfg.name] = rm.score(items)
            stats.update(rm.offload())  # out before the next one comes in: one on the device at a time
            stats[f"time/reward_model/{rm.cfg.name}"] = time.perf_counter() - t0
        for name in sources:
            if name in extras:
                raise HybridRLError(
                    f"the reward function logs a component {name!r}, which is also a reward source's "
                    "name; rename the reward model (reward_model.models[i].name)"
                )
        if self.combine is None:
            weights = {FUNCTION_SOURCE: self.weight, **{rm.cfg.name: rm.cfg.weight for rm in self.models}}
            scores = weighted_sum(sources, weights)
        else:
            try:
                scores, _ = normalize_results(list(self.combine(dict(sources))), expected=len(items))
            except HybridRLError as e:
                raise HybridRLError(f"reward.combine: {e}") from None
        return RewardScores(scores, {**extras, **sources}, fn_out.errors), stats
