"""Symbolic and LaTeX equivalence through `math-verify` (the verifier TRL and open-r1 use).

The math reward reads plain numbers itself (exactly, see `math_answer`); this module handles what is not
one plain number — `\\sqrt{2}`, `\\frac{\\pi}{4}`, `2^{10}+1`, `x^2+2x+1`, intervals, sets — by parsing both
sides to SymPy and asking math-verify whether they are equal.

math-verify bounds its own time with `signal.alarm`, which works only in a process's main thread; off the
main thread (the reward deadline's threads, `rewards/deadline.py`) it runs without that bound, on inputs this module
has already capped at `MAX_CHARS`, and the call as a whole is bounded by `reward.timeout_s`.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

log = logging.getLogger(__name__)

MAX_CHARS = 1000
"""Longer answers are not handed to the symbolic parser (no real final answer is this long)."""
TIMEOUT_S = 3
"""Seconds math-verify may spend parsing or comparing one answer (main thread only)."""


def _timeout() -> int | None:
    if threading.current_thread() is threading.main_thread():
        return TIMEOUT_S
    _quiet_timeout_warning()
    return None


def _quiet_timeout_warning() -> None:
    """math-verify warns that "you must provide the logic for timeout interruption yourself" when called without its
    alarm: the reward deadline is that logic. (Its once-per-process flag is not thread-safe: set it before it races.)"""
    import math_verify.grader
    import math_verify.parser

    math_verify.grader.TIMEOUT_WARNING_SHOWN = True
    math_verify.parser.TIMEOUT_WARNING_SHOWN = True


def _configs():
    from math_verify import ExprExtractionConfig, LatexExtractionConfig

    return [LatexExtractionConfig(), ExprExtractionConfig()]


def parse_answer(answer: str) -> list[Any]:
    """One final answer (already extracted, e.g. the inside of \\boxed{}) parsed by math-verify; [] if it can't."""
    if not answer or len(answer) > MAX_CHARS:
        return []
    from math_verify import parse

    text = answer.strip()
    if not text.startswith("$"):
        text = f"${text}$"  # read it as LaTeX math, not as prose
    try:
        return parse(text, extraction_config=_configs(), parsing_timeout=_timeout())
    except Exception as e:  # noqa: BLE001 - an unparseable answer is a wrong answer, never a crash
        log.debug("math-verify could not parse %r: %s", answer[:80], e)
        return []


def parse_response(response: str) -> list[Any]:
    """math-verify's own reading of a whole response (last \\boxed{}, last LaTeX expression, ...)."""
    if not response:
        return []
    from math_verify import parse

    tail = response[-4 * MAX_CHARS :]
    if len(tail) < len(response):  # the final answer is near the end; start the cut at a word boundary
        tail = tail.split(None, 1)[-1]
    try:
        return parse(tail, extraction_config=_configs(), parsing_timeout=_timeout())
    except Exception as e:  # noqa: BLE001
        log.debug("math-verify could not parse the response: %s", e)
        return []


def symbolic_equal(gold: list[Any], pred: list[Any]) -> bool:
    """True when math-verify judges the parsed prediction equal to the parsed reference."""
    if not gold or not pred:
        return False
    from math_verify import verify

    try:
        return bool(verify(gold, pred, timeout_seconds=_timeout()))
    except Exception as e:  # noqa: BLE001
        log.debug("math-verify comparison failed: %s", e)
        return False
