"""Math-answer verifier: pull the final answer out of a response and compare it with the reference.

    pred = extract_answer(response)            # "#### 72" > last \\boxed{...} > last number in the text
    truth = ground_truth(sample)               # a GSM8K solution "... #### 72", "72", or "\\frac{\\sqrt{3}}{2}"
    reward = 1.0 if answers_match(pred, truth) else 0.0

Rules, chosen from a grader's side (tests/unit/rewards/test_math_verify.py holds the cases):
- The last `####` marker wins over everything else, even a later number or \\boxed; then the last complete
  \\boxed{...} (nested braces allowed); then the last number anywhere. The marker counts only when its line
  starts with the answer ("#### 72", "#### $72 dollars", "#### \\boxed{72}"); a line that starts with words
  (a markdown heading "#### Step 1", "#### The answer is 72") falls through to the next rule.
- A number may carry `$`/`\\$`/currency signs, unit words ("72 dollars", "10 m^2"), a leading `+`, a unicode
  minus, a trailing period, LaTeX `\\text{}`/`\\!`/`\\,`; thousands grouped by commas, spaces, thin or no-break
  spaces or `\\,` ("1,234", "1 000 000", "1\\u2009000"; one separator per number, groups of exactly three);
  `\\frac`/`\\dfrac`/`\\tfrac` and `a/b`; mixed numbers ("1 1/2", "1\\frac{1}{2}"); scientific notation
  ("1.5e6", "1.5 \\times 10^{6}", "10^6").
- `%`: "25%" equals both 25 (GSM8K writes "25" for 25%) and 0.25.
- Two plain numbers are compared exactly when both are terminating decimals (integers included): 1000000
  and 1000001 differ. When either is not ("1/3"), a decimal matches it when it agrees to 6 decimal places
  and within a relative 1e-6 ("0.3333333" == 1/3; "0.333" != 1/3).
- Anything else (`\\sqrt{2}`, `\\pi/4`, `2^{10}+1`, intervals, expressions) is compared symbolically by
  math-verify (`math_symbolic`).
"""

from __future__ import annotations

import logging
import re
from fractions import Fraction
from typing import Any

from hybridrl.errors import HybridRLError
from hybridrl.rewards import math_symbolic
from hybridrl.rewards.base import RewardInput
from hybridrl.rewards.registry import register_reward

log = logging.getLogger(__name__)

REL_TOL = Fraction(1, 10**6)
"""Relative tolerance when one side is not a terminating decimal (1/3); none between terminating decimals."""
DECIMAL_PLACES = 6
"""Such a pair must also agree when rounded to this many decimal places."""

# Unicode minus, small hyphen-minus, fullwidth hyphen-minus: all read as "-".
_MINUS_RE = re.compile("[\u2212\ufe63\uff0d]")
_A = re.ASCII
_SIGN = r"(?:(?<![\w.])[-+])?"  # a sign only where it cannot be a subtraction ("3-5" is not -5)
# Thousands separators: comma, LaTeX {,} \, \; \: \! \  ~, space, no-break, thin, narrow no-break space.
_SEP = r"(?:,|\{,\}|\\[,;:! ]|~|[ \u00a0\u2009\u202f])"
_NOT_AFTER_GROUP = r"(?<![\d.])(?<!\d[, \u00a0\u2009\u202f~])(?<!\d\\[,;:! ])(?<!\d\{,\})"  # start of a number
_GROUPED = rf"{_NOT_AFTER_GROUP}\d{{1,3}}(?P<sep>{_SEP})\d{{3}}(?:(?P=sep)\d{{3}})*(?![\d])(?!{_SEP}?\d)"
_INT = rf"(?:{_GROUPED}|\d+)"
_EXP = r"(?:\{\s*[-+]?\d+\s*\}|[-+]?\d+)"
_SCI = rf"(?:[eE][-+]?\d+(?![A-Za-z])|\s*(?:\\times|\\cdot|[×⋅·*])\s*10\s*\^\s*{_EXP}|\s*\^\s*{_EXP})"
_NUM = rf"{_SIGN}(?:{_INT}(?:\.\d+)?|(?<!\d)\.\d+){_SCI}?(?:/\d+(?:\.\d+)?)?(?:\s*\\?%)?"
_MIXED = rf"{_SIGN}(?<![\d.])\d+(?: \d+/\d+|\s*\\[dt]?frac\s*\{{\s*\d+\s*\}}\s*\{{\s*\d+\s*\}})(?![\d/])"
_TEX_FRAC = r"-?\\[dt]?frac\s*\{[^{}]*\}\s*\{[^{}]*\}"
_NUMBER_RE = re.compile(rf"{_MIXED}|{_TEX_FRAC}|{_NUM}", _A)
_UNIT_POWER_RE = re.compile(r"(?<=[A-Za-z])\s*\^\s*\{?\s*\d\s*\}?|[²³]")  # "m^2": a unit's power, not a number
_LEAD_RE = re.compile(r"^(?:\\\$|[\s$*:])+")  # "#### **$72**": decorations before the number
_BOXED_RE = re.compile(r"\\(?:boxed|fbox)\s*")
_BRACE_RE = re.compile(r"[{}]")

_WRAPPER_RE = re.compile(
    r"\\(?:boxed|fbox|text|textbf|textit|textrm|mathrm|mathbf|mathit|mbox|operatorname)\s*\{([^{}]*)\}"
)
_FRAC_RE = re.compile(r"\\[dt]?frac\s*\{([^{}]*)\}\s*\{([^{}]*)\}")
_FRAC_SHORT_RE = re.compile(r"\\[dt]?frac\s*(\d)\s*(\d)", _A)  # \frac12
_PERCENT_RE = re.compile(r"\\?%|\bpercent\b|\\text\{\s*percent\s*\}")
_JUNK_RE = re.compile(r"\\[!;: ]|~|\\\$|\^\s*\{?\\circ\}?|[$°€£¥₹*]")
_LAYOUT_TEX_RE = re.compile(
    r"\\(?:left|right|[bB]igg?[lr]?|quad|qquad|approx|displaystyle|textstyle|ldots|cdots|dots|mathrm|mathbf)(?![A-Za-z])"
)
_SCI_TIMES_RE = re.compile(r"\s*(?:\\times|\\cdot|[×⋅·*])\s*10\s*\^\s*")
_E_NOTATION_RE = re.compile(r"(?<=\d)[eE](?=[-+]?\d)", _A)
_GROUPED_RE = re.compile(_GROUPED, _A)
_SEP_RE = re.compile(_SEP)
_BODY = r"(\d+(?:\.\d*)?|\.\d+)"
_POW = r"(?:\s*(#|\^)\s*([-+]?\d+))?"  # "#": times ten to the power (scientific); "^": power of the base
_FINAL_RE = re.compile(rf"([-+]?)\s*(?:(\d+)\s+(?=\d+\s*/))?{_BODY}{_POW}(?:\s*/\s*([-+]?)\s*{_BODY}{_POW})?", _A)

_MAX_DIGITS = 500
_MAX_EXPONENT = 400

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
    m = _NUMBER_RE.match(_UNIT_POWER_RE.sub("", line))
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
    for last in _NUMBER_RE.finditer(_UNIT_POWER_RE.sub("", text)):
        pass
    return last.group() if last else None


def parse_number(s: Any) -> tuple[Fraction, bool] | None:
    """One number (with the decorations the module doc lists) as (exact value, written with %), else None."""
    if s is None or isinstance(s, bool):
        return None
    if isinstance(s, int):
        return Fraction(s), False
    if isinstance(s, float):
        # via repr so 0.1 means 1/10, not the binary float; inf/nan are not answers
        return (Fraction(repr(s)), False) if s == s and abs(s) != float("inf") else None
    s = _MINUS_RE.sub("-", str(s))
    if len(s) > 4 * _MAX_DIGITS:
        return None
    s = s.replace("{,}", ",")  # LaTeX thousands: 1{,}234
    for _ in range(5):  # unwrap nested \text{\textbf{..}} / \boxed{\frac{..}{..}} inside out
        s2 = _FRAC_RE.sub(r" \1/\2 ", _WRAPPER_RE.sub(r" \1 ", s))
        if s2 == s:
            break
        s = s2
    s = _FRAC_SHORT_RE.sub(r" \1/\2 ", s)
    percent = bool(_PERCENT_RE.search(s))
    s = _PERCENT_RE.sub(" ", s)
    s = _GROUPED_RE.sub(lambda m: _SEP_RE.sub("", m.group()), s)  # before "\," and spaces lose their meaning
    s = _SCI_TIMES_RE.sub("#", s)  # 1.5 \times 10^{6} -> 1.5#{6}
    s = _E_NOTATION_RE.sub("#", s)  # 1.5e6 -> 1.5#6
    s = _JUNK_RE.sub("", s).replace("\\,", "")
    s = _UNIT_POWER_RE.sub("", s)
    s = _LAYOUT_TEX_RE.sub(" ", s)  # \left, \approx, \quad: layout, not value
    if "\\" in s:  # any other command (\sqrt, \pi, \log) makes it an expression, not one plain number
        return None
    s = s.rsplit("=", 1)[-1]  # "x = 5"
    s = re.sub(r"[A-Za-z_]+", " ", s)  # unit words: "72 dollars", "5 km"
    s = s.replace("{", " ").replace("}", " ")
    s = re.sub(r"^(?:[\s,;:!?]|\.(?!\d))+", "", s).rstrip(" \t\r\n.,;:!?")
    while len(s) > 1 and s[0] + s[-1] in ("()", "[]"):
        s = s[1:-1].strip()
    m = _FINAL_RE.fullmatch(s)
    if m is None:
        return None
    sign, whole, num, nop, nexp, dsign, den, dop, dexp = m.groups()
    if sum(len(x or "") for x in (whole, num, nexp, den, dexp)) > _MAX_DIGITS:
        return None  # no answer is this long; int() would refuse >4300 digits
    value = _power(Fraction(num), nop, nexp)
    if value is None:
        return None
    if den is not None:
        d = _power(Fraction(den), dop, dexp)
        if d is None or d == 0:
            return None
        value /= d
        if dsign == "-":
            value = -value
    if whole is not None:  # a mixed number: a whole part and a proper fraction
        if den is None or not (0 <= value < 1) or "." in num + den or nop or dop:
            return None
        value += int(whole)
    return (-value if sign == "-" else value), percent


def _power(base: Fraction, op: str | None, exponent: str | None) -> Fraction | None:
    if op is None:
        return base
    e = int(exponent)
    if abs(e) > _MAX_EXPONENT:
        return None
    if op == "#":
        return base * Fraction(10) ** e
    if base == 0 and e < 0:
        return None
    if len(str(base.numerator)) * abs(e) > 4 * _MAX_DIGITS:
        return None
    return base**e


def to_fraction(s: Any) -> Fraction | None:
    """Parse one number to an exact Fraction (a % sign is dropped: "25%" -> 25), else None."""
    parsed = parse_number(s)
    return None if parsed is None else parsed[0]


def normalize_number(s: Any) -> str | None:
    """Canonical text of one number ("72", "-0.5", "1/3"), or None when `s` is not exactly one number."""
    value = to_fraction(s)
    if value is None:
        return None
    if value.denominator == 1:
        return str(value.numerator)
    if not _terminates(value):
        return f"{value.numerator}/{value.denominator}"
    places = _decimal_places(value)
    digits = str(abs(value.numerator) * 10**places // value.denominator).rjust(places + 1, "0")
    return ("-" if value < 0 else "") + digits[:-places] + "." + digits[-places:]


def _terminates(x: Fraction) -> bool:
    """True when x has a finite decimal expansion (its reduced denominator has no prime but 2 and 5)."""
    d = x.denominator
    for p in (2, 5):
        while d % p == 0:
            d //= p
    return d == 1


def _decimal_places(x: Fraction) -> int:
    d, twos, fives = x.denominator, 0, 0
    while d % 2 == 0:
        d, twos = d // 2, twos + 1
    while d % 5 == 0:
        d, fives = d // 5, fives + 1
    return max(twos, fives)


def numbers_equal(a: Fraction, b: Fraction) -> bool:
    """Exact between terminating decimals; otherwise equal to DECIMAL_PLACES and within REL_TOL."""
    if a == b:
        return True
    if _terminates(a) and _terminates(b):
        return False
    return round(a, DECIMAL_PLACES) == round(b, DECIMAL_PLACES) and abs(a - b) <= REL_TOL * max(abs(a), abs(b))


def _plain_numbers_match(a: tuple[Fraction, bool], b: tuple[Fraction, bool]) -> bool:
    (x, x_pct), (y, y_pct) = a, b
    xs = [x, x / 100] if x_pct and not y_pct else [x]  # "25%" is 25 (GSM8K's way) or 0.25
    ys = [y, y / 100] if y_pct and not x_pct else [y]
    return any(numbers_equal(p, q) for p in xs for q in ys)


def answers_match(pred: Any, truth: Any) -> bool:
    """True when the extracted answer `pred` equals the reference `truth` by the module doc's rules."""
    if pred is None or truth is None or (isinstance(pred, str) and not pred.strip()):
        return False
    a, b = parse_number(pred), parse_number(truth)
    if a is not None and b is not None:
        return _plain_numbers_match(a, b)
    return math_symbolic.symbolic_equal(math_symbolic.parse_answer(str(truth)), math_symbolic.parse_answer(str(pred)))


_WORD_RE = re.compile(r"(?<!\\)\b[A-Za-z]{3,}\b")


def is_expression(text: str) -> bool:
    """True when `text` reads as one math expression (`\\frac{\\sqrt{3}}{2}`, `x^2+1`, `(1, 2)`) rather than
    prose with a number in it ("The answer is 72"): no words of three letters or more outside LaTeX commands."""
    return not _WORD_RE.search(re.sub(r"\\[A-Za-z]+", " ", text)) and bool(text.strip())


def ground_truth(sample: dict[str, Any]) -> Any:
    """The reference answer of a dataset row: `answer`, else `ground_truth` (a GSM8K solution string is fine).

    A number stays as given; a string's final answer is its `####` / \\boxed{} answer, else the whole string
    when it is one number or one expression, else its last number."""
    for key in ("answer", "ground_truth"):
        if key in sample and sample[key] is not None:
            value = sample[key]
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                return value
            text = _MINUS_RE.sub("-", str(value)).strip()
            marked = extract_marker(text) or extract_boxed(text)
            if marked is not None:
                return marked
            if parse_number(text) is not None or is_expression(text):
                return text
            return _last_number(text)
    raise HybridRLError(
        f"the math reward needs each data row to have an 'answer' or 'ground_truth' field; this row has "
        f"{sorted(sample)}. Convert the data (e.g. scripts/convert_gsm8k.py) or pick another reward.name"
    )


@register_reward("math")
def math_reward(item: RewardInput) -> float:
    """1.0 when the response's final answer equals the row's reference answer, else 0.0."""
    truth = ground_truth(item.sample)  # a missing field is a data error: raise, don't score 0 forever
    try:
        if truth is None or (parse_number(truth) is None and not math_symbolic.parse_answer(str(truth))):
            _warn_once(
                "truth", f"math reward: reference answer {truth!r} is not a number or expression; such rows score 0"
            )
            return 0.0
        response = _MINUS_RE.sub("-", str(item.response))
        if parse_number(truth) is None:  # an expression: compare symbolically, reading the response as math-verify does
            marked = extract_marker(response) or extract_boxed(response)
            pred = math_symbolic.parse_answer(marked) if marked else math_symbolic.parse_response(response)
            return 1.0 if math_symbolic.symbolic_equal(math_symbolic.parse_answer(str(truth)), pred) else 0.0
        return 1.0 if answers_match(extract_answer(response), truth) else 0.0
    except Exception as e:  # weird text must cost a sample its reward, never the run
        _warn_once("error", f"math reward: scoring failed ({type(e).__name__}: {e}); such samples score 0")
        return 0.0


def _warn_once(key: str, msg: str) -> None:
    if key not in _warned:
        _warned.add(key)
        log.warning(msg)
