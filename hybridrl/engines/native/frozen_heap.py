"""The Python heap frozen while an engine serves requests, so the garbage collector's full passes skip it.

A full (oldest-generation) collection walks every tracked object, and the device runs out of queued decode steps
while it does. A rollout allocates steadily (token lists, completions, agent contexts), so such passes do come:
in a 512-trajectory agent workload (`python -m benchmarks.engine`) on a 2-core CPU, one full pass took 0.18 s, and
3 ms with the heap frozen; a training process (modules, configs, datasets) holds more. `gc.freeze` moves everything
alive at the start to a permanent generation that collections ignore; what the rollout allocates is still collected
as usual; `gc.unfreeze` at the end hands the old objects back to the oldest generation, so garbage among them is
collected later, in the trainer's phases.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from contextlib import contextmanager

_lock = threading.Lock()
_depth = 0


@contextmanager
def frozen_heap() -> Iterator[None]:
    """Freeze the heap for the enclosed block (nested and concurrent uses unfreeze when the last one ends)."""
    global _depth
    with _lock:
        if _depth == 0:
            gc.freeze()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                gc.unfreeze()
