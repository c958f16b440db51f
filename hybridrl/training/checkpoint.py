"""Trainer checkpoints: FSDP2 model + optimizer through torch.distributed.checkpoint, plus per-rank state.

Layout of one checkpoint folder (written under a temporary name, renamed when complete)::

    step_000006/
      dcp/            model and optimizer shards (torch.distributed.checkpoint; any world size can load)
      rank0.pt ...    scheduler state and RNG states of each rank
      meta.json       written last by the controller: step, data loader position, config
"""

from __future__ import annotations

import random
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict


def rng_state() -> dict:
    """Every RNG this process draws from."""
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _options(trainable_only: bool) -> StateDictOptions:
    """The state-dict options: with `trainable_only`, frozen parameters (a LoRA base) are left out."""
    return StateDictOptions(ignore_frozen_params=trainable_only, strict=not trainable_only)


def _trained_only(model: torch.nn.Module, msd: dict) -> dict:
    """The entries of trained parameters: `ignore_frozen_params` keeps a tied head whose embedding is frozen."""
    names = {n.replace("_orig_mod.", "").replace("_checkpoint_wrapped_module.", "")
             for n, p in model.named_parameters() if p.requires_grad}
    return {k: v for k, v in msd.items() if k in names}


def save_trainer(model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler, path: str | Path,
                 trainable_only: bool = False) -> None:
    """Write this rank's part of the checkpoint into `path` (every rank calls it; collective)."""
    path = Path(path)
    msd, osd = get_state_dict(model, optimizer, options=_options(trainable_only))
    if trainable_only:
        msd = _trained_only(model, msd)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(path / "dcp"))
    rank = dist.get_rank() if dist.is_initialized() else 0
    torch.save({"scheduler": scheduler.state_dict(), "rng": rng_state()}, path / f"rank{rank}.pt")
    if dist.is_initialized():
        dist.barrier()


def load_trainer(model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler, path: str | Path,
                 trainable_only: bool = False) -> None:
    """Restore model, optimizer, scheduler and RNG from `path` (every rank calls it; collective)."""
    path = Path(path)
    options = _options(trainable_only)
    msd, osd = get_state_dict(model, optimizer, options=options)
    state = {"model": _trained_only(model, msd) if trainable_only else msd, "optim": osd}
    dcp.load(state, checkpoint_id=str(path / "dcp"))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"], options=options)
    rank = dist.get_rank() if dist.is_initialized() else 0
    extra_path = path / f"rank{rank}.pt"
    if not extra_path.exists():  # a different world size: rank 0's schedule and fresh RNG streams
        extra_path = path / "rank0.pt"
    extra = torch.load(extra_path, weights_only=False)
    scheduler.load_state_dict(extra["scheduler"])
    set_rng_state(extra["rng"])


def load_model_weights(path: str | Path, model: torch.nn.Module) -> None:
    """Load only the model weights of a checkpoint into a plain (unsharded) module, in one process."""
    state = {"model": model.state_dict()}
    dcp.load(state, checkpoint_id=str(Path(path) / "dcp"), no_dist=True)
    model.load_state_dict(state["model"])
