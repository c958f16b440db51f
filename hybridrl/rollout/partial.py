"""One step's rollout with `rollout.partial` on: over-sample, stop once enough groups are complete, carry the rest.

In place of the synchronous generate → sleep → batch, step s runs::

    pool.expire(s, max_staleness)              # samples that would lag too far restart (rollout/dropped)
    fill the pool from the data loader up to B + extra groups   (B = data.train_batch_size, extra = oversample·B;
        none extra where B groups are due: holding samples that must finish in this rollout)
    generate every unfinished sample of those groups, its context prompt + its tokens so far, its cap what it has
        left, until B groups are complete (every sample finished) and every sample in its last rollout within
        max_staleness has finished                                    → dispatch.generate_partial
    finish now every unfinished sample with no tail (its cap leaves no more than the rollout ran)
    take B complete groups, in pool order → the training batch; complete groups not taken restart (surplus)
    groups due next step past the first B restart (rollout/dropped)
    sleep; mode=drop: the unfinished samples restart

Four rules keep staleness where it buys time. Waiting for the samples whose next rollout would take them past
`max_staleness` bounds staleness without dropping the tail: a long sample is carried once (with max_staleness=1)
and then finished. Only a tail is carried: a sample whose cap leaves no more tokens than the rollout has run
would save at most that many decode steps, so it finishes under the same weights (the native engine runs on
instead of stopping where nothing has a tail, in the same random streams, so a rollout without a tail samples
what the synchronous one does). Complete groups the step did not need (several complete in the decode step of
the B-th) restart: nothing of them is a tail, and trained a step later they would only be a version old. And no more
is carried than the next step trains: a step with due groups runs until their tails end and trains B groups, so it
gets at most B of them (the rest restart while they hold one rollout's tokens) and starts no others beside B of them
(they would complete while it waits, and restart unused).

The groups not taken stay in the pool, in order, and come first in the next step's rollout, so every prompt the
loader gave is trained once, in order, and the loader's position plus the pool (saved in every checkpoint) is the
whole of the data state. With DAPO's dynamic sampling (algorithm.filter_groups) a step runs rounds of this, each
completing the groups still missing, scoring them and keeping those whose rewards differ, as the synchronous loop
does with fresh batches.

Random streams: every request of step s draws from the stream keyed by (the step's seed, its group's place in the
step's rollout, its sample index), the synchronous rollout's keys; a carried sample continues in the stream of its
new place. Continuing its old stream instead would need every engine to start a request's counter mid-stream, which
vLLM and SGLang cannot; the new stream is as independent of the sample's earlier tokens as the old one's rest.

Log-probs: each token keeps the engine's log-prob from the weights that sampled it (the behaviour policy), while the
log-prob phase recomputes the whole sample under the current weights, so the rollout correction
(algorithm.rollout_correction) and the mismatch metrics see every carried token for what it is.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hybridrl.agent.loop import Trajectory
from hybridrl.algorithms import GroupRefill
from hybridrl.batch import Batch
from hybridrl.config import RunConfig
from hybridrl.data.prompts import Prompt, PromptLoader
from hybridrl.engines.base import Completion, GenerationRequest, SamplingParams
from hybridrl.errors import HybridRLError
from hybridrl.estimation import shaped_scores
from hybridrl.phases import Phase
from hybridrl.rollout.dispatch import generate_partial
from hybridrl.rollout.pool import PoolGroup, PoolSample, RolloutPool, load_pool, save_pool
from hybridrl.workers.group import WorkerGroup

log = logging.getLogger("hybridrl")

#: Trajectory fields the pool keeps apart from the tokens and log-probs (the rest of `Trajectory`'s fields).
_TRAJECTORY_OWN = ("prompt_index", "sample_index", "prompt_ids", "response_ids", "logprobs")

Scored = tuple[list[float], dict[str, list[float]]]


@dataclass
class _Counts:
    """What one step's rollout did besides training."""

    dropped: int = 0
    oversampled: int = 0
    generated: int = 0
    surplus: int = 0
    tails_finished: int = 0


def staleness_metrics(versions: list[list[int]], step: int) -> dict[str, float]:
    """`rollout/staleness_mean`, `_max` and `rollout/staleness_le1_frac` (weight versions a trained token lags the
    policy being updated at `step`) over the trained samples' model tokens (`versions[i]`: sample i's), and
    `rollout/carried`, the samples holding tokens from an earlier step."""
    lags = torch.tensor([step - v for vs in versions for v in vs], dtype=torch.float64)
    if not lags.numel():
        lags = torch.zeros(1, dtype=torch.float64)
    return {
        "rollout/carried": float(sum(1 for vs in versions if vs and min(vs) < step)),
        "rollout/staleness_mean": lags.mean().item(),
        "rollout/staleness_max": lags.max().item(),
        "rollout/staleness_le1_frac": (lags <= 1).double().mean().item(),
    }


class PartialRollout:
    """The pool of groups in flight and one step's rollout over it (module docstring); the controller owns one."""

    def __init__(
        self,
        cfg: RunConfig,
        loader: PromptLoader,
        prompts: list[Prompt],
        group: WorkerGroup,
        timed: Callable[[Phase], AbstractContextManager],
        to_batch: Callable[[list[Prompt], list], tuple[Batch, dict[str, float]]],
        score: Callable[[Batch], Scored],
    ) -> None:
        """`timed(phase)` times a phase as the controller's loop does; `to_batch(prompts, outs)` makes the training
        batch of completions (trajectories with rollout=agent) and checks their log-probs; `score(batch)` is the
        reward phase (dynamic sampling scores while it generates)."""
        self.run, self.cfg = cfg, cfg.rollout.partial
        self.loader, self.prompts, self.group = loader, prompts, group
        self.timed, self.to_batch, self.score = timed, to_batch, score
        self.batch_size, self.group_size = cfg.data.train_batch_size, cfg.algorithm.group_size
        self.extra = self.cfg.extra_groups(self.batch_size)
        self.max_new = cfg.engine.max_new_tokens
        self.agent = cfg.rollout.name == "agent"
        self.pool = RolloutPool(self.group_size)
        self._index = {id(p): i for i, p in enumerate(prompts)}
        if self.cfg.max_staleness and cfg.algorithm.rollout_correction == "none":
            # Measured on the CPU demo: uncorrected carried tokens pulled five seeds of five into a worse policy.
            log.warning(
                "rollout.partial trains tokens up to %d weight version(s) old (rollout.partial.max_staleness) with "
                "algorithm.rollout_correction=none; algorithm.rollout_correction=token_mis (or tis) masks or weights "
                "them by how far the policy moved since it sampled them (docs/partial-rollouts.md)",
                self.cfg.max_staleness,
            )

    # -- checkpoint ---------------------------------------------------------------------------------------------
    def save(self, folder: str | Path) -> None:
        """The pool into the checkpoint folder being staged."""
        save_pool(self.pool, folder)

    def load(self, folder: str | Path) -> None:
        """The pool of a checkpoint (empty where it holds none: a checkpoint of a run without partial rollouts)."""
        if load_pool(self.pool, folder):
            held = sum(1 for g in self.pool.groups for s in g.samples if s.tokens)
            log.info("rollout.partial: %d groups in flight resumed, %d samples holding tokens", len(self.pool), held)

    # -- one step -----------------------------------------------------------------------------------------------
    def rollout(
        self, step: int, sampling: SamplingParams
    ) -> tuple[Batch, list[float] | None, dict[str, list[float]] | None, dict[str, float]]:
        """Step `step`'s training batch, its scores where dynamic sampling scored it already (else None: the reward
        phase is still to run), and the rollout's metrics. The engine is asleep afterwards."""
        counts = _Counts(dropped=self.pool.expire(step, self.cfg.max_staleness))
        scores = extras = None
        if self.run.algorithm.filter_groups:
            batch, scores, extras, trained, metrics = self._dynamic_sampling(step, sampling, counts)
        else:
            trained = self._round(step, sampling, self.batch_size, 0, counts)
            with self.timed(Phase.SLEEP):
                self.group.run_all(Phase.SLEEP)
            batch, metrics = self._batch(trained)
        # Nothing of them is a tail: trained later they would only be older. Counted as groups (surplus), not as
        # dropped samples: they were not cut for their staleness, and they come first in the next step.
        counts.surplus = sum(g.complete for g in self.pool.groups)
        self.pool.restart_complete()
        if self.cfg.mode == "drop":
            counts.dropped += self.pool.reset_unfinished()
        else:
            # The next step must finish every group due then and trains B of them: the ones past B would finish and
            # then restart, tails and all. They restart now, holding one rollout's tokens.
            due = self.pool.due(step + 1, self.cfg.max_staleness)
            counts.dropped += self.pool.restart_groups(due[self.batch_size :])
        metrics.update(staleness_metrics([self._model_versions(s) for g in trained for s in g.samples], step))
        metrics["rollout/dropped"] = float(counts.dropped)
        metrics["rollout/oversampled_groups"] = float(counts.oversampled)
        metrics["rollout/surplus_groups"] = float(counts.surplus)
        metrics["rollout/pending_groups"] = float(len(self.pool))
        metrics["rollout/generated_tokens"] = float(counts.generated)
        metrics["rollout/tails_finished"] = float(counts.tails_finished)
        return batch, scores, extras, metrics

    def _fill(self, groups: int) -> None:
        """Groups from the data loader at the end of the pool until it holds `groups`."""
        while len(self.pool) < groups:
            for p in self.loader.next_batch():
                self.pool.add(self._index[id(p)])

    def _round(self, step: int, sampling: SamplingParams, need: int, first: int, counts: _Counts) -> list[PoolGroup]:
        """Generate the round's groups (`_window`: need + extra, or just the due ones) until `need` are complete; take
        those. `first`: the place of this round's first group in the step's random streams (later rounds of a step
        come after)."""
        # A round that must finish B groups or more anyway (carried tails at their last rollout) trains those: groups
        # started beside them would complete while it waits and restart unused, so it starts none.
        due = self.pool.due(step, self.cfg.max_staleness)
        size = need + (0 if len(due) >= need else self.extra)
        self._fill(size)
        window = self._window(due, size)
        todo = need - sum(g.complete for g in self.pool.groups)  # an earlier round's wider window may hold some
        if todo > 0:
            requests, groups, slots = self._continuations(window, first, lambda s: not s.finished)
            # A sample whose last rollout within the bound is this one finishes in it.
            due = [i for i, s in enumerate(slots) if s.due(step, self.cfg.max_staleness)]
            ran = self._generate(requests, groups, slots, todo, due, step, sampling, counts)
            if not self.agent:
                self._finish_short_tails(step, sampling, window, first, ran, counts)
        counts.oversampled += len(window) - need
        taken = self.pool.take_complete(need, step)
        if len(taken) < need:
            raise HybridRLError(
                f"rollout.partial: the engines completed {len(taken)} groups of the {need} asked for; an engine's "
                "generate_partial stopped too soon"
            )
        return taken

    def _window(self, due: list[PoolGroup], size: int) -> list[PoolGroup]:
        """The round's groups, in pool order: every group due in it, then the pool's first others up to `size`."""
        chosen = {id(g) for g in due}
        room = size - len(due)
        for g in self.pool.groups:
            if room <= 0:
                break
            if id(g) not in chosen:
                chosen.add(id(g))
                room -= 1
        return [g for g in self.pool.groups if id(g) in chosen]

    def _finish_short_tails(
        self, step: int, sampling: SamplingParams, window: list[PoolGroup], first: int, ran: int, counts: _Counts
    ) -> None:
        """Finish now, under the same weights, every unfinished sample of `window` whose cap leaves at most `ran`
        tokens (the most any request of the rollout sampled): it has no tail, and carrying it would train a
        version-old sample to save at most as many decode steps as the rollout ran. The native engine runs on
        where nothing has a tail; this finishes the rest where something had one. Each continues in a stream of
        its own (its group's place after the window's), so it never draws what its first part drew."""
        requests, groups, slots = self._continuations(
            window,
            first + len(window),
            lambda s: not s.finished and bool(s.tokens) and self.max_new - len(s.tokens) <= ran,
        )
        if requests:
            self._generate(requests, groups, slots, 0, list(range(len(requests))), step, sampling, counts)
            counts.tails_finished += len(requests)

    def _continuations(
        self, window: list[PoolGroup], first: int, select: Callable[[PoolSample], bool]
    ) -> tuple[list[GenerationRequest], list[int], list[PoolSample]]:
        """A request for each sample of `window` that `select` keeps: its prompt and tokens so far as the context,
        the random stream of its group's place counted from `first`, its cap what it has left (none for agent
        trajectories); with each request's group (its place in the window) and its sample."""
        requests, groups, slots = [], [], []
        for place, g in enumerate(window):
            prompt = self.prompts[g.prompt].token_ids
            for j, s in enumerate(g.samples):
                if not select(s):
                    continue
                left = None if self.agent else self.max_new - len(s.tokens)
                requests.append(GenerationRequest(list(prompt) + s.tokens, first + place, j, max_new_tokens=left))
                groups.append(place)
                slots.append(s)
        return requests, groups, slots

    def _generate(
        self,
        requests: list[GenerationRequest],
        groups: list[int],
        slots: list[PoolSample],
        need: int,
        due: list[int],
        step: int,
        sampling: SamplingParams,
        counts: _Counts,
    ) -> int:
        """Generate `requests` until `need` groups are complete and the `due` ones finished, and add each output to
        its sample; returns the most tokens any request sampled."""
        with self.timed(Phase.GENERATE):
            outs = generate_partial(self.group, requests, groups, need, due, step, sampling)
        ran = 0
        for s, out in zip(slots, outs, strict=True):
            sampled = len(out.response_ids if isinstance(out, Trajectory) else out.token_ids)
            counts.generated += sampled
            ran = max(ran, sampled)
            counts.dropped += self._apply(s, out, step)
        return ran

    def _apply(self, s: PoolSample, out: Completion | Trajectory, step: int) -> int:
        """Add one request's output to its sample; 1 where tokens were sampled and dropped (an unfinished agent
        trajectory, which restarts), else 0."""
        if isinstance(out, Trajectory):
            if out.finish_reason == "partial":
                return int(out.turns > 0)
            fields = dataclasses.asdict(out)
            s.extend(out.response_ids, [float(x) for x in out.logprobs], step)
            s.finish(out.finish_reason, step)
            s.trajectory = {k: v for k, v in fields.items() if k not in _TRAJECTORY_OWN}
            return 0
        tokens, logprobs, finish = out.token_ids, [float(x) for x in out.logprobs], out.finish_reason
        room = self.max_new - len(s.tokens)
        if len(tokens) >= room and finish == "partial" or len(tokens) > room:
            tokens, logprobs, finish = tokens[:room], logprobs[:room], "length"  # an engine that ignores caps
        s.extend(tokens, logprobs, step)
        if finish != "partial":
            s.finish(finish, step)
        return 0

    def _batch(self, groups: list[PoolGroup]) -> tuple[Batch, dict[str, float]]:
        """The training batch of complete groups (group-major, each group's samples together)."""
        prompts = [self.prompts[g.prompt] for g in groups]
        outs: list[Any] = []
        for i, g in enumerate(groups):
            for j, s in enumerate(g.samples):
                if self.agent:
                    outs.append(
                        Trajectory(
                            i, j, list(prompts[i].token_ids), list(s.tokens), logprobs=list(s.logprobs), **s.trajectory
                        )
                    )
                else:
                    outs.append(Completion(i, list(s.tokens), list(s.logprobs), s.finish_reason))
        return self.to_batch(prompts, outs)

    def _model_versions(self, s: PoolSample) -> list[int]:
        """The weight versions of the sample's model tokens (with rollout=agent not its tool tokens)."""
        if s.trajectory is None:
            return s.versions
        return [v for v, m in zip(s.versions, s.trajectory["response_mask"]) if m]

    def _dynamic_sampling(
        self, step: int, sampling: SamplingParams, counts: _Counts
    ) -> tuple[Batch, list[float], dict[str, list[float]], list[PoolGroup], dict[str, float]]:
        """DAPO's dynamic sampling over partial rounds: each round completes the groups still missing, scores them,
        and keeps those whose rewards differ (`GroupRefill`); a round's unfinished samples continue in the next."""
        algo = self.run.algorithm
        refill = GroupRefill(self.batch_size, self.group_size, algo.max_resample_rounds)
        rounds: list[tuple[list[PoolGroup], Batch, list[float], dict[str, list[float]]]] = []
        first = 0
        while refill.needs_more:
            need = self.batch_size - refill.kept
            first_next = first + 2 * (need + self.extra)  # a round's places, then its short tails' (see _round)
            taken = self._round(step, sampling, need, first, counts)
            first = first_next
            batch, _ = self._batch(taken)
            with self.timed(Phase.REWARD):
                scores, extras = self.score(batch)
            raw = torch.tensor(scores, dtype=torch.float32)
            refill.add(shaped_scores(algo, raw, batch["response_mask"], self.max_new))
            rounds.append((taken, batch, scores, extras))
        with self.timed(Phase.SLEEP):
            self.group.run_all(Phase.SLEEP)
        plan = refill.finish()
        plan.warn_if_filled(log, step, algo.max_resample_rounds)
        n = self.group_size
        chosen = [(r, rows.tolist()) for r, rows in zip(rounds, plan.rows)]
        batch = Batch.concat([b.select(rows) for (_, b, _, _), rows in chosen])
        scores = [sc[i] for (_, _, sc, _), rows in chosen for i in rows]
        extras = {k: [ex[k][i] for (_, _, _, ex), rows in chosen for i in rows] for k in rounds[0][3]}
        trained = [taken[i // n] for (taken, _, _, _), rows in chosen for i in rows[::n]]
        generated = [s for _, _, sc, _ in rounds for s in sc]
        metrics = {**plan.metrics(), "reward/generated_mean": sum(generated) / len(generated)}
        return batch, scores, extras, trained, metrics
