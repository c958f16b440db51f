"""Checks of the command line and the composed config that the dataclasses alone cannot make.

- `+trainer.lrr=1e-3` force-adds a key Hydra's struct mode would refuse: `unknown_keys` compares every
  key of the composed config with the schema (the dataclasses), so a typo fails like `trainer.lrr` does.
- Keys that moved (`MOVED_KEYS`) fail with one line naming the new key: on the command line before Hydra
  composes (`moved_key_in_overrides`), and in the composed config (`check_composed`).
- NaN is never a meaningful config value (`trainer.lr=nan` passes a `lr <= 0` check): refused by key.
- `composition_error_line` turns Hydra's multi-line composition errors into one line (with all of Hydra's hints
  for a sweep value given without -m).
"""

from __future__ import annotations

import dataclasses
import difflib
import math
from functools import lru_cache
from typing import Any

from omegaconf import DictConfig, OmegaConf

from hybridrl.errors import ConfigError

#: Old key -> new key. An entry takes effect once the new key exists in the schema and the old one does not.
MOVED_KEYS: dict[str, str] = {
    "engine.impl": "engine.native.impl",
    "engine.max_batch_size": "engine.native.max_batch_size",
    "engine.cuda_graphs": "engine.native.cuda_graphs",
    "engine.sampler_kernel": "engine.native.sampler_kernel",
    "engine.max_model_len": "engine.native.max_model_len",
    "engine.prefill_tokens": "engine.native.prefill_tokens",
}


@lru_cache(maxsize=None)
def _schema(cls: type | None = None) -> DictConfig:
    """The schema of `cls` (an app's config dataclass: RunConfig, or evaluate's and generate's subclasses of it)."""
    from hybridrl.config import RunConfig

    return OmegaConf.structured(cls or RunConfig)


def _schema_of(cfg: DictConfig) -> DictConfig:
    """The schema `cfg` was composed on (its dataclass), RunConfig's for a plain DictConfig."""
    cls = OmegaConf.get_type(cfg)
    return _schema(cls if dataclasses.is_dataclass(cls) else None)


def _free_form(node: Any) -> bool:
    """A dict field (e.g. engine.sglang.engine_kwargs) takes any keys; a dataclass section does not."""
    return isinstance(node, DictConfig) and OmegaConf.get_type(node) in (dict, None)


def schema_keys(node: DictConfig | None = None, prefix: str = "") -> set[str]:
    """Every dotted key of the schema (sections and leaves; free-form dicts as one key)."""
    node = _schema() if node is None else node
    out: set[str] = set()
    for k in node.keys():
        key = f"{prefix}{k}"
        out.add(key)
        child = node._get_node(k)
        if isinstance(child, DictConfig) and not _free_form(child):
            out |= schema_keys(child, key + ".")
    return out


def active_moves() -> dict[str, str]:
    """The MOVED_KEYS entries in force for this schema (new key present, old key gone)."""
    keys = schema_keys()
    return {old: new for old, new in MOVED_KEYS.items() if new in keys and old not in keys}


def moved_message(key: str) -> str | None:
    """'engine.impl moved to engine.native.impl' when `key` (or a key under it) moved, else None."""
    for old, new in active_moves().items():
        if key == old or key.startswith(old + "."):
            return f"{key} moved to {new}{key[len(old) :]}; write {new}{key[len(old) :]}=... instead"
    return None


def moved_key_in_overrides(args: list[str]) -> str | None:
    """The message for the first command-line override (`key=v`, `+key=v`, `++key=v`, `~key`) of a moved key."""
    for arg in args:
        if arg.startswith("-") or ("=" not in arg and not arg.startswith("~")):
            continue  # flags (-m, --cfg job, -cn ...) and their values
        key = arg.split("=", 1)[0].lstrip("+~").strip()
        message = moved_message(key)
        if message:
            return message
    return None


def unknown_keys(cfg: DictConfig, node: DictConfig | None = None, prefix: str = "") -> list[str]:
    """Dotted keys of the composed `cfg` that the schema does not define (force-added with `+`)."""
    node = _schema_of(cfg) if node is None else node
    out: list[str] = []
    for k in cfg.keys():
        if prefix == "" and k == "hydra":
            continue
        key = f"{prefix}{k}"
        if k not in node:
            out.append(key)
            continue
        sub, child = cfg._get_node(k), node._get_node(k)
        if isinstance(sub, DictConfig) and isinstance(child, DictConfig) and not _free_form(child):
            out += unknown_keys(sub, child, key + ".")
    return out


def nan_keys(cfg: DictConfig, prefix: str = "") -> list[str]:
    """Dotted keys whose value is a float NaN."""
    out: list[str] = []
    for k in cfg.keys():
        key = f"{prefix}{k}"
        value = cfg._get_node(k)
        if isinstance(value, DictConfig):
            out += nan_keys(value, key + ".")
            continue
        raw = getattr(value, "_value", lambda: None)()
        if isinstance(raw, float) and math.isnan(raw):
            out.append(key)
    return out


def check_composed(cfg: DictConfig) -> None:
    """Raise ConfigError naming the first moved, unknown or NaN key of the composed config."""
    keys = unknown_keys(cfg)
    for key in keys:
        message = moved_message(key)
        if message:
            raise ConfigError(message)
    if keys:
        key = keys[0]
        hint = difflib.get_close_matches(key, sorted(schema_keys(_schema_of(cfg))), n=1)
        did_you_mean = f" (did you mean {hint[0]}?)" if hint else ""
        raise ConfigError(
            f"{key} is not a config key{did_you_mean}; a leading + cannot add keys to a section a dataclass defines"
        )
    for key in nan_keys(cfg):
        raise ConfigError(f"{key}=nan is not a number; set a finite value")


def composition_error_line(e: BaseException) -> str:
    """One line for a Hydra/OmegaConf error raised while composing the config."""
    from hydra.errors import MissingConfigException

    if isinstance(e, MissingConfigException) and getattr(e, "options", None):
        first = str(e).strip().splitlines()[0]
        group = first.split("Could not find '", 1)[-1].split("/", 1)[0] if "Could not find '" in first else None
        what = f"{group} options" if group else "options"
        return f"{first.replace('In ', 'in ', 1)}; {what}: {', '.join(sorted(e.options))}"
    cause = e.__cause__ or e.__context__
    full_key = getattr(cause, "full_key", None) or getattr(e, "full_key", None)
    if full_key:
        moved = moved_message(str(full_key))
        if moved:
            return moved
    if cause is not None and type(cause).__name__ in ("ConfigAttributeError", "ConfigKeyError") and full_key:
        hint = difflib.get_close_matches(str(full_key), sorted(schema_keys()), n=1)
        return f"{full_key} is not a config key" + (f" (did you mean {hint[0]}?)" if hint else "")
    text = str(e).strip()
    if text.startswith("Ambiguous value for argument"):  # a sweep without -m: Hydra's hints follow on more lines
        first, *hints = text.splitlines()
        hints = [h.split(". ", 1)[-1].strip() for h in hints if h.strip()]
        return f"{first}: " + "; ".join(hints) + " (-m for short)"
    parts = [text.splitlines()[0] if text else type(e).__name__]
    if cause is not None and str(cause).strip():
        parts.append(str(cause).strip().splitlines()[0])
    if full_key and str(full_key) not in " ".join(parts):
        parts.append(f"key {full_key}")
    return ": ".join(parts)
