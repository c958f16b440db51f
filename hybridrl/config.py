"""The root config: one structured section per component, registered with Hydra's ConfigStore.

The YAML files in conf/ only select and set values; every key and type is defined by the
dataclasses below (each kept next to the code it configures), so an unknown key or a wrong
type fails at composition, and `validate` turns the composed config into these objects,
running each section's checks before any model loads.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from hybridrl.agent.config import AgentConfig
from hybridrl.algorithms.config import AlgorithmConfig
from hybridrl.data.config import DataConfig
from hybridrl.engines.config import EngineConfig
from hybridrl.errors import ConfigError
from hybridrl.models.config import ModelConfig
from hybridrl.reshard.config import ReshardConfig
from hybridrl.rewards.config import RewardConfig
from hybridrl.rewards.reward_model import RewardModelsConfig
from hybridrl.rollout.config import RolloutConfig
from hybridrl.topology import Topology
from hybridrl.tracking.config import LoggerConfig
from hybridrl.training.config import ReferenceConfig, TrainerConfig
from hybridrl.training.critic_config import CriticConfig
from hybridrl.training.ulysses import check_heads, model_heads
from hybridrl.workers.config import ClusterConfig


@dataclass
class RunConfig:
    """Everything one run needs."""

    model: ModelConfig = field(default_factory=ModelConfig)
    """The policy model."""
    engine: EngineConfig = field(default_factory=EngineConfig)
    """The rollout engine."""
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    """The FSDP2 trainer (the actor) and the run's schedule."""
    ref: ReferenceConfig = field(default_factory=ReferenceConfig)
    """The frozen reference policy."""
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    """Advantage estimator and loss."""
    data: DataConfig = field(default_factory=DataConfig)
    """Prompts."""
    reward: RewardConfig = field(default_factory=RewardConfig)
    """Reward function."""
    critic: CriticConfig = field(default_factory=CriticConfig)
    """The value model (algorithm=ppo only)."""
    reward_model: RewardModelsConfig = field(default_factory=RewardModelsConfig)
    """Local reward models, scored one at a time beside the reward function."""
    reshard: ReshardConfig = field(default_factory=ReshardConfig)
    """Trainer → engine weight sync."""
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    """Experiment tracking."""
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    """Process layout."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Single-turn generation (the default) or the multi-turn agent loop."""
    agent: AgentConfig = field(default_factory=AgentConfig)
    """The agent loop's tools and limits (read with rollout=agent)."""

    def __post_init__(self) -> None:
        self.topology().check_batch(self.data.train_batch_size, self.algorithm.group_size, self.trainer.mini_batch_size)
        algo = self.algorithm
        if self.engine.temperature == 0 and algo.group_size > 1:
            raise ConfigError(
                f"engine.temperature=0 with algorithm.group_size={algo.group_size}: greedy decoding gives every sample "
                "of a prompt the same tokens, so every advantage is 0; sample with engine.temperature > 0 "
                "(validation is greedy on its own)"
            )
        if self.rollout.name == "agent" and self.agent.max_total_tokens <= self.data.max_prompt_tokens:
            raise ConfigError(
                f"agent.max_total_tokens={self.agent.max_total_tokens} must exceed data.max_prompt_tokens="
                f"{self.data.max_prompt_tokens}: a trajectory needs room to answer after its prompt"
            )
        self._check_critic()
        self._check_sequence_parallel()
        if algo.overlong_buffer:
            algo.overlong_buffer_tokens(self.engine.max_new_tokens)  # a buffer longer than the responses fails here

    def _check_critic(self) -> None:
        """critic.* only with a critic; its mini-batches must split like the actor's."""
        if not self.algorithm.needs_critic:
            changed = self.critic.changed_keys()
            if changed:
                raise ConfigError(
                    f"{changed[0]} is set, but algorithm={self.algorithm.name} trains no critic "
                    "(only algorithm=ppo does); remove it or use algorithm=ppo"
                )
            return
        mini = self.critic.batching(self.trainer)[0]
        rows = self.data.train_batch_size * self.algorithm.group_size
        dp = self.topology().dp_size
        if mini and (rows % mini or mini % dp):
            key = "critic.mini_batch_size" if self.critic.mini_batch_size is not None else "trainer.mini_batch_size"
            ranks = f"{dp} workers" if dp == self.topology().world_size else f"{dp} data-parallel ranks"
            raise ConfigError(f"{key}={mini} must divide the {rows} samples per step and be a multiple of the {ranks}")

    def _check_sequence_parallel(self) -> None:
        """With trainer.sequence_parallel_size, the heads of every sequence-parallel model must split over it; read
        from config.json (or the tiny model's options) before any weights load."""
        degree = self.trainer.sequence_parallel_size
        if degree == 1:
            return
        policy = f"model.path={self.model.path}" if self.model.path else "the tiny model (model.tiny.num_heads)"
        models = {policy: model_heads(self.model)}
        if self.algorithm.needs_critic and self.critic.model.path:
            models[f"critic.model.path={self.critic.model.path}"] = model_heads(self.model, self.critic.model.path)
        for where, (heads, kv_heads) in models.items():
            check_heads(degree, heads, kv_heads, where)

    def topology(self, rank: int = 0) -> Topology:
        """The process layout this config asks for, seen from `rank`."""
        return Topology(self.cluster.world_size, self.engine.tp_size, rank, self.trainer.sequence_parallel_size)


def register_configs() -> None:
    """Register the schema that conf/config.yaml builds on (idempotent); evaluate's and generate's are
    `hybridrl.eval_config.register_eval_configs`."""
    ConfigStore.instance().store(name="hybridrl_schema", node=RunConfig)


def validate(cfg: DictConfig) -> RunConfig:
    """The composed config as typed objects; each section's checks run here."""
    try:
        return OmegaConf.to_object(cfg)
    except ConfigError:
        raise
    except Exception as e:  # OmegaConf wraps errors raised inside __post_init__
        cause = e.__cause__ or e.__context__
        if isinstance(cause, ConfigError):
            raise cause from None
        raise ConfigError(str(e)) from e
