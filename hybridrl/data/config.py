"""Config of the prompt data (`data=synthetic`, `data=jsonl data.path=...` or `data=hf data.path=...`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from hybridrl.data.shapes import VISION_TASKS
from hybridrl.errors import ConfigError

# calc: the agent loop's tool task; colour, count, lower and shape: the visual tasks of vision-language models
# (data/shapes.py)
SYNTHETIC_TASKS = ("copy", "reverse", "sort", "add", "calc", *VISION_TASKS)
DATA_SOURCES = ("synthetic", "jsonl", "hf")


@dataclass
class SyntheticOptions:
    """The built-in verifiable task (`data.synthetic.*`): digit strings with an exact answer."""

    task: str = "copy"
    """copy | reverse | sort (the digits) | add (two numbers); for a vision-language model (data=synthetic_vl):
    colour (the colour of one shape, a word) | count (how many shapes of a colour) | lower (the colour of the lower of
    two shapes)."""
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
    """synthetic (generated), jsonl (a .jsonl / .parquet file) or hf (a Hugging Face dataset)."""
    path: Optional[str] = None
    """data=jsonl: the training file, JSONL or Parquet, one prompt per row. data=hf: the dataset, as
    datasets.load_dataset takes it: a Hub id (openai/gsm8k) or a local folder (save_to_disk's, or data files)."""
    val_path: Optional[str] = None
    """data=jsonl: optional held-out file in the same format."""
    config: Optional[str] = None
    """data=hf: the dataset's configuration (load_dataset's name: main for openai/gsm8k); None = its default."""
    split: str = "train"
    """data=hf: the split to train on."""
    val_split: Optional[str] = None
    """data=hf: optional held-out split (test, validation) for trainer.eval_every and python -m hybridrl.evaluate."""
    prompt_key: str = "prompt"
    """Column with the prompt: a string, or a list of chat messages ({role, content})."""
    answer_key: str = "answer"
    """Column with the ground truth the reward reads (copied to sample['answer'])."""
    image_key: str = "images"
    """Vision-language models: column with each row's images (a path relative to the data file, a list of them,
    or Parquet / HF datasets image structs with bytes); read only when the model takes images."""
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

    def check_files(self) -> None:
        """data=jsonl: raise ConfigError naming the key when `path` or `val_path` is not a file. Run before the model
        is built, so a mistyped path costs a second, not a model load."""
        if self.name != "jsonl":
            return
        for key in ("path", "val_path"):
            value = getattr(self, key)
            if value is not None and not Path(value).expanduser().is_file():
                raise ConfigError(f"data.{key}={value!r}: file not found")

    def __post_init__(self) -> None:
        if self.name not in DATA_SOURCES:
            raise ConfigError(f"data.name must be one of {', '.join(DATA_SOURCES)}, got {self.name!r}")
        if self.name == "jsonl" and (not self.path or self.path == "???"):
            raise ConfigError("data.path is required with data=jsonl (a .jsonl or .parquet file of prompts)")
        if self.name == "hf" and (not self.path or self.path == "???"):
            raise ConfigError(
                "data.path is required with data=hf: a Hub dataset id (data.path=openai/gsm8k data.config=main) "
                "or a save_to_disk folder"
            )
        if self.name != "hf":
            for key in ("config", "val_split"):
                if getattr(self, key) is not None:
                    raise ConfigError(f"data.{key} is read only with data=hf (a Hugging Face dataset); remove it")
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
