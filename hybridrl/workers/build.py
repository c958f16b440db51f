"""The one builder of a worker's roles: the app's workers, every benchmark under tools/ and the tests call it, so a
benchmark measures exactly what a run executes.

    topology = Topology(world_size, cfg.engine.tp_size, rank)
    roles = build_components(cfg, topology, device)     # actor, ref, engine (+ critic, reward models)
    roles.rollout.sync(roles.actor.model)               # what every phase "reshard" does

Roles are built in a fixed order on every rank (their FSDP wrapping and process groups are collective).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from hybridrl.config import RunConfig
from hybridrl.engines import build_engine
from hybridrl.models.loading import load_tokenizer, resolve_model_path
from hybridrl.reshard import Resharder
from hybridrl.rewards import resolve_reward
from hybridrl.topology import Topology
from hybridrl.training.reference import Reference
from hybridrl.training.trainer import Trainer
from hybridrl.workers.rollout import Rollout

log = logging.getLogger(__name__)


@dataclass
class Components:
    """Everything one worker holds, by role."""

    topology: Topology
    device: torch.device
    tokenizer: Any
    actor: Trainer
    """The FSDP policy and its optimizer."""
    ref: Reference | None
    """The frozen reference (None without a KL term, and with LoRA: the actor's base serves it)."""
    rollout: Rollout | None
    """The engine and its weight sync (None only in trainer-only benchmarks)."""
    reward_fn: Callable

    def roles(self) -> dict[str, Any]:
        """Every role present, by name: what memory reports and checkpoints iterate over."""
        roles = {"actor": self.actor, "ref": self.ref, "engine": self.rollout}
        return {k: v for k, v in roles.items() if v is not None}

    def stateful(self) -> dict[str, Any]:
        """The roles a checkpoint holds (those with `save`/`load`): trained models, not frozen or derived ones."""
        return {name: role for name, role in self.roles().items() if hasattr(role, "save")}

    @staticmethod
    def state_dir(checkpoint: str, role: str) -> str:
        """Where `role` keeps its state inside a checkpoint folder: the actor at its top (the layout `tools/export_hf.py`
        reads), any other role in a subfolder of its name."""
        return checkpoint if role == "actor" else str(Path(checkpoint) / role)

    def shutdown(self) -> None:
        """Release the engine (the trainer roles are plain memory)."""
        if self.rollout is not None:
            self.rollout.shutdown()


def optimizer_steps(cfg: RunConfig) -> int:
    """Optimizer steps over the whole run (the lr schedule's length)."""
    rows = cfg.data.train_batch_size * cfg.algorithm.group_size
    per_epoch = 1 if cfg.trainer.mini_batch_size == 0 else rows // cfg.trainer.mini_batch_size
    return cfg.trainer.steps * cfg.trainer.ppo_epochs * per_epoch


def build_components(cfg: RunConfig, topology: Topology, device: torch.device,
                     with_engine: bool = True) -> Components:
    """Build this rank's roles for `cfg` (collective: every rank of `topology` calls it at the same point).
    `with_engine=False` leaves the engine out (trainer-only benchmarks); a run always has one."""
    torch.manual_seed(cfg.trainer.seed)
    model_path = resolve_model_path(cfg.model)
    tokenizer = load_tokenizer(model_path, cfg.model.trust_remote_code)
    mesh = topology.fsdp_mesh(device.type)
    pad, temperature = tokenizer.pad_token_id, cfg.engine.temperature
    actor = Trainer(model_path, cfg.model, cfg.trainer, cfg.algorithm, device, mesh, pad, temperature,
                    optimizer_steps(cfg))
    ref = None
    if cfg.algorithm.uses_reference and not actor.serves_reference:  # with LoRA the actor's base is the reference
        ref = Reference(model_path, cfg.model, cfg.trainer, device, mesh, pad, temperature,
                        offload=cfg.ref.resolve_offload(cfg.trainer))
    rollout = build_rollout(cfg, model_path, tokenizer, device, topology, actor.model) if with_engine else None
    return Components(topology, device, tokenizer, actor, ref, rollout, resolve_reward(cfg.reward.spec))


def build_rollout(cfg: RunConfig, model_path: str, tokenizer, device: torch.device, topology: Topology,
                  policy: torch.nn.Module) -> Rollout:
    """The engine for this rank and its resharder; an engine that starts empty gets `policy`'s weights now."""
    engine = build_engine(cfg.engine, cfg.model, model_path, tokenizer, device, topology, seed=cfg.trainer.seed)
    resharder = Resharder(cfg.reshard, engine, policy.config, tp_rank=topology.engine_tp_rank,
                          tp_size=topology.engine_tp_size)
    rollout = Rollout(engine, resharder, cfg.engine.sleep_level)
    if engine.starts_empty:
        rollout.sync(policy)  # its first weights: the actor's (the checkpoint's), as every later sync delivers them
    return rollout
