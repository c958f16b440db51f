"""Decode steps over slots [0, B): eager, or one CUDA graph per (batch, attended-length) bucket.

A graph records kernel launches against fixed addresses, so everything it touches is static while it lives:
the token/position input buffers and the logits output buffer here, the weights (reloaded in place by
`load_weights`), the KV cache and the RoPE tables. Whatever moves those (sleep, a cache resize) must call
`release()`, which drops every graph; they are captured again, lazily, on first use of each bucket.

Capture happens in the middle of generation with the real inputs already in the buffers: the warm-up run
then computes exactly what the replay computes (the K/V it writes are the same values), so it does no harm.
If capture fails, the failure is logged once and decoding continues eagerly.
"""

from __future__ import annotations

import logging

import torch

from hybridrl.engines.fused.kv_cache import KVCache
from hybridrl.engines.fused.model import FusedDecoder

log = logging.getLogger(__name__)

LENGTH_BUCKET = 256  # attended positions are rounded up to this on GPU: a few graphs per generation
_SMALL = (1, 2, 4, 8, 12, 16, 24, 32, 48)


def batch_buckets(limit: int) -> list[int]:
    """Batch sizes the GPU decode compacts to: 1, 2, 4, 8, then two per octave (x, 1.5x): ≤ 33% idle rows."""
    out, b = list(_SMALL), 64
    while out[-1] < limit:
        out += [b, b * 3 // 2]
        b *= 2
    return sorted({min(x, limit) for x in out})


class DecodeRunner:
    """Owns the decode input/output buffers of one cache and the CUDA graphs captured over them."""

    def __init__(self, model: FusedDecoder, cuda_graphs: bool) -> None:
        self.model = model
        self.on_gpu = model.device.type == "cuda"
        self.use_graphs = cuda_graphs and self.on_gpu
        self.cache: KVCache | None = None
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.pool = None
        self._buckets: list[int] = []

    # -- buffers ------------------------------------------------------------------------------
    def bind(self, cache: KVCache) -> None:
        """Allocate the static buffers for `cache` (dropping graphs of any earlier cache)."""
        self.release()
        dev, slots = self.model.device, cache.slots
        self.cache = cache
        self.tokens = torch.zeros(slots, dtype=torch.long, device=dev)
        self.pos = torch.zeros(slots, dtype=torch.long, device=dev)
        self.rows = torch.arange(slots, device=dev)
        self.key_idx = torch.arange(cache.max_len, device=dev)
        vocab_cols = self.model.vocab_rows * self.model.tp.size
        self.logits = torch.empty(slots, vocab_cols, dtype=self.model.dtype, device=dev) if self.use_graphs else None
        self._buckets = batch_buckets(slots)

    def release(self) -> None:
        """Drop the graphs (and their memory pool) and the buffers; `bind` again before the next step."""
        self.graphs.clear()
        self.pool = None
        self.cache = None
        self.tokens = self.pos = self.rows = self.key_idx = self.logits = None

    # -- bucketing ----------------------------------------------------------------------------
    def batch_target(self, alive: int) -> int:
        """Rows to keep when `alive` rows still run: exact on CPU, the next bucket on GPU."""
        if not self.on_gpu:
            return alive
        return next(b for b in self._buckets if b >= alive)

    def length_for(self, need: int) -> int:
        """Positions a step attends over when the furthest row is at position need - 1."""
        if not self.on_gpu:
            return need
        return min(self.cache.max_len, -(-need // LENGTH_BUCKET) * LENGTH_BUCKET)

    # -- stepping -----------------------------------------------------------------------------
    def _forward(self, batch: int, length: int) -> torch.Tensor:
        return self.model.decode(self.tokens[:batch], self.pos[:batch], self.rows[:batch],
                                 self.key_idx[:length], self.cache)

    def step(self, batch: int, length: int) -> torch.Tensor:
        """Logits [batch, padded vocab] of the tokens in `tokens[:batch]` at positions `pos[:batch]`."""
        if self.use_graphs:
            graph = self.graphs.get((batch, length)) or self._capture(batch, length)
            if graph is not None:
                graph.replay()
                return self.logits[:batch]
        return self._forward(batch, length)

    def _capture(self, batch: int, length: int) -> torch.cuda.CUDAGraph | None:
        try:
            if self.pool is None:
                self.pool = torch.cuda.graph_pool_handle()  # shared: one graph runs at a time
            side = torch.cuda.Stream(device=self.model.device)
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # warm-up (lazy inits, cuBLAS workspaces) outside the capture
                self.logits[:batch].copy_(self._forward(batch, length))
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            # thread_local: other threads' CUDA calls (the NCCL watchdog's event queries) must not void the capture.
            with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
                self.logits[:batch].copy_(self._forward(batch, length))
        except Exception as e:  # noqa: BLE001 - any capture failure: decode eagerly, say so once
            log.warning("native engine: CUDA graph capture failed (%s: %s); decoding eagerly from now on",
                        type(e).__name__, e)
            self.use_graphs = False
            self.graphs.clear()
            self.pool = None
            try:
                torch.cuda.synchronize(self.model.device)
            except Exception:  # noqa: BLE001 - the eager path reports any real device error itself
                pass
            return None
        self.graphs[(batch, length)] = graph
        return graph
