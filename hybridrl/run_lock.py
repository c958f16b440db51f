"""One writer per run dir: an exclusive lock on `<run dir>/.hybridrl.lock`, held for the whole run.

    lock = RunDirLock(run_dir)
    lock.acquire()        # RunDirBusy (exit 2) naming the holder's pid, host and command when another run holds it
    ... the run writes .hydra/, the log, metrics, checkpoints ...
    lock.release()        # on every exit path; the kernel also drops it when the process ends, however it ends

The lock is `fcntl.flock` on a descriptor kept open. The kernel releases it when the holder's process ends (a crash, a
SIGKILL, a power loss on a network file system once its lease expires), so a dead run never leaves a lock that blocks
the next one, and no pid has to be guessed alive or dead. The file records the holder (pid, host, start time, command
line) for the message; a clean release empties it. A non-empty file that nobody holds was left by a run that ended
without releasing it: the new run takes it over with a warning naming that run. The file itself is never deleted: a
run that opened the old file and a run that created a new one could then both hold "the" lock.

Where the file system cannot lock (some FUSE and old NFS mounts) the run goes on with a warning that a second run in
the same dir would not be detected.

The Hydra app takes the lock before Hydra writes anything into the run dir (`RunDirLockCallback.on_run_start`, before
`.hydra/` and the log); a sweep locks its sweep dir the same way, and each of its jobs its own job dir.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from hybridrl.errors import HybridRLError

log = logging.getLogger("hybridrl")

LOCK_FILE = ".hybridrl.lock"


class RunDirBusy(HybridRLError):
    """Another run holds the run dir's lock; the message names it and what to do."""


def _holder_text(record: dict[str, Any]) -> str:
    """`pid 1234 on host gpu-7, started 2026-12-05 01:08:19: python -m hybridrl trainer.lr=2e-3`."""
    if not record:
        return "a run that has not recorded itself yet"
    started = record.get("started")
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started)) if isinstance(started, (int, float)) else "?"
    text = f"pid {record.get('pid', '?')} on host {record.get('host', '?')}, started {when}"
    if record.get("command"):
        text += f": {record['command']}"
    return text


def _command_line() -> str:
    """This process's command, as typed (`python -m hybridrl trainer.lr=2e-3`), cut to 300 characters."""
    if not sys.argv:
        return ""
    prog = Path(sys.argv[0])
    head = "python -m hybridrl" if prog.name == "__main__.py" and prog.parent.name == "hybridrl" else prog.name
    return " ".join([head, *sys.argv[1:]])[:300]


def _read_record(fd: int) -> dict[str, Any]:
    os.lseek(fd, 0, os.SEEK_SET)
    raw = b""
    while chunk := os.read(fd, 65536):
        raw += chunk
    if not raw.strip():
        return {}
    try:
        record = json.loads(raw)
    except ValueError:
        return {"pid": "?", "host": "?", "command": "(unreadable lock file)"}
    return record if isinstance(record, dict) else {}


class RunDirLock:
    """The lock of one run dir (see the module docstring)."""

    def __init__(self, run_dir: str | Path, key: str = "hydra.run.dir") -> None:
        self.run_dir = Path(run_dir).absolute()
        self.path = self.run_dir / LOCK_FILE
        self.key = key
        self.fd: int | None = None

    @property
    def held(self) -> bool:
        """Whether this object holds the lock now."""
        return self.fd is not None

    def acquire(self) -> None:
        """Take the lock or raise RunDirBusy; an unwritable run dir is a HybridRLError naming it."""
        if self.fd is not None:
            return
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as e:
            raise HybridRLError(
                f"{self.key}={self.run_dir}: cannot write there ({e.strerror or e}); choose a folder you can write to"
            ) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            record = _read_record(fd)
            if not record:  # the holder has the lock but has not written its record yet
                time.sleep(0.2)
                record = _read_record(fd)
            os.close(fd)
            raise RunDirBusy(
                f"{self.key}={self.run_dir} is in use by another run ({_holder_text(record)}); "
                "wait for it to end, or give this run another folder"
            ) from None
        except OSError as e:
            if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                os.close(fd)
                raise
            log.warning(
                "%s=%s: the file system cannot lock %s (%s); a second run started in this folder would not be detected",
                self.key,
                self.run_dir,
                LOCK_FILE,
                e.strerror,
            )
            os.close(fd)
            return
        try:
            if os.fstat(fd).st_ino != os.stat(self.path).st_ino:  # replaced between open and lock: lock the new one
                os.close(fd)
                return self.acquire()
        except FileNotFoundError:
            os.close(fd)
            return self.acquire()
        previous = _read_record(fd)
        if previous:
            log.warning(
                "%s=%s: taking over the lock of a run that ended without releasing it (%s)",
                self.key,
                self.run_dir,
                _holder_text(previous),
            )
        record = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "started": time.time(),
            "command": _command_line(),
        }
        try:
            os.ftruncate(fd, 0)
            os.lseek(fd, 0, os.SEEK_SET)
            os.write(fd, json.dumps(record).encode())
        except OSError as e:
            os.close(fd)
            raise HybridRLError(
                f"{self.key}={self.run_dir}: cannot write there ({e.strerror or e}); choose a folder you can write to"
            ) from None
        self.fd = fd

    def release(self) -> None:
        """Empty the record and drop the lock; safe to call twice."""
        fd, self.fd = self.fd, None
        if fd is None:
            return
        try:
            os.ftruncate(fd, 0)
        except OSError:  # a full or read-only disk: the kernel still drops the lock below
            pass
        finally:
            os.close(fd)  # closing the last descriptor of the open file releases the flock


_HELD: dict[Path, RunDirLock] = {}


def lock_dir(path: str | Path, key: str) -> RunDirLock:
    """Take (once per process) the lock of the run or sweep dir `path`; `key` names it in messages."""
    folder = Path(path).absolute()
    lock = _HELD.get(folder)
    if lock is None:
        lock = RunDirLock(folder, key)
        lock.acquire()
        _HELD[folder] = lock
    return lock


def unlock_dir(path: str | Path) -> None:
    """Release what `lock_dir` took for `path`, if anything."""
    lock = _HELD.pop(Path(path).absolute(), None)
    if lock is not None:
        lock.release()


class RunNotStarted(BaseException):
    """The lock was refused inside a Hydra callback. A BaseException because Hydra turns a callback's Exception into a
    warning and goes on; `app.main` prints `error` (the HybridRLError) as one line and exits 2."""

    def __init__(self, error: HybridRLError) -> None:
        super().__init__(str(error))
        self.error = error


def _lock_or_stop(path: str, key: str) -> None:
    try:
        lock_dir(path, key)
    except HybridRLError as e:
        raise RunNotStarted(e) from None


class RunDirLockCallback(Callback):
    """Hydra callback (conf/config.yaml `hydra.callbacks`): the run dir's lock before Hydra writes `.hydra/` and the
    log into it; for a sweep, the sweep dir's lock before its first job starts."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        _lock_or_stop(str(OmegaConf.select(config, "hydra.run.dir")), "hydra.run.dir")

    def on_run_end(self, config: DictConfig, **kwargs: Any) -> None:
        unlock_dir(str(OmegaConf.select(config, "hydra.run.dir")))

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        _lock_or_stop(str(OmegaConf.select(config, "hydra.sweep.dir")), "hydra.sweep.dir")

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        unlock_dir(str(OmegaConf.select(config, "hydra.sweep.dir")))
