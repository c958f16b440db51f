"""The run's checkpoint folder: atomic publication, finding the newest complete one, keep-last-k.

A checkpoint is written to `checkpoints/.tmp-step_N`, completed with `meta.json`, then renamed to
`checkpoints/step_N`. Only folders named `step_N` that hold `meta.json` count, so a save killed
half-way is never resumed from (its `.tmp-` folder is removed at the next start).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from pathlib import Path
from typing import Any

from hybridrl.errors import ConfigError

log = logging.getLogger("hybridrl")
_NAME = re.compile(r"^step_(\d+)$")


class CheckpointDir:
    """`<run_dir>/checkpoints` and the rules for what in it is a usable checkpoint."""

    def __init__(self, run_dir: str | Path, keep_last: int) -> None:
        self.root = Path(run_dir) / "checkpoints"
        self.keep_last = keep_last

    def staging(self, step: int) -> Path:
        """A fresh temporary folder for step `step`'s checkpoint."""
        tmp = self.root / f".tmp-step_{step:06d}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        return tmp

    def publish(self, tmp: Path, step: int, meta: dict[str, Any]) -> Path:
        """Write meta.json last, then rename into place; prune older checkpoints."""
        meta_tmp = tmp / "meta.json.tmp"
        meta_tmp.write_text(json.dumps({"step": step, **meta}, indent=1))
        os.replace(meta_tmp, tmp / "meta.json")
        final = self.root / f"step_{step:06d}"
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        self._prune()
        return final

    def complete(self) -> list[tuple[int, Path]]:
        """Complete checkpoints, oldest first."""
        if not self.root.is_dir():
            return []
        found = []
        for p in self.root.iterdir():
            m = _NAME.match(p.name)
            if m and (p / "meta.json").is_file():
                found.append((int(m.group(1)), p))
        return sorted(found)

    def latest(self) -> Path | None:
        done = self.complete()
        return done[-1][1] if done else None

    def remove_stale(self) -> None:
        """Delete half-written checkpoints left by a killed run."""
        if self.root.is_dir():
            for p in self.root.glob(".tmp-step_*"):
                log.warning("removing incomplete checkpoint %s", p)
                shutil.rmtree(p, ignore_errors=True)

    def _prune(self) -> None:
        for _, p in self.complete()[: -self.keep_last]:
            shutil.rmtree(p, ignore_errors=True)

    def resolve(self, resume: str | None) -> Path | None:
        """The checkpoint `trainer.resume` names: auto = newest here (None if there is none), or a path."""
        if not resume:
            return None
        if resume == "auto":
            self.remove_stale()
            return self.latest()
        path = Path(resume).expanduser()
        if not (path / "meta.json").is_file():
            raise ConfigError(f"trainer.resume={resume!r} is not a complete checkpoint folder (no meta.json)")
        return path


def read_meta(path: Path) -> dict[str, Any]:
    return json.loads((path / "meta.json").read_text())
