"""Prompt datasets: read rows, render them with the chat template, tokenize, batch with a resumable cursor."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hybridrl.data.config import DataConfig
from hybridrl.data.images import ImageSource, row_images
from hybridrl.data.synthetic import make_synthetic_rows
from hybridrl.errors import ConfigError, HybridRLError

log = logging.getLogger(__name__)


@dataclass
class Prompt:
    """One tokenized prompt and the row it came from (the reward reads `sample`)."""

    token_ids: list[int]
    text: str
    sample: dict[str, Any]
    images: list[ImageSource] | None = None
    """A vision-language prompt's images, checked (their placeholders are in `token_ids`); None for text."""


def read_rows(path: str, key: str) -> list[dict]:
    """Rows of a .jsonl or .parquet file; errors name the file, line and the `key`."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise ConfigError(f"{key}={path!r}: file not found")
    rows = _read_parquet(p, path, key) if p.suffix == ".parquet" else _read_jsonl(p, path, key)
    if not rows:
        raise HybridRLError(f"{key}={path!r}: the file has no rows")
    return rows


def _read_parquet(p: Path, path: str, key: str) -> list[dict]:
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError as e:
        raise HybridRLError(f"{key}={path!r} is Parquet; install pyarrow (pip install pyarrow)") from e
    try:
        return pq.read_table(p).to_pylist()
    except (pa.ArrowException, OSError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise HybridRLError(
            f"{key}={path!r} is not a readable Parquet file ({first}); a .parquet name needs Parquet content"
        ) from None


def _read_jsonl(p: Path, path: str, key: str) -> list[dict]:
    rows = []
    with p.open("rb") as f:
        for lineno, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise HybridRLError(
                    f"{key}={path!r}: line {lineno} is not UTF-8 (byte 0x{raw[e.start]:02x} at column {e.start + 1}); "
                    "save the file as UTF-8"
                ) from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise HybridRLError(f"{key}={path!r}: line {lineno} is not valid JSON ({e.msg})") from e
            if not isinstance(row, dict):
                raise HybridRLError(
                    f"{key}={path!r}: line {lineno} is a JSON {type(row).__name__}, not an object of columns"
                )
            rows.append(row)
    return rows


def check_prompt(raw: Any, where: str, key: str) -> None:
    """Raise HybridRLError unless `raw` is a string or a list of {role, content} chat messages with string content."""
    if isinstance(raw, str):
        return
    if raw is None:
        raise HybridRLError(f"{where}: column {key!r} (data.prompt_key) is null; every row needs a prompt")
    if not isinstance(raw, (list, tuple)) or not raw:
        raise HybridRLError(
            f"{where}: column {key!r} (data.prompt_key) is {type(raw).__name__} {_short(raw)}; "
            "it must be a string or a non-empty list of {role, content} messages"
        )
    for j, m in enumerate(raw):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise HybridRLError(
                f"{where}: message {j} of column {key!r} is {_short(m)}; "
                "each message needs a string 'role' and 'content'"
            )


def _short(value: Any, n: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= n else text[: n - 3] + "..."


def render_prompt(raw: Any, tokenizer, cfg: DataConfig, where: str = "data") -> str:
    """The prompt text the model sees: chat-templated messages, or the raw string."""
    if not cfg.apply_chat_template:
        if not isinstance(raw, str):
            raise HybridRLError(f"{where}: data.apply_chat_template=false needs string prompts, got chat messages")
        return raw
    messages = [{"role": "user", "content": raw}] if isinstance(raw, str) else list(raw)
    if cfg.system_prompt and messages[0].get("role") != "system":
        messages = [{"role": "system", "content": cfg.system_prompt}] + messages
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


@dataclass(frozen=True)
class ContextLimit:
    """The model's context, which every prompt plus the tokens generated after it must fit."""

    tokens: int
    """max_position_embeddings of the model's config.json."""
    response_tokens: int = 0
    """Tokens generated after the prompt (engine.max_new_tokens for single-turn rollouts)."""

    def describe(self, n: int) -> str | None:
        """Why a prompt of `n` tokens does not fit, or None when it does."""
        if n + self.response_tokens <= self.tokens:
            return None
        plus = f" plus engine.max_new_tokens={self.response_tokens}" if self.response_tokens else ""
        return (
            f"{n} prompt tokens{plus}, more than the model's context of {self.tokens} tokens "
            "(max_position_embeddings in model.path's config.json)"
        )


def tokenize_rows(
    rows: list[dict],
    tokenizer,
    cfg: DataConfig,
    source: str,
    context: ContextLimit | None = None,
    vision=None,
    base_dir: Path | None = None,
) -> list[Prompt]:
    """Render and tokenize every row, enforcing data.max_prompt_tokens and the model's context up front (not
    mid-run, where a prompt past the context would fail or be read past the model's positions). With `vision` (a
    `VisionProcessor`: the model takes images) each row's images (`data.image_key`, paths relative to `base_dir`)
    are read and decoded here, so a missing or corrupt one fails now, naming its row and path."""
    prompts, dropped = [], 0
    for i, row in enumerate(rows):
        # Rows count from 0, as in a dataframe; a JSONL file's line number is one more.
        row_name = f"row {i} (from 0)"
        if cfg.prompt_key not in row:
            raise HybridRLError(
                f"{source}: {row_name} has no column {cfg.prompt_key!r} (data.prompt_key); columns: {sorted(row)}"
            )
        where = f"{source}: {row_name}"
        images = None
        if vision is not None:
            from hybridrl.data.vision_prompts import check_vision_prompt, render_vision_prompt

            check_vision_prompt(row[cfg.prompt_key], where, cfg.prompt_key)
            images = row_images(row, cfg.image_key, base_dir, where) if cfg.image_key in row else []
            for image in images:
                image.check(where)
            text = render_vision_prompt(row[cfg.prompt_key], len(images), tokenizer, vision, cfg, where)
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            ids = vision.expand(ids, [vision.tokens_for(s.size) for s in images], where)
        else:
            check_prompt(row[cfg.prompt_key], where, cfg.prompt_key)
            text = render_prompt(row[cfg.prompt_key], tokenizer, cfg, where)
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) > cfg.max_prompt_tokens:
            if cfg.overlong_prompts == "error":
                raise HybridRLError(
                    f"{source}: {row_name} has {len(ids)} prompt tokens, more than data.max_prompt_tokens="
                    f"{cfg.max_prompt_tokens}; raise the limit or set data.overlong_prompts=drop"
                )
            dropped += 1
            continue
        too_long = context.describe(len(ids)) if context is not None else None
        if too_long:
            if cfg.overlong_prompts == "error":
                raise HybridRLError(
                    f"{source}: {row_name} has {too_long}; shorten it, lower engine.max_new_tokens, "
                    "or set data.overlong_prompts=drop"
                )
            dropped += 1
            continue
        sample = dict(row)
        if cfg.answer_key in row:
            sample["answer"] = row[cfg.answer_key]
        prompts.append(Prompt(ids, text, sample, images or None))
    if dropped:
        log.warning(
            "%s: dropped %d prompts longer than data.max_prompt_tokens=%d or the model's context",
            source,
            dropped,
            cfg.max_prompt_tokens,
        )
    if not prompts:
        raise HybridRLError(f"{source}: no prompts left (all longer than data.max_prompt_tokens?)")
    return prompts


def load_prompts(
    cfg: DataConfig, tokenizer, context: ContextLimit | None = None, vision=None
) -> tuple[list[Prompt], list[Prompt]]:
    """Training and held-out prompts for the configured source (each checked against `context` when given; with
    `vision`, a `VisionProcessor`, their images read and checked too)."""
    from hybridrl.data.shapes import VISION_TASKS

    if cfg.name == "synthetic" and cfg.synthetic.task in VISION_TASKS:
        return _load_shapes(cfg, tokenizer, context, vision)
    if cfg.name == "synthetic":
        s = cfg.synthetic
        train_rows = make_synthetic_rows(s.task, s.num_prompts, s.min_digits, s.max_digits, cfg.seed)
        val_rows = make_synthetic_rows(
            s.task,
            s.num_val_prompts,
            s.min_digits,
            s.max_digits,
            cfg.seed + 1,
            exclude={r["digits"] for r in train_rows},
        )
        return (
            tokenize_rows(train_rows, tokenizer, cfg, "data=synthetic", context),
            tokenize_rows(val_rows, tokenizer, cfg, "data=synthetic (val)", context),
        )
    if cfg.name == "hf":
        from hybridrl.data.hf import read_hf_rows

        source = f"data.path={cfg.path}"
        local = Path(cfg.path).expanduser()
        base = local if local.is_dir() else None
        rows = read_hf_rows(cfg.path, cfg.config, cfg.split)
        _check_image_column(rows, cfg, vision, source)
        train = tokenize_rows(rows, tokenizer, cfg, f"{source} [{cfg.split}]", context, vision, base)
        if not cfg.val_split:
            return train, []
        val_rows = read_hf_rows(cfg.path, cfg.config, cfg.val_split, "data.val_split")
        return train, tokenize_rows(val_rows, tokenizer, cfg, f"{source} [{cfg.val_split}]", context, vision, base)
    return _load_files(cfg, tokenizer, context, vision, cfg.path, cfg.val_path)


def _load_files(
    cfg: DataConfig, tokenizer, context: ContextLimit | None, vision, path: str, val_path: str | None
) -> tuple[list[Prompt], list[Prompt]]:
    """Prompts of a JSONL/Parquet training file and its optional held-out file (images relative to each file)."""
    rows = read_rows(path, "data.path")
    _check_image_column(rows, cfg, vision, f"data.path={path}")
    base = Path(path).expanduser().parent
    train = tokenize_rows(rows, tokenizer, cfg, f"data.path={path}", context, vision, base)
    if not val_path:
        return train, []
    val_base = Path(val_path).expanduser().parent
    val_rows = read_rows(val_path, "data.val_path")
    return train, tokenize_rows(val_rows, tokenizer, cfg, f"data.val_path={val_path}", context, vision, val_base)


def _check_image_column(rows: list[dict], cfg: DataConfig, vision, source: str) -> None:
    """A vision-language model reading a file none of whose rows has the images column: data.image_key is likely
    wrong (rows without it are text prompts; a file of only such rows is refused, naming the columns)."""
    if vision is not None and not any(cfg.image_key in row for row in rows):
        raise HybridRLError(
            f"{source}: no row has the column {cfg.image_key!r} (data.image_key) the model's images are read from; "
            f"columns: {sorted(rows[0])}"
        )


def _load_shapes(cfg: DataConfig, tokenizer, context: ContextLimit | None, vision) -> tuple[list[Prompt], list[Prompt]]:
    """The built-in visual task (`data/shapes.py`): made once into the cache, read like any JSONL file of images."""
    from hybridrl.data.shapes import ensure_shapes_data

    s = cfg.synthetic
    if vision is None:
        raise ConfigError(
            f"data.synthetic.task={s.task} is a visual task: it needs a vision-language model (model=tiny_vl, or "
            "model.path of a Qwen2-VL / Qwen2.5-VL checkpoint)"
        )
    folder = ensure_shapes_data(s.task, s.num_prompts, s.num_val_prompts, cfg.seed)
    return _load_files(cfg, tokenizer, context, vision, str(folder / "train.jsonl"), str(folder / "val.jsonl"))


class PromptLoader:
    """Endless batches of prompts: a seeded permutation per epoch, resumable from `state_dict()`."""

    def __init__(self, prompts: list[Prompt], batch_size: int, shuffle: bool, seed: int) -> None:
        if batch_size > len(prompts):
            raise ConfigError(f"data.train_batch_size={batch_size} exceeds the {len(prompts)} training prompts")
        self.prompts, self.batch_size, self.shuffle, self.seed = prompts, batch_size, shuffle, seed
        self.epoch, self.offset = 0, 0
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> list[int]:
        if not self.shuffle:
            return list(range(len(self.prompts)))
        g = torch.Generator().manual_seed(self.seed * 100_003 + epoch)
        return torch.randperm(len(self.prompts), generator=g).tolist()

    def next_batch(self) -> list[Prompt]:
        """The next `batch_size` prompts; an epoch's incomplete tail is skipped so batches stay full."""
        if self.offset + self.batch_size > len(self._order):
            self.epoch, self.offset = self.epoch + 1, 0
            self._order = self._permutation(self.epoch)
        idx = self._order[self.offset : self.offset + self.batch_size]
        self.offset += self.batch_size
        return [self.prompts[i] for i in idx]

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "offset": self.offset}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.offset = int(state["epoch"]), int(state["offset"])
        self._order = self._permutation(self.epoch)
