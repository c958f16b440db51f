"""The single controller: owns the loop, the data, advantages, metrics; drives workers by phase.

One iteration, as issued to the WorkerGroup (`hybridrl.phases.Phase`)::

    wake → generate → sleep → logprob → [values] → reward → advantages (here) → [update_critic] → update → reshard

The bracketed phases run with a critic (algorithm=ppo); during `critic.warmup_steps` the actor's update is skipped.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf

from hybridrl.agent import agent_metrics, trajectories_to_batch
from hybridrl.algorithms import GroupRefill
from hybridrl.batch import Batch
from hybridrl.checkpoints import CheckpointDir, read_meta
from hybridrl.config import RunConfig
from hybridrl.data.prompts import Prompt, PromptLoader, load_prompts
from hybridrl.engines.base import Completion, SamplingParams
from hybridrl.errors import in_phase
from hybridrl.estimation import estimate, shaped_scores
from hybridrl.models.loading import load_tokenizer, resolve_model_path
from hybridrl.phases import TIMED_PHASES, Phase
from hybridrl.resume_policy import enforce_resume_policy
from hybridrl.rewards.base import RewardScores
from hybridrl.rewards.scoring import merge_scores
from hybridrl.tracking.samples import pick_samples, sample_rows
from hybridrl.tracking.tracker import Tracker
from hybridrl.workers.backends import build_worker_group
from hybridrl.workers.group import WorkerGroup

log = logging.getLogger("hybridrl")


def completions_to_batch(prompts: list[Prompt], comps: list[Completion]) -> Batch:
    """Response-aligned tensors (responses, mask, engine log-probs) for every completion."""
    width = max(1, max(len(c.token_ids) for c in comps))
    resp = torch.zeros((len(comps), width), dtype=torch.long)
    mask = torch.zeros((len(comps), width), dtype=torch.float32)
    elp = torch.zeros((len(comps), width), dtype=torch.float32)
    for i, c in enumerate(comps):
        n = len(c.token_ids)
        resp[i, :n] = torch.tensor(c.token_ids, dtype=torch.long)
        mask[i, :n] = 1
        elp[i, :n] = torch.tensor(c.logprobs, dtype=torch.float32)
    src = [prompts[c.prompt_index] for c in comps]
    return Batch(
        prompts=[p.token_ids for p in src],
        tensors={"responses": resp, "response_mask": mask, "engine_logprobs": elp},
        meta={
            "prompt_text": [p.text for p in src],
            "sample": [p.sample for p in src],
            "finish_reason": [c.finish_reason for c in comps],
        },
    )


def mean_over_ranks(results: list[dict[str, float]]) -> dict[str, float]:
    """Average each metric over the ranks that reported it."""
    acc: dict[str, list[float]] = defaultdict(list)
    for r in results:
        for k, v in r.items():
            acc[k].append(float(v))
    return {k: sum(v) / len(v) for k, v in acc.items()}


class Controller:
    """Runs the RL loop for one composed config inside Hydra's run dir."""

    def __init__(
        self, cfg: RunConfig, run_dir: str | Path, full_config: dict, job_name: str, sweep_group: str | None = None
    ) -> None:
        self.cfg, self.run_dir = cfg, Path(run_dir)
        self.full_config, self.job_name, self.sweep_group = full_config, job_name, sweep_group
        self.group: WorkerGroup | None = None
        self.times: dict[str, float] = {}
        self.reward_errors = 0

    # -- setup ----------------------------------------------------------------------------
    def setup(self, prompts: list[Prompt] | None = None) -> None:
        """Data first (cheap, and bad files fail before any model loads), then workers, then tracking.

        `prompts` replaces the configured data (benchmarks feed token ids of a chosen length this way)."""
        cfg = self.cfg
        self.tokenizer = load_tokenizer(resolve_model_path(cfg.model), cfg.model.trust_remote_code)
        if prompts is None:
            self.train_prompts, self.val_prompts = load_prompts(cfg.data, self.tokenizer)
        else:
            self.train_prompts, self.val_prompts = prompts, []
        self.loader = PromptLoader(self.train_prompts, cfg.data.train_batch_size, cfg.data.shuffle, cfg.data.seed)
        stop = list(cfg.engine.stop_token_ids)
        self.sampling = SamplingParams(
            n=cfg.algorithm.group_size,
            temperature=cfg.engine.temperature,
            top_p=cfg.engine.top_p,
            top_k=cfg.engine.top_k,
            max_new_tokens=cfg.engine.max_new_tokens,
            stop_token_ids=stop,
        )
        self.tracker = Tracker(cfg.logger, self.run_dir, self.full_config, self.job_name, self.sweep_group)
        log.info(
            "%d training prompts, %d held out; %d worker(s), engine=%s tp=%d",
            len(self.train_prompts),
            len(self.val_prompts),
            cfg.cluster.world_size,
            cfg.engine.name,
            cfg.engine.tp_size,
        )
        self.group = build_worker_group(cfg)
        self.start_step = 0
        self.checkpoints = CheckpointDir(self.run_dir, cfg.trainer.keep_last)
        self._resume(self.checkpoints.resolve(cfg.trainer.resume))

    def _resume(self, path: Path | None) -> None:
        """Continue from a checkpoint: trainer state, engine weights, data position, metrics rows."""
        if path is None:
            if self.cfg.trainer.resume == "auto":
                log.info("trainer.resume=auto: no complete checkpoint in %s, starting fresh", self.checkpoints.root)
            return
        meta = read_meta(path)
        # Keys that may change on resume take their new values (one log line); the others must not have changed.
        changed = enforce_resume_policy(
            meta["config"], self.full_config, OmegaConf.to_container(OmegaConf.structured(RunConfig))
        )
        if changed:
            log.info(changed)
        self.group.run_all(Phase.LOAD_CHECKPOINT, str(path))
        self.group.run_all(Phase.RESHARD)  # the engine must generate from the restored weights
        self.loader.load_state_dict(meta["loader"])
        self.start_step = int(meta["step"])
        self.tracker.resume_at(self.start_step)
        log.info("resumed from %s at step %d", path, self.start_step)

    def save_checkpoint(self, step: int) -> Path:
        """An atomic checkpoint of every rank's trainer state plus the controller's own."""
        tmp = self.checkpoints.staging(step)
        self.group.run_all(Phase.SAVE_CHECKPOINT, str(tmp))
        path = self.checkpoints.publish(tmp, step, {"loader": self.loader.state_dict(), "config": self.full_config})
        self.tracker.plot()
        log.info("checkpoint %s", path)
        return path

    @contextmanager
    def timed(self, phase: Phase | str):
        """Add the wall time of the block to `time/<phase>`."""
        name, t0 = str(phase), time.perf_counter()
        with in_phase(name):  # an error escaping the block names the phase
            yield
        self.times[name] = self.times.get(name, 0.0) + time.perf_counter() - t0

    # -- train ----------------------------------------------------------------------------
    def train(self) -> None:
        """Run `trainer.steps` iterations, logging one row per step."""
        from tqdm.auto import tqdm
        from tqdm.contrib.logging import logging_redirect_tqdm

        steps = self.cfg.trainer.steps
        bar = tqdm(
            total=steps, initial=self.start_step, desc="steps", disable=not self.cfg.logger.progress_bar, leave=False
        )
        with logging_redirect_tqdm():
            for step in range(self.start_step + 1, steps + 1):
                metrics = self.train_step(step)
                every = self.cfg.trainer.eval_every
                if every and (step % every == 0 or step == steps) and self.val_prompts:
                    metrics.update(self.validate(step))
                self.tracker.log(step, metrics)
                if self.cfg.trainer.save_every and step % self.cfg.trainer.save_every == 0:
                    self.save_checkpoint(step)
                bar.update(1)
        bar.close()

    def train_step(self, step: int) -> dict[str, Any]:
        """One iteration of the phase sequence; returns its metrics."""
        group = self.group
        self.times, self.reward_errors = {}, 0
        t_step = time.perf_counter()
        with self.timed(Phase.WAKE):
            metrics = mean_over_ranks([s or {} for s in group.run_all(Phase.WAKE)])
        if self.cfg.algorithm.filter_groups:
            batch, scores, extras, filtered = self._filtered_rollout(step)
            metrics.update(filtered)
        else:
            prompts = self.loader.next_batch()
            with self.timed(Phase.GENERATE):
                comps = group.generate([p.token_ids for p in prompts], step, self.sampling)
            with self.timed(Phase.SLEEP):
                group.run_all(Phase.SLEEP)
            batch, rollout_metrics = self._rollout_batch(prompts, comps)
            metrics.update(rollout_metrics)
        with self.timed(Phase.LOGPROB):
            parts = group.run_data_parallel(Phase.LOGPROB, batch)
            for key in parts[0]:
                batch[key] = torch.cat([p[key] for p in parts])
        if self.cfg.algorithm.needs_critic:
            with self.timed(Phase.VALUES):
                batch["values"] = torch.cat([p["values"] for p in group.run_data_parallel(Phase.VALUES, batch)])
        if not self.cfg.algorithm.filter_groups:
            with self.timed(Phase.REWARD):
                scores, extras = self._gather_rewards(group.run_scattered(Phase.REWARD, batch))
        with self.timed("advantages"):
            metrics.update(estimate(self.cfg.algorithm, batch, scores, extras, self.cfg.engine.max_new_tokens))
            metrics["reward/errors"] = self.reward_errors
        if self.tracker.samples_due(step):  # a few rollouts in samples.jsonl: what the model wrote, what it scored
            rows = pick_samples(len(batch), self.cfg.logger.samples_per_step, self.cfg.algorithm.group_size)
            self.tracker.log_samples(step, sample_rows(batch, rows, self.tokenizer, scores, extras))
        if self.cfg.algorithm.needs_critic:
            with self.timed(Phase.UPDATE_CRITIC):
                metrics.update(mean_over_ranks(group.run_data_parallel(Phase.UPDATE_CRITIC, batch)))
        if self._actor_trains(step, metrics):
            with self.timed(Phase.UPDATE):
                metrics.update(mean_over_ranks(group.run_data_parallel(Phase.UPDATE, batch)))
        with self.timed(Phase.RESHARD):
            metrics.update(mean_over_ranks(group.run_all(Phase.RESHARD)))
        step_time = time.perf_counter() - t_step
        metrics.update(self._step_metrics(batch, step_time))
        return metrics

    def _actor_trains(self, step: int, metrics: dict[str, Any]) -> bool:
        """False during the critic's warm-up (`critic.warmup_steps` critic-only steps), logged as `critic/warmup`."""
        if not self.cfg.algorithm.needs_critic:
            return True
        warmup = self.cfg.critic.warmup_steps
        metrics["critic/warmup"] = float(step <= warmup)
        if step <= warmup:
            log.info(
                "step %d: critic warm-up (%d of critic.warmup_steps=%d): the actor's update is skipped",
                step,
                step,
                warmup,
            )
        return step > warmup

    def _filtered_rollout(self, step: int) -> tuple[Batch, list[float], dict[str, list[float]], dict[str, float]]:
        """DAPO's dynamic sampling: generate and score rounds of new prompts until `data.train_batch_size` groups
        whose rewards differ are collected (or `algorithm.max_resample_rounds` extra rounds are spent; then the
        batch is filled with equal-reward groups, whose advantages are 0, so its size stays constant — logged).
        The reward phase runs before the log-probs here: only the kept rows are scored by the models."""
        algo, group = self.cfg.algorithm, self.group
        refill = GroupRefill(self.cfg.data.train_batch_size, algo.group_size, algo.max_resample_rounds)
        rounds: list[tuple[Batch, list[float], dict[str, list[float]]]] = []
        first_index = 0
        while refill.needs_more:
            prompts = self.loader.next_batch()
            with self.timed(Phase.GENERATE):
                comps = group.generate([p.token_ids for p in prompts], step, self.sampling, first_index=first_index)
            first_index += len(prompts)  # later rounds draw from streams of their own
            batch, _ = self._rollout_batch(prompts, comps)
            with self.timed(Phase.REWARD):
                scores, extras = self._gather_rewards(group.run_scattered(Phase.REWARD, batch))
            raw = torch.tensor(scores, dtype=torch.float32)
            refill.add(shaped_scores(algo, raw, batch["response_mask"], self.cfg.engine.max_new_tokens))
            rounds.append((batch, scores, extras))
        with self.timed(Phase.SLEEP):
            group.run_all(Phase.SLEEP)
        plan = refill.finish()
        if plan.filled_groups:
            log.warning(
                "step %d: dynamic sampling kept %d of %d groups after %d rounds (algorithm.max_resample_rounds=%d); "
                "%d groups with equal rewards fill the batch",
                step,
                plan.kept_groups,
                self.cfg.data.train_batch_size,
                plan.rounds,
                algo.max_resample_rounds,
                plan.filled_groups,
            )
        generated = [s for _, sc, _ in rounds for s in sc]
        batch = Batch.concat([b.select(rows.tolist()) for (b, _, _), rows in zip(rounds, plan.rows)])
        scores = [sc[i] for (_, sc, _), rows in zip(rounds, plan.rows) for i in rows.tolist()]
        extras = {
            k: [ex[k][i] for (_, _, ex), rows in zip(rounds, plan.rows) for i in rows.tolist()] for k in rounds[0][2]
        }
        return batch, scores, extras, {**plan.metrics(), "reward/generated_mean": sum(generated) / len(generated)}

    def _rollout_batch(self, prompts: list[Prompt], outs: list) -> tuple[Batch, dict[str, float]]:
        """The rollout as a training batch: completions, or with rollout=agent trajectories (and `agent/*`)."""
        if self.cfg.rollout.name == "agent":
            return trajectories_to_batch(prompts, outs), agent_metrics(outs)
        return completions_to_batch(prompts, outs), {}

    def _gather_rewards(self, parts: list[RewardScores]) -> tuple[list[float], dict[str, list[float]]]:
        """The ranks' scores joined; samples the reward function raised on are counted for `reward/errors`."""
        merged = merge_scores(parts)
        self.reward_errors += merged.errors
        return merged.scores, merged.extras

    def _step_metrics(self, batch: Batch, step_time: float) -> dict[str, Any]:
        lengths = batch["response_mask"].sum(-1)
        prompt_tokens = sum(len(p) for p in batch.prompts)
        response_tokens = lengths.sum().item()
        # Every phase of the loop that ran, and the core ones always (0 when they took no time).
        m: dict[str, Any] = {
            f"time/{p}": self.times.get(p, 0.0)
            for p in TIMED_PHASES
            if p in self.times or p not in ("values", "update_critic")
        }
        m["time/step"] = step_time
        m["batch/samples"] = len(batch)
        m["response/length_mean"] = lengths.mean().item()
        m["response/length_max"] = lengths.max().item()
        m["response/clip_frac"] = sum(r == "length" for r in batch.meta["finish_reason"]) / len(batch)
        m["perf/tokens_per_s"] = (prompt_tokens + response_tokens) / step_time
        m["perf/rollout_tokens_per_s"] = response_tokens / max(self.times.get("generate", 0.0), 1e-9)
        for rank_mem in self.group.run_all(Phase.MEMORY_REPORT)[:1]:
            for phase, stats in rank_mem.items():
                for k, v in stats.items():
                    m[f"memory/{phase}/{k}"] = v
        return m

    def objective(self, frac: float = 0.2) -> float:
        """Mean reward/mean over the last `frac` of logged steps (what sweepers maximize)."""
        from hybridrl.tracking.plot import read_metrics

        rows = [r["reward/mean"] for r in read_metrics(self.tracker.metrics_path) if r.get("reward/mean") is not None]
        tail = rows[-max(1, int(len(rows) * frac)) :] if rows else [float("nan")]
        return sum(tail) / len(tail)

    # -- validation -----------------------------------------------------------------------
    def validate(self, step: int) -> dict[str, float]:
        """Generation on the held-out prompts through the same engines: greedy `val/*` metrics, and with
        `trainer.eval_samples=k` also k samples per prompt (`val/pass@k`, `val/mean@k`)."""
        cfg = self.cfg
        self.group.run_all(Phase.WAKE)
        greedy = SamplingParams(
            n=1,
            temperature=0.0,
            max_new_tokens=cfg.engine.max_new_tokens,
            stop_token_ids=list(cfg.engine.stop_token_ids),
        )
        scores, correct, batch = self._score_val(greedy, step)
        out = {
            "val/reward_mean": sum(scores) / len(scores),
            "val/accuracy": sum(correct) / len(correct),
            "val/response_length_mean": batch["response_mask"].sum(-1).mean().item(),
        }
        k = cfg.trainer.eval_samples
        if k:
            sampled = dataclasses.replace(self.sampling, n=k)
            scores, correct, _ = self._score_val(sampled, step)
            per_prompt = torch.tensor(correct).view(-1, k)
            out[f"val/pass@{k}"] = per_prompt.any(-1).float().mean().item()
            out[f"val/mean@{k}"] = sum(scores) / len(scores)
        return out

    def _score_val(self, params: SamplingParams, step: int) -> tuple[list[float], list[bool], Batch]:
        """Scores and exact-correctness of held-out completions (`correct` component, else score >= 1)."""
        comps = self.group.generate([p.token_ids for p in self.val_prompts], step, params)
        batch, _ = self._rollout_batch(self.val_prompts, comps)
        pad = self.group.topology.padding_rows(len(batch))  # repeat the last rows so every rank gets an equal share
        padded = Batch.concat([batch, batch.select([len(batch) - 1] * pad)]) if pad else batch
        scores, extras = self._gather_rewards(self.group.run_scattered(Phase.REWARD, padded))
        scores = scores[: len(batch)]
        exact = extras.get("correct") or extras.get("exact")
        correct = [c >= 1.0 for c in exact[: len(batch)]] if exact else [s >= 1.0 for s in scores]
        return scores, correct, batch

    # -- cleanup --------------------------------------------------------------------------
    def cleanup(self) -> None:
        """Stop workers and close tracking; safe after a failure half-way through setup."""
        if self.group is not None:
            self.group.shutdown()
            self.group = None
        if hasattr(self, "tracker"):
            self.tracker.finish()
