"""The run's checkpoint folder: atomic publication with checksums, verified resume, keep-last-k.

A checkpoint is written to `checkpoints/.tmp-step_N` (by every role of every worker: the actor's DCP
shards and per-rank state, and whatever else a role saves into a subfolder), then `publish` records
the size and sha256 of every file under it in `meta.json`, written last, and renames the folder to
`checkpoints/step_N`. Only folders named `step_N` that hold `meta.json` count, so a save killed
half-way is never resumed from (its `.tmp-` folder is removed at the next start, or at once when the save
failed or was interrupted). `meta.json` carries the sha256 of its own content too (`meta_sha256`, over every
other key in canonical JSON), so an edited step, loader position or manifest is caught like a changed shard, and
its step must be the folder's (`step_000003` holds step 3).

`resolve` verifies before it returns a path: a file missing, added, truncated or changed since it was
written, an edited meta.json, or a step that disagrees with the folder's name is an error naming the file
(explicit `trainer.resume=PATH`), or a skipped checkpoint, logged, with `trainer.resume=auto` falling back to the
newest one that verifies. `keep_last` never deletes the newest verified checkpoint to make room for ones that do
not verify.

A save that cannot write (a full disk, a read-only or vanished folder) stops the run with one line naming the
checkpoint, the file and the OS error (`CheckpointWriteError`); earlier checkpoints stay as they are.

The controller's use::

    ckpts = CheckpointDir(run_dir, keep_last)
    path = ckpts.resolve(cfg.trainer.resume)      # a verified checkpoint, or None
    ...
    tmp = ckpts.staging(step); <every worker saves into tmp>; ckpts.publish(tmp, step, {"loader": ..., "config": ...})
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from hybridrl.errors import CheckpointError, ConfigError

log = logging.getLogger("hybridrl")
_NAME = re.compile(r"^step_(\d+)$")
_STAGING = re.compile(r"^\.tmp-(step_\d+)$")
META = "meta.json"
FORMAT = 3
"""meta.json format: 2 = with the `files` manifest (sha256 and size of every file); 3 = also `meta_sha256`, the
sha256 of meta.json's own content. Format 2 still loads (its step is checked against the folder's name)."""
META_SHA = "meta_sha256"
_CHUNK = 8 << 20


class CheckpointWriteError(CheckpointError):
    """A checkpoint could not be written; the message names it, the file and the OS error."""


def write_failure(folder: str | Path, file: str | Path | None, error: OSError) -> CheckpointWriteError:
    """`checkpoint step_000003: cannot write dcp/__0_0.distcp (in /run/checkpoints/.tmp-step_000003): No space left
    on device [errno 28]; ...` for `error` while writing `file` of the checkpoint being written into `folder`."""
    folder = Path(folder)
    staged = _STAGING.match(folder.name)
    name = staged.group(1) if staged else folder.name
    rel = "its folder"
    if file is not None:
        file = Path(file)
        try:
            rel = file.relative_to(folder).as_posix()
        except ValueError:
            rel = str(file)
    why = error.strerror or str(error) or type(error).__name__
    code = f" [errno {error.errno}]" if error.errno else ""
    return CheckpointWriteError(
        f"checkpoint {name}: cannot write {rel} (in {folder}): {why}{code}; the checkpoint was not kept and earlier "
        "checkpoints are untouched. Free space there, or give the run another hydra.run.dir and resume from the last "
        "checkpoint"
    )


def meta_digest(meta: dict[str, Any]) -> str:
    """sha256 of meta.json's content less its own `meta_sha256`, as canonical JSON (sorted keys, no spaces)."""
    body = {k: v for k, v in meta.items() if k != META_SHA}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def file_sha256(path: Path) -> str:
    """Hex sha256 of a file, read in 8 MiB chunks (hashlib releases the GIL: threads hash in parallel)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _files(folder: Path) -> list[str]:
    """Every file under `folder` (any depth, dotfiles included) except meta.json, as posix relative paths."""
    out = []
    for p in folder.rglob("*"):
        rel = p.relative_to(folder).as_posix()
        if p.is_file() and rel not in (META, META + ".tmp"):
            out.append(rel)
    return sorted(out)


def _hash_all(folder: Path, names: list[str]) -> dict[str, str]:
    with ThreadPoolExecutor(max_workers=max(1, min(8, len(names), os.cpu_count() or 1))) as pool:
        return dict(zip(names, pool.map(lambda n: file_sha256(folder / n), names)))


def build_manifest(folder: Path) -> dict[str, dict[str, Any]]:
    """{relative path: {"bytes": size, "sha256": hex}} for every file under `folder`, whatever role wrote it."""
    names = _files(folder)
    for n in names:  # the bytes we hash are the bytes on disk, not a page cache that a crash would lose
        fd = os.open(folder / n, os.O_RDONLY)
        try:
            os.fsync(fd)
        except OSError:  # a file system that cannot fsync a read-only descriptor: hash what is there
            pass
        finally:
            os.close(fd)
    digests = _hash_all(folder, names)
    return {n: {"bytes": (folder / n).stat().st_size, "sha256": digests[n]} for n in names}


def read_meta(path: Path) -> dict[str, Any]:
    """The checkpoint's meta.json (step, loader position, config, file manifest)."""
    try:
        return json.loads((Path(path) / META).read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"checkpoint {path}: {META} cannot be read ({e})") from None


def verify(path: Path) -> None:
    """Raise CheckpointError naming the first file of checkpoint `path` that differs from its manifest."""
    path = Path(path)
    meta = read_meta(path)
    files = meta.get("files")
    if not isinstance(files, dict):
        raise CheckpointError(
            f"checkpoint {path} has no file checksums (written by an older hybridrl, or its {META} was edited); "
            "it cannot be verified"
        )
    if META_SHA in meta and meta[META_SHA] != meta_digest(meta):
        raise CheckpointError(f"checkpoint {path}: {META} fails its sha256 check (edited after it was written)")
    if int(meta.get("format", 0)) >= 3 and META_SHA not in meta:
        raise CheckpointError(f"checkpoint {path}: {META} has lost its own checksum ({META_SHA}); it was edited")
    named = _NAME.match(path.name)
    if named and int(named.group(1)) != meta.get("step"):
        raise CheckpointError(
            f"checkpoint {path}: the folder's name says step {int(named.group(1))}, its {META} says step "
            f"{meta.get('step')!r} (renamed or edited after it was written)"
        )
    present = set(_files(path))
    for name in sorted(set(files) - present):
        raise CheckpointError(f"checkpoint {path}: file {name} is missing")
    for name in sorted(present - set(files)):
        raise CheckpointError(
            f"checkpoint {path}: file {name} is not in its manifest (added after the checkpoint was written)"
        )
    for name, want in sorted(files.items()):
        size = (path / name).stat().st_size
        if size != want.get("bytes"):
            raise CheckpointError(
                f"checkpoint {path}: file {name} has {size} bytes, {want.get('bytes')} were written "
                "(truncated or replaced)"
            )
    for name, digest in sorted(_hash_all(path, sorted(files)).items()):
        if digest != files[name].get("sha256"):
            raise CheckpointError(
                f"checkpoint {path}: file {name} fails its sha256 check (corrupt, or modified after it was written)"
            )


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class CheckpointDir:
    """`<run_dir>/checkpoints` and the rules for what in it is a usable checkpoint."""

    def __init__(self, run_dir: str | Path, keep_last: int) -> None:
        self.root = Path(run_dir) / "checkpoints"
        self.keep_last = keep_last
        # path -> (meta.json mtime_ns, size, verified?) so pruning hashes each checkpoint at most once.
        self._checked: dict[Path, tuple[int, int, bool]] = {}

    def staging(self, step: int) -> Path:
        """A fresh temporary folder for step `step`'s checkpoint."""
        tmp = self.root / f".tmp-step_{step:06d}"
        try:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        except OSError as e:
            raise write_failure(tmp, None, e) from None
        return tmp

    def publish(self, tmp: Path, step: int, meta: dict[str, Any]) -> Path:
        """Checksum every file in `tmp`, write meta.json last, rename into place; prune older checkpoints. A failure
        to write removes `tmp` and raises CheckpointWriteError naming the file."""
        try:
            final = self._publish(tmp, step, meta)
        except OSError as e:
            shutil.rmtree(tmp, ignore_errors=True)  # frees the space a full disk needs, and leaves nothing half-done
            raise write_failure(tmp, e.filename or tmp / META, e) from None
        self._prune()
        return final

    def _publish(self, tmp: Path, step: int, meta: dict[str, Any]) -> Path:
        files = build_manifest(tmp)
        record = {"step": step, **meta, "format": FORMAT, "files": files}
        record[META_SHA] = meta_digest(record)
        meta_tmp = tmp / (META + ".tmp")
        with open(meta_tmp, "w") as f:
            json.dump(record, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(meta_tmp, tmp / META)
        _fsync_dir(tmp)
        final = self.root / f"step_{step:06d}"
        if final.exists():  # a resumed run redoing a step (e.g. past one that failed its checks): say so
            log.warning("replacing %s (written before this run resumed from an earlier step)", final.name)
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync_dir(self.root)
        self._remember(final, True)
        return final

    def complete(self) -> list[tuple[int, Path]]:
        """Complete checkpoints (a step_N folder with meta.json), oldest first; not yet verified."""
        if not self.root.is_dir():
            return []
        found = []
        for p in self.root.iterdir():
            m = _NAME.match(p.name)
            if m and (p / META).is_file():
                found.append((int(m.group(1)), p))
        return sorted(found)

    def latest(self) -> Path | None:
        """The newest complete checkpoint, verified or not."""
        done = self.complete()
        return done[-1][1] if done else None

    def newest_verified(self, log_skipped: bool = False) -> Path | None:
        """The newest checkpoint that verifies; with `log_skipped`, a warning for each newer one that does not."""
        for _, p in reversed(self.complete()):
            try:
                self._verify(p)
                return p
            except CheckpointError as e:
                if log_skipped:
                    log.warning("trainer.resume=auto: skipping %s: %s", p.name, e)
        return None

    def remove_stale(self) -> None:
        """Delete half-written checkpoints: left by a killed run, or by this run's save that failed or was
        interrupted (the run dir's lock makes every one of them this run's or a dead run's)."""
        if self.root.is_dir():
            for p in self.root.glob(".tmp-step_*"):
                log.warning("removing incomplete checkpoint %s", p)
                shutil.rmtree(p, ignore_errors=True)

    def resolve(self, resume: str | None) -> Path | None:
        """The verified checkpoint `trainer.resume` names: auto = the newest here that verifies (None when
        there is no checkpoint at all), or a path. Raises CheckpointError naming the file that fails."""
        if not resume:
            return None
        if resume == "auto":
            self.remove_stale()
            done = self.complete()
            path = self.newest_verified(log_skipped=True)
            if path is None and done:
                raise CheckpointError(
                    f"trainer.resume=auto: none of the {len(done)} checkpoints in {self.root} verifies (see the "
                    "warnings above); move them away to start fresh, or resume one explicitly after repairing it"
                )
            if path is not None and path != done[-1][1]:
                log.warning("trainer.resume=auto: resuming from %s, the newest checkpoint that verifies", path.name)
            return path
        path = Path(resume).expanduser()
        if not (path / META).is_file():
            raise ConfigError(f"trainer.resume={resume!r} is not a complete checkpoint folder (no {META})")
        self._verify(path)
        return path

    # -- internals ------------------------------------------------------------------------
    def _signature(self, path: Path) -> tuple[int, int]:
        st = (path / META).stat()
        return st.st_mtime_ns, st.st_size

    def _remember(self, path: Path, ok: bool) -> None:
        self._checked[path] = (*self._signature(path), ok)

    def _verify(self, path: Path) -> None:
        seen = self._checked.get(path)
        if seen is not None and seen[:2] == self._signature(path) and seen[2]:
            return
        try:
            verify(path)
        except CheckpointError:
            self._remember(path, False)
            raise
        self._remember(path, True)

    def _is_verified(self, path: Path) -> bool:
        try:
            self._verify(path)
            return True
        except CheckpointError:
            return False

    def _prune(self) -> None:
        """Delete all but the newest `keep_last`, except the newest verified checkpoint, which always stays."""
        done = self.complete()
        doomed = done[: -self.keep_last]
        if not doomed:
            return
        kept = [p for _, p in done[-self.keep_last :]]
        keep = next((p for p in reversed(kept) if self._is_verified(p)), None)
        if keep is None:  # every kept one fails: the newest good one among the older ones stays too
            keep = next((p for _, p in reversed(doomed) if self._is_verified(p)), None)
            if keep is not None:
                log.warning("keep_last: keeping %s, the newest checkpoint that verifies", keep.name)
        for _, p in doomed:
            if p != keep:
                shutil.rmtree(p, ignore_errors=True)
                self._checked.pop(p, None)
