"""vLLM's log records that say nothing true about a colocated engine fed token ids, dropped at their loggers.

- "Chat template warmup failed" with a traceback, and "Using None for EOS token id": the engine runs with
  `skip_tokenizer_init=True` (token ids in and out) and adds the model's EOS ids to every request's stop ids.
- "<Layer>: Failed to load weights" on every weight push, for layers that have nothing to load: RotaryEmbedding
  (its cos/sin cache is computed, never in a checkpoint) and, when the embeddings are tied, ParallelLMHead (the
  engine re-packs the tied head itself after a push). Any other layer's failure still shows.
- torch's FutureWarning about `torch.distributed.reduce_op`, raised inside vLLM's own code at start-up.
"""

from __future__ import annotations

import logging
import warnings

RENDERER_LOGGER = "vllm.renderers.base"
RELOAD_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"


class _DropRecords(logging.Filter):
    """Drops records whose rendered message starts with one of `prefixes`."""

    def __init__(self, prefixes: tuple[str, ...]) -> None:
        super().__init__()
        self.prefixes = prefixes

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(self.prefixes)


def _install(logger_name: str, prefixes: tuple[str, ...]) -> None:
    logger = logging.getLogger(logger_name)
    for f in logger.filters:
        if isinstance(f, _DropRecords):
            f.prefixes = tuple(sorted(set(f.prefixes) | set(prefixes)))
            return
    logger.addFilter(_DropRecords(prefixes))


def quiet_vllm_logs(tied_embeddings: bool) -> None:
    """Install the filters (idempotent; call before constructing `vllm.LLM`)."""
    _install(RENDERER_LOGGER, ("Chat template warmup failed", "Using None for EOS token id"))
    layers = ("RotaryEmbedding: Failed to load weights",)
    if tied_embeddings:
        layers += ("ParallelLMHead: Failed to load weights",)
    _install(RELOAD_LOGGER, layers)
    warnings.filterwarnings("ignore", message=r".*torch\.distributed\.reduce_op.*", category=FutureWarning)
