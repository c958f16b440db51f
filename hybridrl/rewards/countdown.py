"""Countdown: combine the given numbers with + - * / to reach the target; the answer is the equation.

The response's last `<answer>...</answer>` (else its last line) must be an arithmetic expression that
uses each given number exactly once and evaluates to the target. Parsed with `ast`, never `eval`.
"""

from __future__ import annotations

import ast
import re
from collections import Counter
from fractions import Fraction

from hybridrl.rewards.base import RewardInput
from hybridrl.rewards.registry import register_reward

_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_OPS = {
    ast.Add: lambda a, b: a + b,
    ast.Sub: lambda a, b: a - b,
    ast.Mult: lambda a, b: a * b,
    ast.Div: lambda a, b: a / b,
}


def _evaluate(node: ast.AST, used: list[int]) -> Fraction:
    if isinstance(node, ast.Expression):
        return _evaluate(node.body, used)
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_evaluate(node.left, used), _evaluate(node.right, used))
    if isinstance(node, ast.Constant) and isinstance(node.value, int) and not isinstance(node.value, bool):
        used.append(node.value)
        return Fraction(node.value)
    raise ValueError("only integers, + - * / and parentheses are allowed")


def extract_equation(text: str) -> str | None:
    """The candidate equation: the last <answer> block, else the last non-empty line; `= target` dropped."""
    found = _ANSWER.findall(text)
    cand = found[-1] if found else next((s for s in reversed(text.strip().splitlines()) if s.strip()), "")
    cand = cand.split("=")[0].strip()
    return cand or None


def check_equation(equation: str, numbers: list[int], target: int) -> bool:
    """True when `equation` uses each of `numbers` exactly once and equals `target`."""
    if len(equation) > 200:  # a long expression is not an answer, and bounds the parser's work
        return False
    try:
        used: list[int] = []
        value = _evaluate(ast.parse(equation, mode="eval"), used)
    except (SyntaxError, ValueError, ZeroDivisionError, RecursionError):
        return False
    return Counter(used) == Counter(numbers) and value == target


@register_reward("countdown")
def countdown_reward(item: RewardInput) -> dict[str, float]:
    """1.0 for a correct equation; 0.1 for a well-formed answer that is wrong; 0 otherwise."""
    numbers = [int(n) for n in item.sample["numbers"]]
    target = int(item.sample["target"])
    eq = extract_equation(item.response) if isinstance(item.response, str) else None
    correct = float(eq is not None and check_equation(eq, numbers, target))
    formatted = float(bool(_ANSWER.search(item.response or "")))
    return {"score": correct if correct else 0.1 * formatted, "correct": correct, "format": formatted}
