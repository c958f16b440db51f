"""HybridWorker: one device's trainer, rollout engine and weight sync; each phase is a method.

The controller calls these in order every iteration (on every worker, same order)::

    wake → generate → sleep → logprob → reward → [advantages on the controller] → update → reshard
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Sequence

import torch

from hybridrl.batch import Batch
from hybridrl.config import RunConfig
from hybridrl.engines import build_engine
from hybridrl.engines.fused.groups import engine_tp_group
from hybridrl.engines.base import Completion, SamplingParams
from hybridrl.models.loading import load_tokenizer, resolve_model_path
from hybridrl.reshard import Resharder
from hybridrl.rewards import RewardInput, normalize_results, resolve_reward
from hybridrl.training.trainer import Trainer
from hybridrl.workers.dist import init_process_group, memory_snapshot, pick_device

log = logging.getLogger(__name__)


def sampling_seed(base: int, step: int) -> int:
    """Seed of step `step`'s rollouts. Engines derive each sample's stream from it and the sample's
    global (prompt, index) position, so samples are the same on 1 or N workers, and every rank of
    an engine TP group draws the same tokens."""
    return (base * 1_000_003 + step * 7919) % (2**31 - 1)


class HybridWorker:
    """Trainer + engine on one device. Holds no schedule: the controller decides what runs when."""

    def __init__(self, cfg: RunConfig, rank: int = 0, world_size: int = 1, local_rank: int = 0) -> None:
        self.cfg, self.rank, self.world_size = cfg, rank, world_size
        self.device = pick_device(cfg.trainer.device, local_rank)
        init_process_group(rank, world_size, self.device, cfg.cluster.collective_timeout_s)
        torch.manual_seed(cfg.trainer.seed)
        self.tp_size = cfg.engine.tp_size
        self.tp_rank = rank % self.tp_size
        self.model_path = resolve_model_path(cfg.model)
        self.tokenizer = load_tokenizer(self.model_path, cfg.model.trust_remote_code)
        steps_per_iter = cfg.trainer.ppo_epochs * self._minibatches_per_step()
        self.trainer = Trainer(
            self.model_path, cfg.model, cfg.trainer, cfg.algorithm, self.device,
            self.tokenizer.pad_token_id, cfg.engine.temperature, cfg.trainer.steps * steps_per_iter,
        )
        # Collective: every rank creates every engine TP group, in the same order.
        self.tp_group = engine_tp_group(self.tp_size)
        self.engine = build_engine(
            cfg.engine, cfg.model, self.model_path, self.tokenizer, self.device,
            tp_rank=self.tp_rank, tp_size=self.tp_size, seed=cfg.trainer.seed, tp_group=self.tp_group,
        )
        self.resharder = Resharder(
            cfg.reshard, self.engine, self.trainer.model.config, tp_rank=self.tp_rank, tp_size=self.tp_size
        )
        self.reward_fn = resolve_reward(cfg.reward.spec)
        self.memory: dict[str, dict[str, float]] = {}
        self.phase_stats: dict[str, float] = {}  # offload figures, reported with the update's metrics
        self._record("init")

    def _minibatches_per_step(self) -> int:
        rows = self.cfg.data.train_batch_size * self.cfg.algorithm.group_size
        return 1 if self.cfg.trainer.mini_batch_size == 0 else rows // self.cfg.trainer.mini_batch_size

    def _record(self, phase: str) -> None:
        self.memory[phase] = memory_snapshot(self.device)

    # -- phase commands -------------------------------------------------------------------
    def wake(self) -> dict[str, float]:
        """Give the device to the engine: trainer state to host (per trainer.offload), engine fully awake."""
        stats = self.trainer.offload()
        self.engine.wake_up(["weights", "kv_cache"])
        self._record("wake")
        return stats

    def generate(
        self, prompts: Sequence[Sequence[int]], step: int, params: SamplingParams, prompt_offset: int = 0
    ) -> list[Completion]:
        """Sample completions for this worker's engine-DP share of the prompts (global index `prompt_offset` on)."""
        params = dataclasses.replace(params, seed=sampling_seed(self.cfg.trainer.seed, step), prompt_offset=prompt_offset)
        out = self.engine.generate(prompts, params)
        self._record("generate")
        return out

    def sleep(self) -> None:
        """Free the engine's memory for training (level per engine.sleep_level)."""
        self.engine.sleep(self.cfg.engine.sleep_level)
        self._record("sleep")

    def logprob(self, batch: Batch) -> dict[str, torch.Tensor]:
        """Old-policy and reference log-probs of the sampled tokens."""
        self.phase_stats.update(self.trainer.onload_params())
        out = self.trainer.compute_logprobs(batch)
        self._record("logprob")
        return out

    def reward(self, batch: Batch) -> tuple[list[float], dict[str, list[float]]]:
        """Score each completion with the configured reward function."""
        lengths = batch["response_mask"].sum(-1).tolist()
        items = [
            RewardInput(
                prompt=batch.meta["prompt_text"][i],
                response=self.tokenizer.decode(batch["responses"][i, : int(n)].tolist(), skip_special_tokens=True),
                sample=batch.meta["sample"][i],
                finish_reason=batch.meta["finish_reason"][i],
            )
            for i, n in enumerate(lengths)
        ]
        out = normalize_results(self.reward_fn(items), expected=len(items))
        self._record("reward")
        return out

    def update(self, batch: Batch) -> dict[str, float]:
        """PPO-clip update of the policy on this worker's shard."""
        self.phase_stats.update(self.trainer.onload_optimizer())
        out = {**self.trainer.update(batch), **self.phase_stats}
        self.phase_stats = {}
        self._record("update")
        return out

    def reshard(self) -> dict[str, float]:
        """Stream the updated weights into the engine (wakes the engine's weights first)."""
        t0 = time.perf_counter()
        self.engine.wake_up(["weights"])
        stats = self.resharder.sync(self.trainer.model).metrics()
        self.engine.finish_weight_update()
        stats["reshard/seconds"] = time.perf_counter() - t0
        self._record("reshard")
        return stats

    def save_checkpoint(self, path: str) -> None:
        """Write this rank's trainer state into the checkpoint folder `path`."""
        self.trainer.save(path)

    def load_checkpoint(self, path: str) -> None:
        """Restore the trainer from `path`; the controller reshards afterwards so the engine follows."""
        self.trainer.load(path)

    def memory_report(self) -> dict[str, dict[str, float]]:
        """Memory after each phase of the last iteration."""
        return dict(self.memory)

    def shutdown(self) -> None:
        """Release the engine and leave the process group."""
        import torch.distributed as dist

        self.engine.shutdown()
        if dist.is_initialized():
            dist.destroy_process_group()
