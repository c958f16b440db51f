"""The decode runner's CUDA graphs: captured lazily per key, replayed in place of the work they record.

    graphs = GraphCache(device, enabled=True)
    graph = graphs.graphs.get(key) or graphs.capture(key, body, state)   # None: capture failed, run eagerly
    graph.replay()
    graphs.drop()                                                         # whatever a graph points at moved

A graph bakes in the address of every tensor its kernels read or write, so its owner drops them all whenever one of
those moves (a sleep without fixed addresses, a larger KV cache or block table, new RoPE tables). The graphs share one
memory pool: one runs at a time. A capture costs more host time than one eager run, so keys that most rollouts use
once are captured only at a later use within one rollout (`due`; `forget_uses` at each sleep): a rollout that meets
the shapes of an earlier one captures nothing, whether or not the graphs outlived the sleep between them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

log = logging.getLogger(__name__)


def batch_buckets(limit: int) -> list[int]:
    """Batch sizes a GPU step runs at: 1, 2, 4, 8, then two per octave (x, 1.5x): ≤ 33% padding rows."""
    out, b = [1, 2, 4, 8, 12, 16, 24, 32, 48], 64
    while out[-1] < limit:
        out += [b, b * 3 // 2]
        b *= 2
    return sorted({min(x, limit) for x in out})


class GraphCache:
    """Captured graphs by key, their shared memory pool, and what capturing them cost."""

    def __init__(self, device: torch.device, enabled: bool) -> None:
        """`enabled`: whether graphs are captured at all (a GPU, `engine.native.cuda_graphs`); turned off for good by
        a failed capture."""
        self.device, self.enabled = device, enabled
        self.graphs: dict[tuple, torch.cuda.CUDAGraph] = {}
        self.pool = None
        self._uses: dict[tuple, int] = {}  # uses of keys captured at a later use, since the last `drop` or sleep
        # Captures since `take_stats`: without fixed addresses each sleep drops the graphs, so a rollout after a
        # wake-up pays them again (host seconds: the warm-up's launches, the capture's, the instantiation).
        self.captures, self.capture_s = 0, 0.0
        self.eager_steps = 0  # steps run without a graph while graphs are on (`take_eager_steps`)

    def drop(self) -> None:
        """Forget every captured graph (each is captured again at its next due use)."""
        self.graphs.clear()
        self._uses = {}
        self.pool = None

    def forget_uses(self) -> None:
        """Count uses afresh, keeping the graphs (the engine sleeps with its graphs kept: fixed addresses). A key that
        one rollout used once is not due at its first use in the next: it stays eager, as when the sleep drops the
        graphs, and the next rollout of the same shapes captures none."""
        self._uses = {}

    def due(self, key: tuple, use: int) -> bool:
        """Count a use of `key`; whether its graph exists or is due (its `use`-th use since the last drop or sleep)."""
        self._uses[key] = self._uses.get(key, 0) + 1
        return key in self.graphs or self._uses[key] >= use

    def capture(self, key: tuple, body: Callable[[], None], state: list[torch.Tensor]) -> torch.cuda.CUDAGraph | None:
        """Warm `body` up (lazy inits, Triton compiles, cuBLAS workspaces), put `state` back, capture it as the graph
        `key`. The warm-up runs the real work and may advance `state`; putting it back makes the replay that follows
        compute it exactly once. On any failure: log once, capture nothing from now on, return None."""
        t0 = time.perf_counter()
        saved = [t.clone() for t in state]
        try:
            if self.pool is None:
                self.pool = torch.cuda.graph_pool_handle()
            side = torch.cuda.Stream(device=self.device)
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                body()
            torch.cuda.current_stream().wait_stream(side)
            for t, old in zip(state, saved):
                t.copy_(old)
            graph = torch.cuda.CUDAGraph()
            # Not `with torch.cuda.graph(...)`: it first synchronizes and empties the device and pinned-host caches,
            # so each capture gave back memory the next steps allocate again (cudaFree and cudaFreeHost wait for the
            # device) and dropped the pinned staging buffers. thread_local: other threads' CUDA calls (the NCCL
            # watchdog's event queries) must not void the capture.
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                graph.capture_begin(pool=self.pool, capture_error_mode="thread_local")
                try:
                    body()
                finally:
                    graph.capture_end()
            torch.cuda.current_stream().wait_stream(side)
        except Exception as e:  # noqa: BLE001 - any capture failure: run eagerly, say so once
            log.warning(
                "native engine: CUDA graph capture failed (%s: %s); running eagerly from now on", type(e).__name__, e
            )
            self.enabled = False
            self.drop()
            try:
                torch.cuda.synchronize(self.device)
            except Exception:  # noqa: BLE001 - the eager path reports any real device error itself
                pass
            for t, old in zip(state, saved):
                t.copy_(old)
            return None
        self.graphs[key] = graph
        self.captures += 1
        self.capture_s += time.perf_counter() - t0
        return graph

    def take_eager_steps(self) -> int:
        """Steps run eagerly with graphs on (a mixed step's key before its capture use) since the last call."""
        n, self.eager_steps = self.eager_steps, 0
        return n

    def take_stats(self) -> tuple[int, float]:
        """Graphs captured and host seconds spent capturing them since the last call."""
        out = (self.captures, self.capture_s)
        self.captures, self.capture_s = 0, 0.0
        return out
