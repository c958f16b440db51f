"""HybridWorker: one device's roles (actor, ref, engine, ...) on the run's topology; each phase is a method.

The controller sends the phases (`hybridrl.phases.Phase`) in order every iteration, on every worker::

    wake → generate → sleep → logprob → [values] → reward → [advantages on the controller] → [update_critic]
         → update → reshard

The worker decides no schedule: it dispatches each phase to the roles it concerns, and records memory after it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from hybridrl.agent.loop import Trajectory
from hybridrl.agent.tp_leader import agent_trajectories
from hybridrl.batch import Batch
from hybridrl.config import RunConfig
from hybridrl.cpu_threads import configure_threads
from hybridrl.data.images import ImageInputs
from hybridrl.engines.base import Completion, SamplingParams
from hybridrl.models.loading import resolve_model_path
from hybridrl.plan import estimate_report
from hybridrl.rewards.base import RewardScores
from hybridrl.rollout.generation import ReplicaShare, generate_partial_on
from hybridrl.workers.build import build_components
from hybridrl.workers.device_room import DeviceRoom
from hybridrl.workers.dist import init_process_group, memory_snapshot, pick_device


def sampling_seed(base: int, step: int) -> int:
    """Seed of step `step`'s rollouts. Engines derive each sample's stream from it and the sample's
    global (prompt, index) position, so samples are the same on 1 or N workers, and every rank of
    an engine TP group draws the same tokens."""
    return (base * 1_000_003 + step * 7919) % (2**31 - 1)


class HybridWorker:
    """The roles of one device. Holds no schedule: the controller decides what runs when."""

    def __init__(self, cfg: RunConfig, rank: int = 0, world_size: int = 1, local_rank: int = 0) -> None:
        self.cfg = cfg
        self.topology = dataclasses.replace(cfg.topology(), rank=rank)
        if self.topology.world_size != world_size:
            raise ValueError(
                f"worker started in a world of {world_size}, the config asks for {self.topology.world_size}"
            )
        self.device = pick_device(cfg.trainer.device, local_rank)
        # Before any model is built: a tiny model on too many threads spins (seen: 12x slower beside another job).
        configure_threads(
            cfg.cluster.cpu_threads,
            workers_on_node=cfg.cluster.workers_per_node,
            model_path=resolve_model_path(cfg.model),
        )
        init_process_group(rank, world_size, self.device, cfg.cluster.collective_timeout_s)
        self.roles = build_components(cfg, self.topology, self.device)
        self.room = DeviceRoom(self.device, int(cfg.trainer.offload_headroom_gb * 2**30))
        self.memory: dict[str, dict[str, float]] = {}
        self.switch_stats: dict[str, float] = {}  # onload figures, reported with the update's metrics
        self._record("init")

    def _record(self, phase: str) -> None:
        """Memory after `phase`. The phase's device work is waited for first (the current stream only: copies left
        on side streams on purpose keep running), so the controller's `time/<phase>` is the phase's real time."""
        engine = self.roles.rollout.engine
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        self.memory[phase] = memory_snapshot(self.device, engine.mapped_bytes())
        if self.device.type == "cuda":
            # The most held at any time since the previous record: during this phase. With memory the engine maps
            # itself an upper bound: where torch's and its peaks fall at different moments of a phase (a wake-up moves
            # trainer state out, then maps the engine's), the sum overstates by the smaller.
            peak = torch.cuda.max_memory_allocated(self.device) + engine.take_peak_mapped_bytes()
            self.memory[phase]["peak_allocated_gb"] = peak / 2**30
            if phase in ("wake", "generate", "update") and self.room.pending:
                # Lazy offload's trainer state, still on the device: in the peak, but not what the phase needs.
                self.memory[phase]["lazily_kept_gb"] = self.room.kept_bytes() / 2**30
            torch.cuda.reset_peak_memory_stats(self.device)

    # -- phase commands -------------------------------------------------------------------
    def wake(self) -> dict[str, float]:
        """Give the device to the engine: trainer roles to host (per their offload policies), engine awake. With
        trainer.offload_lazy and an engine that gates its allocations, the trainer's state leaves only where the
        engine needs its room (workers/device_room.py)."""
        r = self.roles
        self.switch_stats = {}  # a step whose update was skipped (critic warm-up) leaves its figures behind
        self.room.clear()
        if self.cfg.trainer.offload_lazy and r.rollout.engine.gates_memory:
            learners = {"actor": r.actor, "ref": r.ref, "critic": r.critic}
            for name, learner in learners.items():
                for offloader in learner.lazy_offloaders() if learner is not None else ():
                    self.room.defer(name, offloader)
            r.rollout.engine.set_memory_gate(self.room.make_room)
            r.rollout.wake()
            stats = self.room.take_stats()
        else:
            stats = r.actor.offload()
            if r.ref is not None:
                stats.update(r.ref.offload())  # completes the copy started after its log-prob pass
            if r.critic is not None:
                stats.update(r.critic.offload())  # completes the copy started after its update
            r.rollout.wake()
        self._record("wake")
        return stats

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        step: int,
        params: SamplingParams,
        prompt_offset: int = 0,
        images: Sequence[ImageInputs | None] | None = None,
    ) -> list[Completion] | list[Trajectory]:
        """Sample completions (with rollout=agent: trajectories) for this worker's engine replica's prompts (global
        index `prompt_offset` on); `images[i]`: prompt i's images (a vision-language model)."""
        params = dataclasses.replace(
            params, seed=sampling_seed(self.cfg.trainer.seed, step), prompt_offset=prompt_offset
        )
        if self.roles.agent_loop is not None:  # trajectories: model tokens, tool results, masks
            out = agent_trajectories(self.roles.agent_loop, self.roles.rollout.engine, self.topology, prompts, params)
        else:
            out = self.roles.rollout.generate(prompts, params, images)
        self._record("generate")
        return out

    def generate_partial(
        self, share: ReplicaShare, step: int, params: SamplingParams
    ) -> list[Completion] | list[Trajectory]:
        """Completions (trajectories with rollout=agent) of this engine replica's share of a partial rollout, stopped
        once its groups are complete (rollout.partial; hybridrl/rollout/generation.py)."""
        params = dataclasses.replace(params, seed=sampling_seed(self.cfg.trainer.seed, step), prompt_offset=0)
        out = generate_partial_on(self.roles, share, params)
        self._record("generate")
        return out

    def sleep(self) -> None:
        """Free the engine's memory for training (level per engine.sleep_level). Offloads the engine did not need
        stay unfreed: the log-prob phase's onload cancels them."""
        engine = self.roles.rollout.engine
        self.roles.rollout.sleep()
        self.switch_stats.update(engine.take_stats())  # e.g. its graph captures
        engine.set_memory_gate(None)
        self.switch_stats.update(self.room.take_stats())  # what the engine freed while it generated
        self.room.clear()
        self._record("sleep")

    def logprob(self, batch: Batch) -> dict[str, torch.Tensor]:
        """Old-policy and reference log-probs of the sampled tokens. The reference and the optimizer state start
        coming back on side streams, behind the actor's passes."""
        r = self.roles
        self.switch_stats.update(r.actor.onload_params())
        if r.ref is not None:
            self.switch_stats.update(r.ref.onload(wait=False))
        if r.critic is not None:
            self.switch_stats.update(r.critic.onload_params(wait=False))  # joined by the values phase
        self.switch_stats.update(r.actor.onload_optimizer(wait=False))
        micro = r.actor.micro_batches(batch)
        out = r.actor.compute_logprobs(micro)
        if r.ref is not None:
            out.update(r.ref.compute_logprobs(micro))
            r.ref.offload(wait=False)  # its copy to host runs behind the next phases; the update may need its room
            self.room.defer("ref", r.ref.offloader)
        elif r.actor.serves_reference:  # LoRA: the reference is the actor's base, adapters off
            out.update(r.actor.compute_ref_logprobs(micro))
        self._record("logprob")
        return out

    def values(self, batch: Batch) -> dict[str, torch.Tensor]:
        """The critic's values of the rollout (algorithm=ppo); its Adam state starts coming back behind the pass."""
        critic = self.roles.critic
        self.switch_stats.update(critic.onload_optimizer(wait=False))
        out, stats = critic.compute_values(critic.micro_batches(batch))
        self.switch_stats.update(stats)
        self._record("values")
        return out

    def reward(self, batch: Batch) -> RewardScores:
        """Score each completion: the reward function, then each reward model in turn (one on the device at a
        time), combined per `reward.combine`."""
        moved: dict[str, float] = {}
        if getattr(self.roles.scorer, "models", None):  # what a lazy offload or a finished pass left leaves first
            self.room.make_room(None)
            moved = self.room.take_stats()  # a step's moves (validation's are dropped with its wake-up's)
        out, stats = self.roles.scorer(batch)
        for k, v in {**moved, **stats}.items():  # several reward rounds in a step (dynamic sampling) add up
            self.switch_stats[k] = v if k.endswith("_gbps") else self.switch_stats.get(k, 0.0) + v
        self._record("reward")
        return out

    def update_critic(self, batch: Batch) -> dict[str, float]:
        """Clipped value-loss update of the critic towards the returns; then it leaves the device behind the
        actor's update. Reports the step's memory moves so far (the actor's update may be skipped in warm-up)."""
        critic = self.roles.critic
        self.switch_stats.update(critic.onload_optimizer())
        out = {**critic.update(batch), **self.switch_stats}
        self.switch_stats = {}
        critic.offload(wait=False)
        self.room.defer("critic", *critic.lazy_offloaders())
        self._record("update_critic")
        return out

    def update(self, batch: Batch) -> dict[str, float]:
        """PPO-clip update of the policy on this worker's shard; parts held since their passes leave if it needs it."""
        actor = self.roles.actor
        self.switch_stats.update(actor.onload_optimizer())
        plan = self.roles.memory_plan
        self.room.make_room_for_phase(plan.phase_bytes("update") if plan is not None else None)
        self.switch_stats.update(self.room.take_stats())
        out = {**actor.update(batch), **self.switch_stats}
        self.switch_stats = {}
        self._record("update")
        return out

    def reshard(self) -> dict[str, float]:
        """Stream the updated weights into the engine."""
        stats = self.roles.rollout.sync(self.roles.actor.model)
        self._record("reshard")
        return stats

    # -- housekeeping ---------------------------------------------------------------------
    def save_checkpoint(self, path: str) -> None:
        """Write this rank's state of every stateful role into the checkpoint folder `path` (collective)."""
        for name, role in self.roles.stateful().items():
            role.save(self.roles.state_dir(path, name))

    def load_checkpoint(self, path: str) -> None:
        """Restore every stateful role from `path`; the controller reshards afterwards so the engine follows."""
        for name, role in self.roles.stateful().items():
            role.load(self.roles.state_dir(path, name))

    def memory_report(self) -> dict[str, dict[str, float]]:
        """Memory after each phase of the last iteration, and each role's own figures (`roles/<name>`)."""
        report = dict(self.memory)
        for name, role in self.roles.roles().items():
            report[f"roles/{name}"] = role.memory_stats()
        if self.roles.memory_plan is not None:  # the estimate beside the measured peaks (`hybridrl/plan.py`)
            report.update(estimate_report(self.roles.memory_plan.estimate_gb(), self.memory))
        return report

    def shutdown(self) -> None:
        """Release the engine and leave the process group."""
        import torch.distributed as dist

        self.roles.shutdown()
        if dist.is_initialized():
            dist.destroy_process_group()
