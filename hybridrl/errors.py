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


class HybridRLError(Exception):
    """An error caused by the user's input (config, files, data); its message says what to change."""


class ConfigError(HybridRLError):
    """A config value is invalid; the message names the full key (e.g. `trainer.lr`)."""


class CheckpointError(HybridRLError):
    """A checkpoint is incomplete, corrupt or unsafe to load; the message names the checkpoint and the file."""


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
