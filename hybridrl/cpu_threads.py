"""How many CPU threads torch uses in a worker process, chosen once at start.

Why it matters: torch's default is one intra-op thread per core, and its OpenMP threads spin-wait for each
other at the end of every operation. With the tiny model each operation is microseconds long, so when any
other process wants a core (another torch job, another worker), a step waits on a descheduled thread
again and again: the demo slowed 10-50x that way. A model this small gains nothing from a second thread
anyway (its matrices are 64 wide), so for it one thread is both the fastest and the steadiest choice.

    configure_threads(cfg.cluster.cpu_threads, workers_on_node=..., model_path=resolve_model_path(cfg.model))

Precedence: an explicit request (the config knob), then OMP_NUM_THREADS when the user set it, then the
default: 1 thread for a small model (under SMALL_MODEL_PARAMS, read from its config.json); otherwise the
cores this process may use, divided among the node's workers so they do not oversubscribe each other.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SMALL_MODEL_PARAMS = 20_000_000
"""Below this many parameters a model runs fastest (and steadiest) on one CPU thread."""


def available_cores() -> int:
    """Cores this process may run on (its CPU affinity where the OS reports it)."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


def estimate_params(config: dict) -> int | None:
    """Rough parameter count of a decoder from its Hugging Face config (embeddings + attention + MLP); of a
    vision-language model's config, its language model's (`text_config`)."""
    if "hidden_size" not in config and isinstance(config.get("text_config"), dict):
        config = {"tie_word_embeddings": config.get("tie_word_embeddings", True), **config["text_config"]}
    try:
        h, n = int(config["hidden_size"]), int(config["num_hidden_layers"])
        inter = int(config.get("intermediate_size") or 4 * h)
        vocab = int(config.get("vocab_size") or 0)
    except (KeyError, TypeError, ValueError):
        return None
    return vocab * h * (1 if config.get("tie_word_embeddings", True) else 2) + n * (4 * h * h + 3 * h * inter)


def is_small_model(model_path: str | os.PathLike | None) -> bool:
    """True when the model folder's config.json describes a model under SMALL_MODEL_PARAMS."""
    if model_path is None:
        return False
    try:
        config = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return False
    n = estimate_params(config)
    return n is not None and n < SMALL_MODEL_PARAMS


def choose_threads(
    requested: int | None, *, workers_on_node: int = 1, small_model: bool = False, env: dict | None = None
) -> int:
    """The intra-op thread count for one worker (see the module doc for the precedence)."""
    env = os.environ if env is None else env
    if requested is not None:
        if requested < 1:
            raise ValueError(f"cpu_threads must be >= 1 (or unset), got {requested}")
        return requested
    omp = env.get("OMP_NUM_THREADS", "").strip()
    if omp.isdigit() and int(omp) >= 1:
        return int(omp)
    if small_model:
        return 1
    return max(1, available_cores() // max(1, workers_on_node))


def configure_threads(
    requested: int | None = None, *, workers_on_node: int = 1, model_path: str | os.PathLike | None = None
) -> int:
    """Set torch's intra-op threads (and one inter-op thread: phases run one after another) for this process;
    returns the intra-op count. Call it once, before the first model is built."""
    n = choose_threads(requested, workers_on_node=workers_on_node, small_model=is_small_model(model_path))
    torch.set_num_threads(n)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:  # already set, or parallel work has started: only the inter-op pool keeps its size
        pass
    log.info("torch CPU threads: %d intra-op per worker", n)
    return n
