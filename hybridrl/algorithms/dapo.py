"""DAPO's data-side pieces (Yu et al. 2025): overlong reward shaping and dynamic sampling.

Overlong shaping is added to the scores before advantages. Dynamic sampling drops groups whose
scores are all equal (they get zero advantage) and refills the batch with fresh prompts; the
controller's loop, with `GroupRefill` keeping the books::

    refill = GroupRefill(target_groups=prompts_per_step, group_size=cfg.group_size,
                         max_resample_rounds=cfg.max_resample_rounds)
    rounds = []
    while refill.needs_more:
        batch = generate(next_prompts(prompts_per_step)); scores = reward(batch)   # scores [B]
        rounds.append(batch)
        refill.add(scores)
    plan = refill.finish()            # which rows of each round to train on, and the metrics
    batch = concat([b.select(rows) for b, rows in zip(rounds, plan.rows)])
    metrics |= plan.metrics()
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch


def overlong_penalty(lengths: torch.Tensor, max_len: int, buffer_len: int, penalty_factor: float) -> torch.Tensor:
    """DAPO's soft overlong punishment, verl's DAPO reward manager formula, to add to the scores:

        expected_len = max_len - buffer_len
        penalty      = min(-(length - expected_len) / buffer_len * penalty_factor, 0)

    0 up to expected_len, then linear down to -penalty_factor at max_len. `lengths` [B] are response
    lengths in tokens, `max_len` the generation limit (engine.max_new_tokens).
    """
    if not 0 < buffer_len <= max_len:
        raise ValueError(f"the overlong buffer ({buffer_len} tokens) must be in (0, max_len={max_len}]")
    expected_len = max_len - buffer_len
    exceed = lengths.to(torch.float32) - expected_len
    return (-exceed / buffer_len * penalty_factor).clamp(max=0.0)


def groups_with_signal(scores: torch.Tensor, group_size: int) -> torch.Tensor:
    """Which prompt groups carry a learning signal: [B / group_size] bool, True where the group's scores
    are not all equal (std > 0; verl's `filter_groups`). A prompt's samples are contiguous."""
    if scores.dim() != 1 or group_size < 2 or scores.numel() % group_size:
        raise ValueError(
            f"scores must be [B] with B divisible by group_size >= 2; got shape {tuple(scores.shape)}, "
            f"group_size={group_size}"
        )
    groups = scores.view(-1, group_size)
    return ~(groups == groups[:, :1]).all(dim=-1)


@dataclass
class RefillPlan:
    """What to train on after dynamic sampling: for each generation round, the rows to keep."""

    rows: list[torch.Tensor]
    """Per round, the sorted row indices (int64) into that round's batch; concatenated in round order
    they give exactly target_groups * group_size rows, each group's samples contiguous."""
    rounds: int
    """Generation rounds run this step (1 = no resampling)."""
    kept_groups: int
    """Groups with signal in the batch."""
    filtered_groups: int
    """Groups dropped over all rounds because their scores were all equal."""
    filled_groups: int
    """Groups without signal put back because max_resample_rounds ran out (0 when the batch filled)."""
    trimmed_groups: int
    """Groups with signal generated beyond the target and left out (the last round's overflow)."""

    def warn_if_filled(self, log: logging.Logger, step: int, max_resample_rounds: int) -> None:
        """Say in the log when groups without signal filled the batch (the resampling rounds ran out)."""
        if self.filled_groups:
            log.warning(
                "step %d: dynamic sampling kept %d of %d groups after %d rounds (algorithm.max_resample_rounds=%d); "
                "%d groups with equal rewards fill the batch",
                step,
                self.kept_groups,
                self.kept_groups + self.filled_groups,
                self.rounds,
                max_resample_rounds,
                self.filled_groups,
            )

    def metrics(self) -> dict[str, float]:
        """`batch/*` metrics of this step's dynamic sampling."""
        return {
            "batch/resample_rounds": float(self.rounds - 1),
            "batch/filtered_groups": float(self.filtered_groups),
            "batch/filled_groups": float(self.filled_groups),
            "batch/trimmed_groups": float(self.trimmed_groups),
        }


@dataclass
class GroupRefill:
    """Collects groups with signal over generation rounds until `target_groups` are kept.

    Kept groups are taken in generation order (round, then position) and the overflow of the last
    round is trimmed, so the result is deterministic. When `max_resample_rounds` extra rounds are
    spent and groups are still missing, the batch is filled with dropped groups, earliest first: the
    training batch keeps its size (their advantages are 0, so they add no gradient but count in the
    token-mean denominator); `RefillPlan.filled_groups` says how many, for the log.
    """

    target_groups: int
    """Groups the training batch must hold (prompts per step)."""
    group_size: int
    """Samples per prompt (>= 2)."""
    max_resample_rounds: int
    """Extra generation rounds allowed after the first (>= 0)."""
    _kept: list[list[int]] = field(default_factory=list, init=False, repr=False)
    _dropped: list[list[int]] = field(default_factory=list, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.target_groups < 1 or self.group_size < 2 or self.max_resample_rounds < 0:
            raise ValueError(
                f"need target_groups >= 1, group_size >= 2, max_resample_rounds >= 0; got {self.target_groups}, "
                f"{self.group_size}, {self.max_resample_rounds}"
            )

    @property
    def rounds(self) -> int:
        """Rounds added so far."""
        return len(self._kept)

    @property
    def kept(self) -> int:
        """Groups with signal collected so far (may exceed the target before `finish` trims)."""
        return sum(len(k) for k in self._kept)

    @property
    def needs_more(self) -> bool:
        """Whether the controller should generate another round."""
        return self.kept < self.target_groups and self.rounds < 1 + self.max_resample_rounds

    def add(self, scores: torch.Tensor) -> int:
        """Record one round's scores [B] (B a multiple of group_size); returns its groups with signal."""
        signal = groups_with_signal(scores, self.group_size).tolist()
        self._kept.append([g for g, s in enumerate(signal) if s])
        self._dropped.append([g for g, s in enumerate(signal) if not s])
        return len(self._kept[-1])

    def finish(self) -> RefillPlan:
        """The rows to train on: the first target_groups kept groups, filled with dropped ones if short."""
        if not self._kept:
            raise ValueError("GroupRefill.finish() before any round was added")
        chosen: list[list[int]] = [[] for _ in self._kept]
        missing = self.target_groups
        for r, groups in enumerate(self._kept):
            take = groups[:missing]
            chosen[r].extend(take)
            missing -= len(take)
        kept = self.target_groups - missing
        filled = 0
        for r, groups in enumerate(self._dropped):
            take = groups[:missing]
            chosen[r].extend(take)
            missing -= len(take)
            filled += len(take)
        if missing:
            raise ValueError(
                f"only {self.target_groups - missing} groups were generated over {self.rounds} rounds; "
                f"the batch needs {self.target_groups}"
            )
        rows = [
            (
                torch.tensor(sorted(gs), dtype=torch.long).unsqueeze(-1) * self.group_size
                + torch.arange(self.group_size)
            ).view(-1)
            for gs in chosen
        ]
        return RefillPlan(
            rows=rows,
            rounds=self.rounds,
            kept_groups=kept,
            filtered_groups=sum(len(d) for d in self._dropped),
            filled_groups=filled,
            trimmed_groups=self.kept - kept,
        )
