"""vLLM-CPU's tensor-parallel shared memory, and what our worker processes leave of it."""

from __future__ import annotations

import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)


def remove_stale_cpu_shm(root: str = "/dev/shm") -> list[str]:
    """Remove vLLM-CPU's tensor-parallel shared-memory segments that no live process maps; returns their names.

    vLLM on CPU names them by group and rank list only (`…-tp:0-[0-1]-cpushm_<rank>`), the same name in every
    run, and unlinks them when its SHM manager is destroyed at a normal interpreter exit. Our workers leave with
    `os._exit` (the interpreter's DeviceMesh teardown can abort), so the segments stay, and the next TP engine on
    this machine fails to create them (errno 17, EEXIST). A segment still mapped belongs to a running engine and
    is left alone.
    """
    shm = Path(root)
    stale = [f for f in shm.glob("*cpushm*") if f.is_file() and f.stat().st_uid == os.getuid()] if shm.is_dir() else []
    if not stale:
        return []
    mapped: set[str] = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            mapped.update(line.split(None, 5)[-1].strip() for line in maps.read_text().splitlines() if root in line)
        except OSError:  # a process that ended or is not ours to read
            continue
    removed = []
    for f in stale:
        if str(f) not in mapped:
            f.unlink(missing_ok=True)
            removed.append(f.name)
    if removed:
        log.info("vLLM CPU: removed %d stale shared-memory segment(s) of an earlier engine: %s", len(removed), removed)
    return removed
