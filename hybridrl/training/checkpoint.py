"""Trainer checkpoints: FSDP2 model + optimizer through torch.distributed.checkpoint, plus per-rank state.

Layout of one checkpoint folder (written under a temporary name, renamed when complete)::

    step_000006/
      dcp/            model and optimizer shards (torch.distributed.checkpoint; any world size can load)
      rank0.pt ...    scheduler state and RNG states of each rank: tensors and plain numbers only
      meta.json       written last by the controller: step, data loader position, config, file checksums

A save that cannot write (a full disk, a read-only folder) raises `CheckpointWriteError` naming the file and the
OS error, also from inside DCP, whose `CheckpointException` is a BaseException that would otherwise escape the
run's error handling as a raw traceback.

Nothing here runs code from a checkpoint: `rank*.pt` load with `weights_only=True`, and DCP's own two
pickles (the `.metadata` index and the non-tensor values such as AdamW's hyperparameters) go through a
reader that allows only DCP's metadata classes and through `weights_only=True`. A file that fails
these checks is a CheckpointError naming it.
"""

from __future__ import annotations

import errno
import io
import logging
import os
import pickle
import random
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from hybridrl.checkpoints import write_failure
from hybridrl.errors import CheckpointError

log = logging.getLogger(__name__)

# What a DCP `.metadata` pickle may name: the classes defined in DCP's metadata module, the storage
# record of its file system writer, and the torch/pathlib types they hold.
_DCP_METADATA = "torch.distributed.checkpoint.metadata"
_ALLOWED_GLOBALS = {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("collections", "OrderedDict"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
}


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP metadata and refuses every other global (no `os.system`, no `__reduce__` gadgets)."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED_GLOBALS:
            return super().find_class(module, name)
        if module == _DCP_METADATA:
            import torch.distributed.checkpoint.metadata as md

            obj = getattr(md, name, None)
            if isinstance(obj, type) and obj.__module__ == _DCP_METADATA:  # its dataclasses and enums only
                return obj
        if module == "torch" and isinstance(
            getattr(torch, name, None), (torch.dtype, torch.layout, torch.memory_format)
        ):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in checkpoint metadata")


class SafeReader(FileSystemReader):
    """A DCP FileSystemReader whose `.metadata` is read by `_MetadataUnpickler` instead of `pickle.load`."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

        rank = kwargs.get("rank")
        if hasattr(self, "_get_metadata_path"):
            path = self._get_metadata_path(rank)
        else:  # older torch: one metadata file
            path = self.fs.concat_path(self.path, ".metadata")
        with self.fs.create_stream(path, "rb") as f:
            try:
                metadata = _MetadataUnpickler(f).load()
            except Exception as e:
                why = _first_line(e)
                raise CheckpointError(f"checkpoint file {path} is not safe to load or is corrupt: {why}") from None
        if not isinstance(metadata, Metadata):
            raise CheckpointError(f"checkpoint file {path} holds a {type(metadata).__name__}, not DCP metadata")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default planner, but non-tensor values load with `weights_only=True` (DCP's own uses False)."""

    refused: str | None = None
    """Why a value was refused (DCP wraps exceptions raised inside its load; `safe_dcp_load` re-raises this)."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        try:
            obj = torch.load(value, weights_only=True)
        except Exception as e:
            self.refused = f"checkpoint value {read_item.dest_index.fqn!r} is not safe to load: {_first_line(e)}"
            raise CheckpointError(self.refused) from None
        clean = io.BytesIO()
        torch.save(obj, clean)  # re-serialized from checked plain data, so the parent's load runs nothing foreign
        clean.seek(0)
        super().load_bytes(read_item, clean)


def _unpickler_reason(e: pickle.UnpicklingError) -> str:
    """What torch's weights-only unpickler refused (e.g. `Unsupported global: GLOBAL posix.system`), without its
    advice to retry with weights_only=False: for a file that is not ours that advice is the attack."""
    text = str(e)
    _, found, rest = text.partition("WeightsUnpickler error:")
    reason = rest.strip().split("\n\n")[0].strip() if found else ""
    return reason or "not a tensors-and-plain-values file"


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def safe_dcp_load(state: dict[str, Any], folder: Path, no_dist: bool = False) -> None:
    """`dcp.load` of `folder` into `state` through SafeReader and SafeLoadPlanner; a refused file or value is a
    CheckpointError naming it (checked before DCP starts, so no rank enters the load with a bad index)."""
    SafeReader(str(folder)).read_metadata()
    planner = SafeLoadPlanner()
    try:
        dcp.load(state, storage_reader=SafeReader(str(folder)), planner=planner, no_dist=no_dist)
    except Exception:
        if planner.refused:
            raise CheckpointError(planner.refused) from None
        raise


# -- per-rank state: RNG streams and the scheduler, as tensors and plain values ---------------
def rng_state() -> dict[str, Any]:
    """Every RNG this process draws from, as tensors and plain numbers (loadable with weights_only)."""
    version, internal, gauss = random.getstate()
    state: dict[str, Any] = {
        "python": {"version": version, "state": torch.tensor(internal, dtype=torch.int64), "gauss_next": gauss},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what `rng_state` returned (also the tuple form older checkpoints stored)."""
    py = state["python"]
    if isinstance(py, dict):
        random.setstate((int(py["version"]), tuple(int(x) for x in py["state"].tolist()), py["gauss_next"]))
    else:
        random.setstate(py)
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


_PLAIN = (bool, int, float, str, type(None), torch.Tensor)


def check_plain(value: Any, where: str) -> None:
    """Raise TypeError unless `value` is tensors and plain values in dicts/lists/tuples (what weights_only loads)."""
    if isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, (str, int)):
                raise TypeError(f"{where}: key {k!r} is a {type(k).__name__}")
            check_plain(v, f"{where}.{k}")
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            check_plain(v, f"{where}[{i}]")
    elif not isinstance(value, _PLAIN):
        raise TypeError(f"{where} is a {type(value).__name__}; a checkpoint stores tensors and plain values only")


def read_rank_state(path: Path) -> dict[str, Any]:
    """A `rank*.pt` file, loaded with weights_only=True; a file that needs more is refused, naming it."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        why = _unpickler_reason(e)
        raise CheckpointError(
            f"checkpoint file {path} holds objects that could run code on load; refused ({why})"
        ) from None
    except (RuntimeError, EOFError, OSError) as e:
        raise CheckpointError(f"checkpoint file {path} cannot be read ({e})") from None


def apply_lr(optimizer: torch.optim.Optimizer, scheduler: Any, lr: float) -> bool:
    """Make `lr` the peak learning rate after a restore (the checkpoint's base lr is replaced).

    Sets the scheduler's `base_lrs`, every param group's `initial_lr`, and its current `lr` to
    `lr * multiplier(last_epoch)`, so the schedule continues from the same point with the new peak.
    Returns whether anything changed. Works for LambdaLR (ours, from training/schedule.py).
    """
    if not hasattr(scheduler, "lr_lambdas"):
        raise TypeError(f"apply_lr supports LambdaLR schedulers, got {type(scheduler).__name__}")
    changed = any(b != lr for b in scheduler.base_lrs)
    scheduler.base_lrs = [lr for _ in optimizer.param_groups]
    for group, fn in zip(optimizer.param_groups, scheduler.lr_lambdas):
        group["initial_lr"] = lr
        group["lr"] = lr * fn(scheduler.last_epoch)
    scheduler._last_lr = [g["lr"] for g in optimizer.param_groups]  # what get_last_lr() reports
    return changed


# -- the trainer's save/load -------------------------------------------------------------
def _options(trainable_only: bool) -> StateDictOptions:
    """The state-dict options: with `trainable_only`, frozen parameters (a LoRA base) are left out."""
    return StateDictOptions(ignore_frozen_params=trainable_only, strict=not trainable_only)


def _trained_only(model: torch.nn.Module, msd: dict) -> dict:
    """The entries of trained parameters: `ignore_frozen_params` keeps a tied head whose embedding is frozen."""
    names = {
        n.replace("_orig_mod.", "").replace("_checkpoint_wrapped_module.", "")
        for n, p in model.named_parameters()
        if p.requires_grad
    }
    return {k: v for k, v in msd.items() if k in names}


def save_trainer(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler, path: str | Path, trainable_only: bool = False
) -> None:
    """Write this rank's part of the checkpoint into `path` (every rank calls it; collective). A write that fails
    raises CheckpointWriteError naming the file and the OS error."""
    path = Path(path)
    msd, osd = get_state_dict(model, optimizer, options=_options(trainable_only))
    if trainable_only:
        msd = _trained_only(model, msd)
    try:
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(path / "dcp"))
    except CheckpointException as e:  # a BaseException: turned into an ordinary error naming the file
        raise _dcp_failure(path, e) from None
    rank = dist.get_rank() if dist.is_initialized() else 0
    extra = {"scheduler": scheduler.state_dict(), "rng": rng_state()}
    check_plain(extra, f"rank{rank}.pt")
    buf = io.BytesIO()
    torch.save(extra, buf)  # in memory first: torch's zip writer reports a full disk as "unexpected pos ..."
    write_file(path / f"rank{rank}.pt", buf.getbuffer(), path)
    if dist.is_initialized():
        dist.barrier()


def write_file(file: Path, data: bytes | memoryview, checkpoint: Path) -> None:
    """Write `data` to `file` and fsync it; an OSError becomes CheckpointWriteError naming the file of `checkpoint`."""
    try:
        with open(file, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        raise write_failure(checkpoint, file, e) from None


def _dcp_failure(path: Path, e: BaseException) -> Exception:
    """The first OSError among DCP's per-rank failures as a CheckpointWriteError naming the file; another failure as
    a RuntimeError (a library's crash: the app reports it with its traceback in the log)."""
    failures = getattr(e, "failures", {}) or {}
    for _rank, failure in sorted(failures.items()):
        exc = failure[0] if isinstance(failure, tuple) else failure
        while exc is not None and not isinstance(exc, OSError):
            exc = exc.__cause__ or exc.__context__
        if isinstance(exc, OSError):
            return write_failure(path, exc.filename or _newest_file(path / "dcp") or path / "dcp", exc)
    first = next(iter(failures.values()), None)
    exc = first[0] if isinstance(first, tuple) else first
    if _disk_full(path):  # torch's zip writer reports a short write as "unexpected pos ...", without the OSError
        full = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return write_failure(path, _newest_file(path / "dcp") or path / "dcp", full)
    summary = f"{type(exc).__name__}: {_first_line(exc)}" if exc is not None else _first_line(e)
    return RuntimeError(
        f"saving the distributed checkpoint into {path / 'dcp'} failed on rank(s) {sorted(failures)}: {summary}"
    )


def _disk_full(path: Path) -> bool:
    """Whether the file system holding `path` has (almost) no room left: under 1 MiB for its user."""
    try:
        st = os.statvfs(path)
    except OSError:
        return False
    return st.f_bavail * st.f_frsize < (1 << 20)


def _newest_file(folder: Path) -> Path | None:
    """The file written last under `folder`: the one a write error without a file name was writing."""
    files = [p for p in folder.rglob("*") if p.is_file()] if folder.is_dir() else []
    return max(files, key=lambda p: p.stat().st_mtime_ns, default=None)


def load_trainer(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler,
    path: str | Path,
    lr: float | None = None,
    trainable_only: bool = False,
) -> None:
    """Restore model, optimizer, scheduler and RNG from `path` (every rank calls it; collective).

    With `lr`, that becomes the peak learning rate (a resume with a changed `trainer.lr`, see `apply_lr`); with
    `trainable_only`, frozen parameters (a LoRA base) keep what the model folder gave them.
    """
    path = Path(path)
    options = _options(trainable_only)
    msd, osd = get_state_dict(model, optimizer, options=options)
    state = {"model": _trained_only(model, msd) if trainable_only else msd, "optim": osd}
    safe_dcp_load(state, path / "dcp")
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"], options=options)
    rank = dist.get_rank() if dist.is_initialized() else 0
    extra_path = path / f"rank{rank}.pt"
    if not extra_path.exists():  # a different world size: rank 0's schedule and fresh RNG streams
        extra_path = path / "rank0.pt"
    extra = read_rank_state(extra_path)
    scheduler.load_state_dict(extra["scheduler"])
    set_rng_state(extra["rng"])
    if lr is not None:
        apply_lr(optimizer, scheduler, lr)


def load_model_weights(path: str | Path, model: torch.nn.Module) -> None:
    """Load only the model weights of a checkpoint into a plain (unsharded) module, in one process."""
    state = {"model": model.state_dict()}
    safe_dcp_load(state, Path(path) / "dcp", no_dist=True)
    model.load_state_dict(state["model"])
