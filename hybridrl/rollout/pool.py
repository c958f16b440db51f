"""The samples a partial rollout holds from one step to the next, in prompt order.

    pool = RolloutPool(group_size)
    pool.add(prompt_index)                    # a group of group_size samples with no tokens yet
    dropped = pool.expire(step, max_staleness)
    ... each sample of the first groups gets tokens (`PoolSample.extend`), some finish ...
    trained = pool.take_complete(k, step)     # k complete groups, this step's first, in order, out of the pool
    save_pool(pool, staging_folder) / load_pool(pool, checkpoint)   # tensors and plain values: rollout_pool.pt

Each token remembers the step whose rollout sampled it, its weight version: the rollout of step s runs on the
weights of s - 1 updates, so a token sampled at step t and trained at step s lags the updated policy by s - t
versions, its staleness. Groups keep the order their prompts came from the data loader: groups a step did not train
(over-sampled, or waiting for a sample) come first in the next step's rollout.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from hybridrl.checkpoints import write_failure
from hybridrl.errors import CheckpointError

FORMAT = 1
"""The layout of `RolloutPool.state_dict`."""


@dataclass
class PoolSample:
    """One sample of a group: its tokens so far, their engine log-probs and weight versions, whether it finished."""

    tokens: list[int] = field(default_factory=list)
    """The response so far (the whole response once finished)."""
    logprobs: list[float] = field(default_factory=list)
    """The engine's log-prob of each token, from the weights that sampled it."""
    versions: list[int] = field(default_factory=list)
    """The step whose rollout sampled each token."""
    finish_reason: str | None = None
    """'stop' or 'length' once finished; None while unfinished."""
    trajectory: dict[str, Any] | None = None
    """rollout=agent, once finished: the trajectory's other fields (mask, turns, messages, ...) as plain values."""
    finished_at: int = 0
    """The step whose rollout finished it (0 while unfinished)."""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def finish(self, reason: str, step: int) -> None:
        """Mark it finished ('stop' or 'length') in step `step`'s rollout."""
        self.finish_reason, self.finished_at = reason, step

    def extend(self, tokens: list[int], logprobs: list[float], step: int) -> None:
        """Append tokens that step `step`'s rollout sampled."""
        self.tokens += tokens
        self.logprobs += logprobs
        self.versions += [step] * len(tokens)

    def due(self, step: int, max_staleness: int) -> bool:
        """Whether it must finish in step `step`'s rollout: unfinished, and trained any later its oldest token would
        lag more than `max_staleness` versions."""
        return not self.finished and bool(self.versions) and step - self.versions[0] >= max_staleness

    def reset(self) -> bool:
        """Forget everything sampled, so the sample starts again; whether there was anything to forget."""
        had = bool(self.tokens) or self.finished
        self.tokens, self.logprobs, self.versions = [], [], []
        self.finish_reason, self.trajectory, self.finished_at = None, None, 0
        return had


@dataclass
class PoolGroup:
    """The samples of one prompt."""

    prompt: int
    """Index of the prompt in the run's training prompts."""
    samples: list[PoolSample]

    @property
    def complete(self) -> bool:
        """Every sample finished: the group can be trained."""
        return all(s.finished for s in self.samples)

    @property
    def completed_at(self) -> int:
        """The step whose rollout finished its last sample (for a complete group)."""
        return max(s.finished_at for s in self.samples)


class RolloutPool:
    """The groups in flight between steps, oldest first."""

    def __init__(self, group_size: int) -> None:
        self.group_size = group_size
        self.groups: list[PoolGroup] = []

    def __len__(self) -> int:
        return len(self.groups)

    def add(self, prompt: int) -> None:
        """A new group for training prompt `prompt`, at the end."""
        self.groups.append(PoolGroup(prompt, [PoolSample() for _ in range(self.group_size)]))

    def expire(self, step: int, max_staleness: int) -> int:
        """Restart every sample whose oldest token would lag by more than `max_staleness` versions if trained at
        `step`; returns how many were restarted (their tokens dropped)."""
        dropped = 0
        for g in self.groups:
            for s in g.samples:
                if s.versions and step - s.versions[0] > max_staleness:
                    dropped += s.reset()
        return dropped

    def due(self, step: int, max_staleness: int) -> list[PoolGroup]:
        """The groups holding a sample that must finish in step `step`'s rollout (`PoolSample.due`)."""
        return [g for g in self.groups if any(s.due(step, max_staleness) for s in g.samples)]

    def restart_groups(self, groups: list[PoolGroup]) -> int:
        """Restart every sample of `groups` (they stay in place); returns how many held tokens."""
        return sum(s.reset() for g in groups for s in g.samples)

    def restart_complete(self) -> int:
        """Restart every complete group (one a step did not train); returns how many samples held tokens."""
        return sum(s.reset() for g in self.groups if g.complete for s in g.samples)

    def reset_unfinished(self) -> int:
        """Restart every unfinished sample that holds tokens; returns how many."""
        return sum(s.reset() for g in self.groups for s in g.samples if not s.finished and s.tokens)

    def take_complete(self, k: int, step: int) -> list[PoolGroup]:
        """`k` complete groups (fewer if there are not as many), removed from the pool, in pool order: first those
        step `step`'s rollout completed, then those completed before it (over-sampled in an earlier step, a version
        older, taken only where the step's own do not suffice); the others keep their order."""
        done = [i for i, g in enumerate(self.groups) if g.complete]
        chosen = set(sorted(done, key=lambda i: (self.groups[i].completed_at < step, i))[:k])
        taken = [g for i, g in enumerate(self.groups) if i in chosen]
        self.groups = [g for i, g in enumerate(self.groups) if i not in chosen]
        return taken

    # -- checkpoint ---------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The pool as tensors and plain values (torch.load(weights_only=True) reads it back; no class of ours)."""
        samples = [s for g in self.groups for s in g.samples]
        return {
            "format": FORMAT,
            "group_size": self.group_size,
            "prompts": torch.tensor([g.prompt for g in self.groups], dtype=torch.long),
            "lengths": torch.tensor([len(s.tokens) for s in samples], dtype=torch.long),
            "tokens": torch.tensor([t for s in samples for t in s.tokens], dtype=torch.long),
            "logprobs": torch.tensor([x for s in samples for x in s.logprobs], dtype=torch.float64),
            "versions": torch.tensor([v for s in samples for v in s.versions], dtype=torch.long),
            "finish": [s.finish_reason or "" for s in samples],
            "finished_at": torch.tensor([s.finished_at for s in samples], dtype=torch.long),
            "trajectories": [s.trajectory for s in samples],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` returned; ValueError when it does not fit this pool."""
        if state.get("format") != FORMAT:
            raise ValueError(f"unknown rollout pool format {state.get('format')!r} (this version reads {FORMAT})")
        if state["group_size"] != self.group_size:
            raise ValueError(f"the pool holds groups of {state['group_size']}, this run's are of {self.group_size}")
        lengths = state["lengths"].tolist()
        prompts = state["prompts"].tolist()
        if len(lengths) != len(prompts) * self.group_size or sum(lengths) != len(state["tokens"]):
            raise ValueError("the pool's sample lengths do not match its groups and tokens")
        tokens, logprobs, versions = state["tokens"].tolist(), state["logprobs"].tolist(), state["versions"].tolist()
        samples, at = [], 0
        rows = zip(lengths, state["finish"], state["trajectories"], state["finished_at"].tolist(), strict=True)
        for n, finish, traj, when in rows:
            span = slice(at, at + n)
            samples.append(PoolSample(tokens[span], logprobs[span], versions[span], finish or None, traj, when))
            at += n
        n = self.group_size
        self.groups = [PoolGroup(p, samples[i * n : (i + 1) * n]) for i, p in enumerate(prompts)]


POOL_FILE = "rollout_pool.pt"
"""The pool's file in a checkpoint folder."""


def save_pool(pool: RolloutPool, folder: str | Path) -> None:
    """Write `pool` into the checkpoint folder being staged (CheckpointWriteError naming the file if it cannot)."""
    path = Path(folder) / POOL_FILE
    try:
        torch.save(pool.state_dict(), path)
    except OSError as e:
        raise write_failure(folder, path, e) from None


def load_pool(pool: RolloutPool, folder: str | Path) -> bool:
    """Restore `pool` from a checkpoint folder; False (the pool left empty) when the checkpoint holds none.
    CheckpointError naming the file when it cannot be read as a pool of this run."""
    path = Path(folder) / POOL_FILE
    if not path.is_file():
        pool.groups = []
        return False
    try:
        pool.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
    except (OSError, ValueError, KeyError, RuntimeError, pickle.UnpicklingError) as e:
        raise CheckpointError(
            f"checkpoint {folder}: {POOL_FILE} cannot be read as this run's rollout pool ({e})"
        ) from None
    return True
