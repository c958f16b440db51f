"""User-facing errors: the app prints these as one short line (no traceback) and exits non-zero.

Unexpected exceptions (bugs, crashes of a library) are printed as one line too, naming the phase they
escaped from; `in_phase` is how the code that knows the phase tells the app::

    with in_phase("generate"):
        group.generate(...)        # an exception escaping here carries .hybridrl_phase = "generate"
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

PHASE_ATTR = "hybridrl_phase"
STEP_ATTR = "hybridrl_step"


class HybridRLError(Exception):
    """An error caused by the user's input (config, files, data); its message says what to change."""


class ConfigError(HybridRLError):
    """A config value is invalid; the message names the full key (e.g. `trainer.lr`)."""


class CheckpointError(HybridRLError):
    """A checkpoint is incomplete, corrupt or unsafe to load; the message names the checkpoint and the file."""


class DivergenceError(HybridRLError):
    """Training produced weights or logits that are no longer a usable policy (a step past the divergence guard's
    bounds, non-finite logits); the run stops before such a step reaches a checkpoint."""


class Terminated(KeyboardInterrupt):
    """SIGTERM (a scheduler's or `kill`'s stop), raised in the main thread where Ctrl-C raises KeyboardInterrupt, so
    both take the same path: workers stopped, temporary files removed, one line. Exit code 143 (128 + 15)."""


@contextmanager
def in_phase(name: str) -> Iterator[None]:
    """Tag an exception escaping the block with the phase `name` (the innermost phase wins)."""
    try:
        yield
    except BaseException as e:
        if getattr(e, PHASE_ATTR, None) is None:
            try:
                setattr(e, PHASE_ATTR, name)
            except AttributeError:  # a few built-in exception objects take no attributes
                pass
        raise


def phase_of(e: BaseException) -> str | None:
    """The phase `in_phase` recorded on `e`, if any."""
    return getattr(e, PHASE_ATTR, None)


@contextmanager
def at_step(step: int) -> Iterator[None]:
    """Tag an exception escaping the block with the training step it happened in (the app's error line names it)."""
    try:
        yield
    except BaseException as e:
        if getattr(e, STEP_ATTR, None) is None:
            try:
                setattr(e, STEP_ATTR, step)
            except AttributeError:
                pass
        raise


def step_of(e: BaseException) -> int | None:
    """The training step `at_step` recorded on `e`, if any."""
    return getattr(e, STEP_ATTR, None)
