"""Loading and saving models without transformers' per-call progress bars ("Loading weights", "Writing model
shards"): a run loads the policy several times (trainer, reference, engine) and the bars, drawn over the log lines,
said nothing the log does not."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def no_progress_bars() -> Iterator[None]:
    """transformers' progress bars off inside the block (restored after, so a caller's own setting stands)."""
    from transformers.utils import logging as hf_logging

    was_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_on:
            hf_logging.enable_progress_bar()
