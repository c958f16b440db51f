"""Config of `python -m hybridrl.evaluate` and `python -m hybridrl.generate`: the training config's groups plus `eval.*`
(and generate's `prompts`), so a model, data set, reward, engine or recipe is chosen with the same keys as in
training."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from hybridrl.config import RunConfig
from hybridrl.errors import ConfigError

SPLITS = ("auto", "val", "train")


@dataclass
class EvalConfig:
    """How the model is sampled and scored (`eval.*`)."""

    checkpoint: Optional[str] = None
    """A checkpoints/step_N folder to score (verified first); its model section comes from the checkpoint, and a run
    that trained a model folder needs model.path to name it. model.path may also name the checkpoint itself."""
    n: int = 1
    """Samples per prompt; pass@k is reported for every power of 2 up to n, and for n."""
    temperature: float = 0.0
    """0 = greedy (as validation during training: the same prompts give the same answers); > 0 samples."""
    top_p: float = 1.0
    """Nucleus sampling mass (1.0 = off)."""
    top_k: int = -1
    """Keep the k most likely tokens (-1 = off)."""
    max_new_tokens: Optional[int] = None
    """Longest answer in tokens; None = engine.max_new_tokens (what the run trained with)."""
    seed: int = 0
    """Seed of the sampling (each prompt's and sample's stream follows from it)."""
    split: str = "auto"
    """Which prompts: val (data.val_path, data.val_split, or the synthetic task's held-out set), train, or auto (the
    held-out prompts when the data has them, else the training prompts)."""
    max_prompts: int = 0
    """Score only the first N prompts of the split (0 = all)."""

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ConfigError(f"eval.n must be >= 1, got {self.n}")
        if self.temperature < 0:
            raise ConfigError(f"eval.temperature must be >= 0, got {self.temperature}")
        if self.temperature == 0 and self.n > 1:
            raise ConfigError(
                f"eval.n={self.n} with eval.temperature=0: greedy decoding gives every sample the same answer; "
                "set eval.temperature (e.g. 1.0) to sample n answers, or eval.n=1"
            )
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"eval.top_p must be in (0, 1], got {self.top_p}")
        if self.max_new_tokens is not None and self.max_new_tokens < 1:
            raise ConfigError(f"eval.max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.split not in SPLITS:
            raise ConfigError(f"eval.split must be one of {', '.join(SPLITS)}, got {self.split!r}")
        if self.max_prompts < 0:
            raise ConfigError(f"eval.max_prompts must be >= 0, got {self.max_prompts}")


@dataclass
class EvaluateConfig(RunConfig):
    """`python -m hybridrl.evaluate`: a model on a data set, scored by the reward."""

    eval: EvalConfig = field(default_factory=EvalConfig)
    """Sampling and which prompts."""


@dataclass
class GenerateConfig(RunConfig):
    """`python -m hybridrl.generate`: completions of a few prompts, printed."""

    prompts: list[str] = field(default_factory=list)
    """The prompts (rendered with the chat template per data.apply_chat_template and data.system_prompt)."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """Sampling (eval.n, eval.temperature, eval.max_new_tokens, ...) and the checkpoint to load."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.prompts:
            raise ConfigError("prompts is empty; give some: python -m hybridrl.generate 'prompts=[\"copy: 1234\"]'")


def register_eval_configs() -> None:
    """Register the schemas conf/evaluate.yaml and conf/generate.yaml build on, and training's (idempotent)."""
    from hydra.core.config_store import ConfigStore

    from hybridrl.config import register_configs

    register_configs()
    store = ConfigStore.instance()
    store.store(name="hybridrl_evaluate_schema", node=EvaluateConfig)
    store.store(name="hybridrl_generate_schema", node=GenerateConfig)
