"""The one builder of a worker's roles: the app's workers, every benchmark under benchmarks/ and the tests call it,
so a benchmark measures exactly what a run executes.

    topology = Topology(world_size, cfg.engine.tp_size, rank)
    roles = build_components(cfg, topology, device)     # actor, ref, engine (+ critic, reward models)
    roles.rollout.sync(roles.actor.model)               # what every phase "reshard" does

Roles are built in a fixed order on every rank (their FSDP wrapping and process groups are collective).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

import hybridrl.agent.tasks  # noqa: F401  (registers the tool task's rewards)
import hybridrl.data.synthetic  # noqa: F401  (registers the built-in "synthetic" reward)
from hybridrl.agent.loop import AgentLoop
from hybridrl.config import RunConfig
from hybridrl.engines import build_engine
from hybridrl.errors import ConfigError
from hybridrl.models.loading import load_tokenizer, resolve_model_path
from hybridrl.models.vision import is_vision_language, tower_trains
from hybridrl.plan import Plan, make_plan
from hybridrl.reshard import Resharder
from hybridrl.rewards import resolve_reward
from hybridrl.rewards.combine import RewardScorer
from hybridrl.rewards.remote import RemoteReward
from hybridrl.rewards.reward_model import TINY, RewardModel
from hybridrl.topology import Topology
from hybridrl.training.critic import Critic
from hybridrl.training.fsdp import Precision
from hybridrl.training.reference import Reference
from hybridrl.training.sequence_parallel import SequenceParallel
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
    """The reward function (registered, `reward.fn`, or `reward=remote`)."""
    critic: Critic | None = None
    """The value model (algorithm=ppo only)."""
    reward_models: list[RewardModel] = field(default_factory=list)
    """Local reward models, in host memory outside their turn in the reward phase."""
    scorer: RewardScorer | None = None
    """The reward phase: the function and the reward models, combined."""
    agent_loop: AgentLoop | None = None
    """The multi-turn agent loop (rollout=agent), driving the engine through requests; None for single-turn."""
    memory_plan: Plan | None = None
    """The estimate of each phase's peak device memory (`hybridrl/plan.py`), logged beside the measured peaks."""

    def roles(self) -> dict[str, Any]:
        """Every role present, by name: what memory reports and checkpoints iterate over."""
        roles = {
            "actor": self.actor,
            "ref": self.ref,
            "critic": self.critic,
            "engine": self.rollout,
            **{rm.name: rm for rm in self.reward_models},
        }
        return {k: v for k, v in roles.items() if v is not None}

    def stateful(self) -> dict[str, Any]:
        """The roles a checkpoint holds (those with `save`/`load`): trained models, not frozen or derived ones."""
        return {name: role for name, role in self.roles().items() if hasattr(role, "save")}

    @staticmethod
    def state_dir(checkpoint: str, role: str) -> str:
        """Where `role` keeps its state inside a checkpoint folder: the actor at its top (the layout
        `hybridrl/export.py` reads), any other role in a subfolder of its name."""
        return checkpoint if role == "actor" else str(Path(checkpoint) / role)

    def shutdown(self) -> None:
        """Release the engine and the agent loop's tools (the trainer roles are plain memory)."""
        if self.agent_loop is not None:
            self.agent_loop.close()
        if self.rollout is not None:
            self.rollout.shutdown()


def optimizer_steps(cfg: RunConfig, mini_batch_size: int | None = None, ppo_epochs: int | None = None) -> int:
    """Optimizer steps over the whole run (the lr schedule's length); the actor's batching unless given."""
    mini = cfg.trainer.mini_batch_size if mini_batch_size is None else mini_batch_size
    epochs = cfg.trainer.ppo_epochs if ppo_epochs is None else ppo_epochs
    rows = cfg.data.train_batch_size * cfg.algorithm.group_size
    per_epoch = 1 if mini == 0 else rows // mini
    return cfg.trainer.steps * epochs * per_epoch


def build_components(cfg: RunConfig, topology: Topology, device: torch.device, with_engine: bool = True) -> Components:
    """Build this rank's roles for `cfg` (collective: every rank of `topology` calls it at the same point).
    `with_engine=False` leaves the engine out (trainer-only benchmarks); a run always has one."""
    torch.manual_seed(cfg.trainer.seed)
    model_path = resolve_model_path(cfg.model)
    tokenizer = load_tokenizer(model_path, cfg.model.trust_remote_code)
    mesh = topology.fsdp_mesh(device.type)
    sp = sequence_parallel(topology, device)
    pad, temperature = tokenizer.pad_token_id, cfg.engine.temperature
    actor = Trainer(
        model_path, cfg.model, cfg.trainer, cfg.algorithm, device, mesh, pad, temperature, optimizer_steps(cfg), sp
    )
    ref = None
    if cfg.algorithm.uses_reference and not actor.serves_reference:  # with LoRA the actor's base is the reference
        ref = Reference(
            model_path,
            cfg.model,
            cfg.trainer,
            device,
            mesh,
            pad,
            temperature,
            offload=cfg.ref.resolve_offload(cfg.trainer),
            sequence_parallel_size=topology.sequence_parallel_size,
        )
    critic = build_critic(cfg, model_path, device, mesh, pad, sp) if cfg.algorithm.needs_critic else None
    for role in (ref, critic):  # one meter counts the step's trainer passes, whichever role runs them
        if role is not None:
            role.meter = actor.meter
    reward_models = build_reward_models(cfg, device, mesh)
    rollout = build_rollout(cfg, model_path, tokenizer, device, topology, actor.model) if with_engine else None
    reward_fn = RemoteReward(cfg.reward.remote) if cfg.reward.spec == "remote" else resolve_reward(cfg.reward.spec)
    scorer = RewardScorer(reward_fn, tokenizer, cfg.reward, reward_models)
    agent_loop = AgentLoop(cfg.agent, tokenizer) if cfg.rollout.name == "agent" else None
    return Components(
        topology,
        device,
        tokenizer,
        actor,
        ref,
        rollout,
        reward_fn,
        critic,
        reward_models,
        scorer,
        agent_loop,
        memory_plan=memory_plan(cfg, device),
    )


def sequence_parallel(topology: Topology, device: torch.device) -> SequenceParallel | None:
    """This rank's SP group for the trainer roles (None without `trainer.sequence_parallel_size`); collective."""
    group = topology.sequence_parallel_group(device.type)
    if group is None:
        return None
    return SequenceParallel(group, topology.sp_rank, topology.sequence_parallel_size)


def memory_plan(cfg: RunConfig, device: torch.device) -> Plan | None:
    """The estimate logged beside the measured peaks; None (said once) where the model's skeleton cannot be built
    from its config alone: the estimate is a report here, the run's own check has already passed."""
    try:
        return make_plan(cfg, device_bytes(cfg, device))
    except Exception as e:  # noqa: BLE001 - a missing estimate must not stop a run
        log.warning("memory estimate unavailable (%s: %s); memory/estimate_gb is not logged", type(e).__name__, e)
        return None


def device_bytes(cfg: RunConfig, device: torch.device) -> float | None:
    """This worker's device memory as the plan sees it: trainer.device_memory_gb, else the GPU's size."""
    if cfg.trainer.device_memory_gb is not None:
        return cfg.trainer.device_memory_gb * 2**30
    return float(torch.cuda.get_device_properties(device).total_memory) if device.type == "cuda" else None


def build_critic(
    cfg: RunConfig, policy_path: str, device: torch.device, mesh, pad_token_id: int, sp: SequenceParallel | None = None
) -> Critic:
    """The value model: `critic.model.path` (default the policy's folder) with a scalar head, its own optimizer."""
    c = cfg.critic
    path = os.path.expanduser(c.model.path) if c.model.path else policy_path
    if not (Path(path) / "config.json").is_file():
        raise ConfigError(f"critic.model.path={c.model.path!r} is not a Hugging Face model folder (no config.json)")
    mini, _micro, epochs = c.batching(cfg.trainer)
    return Critic(
        path,
        cfg.model,
        c,
        cfg.trainer,
        cfg.algorithm,
        device,
        mesh,
        pad_token_id,
        optimizer_steps(cfg, mini, epochs),
        head_seed=cfg.trainer.seed,
        sequence_parallel=sp,
    )


def build_reward_models(cfg: RunConfig, device: torch.device, mesh) -> list[RewardModel]:
    """Every configured reward model, loaded one at a time and left in host memory (GPU) until its turn."""
    from hybridrl.models.tiny_heads import ensure_tiny_reward_model

    precision = Precision.for_device(cfg.trainer.param_dtype, device)
    out = []
    for i, m in enumerate(cfg.reward_model.models):
        where = f"reward_model.models[{i}] ({m.name})"
        path = str(ensure_tiny_reward_model(cfg.model.cache_dir, seed=m.seed)) if m.path == TINY else m.path
        with torch.random.fork_rng(devices=[]):  # loading draws no number the run's other roles would see
            out.append(
                RewardModel(
                    m,
                    path,
                    device,
                    mesh,
                    precision,
                    cfg.data.prompt_key,
                    cfg.data.system_prompt,
                    cfg.model.trust_remote_code,
                    where,
                    padding_free=cfg.trainer.padding_free,
                )
            )
    return out


def build_rollout(
    cfg: RunConfig, model_path: str, tokenizer, device: torch.device, topology: Topology, policy: torch.nn.Module
) -> Rollout:
    """The engine for this rank and its resharder; an engine that starts empty gets `policy`'s weights now."""
    engine = build_engine(cfg.engine, cfg.model, model_path, tokenizer, device, topology, seed=cfg.trainer.seed)
    # A vision-language model's tower reaches the engine only when it trains; frozen, the engine loaded it already.
    if is_vision_language(policy.config) and not engine.takes_images:
        raise ConfigError(
            f"engine={cfg.engine.name}: this engine does not take image prompts yet, and model.path is a "
            "vision-language model; use engine=native (its transformers path generates with images) or engine=sglang"
        )
    if is_vision_language(policy.config) and (cfg.rollout.partial.enabled or cfg.rollout.name == "agent"):
        key = "rollout.partial.enabled=true" if cfg.rollout.partial.enabled else "rollout=agent"
        raise ConfigError(
            f"{key}: carried samples and agent turns do not hold images yet, and model.path is a vision-language "
            "model; use the default single-turn rollout (rollout=single) without rollout.partial"
        )

    def rollout_of(vision: bool) -> Rollout:
        resharder = Resharder(
            cfg.reshard,
            engine,
            policy.config,
            tp_rank=topology.engine_tp_rank,
            tp_size=topology.engine_tp_size,
            vision=vision,
        )
        return Rollout(engine, resharder, cfg.engine.sleep_level)

    vl = is_vision_language(policy.config)
    rollout = rollout_of(vl and tower_trains(cfg.model))
    if engine.starts_empty:
        # Its first weights: the actor's (the checkpoint's), as every later sync delivers them; a frozen vision
        # tower's too, this once (the engine keeps them: `FusedEngine(tower_trains=False)`).
        (rollout_of(True) if vl and not tower_trains(cfg.model) else rollout).sync(policy)
    return rollout
