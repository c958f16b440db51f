"""The single controller: owns the loop, the data, advantages, metrics; drives workers by phase.

One iteration, as issued to the WorkerGroup (`hybridrl.phases.Phase`)::

    wake → generate → sleep → logprob → [values] → reward → advantages (here) → [update_critic] → update → reshard

The bracketed phases run with a critic (algorithm=ppo); during `critic.warmup_steps` the actor's update is skipped.
With rollout.partial on, generate → sleep is `PartialRollout.rollout` (hybridrl/rollout/partial.py): it over-samples,
stops once the step's groups are complete and carries the unfinished samples to the next step (checkpoints hold them).

A checkpoint is written only after a step that passed every check: the learners' divergence guard (in the update,
before the weights reach the engine) and the engine's log-probs being finite (after generation). An error escaping a
step names it (`at_step`); a save that fails or is interrupted leaves no staging folder behind.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import sys
import time
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf

from hybridrl.algorithms import GroupRefill
from hybridrl.batch import Batch
from hybridrl.checkpoints import CheckpointDir, read_meta
from hybridrl.config import RunConfig
from hybridrl.data.prompts import ContextLimit, Prompt, PromptLoader, load_prompts
from hybridrl.engines.base import SamplingParams
from hybridrl.errors import ConfigError, DivergenceError, at_step, in_phase
from hybridrl.estimation import estimate, shaped_scores
from hybridrl.models.image_processor import vision_processor
from hybridrl.models.loading import load_hf_config, load_tokenizer, resolve_model_path
from hybridrl.phases import TIMED_PHASES, Phase
from hybridrl.resume_policy import enforce_resume_policy
from hybridrl.rewards.base import RewardScores
from hybridrl.rewards.scoring import merge_scores
from hybridrl.rollout.partial import PartialRollout
from hybridrl.rollout.scoring import (
    completions_to_batch,
    correct_flags,
    generate_and_score,
    prompt_images,
    rollout_batch,
    score_batch_on_workers,
)
from hybridrl.tracking.console import LearningSignalWatch, validation_line
from hybridrl.tracking.samples import pick_samples, sample_rows
from hybridrl.tracking.summary import run_summary
from hybridrl.tracking.tracker import Tracker
from hybridrl.workers.backends import build_worker_group
from hybridrl.workers.group import WorkerGroup

log = logging.getLogger("hybridrl")

__all__ = ["Controller", "completions_to_batch", "mean_over_ranks"]  # completions_to_batch: kept importable here

#: Steps in a row without a learning signal (reward/zero_std_frac = 1) before the console says so.
NO_SIGNAL_PATIENCE = 5


def check_engine_logprobs(batch: Batch) -> None:
    """DivergenceError when a sampled token's engine log-prob is NaN or inf: its logits were not finite."""
    elp, mask = batch["engine_logprobs"], batch["response_mask"].bool()
    bad = (~torch.isfinite(elp) & mask).any(-1)
    if bad.any():
        raise DivergenceError(
            f"the engine drew {int(bad.sum())} of {len(bad)} responses from logits that are not finite (NaN or inf): "
            "the policy's weights have diverged or hold values the model cannot compute with. Lower trainer.lr and "
            "resume from the last checkpoint, or check model.path"
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
        self.model_at: Path | None = None  # the newest checkpoint: where the trained model is
        self.finished = False  # resumed from a checkpoint at trainer.steps: nothing left to train

    # -- setup ----------------------------------------------------------------------------
    def setup(self, prompts: list[Prompt] | None = None) -> None:
        """Data first (cheap, and bad files fail before any model loads), then workers, then tracking.

        `prompts` replaces the configured data (benchmarks feed token ids of a chosen length this way)."""
        cfg = self.cfg
        self.tokenizer = load_tokenizer(resolve_model_path(cfg.model), cfg.model.trust_remote_code)
        #: A vision-language model's image processor (images checked with the data, processed once per rollout).
        self.vision = vision_processor(cfg.model)
        if prompts is None:
            limit = self._context_limit()
            self.train_prompts, self.val_prompts = load_prompts(cfg.data, self.tokenizer, limit, self.vision)
        else:
            self.train_prompts, self.val_prompts = prompts, []
        self.loader = PromptLoader(self.train_prompts, cfg.data.train_batch_size, cfg.data.shuffle, cfg.data.seed)
        stop = list(cfg.engine.stop_token_ids) + (self.vision.stop_ids if self.vision else [])
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
        self.partial = (
            PartialRollout(
                cfg, self.loader, self.train_prompts, self.group, self.timed, self._rollout_batch, self._score
            )
            if cfg.rollout.partial.enabled
            else None
        )
        self.start_step = 0
        self.checkpoints = CheckpointDir(self.run_dir, cfg.trainer.keep_last)
        self._resume(self.checkpoints.resolve(cfg.trainer.resume))

    def _context_limit(self) -> ContextLimit | None:
        """The model's context (max_position_embeddings) that a prompt and, single-turn, its response must fit."""
        hf = load_hf_config(resolve_model_path(self.cfg.model), self.cfg.model.trust_remote_code)
        text = hf.get_text_config() if hasattr(hf, "get_text_config") else hf
        tokens = getattr(text, "max_position_embeddings", None)
        if not isinstance(tokens, int) or tokens <= 0:
            return None
        single = self.cfg.rollout.name != "agent"  # an agent's turns have budgets of their own
        return ContextLimit(tokens, self.cfg.engine.max_new_tokens if single else 0)

    def _resume(self, path: Path | None) -> None:
        """Continue from a checkpoint: trainer state, engine weights, data position, metrics rows."""
        if path is None:
            if self.cfg.trainer.resume == "auto":
                log.info("trainer.resume=auto: no complete checkpoint in %s, starting fresh", self.checkpoints.root)
            return
        meta = read_meta(path)
        step, steps = int(meta["step"]), self.cfg.trainer.steps
        if step > steps:
            raise ConfigError(
                f"trainer.steps={steps} is below the checkpoint's step {step} ({path}); set trainer.steps >= {step}"
            )
        # Keys that may change on resume take their new values (one log line); the others must not have changed.
        changed = enforce_resume_policy(
            meta["config"], self.full_config, OmegaConf.to_container(OmegaConf.structured(RunConfig))
        )
        if changed:
            log.info(changed)
        self.group.run_all(Phase.LOAD_CHECKPOINT, str(path))
        self.group.run_all(Phase.RESHARD)  # the engine must generate from the restored weights
        self.loader.load_state_dict(meta["loader"])
        if self.partial is not None:
            self.partial.load(path)  # the groups in flight: they come first, as they would have
        self.start_step, self.model_at, self.finished = step, path, step == steps
        self.tracker.resume_at(self.start_step)
        log.info("resumed from %s at step %d", path, self.start_step)

    def save_checkpoint(self, step: int, plot: bool = True) -> Path:
        """An atomic checkpoint of every rank's trainer state plus the controller's own (and plots.png, unless
        `plot` is off: the run's end draws it anyway). A save that fails or is interrupted removes its staging
        folder (the workers have stopped writing by then: a failed or interrupted phase stops them first)."""
        with in_phase(str(Phase.SAVE_CHECKPOINT)):
            tmp = self.checkpoints.staging(step)
            try:
                self.group.run_all(Phase.SAVE_CHECKPOINT, str(tmp))
                if self.partial is not None:
                    self.partial.save(tmp)
                meta = {"loader": self.loader.state_dict(), "config": self.full_config}
                path = self.checkpoints.publish(tmp, step, meta)
            except BaseException:
                self.checkpoints.remove_stale()
                raise
        if plot:
            self.tracker.plot()
        self.model_at = path
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
        """Run `trainer.steps` iterations, logging one row per step; then save the final model (trainer.save_final).
        The progress bar shows only on a terminal: redirected output gets the log lines alone."""
        from tqdm.auto import tqdm
        from tqdm.contrib.logging import logging_redirect_tqdm

        trainer = self.cfg.trainer
        steps, every = trainer.steps, trainer.eval_every
        show_bar = self.cfg.logger.progress_bar and sys.stderr.isatty()
        bar = tqdm(total=steps, initial=self.start_step, desc="steps", disable=not show_bar, leave=False)
        watch = LearningSignalWatch(NO_SIGNAL_PATIENCE) if self._group_baseline() else None
        with logging_redirect_tqdm():
            for step in range(self.start_step + 1, steps + 1):
                with at_step(step):
                    metrics = self.train_step(step)
                    if every and (step % every == 0 or step == steps) and self.val_prompts:
                        metrics.update(self.validate(step))
                    self.tracker.log(step, metrics)
                    if "val/accuracy" in metrics:
                        log.info(validation_line(step, metrics))
                    warning = watch.update(step, metrics) if watch else None
                    if warning:
                        log.warning(warning)
                    if trainer.save_every and step % trainer.save_every == 0:
                        self.save_checkpoint(step)
                    elif step == steps and trainer.save_final:
                        self.save_checkpoint(step, plot=False)
                bar.update(1)
        bar.close()

    def _group_baseline(self) -> bool:
        """Whether advantages come from the group's rewards alone (no critic, no token-level KL rewards), so equal
        rewards in every group mean no learning signal at all."""
        return not self.cfg.algorithm.needs_critic and self.cfg.algorithm.adv_estimator != "reinforce_pp"

    def train_step(self, step: int) -> dict[str, Any]:
        """One iteration of the phase sequence; returns its metrics."""
        group = self.group
        self.times, self.reward_errors = {}, 0
        t_step = time.perf_counter()
        with self.timed(Phase.WAKE):
            metrics = mean_over_ranks([s or {} for s in group.run_all(Phase.WAKE)])
        scores = None
        if self.partial is not None:  # over-sampled, partial rollouts (hybridrl/rollout/partial.py)
            batch, scores, extras, rollout_metrics = self.partial.rollout(step, self.sampling)
            metrics.update(rollout_metrics)
        elif self.cfg.algorithm.filter_groups:
            batch, scores, extras, filtered = self._filtered_rollout(step)
            metrics.update(filtered)
        else:
            prompts = self.loader.next_batch()
            with self.timed(Phase.GENERATE):
                images = prompt_images(prompts, self.vision)
                comps = group.generate([p.token_ids for p in prompts], step, self.sampling, images=images)
            with self.timed(Phase.SLEEP):
                group.run_all(Phase.SLEEP)
            batch, rollout_metrics = self._rollout_batch(prompts, comps, images)
            metrics.update(rollout_metrics)
        with self.timed(Phase.LOGPROB):
            parts = group.run_data_parallel(Phase.LOGPROB, batch)
            for key in parts[0]:
                batch[key] = torch.cat([p[key] for p in parts])
        if self.cfg.algorithm.needs_critic:
            with self.timed(Phase.VALUES):
                batch["values"] = torch.cat([p["values"] for p in group.run_data_parallel(Phase.VALUES, batch)])
        if scores is None:  # not scored during the rollout (dynamic sampling scores as it generates)
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
        metrics.update(self._step_metrics(batch, step_time, metrics.get("rollout/generated_tokens")))
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
                images = prompt_images(prompts, self.vision)
                ids = [p.token_ids for p in prompts]
                comps = group.generate(ids, step, self.sampling, first_index=first_index, images=images)
            first_index += len(prompts)  # later rounds draw from streams of their own
            batch, _ = self._rollout_batch(prompts, comps, images)
            with self.timed(Phase.REWARD):
                scores, extras = self._gather_rewards(group.run_scattered(Phase.REWARD, batch))
            raw = torch.tensor(scores, dtype=torch.float32)
            refill.add(shaped_scores(algo, raw, batch["response_mask"], self.cfg.engine.max_new_tokens))
            rounds.append((batch, scores, extras))
        with self.timed(Phase.SLEEP):
            group.run_all(Phase.SLEEP)
        plan = refill.finish()
        plan.warn_if_filled(log, step, algo.max_resample_rounds)
        generated = [s for _, sc, _ in rounds for s in sc]
        batch = Batch.concat([b.select(rows.tolist()) for (b, _, _), rows in zip(rounds, plan.rows)])
        scores = [sc[i] for (_, sc, _), rows in zip(rounds, plan.rows) for i in rows.tolist()]
        extras = {
            k: [ex[k][i] for (_, _, ex), rows in zip(rounds, plan.rows) for i in rows.tolist()] for k in rounds[0][2]
        }
        return batch, scores, extras, {**plan.metrics(), "reward/generated_mean": sum(generated) / len(generated)}

    def _rollout_batch(self, prompts: list[Prompt], outs: list, images: list | None = None) -> tuple[Batch, dict]:
        """The rollout as a training batch: completions, or with rollout=agent trajectories (and `agent/*`). Tokens
        drawn from non-finite logits (a diverged policy, whichever engine drew them) stop the run here."""
        batch, metrics = rollout_batch(prompts, outs, self.cfg.rollout.name == "agent", images)
        check_engine_logprobs(batch)
        return batch, metrics

    def _gather_rewards(self, parts: list[RewardScores]) -> tuple[list[float], dict[str, list[float]]]:
        """The ranks' scores joined; samples the reward function raised on are counted for `reward/errors`."""
        merged = merge_scores(parts)
        self.reward_errors += merged.errors
        return merged.scores, merged.extras

    def _score(self, batch: Batch) -> tuple[list[float], dict[str, list[float]]]:
        """The reward phase over any number of rows (padded to the ranks); errors counted for `reward/errors`."""
        merged = score_batch_on_workers(self.group, batch)
        self.reward_errors += merged.errors
        return merged.scores, merged.extras

    def _step_metrics(self, batch: Batch, step_time: float, generated: float | None = None) -> dict[str, Any]:
        """Time, size and rate figures of the step; `generated`: the tokens its rollout sampled where they are not the
        batch's responses (partial rollouts sample some of a step's responses in earlier steps)."""
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
        sampled = response_tokens if generated is None else generated
        m["perf/rollout_tokens_per_s"] = sampled / max(self.times.get("generate", 0.0), 1e-9)
        for rank_mem in self.group.run_all(Phase.MEMORY_REPORT)[:1]:
            for phase, stats in rank_mem.items():
                for k, v in stats.items():
                    m[f"memory/{phase}/{k}"] = v
        return m

    def objective(self, frac: float = 0.2) -> float:
        """Mean reward/mean over the last `frac` of logged steps (what sweepers maximize)."""
        from hybridrl.tracking.plot import read_metrics

        if not self.tracker.metrics_path.exists():  # a finished run resumed into a new folder: no step ran here
            return math.nan
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
        """Scores and exact-correctness of held-out completions (`rollout.scoring.correct_flags`)."""
        batch, merged = generate_and_score(
            self.group, self.val_prompts, params, step, agent=self.cfg.rollout.name == "agent", vision=self.vision
        )
        self.reward_errors += merged.errors
        return merged.scores, correct_flags(merged.scores, merged.extras), batch

    def summary(self, objective: float) -> str:
        """The end-of-run lines (first -> last reward and components, validation, time per step, where the model
        and the plot are, the objective); for a run resumed at its last step, one line saying it is finished."""
        from hybridrl.tracking.plot import read_metrics

        if self.finished:
            at = self.model_at
            return (
                f"{at} is at step {self.start_step} = trainer.steps: the run is finished, nothing to train (raise "
                f"trainer.steps to go on; python -m hybridrl.evaluate model.path={at} scores it)"
            )
        path = self.tracker.metrics_path
        rows = read_metrics(path) if path.exists() else []
        plot = self.run_dir / "plots.png" if self.cfg.logger.plot else None
        return run_summary(rows, objective, self.model_at, plot)

    # -- cleanup --------------------------------------------------------------------------
    def cleanup(self) -> None:
        """Stop workers, remove what an interrupted save left, close tracking; safe after a failure half-way
        through setup."""
        if self.group is not None:
            self.group.shutdown()
            self.group = None
        if hasattr(self, "checkpoints"):
            self.checkpoints.remove_stale()
        if hasattr(self, "tracker"):
            self.tracker.finish()
