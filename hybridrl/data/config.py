"""Config of the prompt data (`data=synthetic` or `data=jsonl data.path=...`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from hybridrl.errors import ConfigError

SYNTHETIC_TASKS = ("copy", "reverse", "sort", "add", "calc")  # calc: the agent loop's tool task


@dataclass
class SyntheticOptions:
    """The built-in verifiable task (`data.synthetic.*`): digit strings with an exact answer."""

    task: str = "copy"
    """copy | reverse | sort (the digits) | add (two numbers)."""
    min_digits: int = 2
    """Fewest digits in a prompt."""
    max_digits: int = 4
    """Most digits in a prompt."""
    num_prompts: int = 4096
    """Training prompts generated (deterministically from data.seed)."""
    num_val_prompts: int = 64
    """Held-out prompts, disjoint from the training set."""


@dataclass
class DataConfig:
    """Where prompts come from and how they are batched."""

    name: str = "synthetic"
    """synthetic (generated) or jsonl (a user's .jsonl / .parquet file)."""
    path: Optional[str] = None
    """Training file for data=jsonl: JSONL or Parquet, one prompt per row."""
    val_path: Optional[str] = None
    """Optional held-out file in the same format."""
    prompt_key: str = "prompt"
    """Column with the prompt: a string, or a list of chat messages ({role, content})."""
    answer_key: str = "answer"
    """Column with the ground truth the reward reads (copied to sample['answer'])."""
    train_batch_size: int = 16
    """Prompts per step (each sampled algorithm.group_size times)."""
    max_prompt_tokens: int = 256
    """Longest prompt allowed, in tokens after the chat template."""
    overlong_prompts: str = "error"
    """What to do with longer prompts: error (stop, naming the row) or drop (skip them, counted in the log)."""
    apply_chat_template: bool = True
    """Render prompts with the tokenizer's chat template (off: the raw text is the prompt)."""
    system_prompt: Optional[str] = None
    """A system message prepended to every prompt when the chat template is applied."""
    shuffle: bool = True
    """Reshuffle the training prompts every epoch (seeded by data.seed and the epoch)."""
    seed: int = 0
    """Seed of the synthetic task and of shuffling."""
    synthetic: SyntheticOptions = field(default_factory=SyntheticOptions)
    """Options of the built-in task."""

    def __post_init__(self) -> None:
        if self.name not in ("synthetic", "jsonl"):
            raise ConfigError(f"data.name must be synthetic or jsonl, got {self.name!r}")
        if self.name == "jsonl" and (not self.path or self.path == "???"):
            raise ConfigError("data.path is required with data=jsonl (a .jsonl or .parquet file of prompts)")
        if self.train_batch_size < 1:
            raise ConfigError(f"data.train_batch_size must be >= 1, got {self.train_batch_size}")
        if self.max_prompt_tokens < 1:
            raise ConfigError(f"data.max_prompt_tokens must be >= 1, got {self.max_prompt_tokens}")
        if self.overlong_prompts not in ("error", "drop"):
            raise ConfigError(f"data.overlong_prompts must be error or drop, got {self.overlong_prompts!r}")
        s = self.synthetic
        if s.task not in SYNTHETIC_TASKS:
            raise ConfigError(f"data.synthetic.task must be one of {', '.join(SYNTHETIC_TASKS)}, got {s.task!r}")
        if not 1 <= s.min_digits <= s.max_digits:
            raise ConfigError(
                f"data.synthetic.min_digits/max_digits must satisfy 1 <= min <= max, got {s.min_digits}, {s.max_digits}"
            )
