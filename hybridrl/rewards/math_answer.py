"""Math-answer verifier: pull the final answer out of a response and compare it numerically.

    pred = extract_answer(response)      # "#### 72" > last \\boxed{...} > last number in the text
    truth = extract_answer(sample["answer"])   # a GSM8K solution "... #### 72", or just "72"
    reward = 1.0 if answers_match(pred, truth) else 0.0

Rules, chosen for GSM8K-style answers (document any change in the tests):
- The last `####` marker wins over everything else, even a later number or \\boxed; then the last complete
  \\boxed{...} (nested braces allowed); then the last number anywhere. The marker counts only when its line
  starts with the answer ("#### 72", "#### $72 dollars", "#### \\boxed{72}"); a line that starts with words
  (a markdown heading "#### Step 1", "#### The answer is 72") falls through to the next rule.
- Numbers may carry `$`/`\\$`/currency signs, `%` (stripped, NOT divided by 100: GSM8K writes "25" for 25%),
  unit words ("72 dollars"), thousands commas ("1,234"; "1,2" is not a number), a leading `+`, a unicode
  minus, a trailing period, LaTeX `\\text{}`/`\\!`/`\\,` and `\\frac`/`\\dfrac`/`\\tfrac`. `0.50`, `.5` and `1/2`
  are equal. Scientific notation ("1e3") is not a number here: no GSM8K answer uses it, and accepting it
  would make "2e" style typos parse.
- Values are compared exactly as fractions, within a relative tolerance of 1e-6.
"""

from __future__ import annotations

import logging
import re
from fractions import Fraction
from typing import Any

from hybridrl.errors import HybridRLError
from hybridrl.rewards.base import RewardInput
from hybridrl.rewards.registry import register_reward

log = logging.getLogger(__name__)

REL_TOL = Fraction(1, 10**6)
"""Relative tolerance of `answers_match`."""

# Unicode minus, small hyphen-minus, fullwidth hyphen-minus: all read as "-".
_MINUS_RE = re.compile("[\u2212\ufe63\uff0d]")
_SIGN = r"(?:(?<![\w.])[-+])?"  # a sign only where it cannot be a subtraction ("3-5" is not -5)
_INT = r"(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)"
_NUM = rf"{_SIGN}(?:{_INT}(?:\.\d+)?|(?<!\d)\.\d+)(?:/\d+(?:\.\d+)?)?"
_TEX_FRAC = r"-?\\[dt]?frac\s*\{[^{}]*\}\s*\{[^{}]*\}"
_NUMBER_RE = re.compile(rf"{_TEX_FRAC}|{_NUM}")
_LEAD_RE = re.compile(r"^(?:\\\$|[\s$*:])+")  # "#### **$72**": decorations before the number
_BOXED_RE = re.compile(r"\\(?:boxed|fbox)\s*")
_BRACE_RE = re.compile(r"[{}]")

_WRAPPER_RE = re.compile(
    r"\\(?:boxed|fbox|text|textbf|textit|textrm|mathrm|mathbf|mathit|mbox|operatorname)\s*\{([^{}]*)\}"
)
_FRAC_RE = re.compile(r"\\[dt]?frac\s*\{([^{}]*)\}\s*\{([^{}]*)\}")
_FRAC_SHORT_RE = re.compile(r"\\[dt]?frac\s*(\d)\s*(\d)")  # \frac12
_JUNK_RE = re.compile(r"\\[!,;: ]|~|\\\$|\\%|\^\s*\{?\\circ\}?|[$%°€£¥₹*]")
_THOUSANDS_RE = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")
_BODY = r"(\d+(?:\.\d*)?|\.\d+)"
_FINAL_RE = re.compile(rf"([+-]?)\s*{_BODY}(?:\s*/\s*([+-]?)\s*{_BODY})?")

_MAX_DIGITS = 500

_warned: set[str] = set()


def extract_answer(text: Any) -> str | None:
    """The final-answer string in `text` by the priority in the module doc, or None when there is none."""
    if text is None:
        return None
    text = _MINUS_RE.sub("-", str(text))
    return extract_marker(text) or extract_boxed(text) or _last_number(text)


def extract_marker(text: str) -> str | None:
    """The answer after the last `####`: its line when that is one number ("72 dollars"), else the number or
    \\boxed{} the line starts with ("72. Check: 70+2"); None when it starts with words ("#### Step 1")."""
    idx = text.rfind("####")
    if idx < 0:
        return None
    line = _LEAD_RE.sub("", _MINUS_RE.sub("-", text[idx + 4 :].lstrip().split("\n", 1)[0].strip()))
    if not re.match(r"[-+.(\d\\]", line):  # starts with words (or is empty): not a marker answer
        return None
    if normalize_number(line) is not None:
        return line
    if line.startswith(("\\boxed", "\\fbox")):
        return extract_boxed(line)
    m = _NUMBER_RE.match(line)
    return m.group() if m else None


def extract_boxed(text: str) -> str | None:
    """The content of the last complete, non-empty `\\boxed{...}` (balanced braces), or None."""
    starts = list(_BOXED_RE.finditer(text))
    if not starts:
        return None
    # Match every brace once (a stack over the brace positions): linear even for a response full of
    # unclosed \boxed{ — scanning from each one would be quadratic.
    closing: dict[int, int] = {}
    stack: list[int] = []
    for b in _BRACE_RE.finditer(text):
        if b.group() == "{":
            stack.append(b.start())
        elif stack:
            closing[stack.pop()] = b.start()
    for m in reversed(starts):
        start = m.end()
        if start < len(text) and text[start] != "{":
            word = re.match(r"[^\s${}]+", text[start:])  # "\boxed 5"
            if word:
                return word.group()
        elif start in closing:
            content = text[start + 1 : closing[start]].strip()
            if content:
                return content
        # unbalanced (a cut-off response) or empty: try an earlier \boxed
    return None


def _last_number(text: str) -> str | None:
    last = None
    for last in _NUMBER_RE.finditer(text):
        pass
    return last.group() if last else None


def to_fraction(s: Any) -> Fraction | None:
    """Parse one number (with the decorations the module doc lists) to an exact Fraction, else None."""
    if s is None or isinstance(s, bool):
        return None
    if isinstance(s, int):
        return Fraction(s)
    if isinstance(s, float):
        # via repr so 0.1 means 1/10, not the binary float; inf/nan are not answers
        return Fraction(repr(s)) if s == s and abs(s) != float("inf") else None
    s = _MINUS_RE.sub("-", str(s)).replace("{,}", ",")  # LaTeX thousands: 1{,}234
    for _ in range(5):  # unwrap nested \text{\textbf{..}} / \boxed{\frac{..}{..}} inside out
        s2 = _FRAC_RE.sub(r"\1/\2", _WRAPPER_RE.sub(r" \1 ", s))
        if s2 == s:
            break
        s = s2
    s = _FRAC_SHORT_RE.sub(r"\1/\2", s)
    s = _JUNK_RE.sub("", s)
    s = re.sub(r"\\[A-Za-z]+", " ", s)  # other LaTeX commands: \left, \approx, \quad
    s = s.rsplit("=", 1)[-1]  # "x = 5"
    s = _THOUSANDS_RE.sub("", s)
    s = re.sub(r"[A-Za-z_]+", " ", s)  # unit words: "72 dollars", "5 km"
    s = s.replace("{", " ").replace("}", " ")
    s = re.sub(r"^(?:[\s,;:!?]|\.(?!\d))+", "", s).rstrip(" \t\r\n.,;:!?")
    while len(s) > 1 and s[0] + s[-1] in ("()", "[]"):
        s = s[1:-1].strip()
    m = _FINAL_RE.fullmatch(s)
    if m is None:
        return None
    sign, num, dsign, den = m.groups()
    if len(num) + len(den or "") > _MAX_DIGITS:  # no answer is this long; int() would refuse >4300 digits
        return None
    value = Fraction(num)
    if den is not None:
        d = Fraction(den)
        if d == 0:
            return None
        value /= d
        if dsign == "-":
            value = -value
    return -value if sign == "-" else value


def normalize_number(s: Any) -> str | None:
    """Canonical text of one number ("72", "-0.5", "1/3"), or None when `s` is not exactly one number."""
    value = to_fraction(s)
    if value is None:
        return None
    if value.denominator == 1:
        return str(value.numerator)
    d, twos, fives = value.denominator, 0, 0
    while d % 2 == 0:
        d, twos = d // 2, twos + 1
    while d % 5 == 0:
        d, fives = d // 5, fives + 1
    if d != 1:
        return f"{value.numerator}/{value.denominator}"  # not a terminating decimal
    places = max(twos, fives)
    digits = str(abs(value.numerator) * 10**places // value.denominator).rjust(places + 1, "0")
    return ("-" if value < 0 else "") + digits[:-places] + "." + digits[-places:]


def answers_match(pred: Any, truth: Any) -> bool:
    """True when both parse as numbers equal within REL_TOL (relative; exact for zero)."""
    a, b = to_fraction(pred), to_fraction(truth)
    if a is None or b is None:
        return False
    return abs(a - b) <= REL_TOL * max(abs(a), abs(b))


def ground_truth(sample: dict[str, Any]) -> Any:
    """The reference answer of a dataset row: `answer`, else `ground_truth` (a GSM8K solution string is fine)."""
    for key in ("answer", "ground_truth"):
        if key in sample and sample[key] is not None:
            value = sample[key]
            return value if isinstance(value, (int, float)) and not isinstance(value, bool) else extract_answer(value)
    raise HybridRLError(
        f"the math reward needs each data row to have an 'answer' or 'ground_truth' field; this row has "
        f"{sorted(sample)}. Convert the data (e.g. tools/convert_gsm8k.py) or pick another reward.name"
    )


@register_reward("math")
def math_reward(item: RewardInput) -> float:
    """1.0 when the response's final answer equals the row's reference answer numerically, else 0.0."""
    truth = ground_truth(item.sample)  # a missing field is a data error: raise, don't score 0 forever
    try:
        if to_fraction(truth) is None:
            _warn_once("truth", f"math reward: reference answer {truth!r} is not a number; such rows score 0")
            return 0.0
        return 1.0 if answers_match(extract_answer(item.response), truth) else 0.0
    except Exception as e:  # weird text must cost a sample its reward, never the run
        _warn_once("error", f"math reward: scoring failed ({type(e).__name__}: {e}); such samples score 0")
        return 0.0


def _warn_once(key: str, msg: str) -> None:
    if key not in _warned:
        _warned.add(key)
        log.warning(msg)
