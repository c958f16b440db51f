"""The math reward judged from a grader's side.

Every row is (response, reference answer, verdict) written by asking "would a careful human grader accept
this final answer for this reference?" — not by running the verifier. Two rules follow from that: no answer
whose value differs from the reference is accepted, and no equal answer written in a common notation is
rejected. The classes that were wrong before are first: large integers one apart (a relative tolerance made
them equal), scientific notation and space-grouped thousands (read as their leading digits).
"""

from __future__ import annotations

import threading

import pytest

from hybridrl.rewards import RewardInput, math_reward

THIN, NNBSP, NBSP = "\u2009", "\u202f", "\u00a0"

LARGE_INTEGERS = [
    ("#### 1000001", "1000000", 0.0),
    ("The total is 1000000.", "1000001", 0.0),
    ("#### 123456789", "123456788", 0.0),
    ("\\boxed{98765432101}", "98765432100", 0.0),
    ("12345678901234567890", "12345678901234567891", 0.0),
    ("#### 1,000,001", "1000000", 0.0),
    ("The answer is 2000000.5", "2000000", 0.0),
    ("#### 1000001", 1000000, 0.0),  # a numeric reference
    ("#### 1000000", "1000000", 1.0),
    ("#### 1000000.0", "1000000", 1.0),
    ("#### 12345678901234567890", "12345678901234567890", 1.0),
]

SCIENTIFIC = [
    ("#### 1.5e6", "1500000", 1.0),
    ("#### 1.5e6", "1.5", 0.0),  # not its leading digits
    ("#### 1.5e6", "6", 0.0),  # nor its exponent
    ("#### 1.5e6", "1500001", 0.0),
    ("#### 1e3", "1000", 1.0),
    ("It travels at 3E+08 m/s.", "300000000", 1.0),
    ("The answer is 1.5 \\times 10^{6}", "1500000", 1.0),
    ("The answer is 1.5 \\times 10^{6}", "1.5", 0.0),
    ("\\boxed{1.5 \\times 10^6}", "1500000", 1.0),
    ("\\boxed{1.5 \\times 10^6}", "10", 0.0),
    ("It is 2.5 × 10^-3 m.", "0.0025", 1.0),
    ("\\boxed{6.02 \\cdot 10^{23}}", "602000000000000000000000", 1.0),
    ("\\boxed{10^6}", "1000000", 1.0),
    ("\\boxed{2^{10}}", "1024", 1.0),
    ("\\boxed{2^{10}}", "1025", 0.0),
]

SPACE_GROUPED = [
    ("#### 1 000 000", "1000000", 1.0),
    ("#### 1 000 000", "1", 0.0),
    ("#### 1 000 000", "0", 0.0),
    (f"The population is 1{THIN}000{THIN}000.", "1000000", 1.0),
    (f"The population is 1{THIN}000{THIN}000.", "1", 0.0),
    (f"The population is 1{NNBSP}000{NNBSP}000.", "1000000", 1.0),
    (f"#### 1{NBSP}234{NBSP}567", "1234567", 1.0),
    (f"#### 1{THIN}000{THIN}001", "1000000", 0.0),
    ("\\boxed{1\\,000\\,000}", "1000000", 1.0),
    ("The answer is $1\\,000\\,000$.", "1000000", 1.0),
    ("#### 12 345.5", "12345.5", 1.0),
]

FRACTIONS_AND_DECIMALS = [
    ("#### 3/4", "0.75", 1.0),
    ("#### 0.75", "3/4", 1.0),
    ("#### 0.7", "3/4", 0.0),
    ("#### 2/4", "1/2", 1.0),
    ("#### 0.666667", "2/3", 1.0),  # 2/3 to six places
    ("#### 0.6667", "2/3", 0.0),  # too coarse to be the exact answer
    ("#### 0.33", "1/3", 0.0),
    ("#### 1/3", "0.33", 0.0),
    ("\\boxed{\\frac{2}{3}}", "\\frac{4}{6}", 1.0),
    ("\\boxed{\\frac{1}{2}}", "0.5", 1.0),
    ("\\boxed{\\frac{1}{2}}", "0.51", 0.0),
    ("\\boxed{\\frac12}", "0.5", 1.0),
    ("\\boxed{\\dfrac{3}{8}}", "0.375", 1.0),
    ("\\boxed{\\tfrac{3}{8}}", "0.38", 0.0),
    ("\\boxed{-\\frac{3}{4}}", "-0.75", 1.0),
    ("\\boxed{-\\frac{3}{4}}", "0.75", 0.0),
    ("\\boxed{\\frac{-3}{4}}", "-0.75", 1.0),
    ("\\boxed{1\\frac{1}{2}}", "1.5", 1.0),  # a mixed number
    ("\\boxed{1\\frac{1}{2}}", "0.5", 0.0),
    ("She used 1 1/2 cups of flour.", "1.5", 1.0),
    ("She used 1 1/2 cups of flour.", "0.5", 0.0),
]

PERCENTAGES = [
    ("The discount is 25%.", "25", 1.0),  # GSM8K writes the number of percent
    ("The discount is 25%.", "0.25", 1.0),  # or the fraction
    ("#### 25\\%", "25", 1.0),
    ("#### 0.25", "25%", 1.0),
    ("#### 25%", "2.5", 0.0),
    ("#### 25%", "0.025", 0.0),
    ("#### 30%", "25", 0.0),
    ("The rate is 12.5 percent.", "12.5", 1.0),
]

NEGATIVE = [
    ("The temperature is -5 degrees.", "-5", 1.0),
    ("The temperature is -5 degrees.", "5", 0.0),
    ("The temperature is 5 degrees.", "-5", 0.0),
    ("#### \u22125", "-5", 1.0),
    ("\\boxed{-12}", "-12", 1.0),
    ("#### (-3)", "-3", 1.0),
    ("#### -0.5", "-1/2", 1.0),
    ("10 - 3 = 7", "-3", 0.0),
]

UNITS_AND_COMMAS = [
    ("#### 72 dollars", "72", 1.0),
    ("It weighs 5 kg.", "5", 1.0),
    ("The area is 10 m^2.", "10", 1.0),
    ("The area is 10 m^2.", "2", 0.0),
    ("The angle is 90^\\circ", "90", 1.0),
    ("\\boxed{5\\text{ cm}}", "5", 1.0),
    ("\\boxed{5 \\mathrm{cm}^2}", "5", 1.0),
    ("The speed is 60 km/h.", "60", 1.0),
    ("It costs $\\$18.50$.", "18.5", 1.0),
    ("Total: 1,000,000", "1000000", 1.0),
    ("#### 1,234.50", "1234.5", 1.0),
    ("#### 1,234", "1.234", 0.0),  # a thousands comma, not a decimal comma
    ("\\boxed{1{,}234}", "1234", 1.0),
]

ENDINGS_AND_SEVERAL_NUMBERS = [
    ("#### 72.", "72", 1.0),
    ("The answer is 0.5.", "0.5", 1.0),
    ("The answer is 72.", "72", 1.0),
    ("It is 3.", "3.5", 0.0),
    ("3 + 4 = 7", "7", 1.0),
    ("3 + 4 = 7", "4", 0.0),
    ("She had 12 apples and ate 5, so 7 remain.", "7", 1.0),
    ("She had 12 apples and ate 5, so 7 remain.", "12", 0.0),
    ("#### 72\nCheck: 72 + 5 = 77", "72", 1.0),
    ("#### 72\nCheck: 72 + 5 = 77", "77", 0.0),
    ("\\boxed{72} and then 5 more", "72", 1.0),
    ("\\boxed{72} and then 5 more", "5", 0.0),
]

NO_ANSWER = [
    ("I don't know.", "72", 0.0),
    ("", "0", 0.0),
    ("\\boxed{}", "0", 0.0),
    ("#### ", "0", 0.0),
    ("The answer is \\boxed{", "0", 0.0),
]

SYMBOLIC = [
    ("\\boxed{\\sqrt{2}}", "\\sqrt{2}", 1.0),
    ("\\boxed{\\sqrt{2}}", "2", 0.0),
    ("\\boxed{\\sqrt{2}}", "1.414", 0.0),
    ("\\boxed{2\\sqrt{2}}", "\\sqrt{8}", 1.0),
    ("\\boxed{\\frac{\\sqrt{3}}{2}}", "\\frac{\\sqrt3}{2}", 1.0),
    ("\\boxed{\\frac{\\sqrt{3}}{2}}", "\\frac{\\sqrt{2}}{2}", 0.0),
    ("\\boxed{\\pi/2}", "\\frac{\\pi}{2}", 1.0),
    ("\\boxed{10^{6}+1}", "1000000", 0.0),
    ("\\boxed{10^{6}+1}", "1000001", 1.0),
    ("\\boxed{(x+1)^2}", "x^2+2x+1", 1.0),
    ("\\boxed{(x+1)^2}", "x^2+1", 0.0),
    ("So the answer is $\\frac{\\pi}{4}$.", "\\frac{\\pi}{4}", 1.0),
]

CASES = (
    LARGE_INTEGERS
    + SCIENTIFIC
    + SPACE_GROUPED
    + FRACTIONS_AND_DECIMALS
    + PERCENTAGES
    + NEGATIVE
    + UNITS_AND_COMMAS
    + ENDINGS_AND_SEVERAL_NUMBERS
    + NO_ANSWER
    + SYMBOLIC
)


def grade(response: str, answer: object) -> float:
    return math_reward(RewardInput(prompt="Q", response=response, sample={"answer": answer}, finish_reason="stop"))


@pytest.mark.parametrize("response,answer,expected", CASES)
def test_grader_verdict(response: str, answer: object, expected: float) -> None:
    assert grade(response, answer) == expected


def test_symbolic_answers_are_graded_off_the_main_thread() -> None:
    # math-verify's own time limit uses signal.alarm, which only the main thread may set.
    out: list[float] = []
    t = threading.Thread(
        target=lambda: out.extend([grade("\\boxed{2\\sqrt{2}}", "\\sqrt{8}"), grade("\\boxed{3}", "\\sqrt{8}")])
    )
    t.start()
    t.join()
    assert out == [1.0, 0.0]
