"""`calculator`: arithmetic on numbers, evaluated by walking a whitelisted `ast`, never `eval`.

Allowed: int and float literals, + - * / // % ** and unary + -, parentheses. Everything else (names, calls,
attributes, subscripts, comparisons, strings, bit operations) is rejected before anything is computed. Sizes are
bounded so no expression can stall a worker: the text length, the number of nodes, the exponent, and the size in
bits of every intermediate integer (checked before a power or product is computed, from its operands' sizes).
"""

from __future__ import annotations

import ast
import math
import operator
from typing import Any

from hybridrl.agent.tools.base import Tool, ToolError

MAX_EXPRESSION_CHARS = 500
MAX_NODES = 200
MAX_EXPONENT = 10_000
MAX_INT_BITS = 4096  # ~1233 decimal digits

_BINOPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


def _bits(x: int | float) -> int:
    return abs(x).bit_length() if isinstance(x, int) else 0


def _check_size(x: int | float) -> int | float:
    if isinstance(x, int) and x.bit_length() > MAX_INT_BITS:
        raise ToolError(f"result too large (more than {MAX_INT_BITS} bits)")
    if isinstance(x, float) and not math.isfinite(x):
        raise ToolError("result is not a finite number")
    return x


def _binop(op: ast.operator, a: int | float, b: int | float) -> int | float:
    if isinstance(op, ast.Pow):
        if abs(b) > MAX_EXPONENT:
            raise ToolError(f"exponent {b} is too large (limit {MAX_EXPONENT})")
        # (bits - 1) * b is a lower bound on the result's size: reject only what is surely too large, before
        # computing it; what slips through is at most twice the limit and is caught by _check_size.
        if isinstance(a, int) and isinstance(b, int) and b > 0 and (_bits(a) - 1) * b > MAX_INT_BITS:
            raise ToolError(f"result too large (more than {MAX_INT_BITS} bits)")
        if a == 0 and b < 0:
            raise ToolError("zero cannot be raised to a negative power")
    if isinstance(op, ast.Mult) and _bits(a) + _bits(b) > MAX_INT_BITS + 1:
        raise ToolError(f"result too large (more than {MAX_INT_BITS} bits)")
    try:
        result = _BINOPS[type(op)](a, b)
    except ZeroDivisionError:
        raise ToolError("division by zero") from None
    except OverflowError:
        raise ToolError("result too large for a float") from None
    if isinstance(result, complex):
        raise ToolError("result is not a real number (a negative number to a fractional power)")
    return _check_size(result)


def _eval(node: ast.AST) -> int | float:
    if isinstance(node, ast.Expression):
        return _eval(node.body)
    if isinstance(node, ast.Constant):
        if isinstance(node.value, bool) or not isinstance(node.value, (int, float)):
            raise ToolError(f"only numbers are allowed, got {node.value!r}")
        return _check_size(node.value)
    if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
        return _binop(node.op, _eval(node.left), _eval(node.right))
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitXor):
        raise ToolError("^ is not a power here; write a**b")
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand))
    what = f"{type(node).__name__} is"
    if isinstance(node, ast.Name):
        what = f"the name {node.id!r} is"
    elif isinstance(node, ast.Attribute):
        what = "attribute access is"
    elif isinstance(node, ast.Call):
        what = "function calls are"
    raise ToolError(f"{what} not allowed; use numbers, + - * / // % ** and parentheses")


def evaluate(expression: str) -> int | float:
    """The value of an arithmetic expression; raises ToolError for anything outside the whitelist or bounds."""
    text = expression.strip()
    if not text:
        raise ToolError("empty expression")
    if len(text) > MAX_EXPRESSION_CHARS:
        raise ToolError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(text, mode="eval")
    except (SyntaxError, ValueError) as e:
        raise ToolError(f"not an arithmetic expression ({getattr(e, 'msg', e)})") from None
    except (RecursionError, MemoryError):
        raise ToolError("expression nested too deeply") from None
    if sum(1 for _ in ast.walk(tree)) > MAX_NODES:
        raise ToolError(f"expression has more than {MAX_NODES} parts")
    try:
        return _eval(tree)
    except RecursionError:
        raise ToolError("expression nested too deeply") from None


def format_number(x: int | float) -> str:
    """Integers exactly; floats by repr, integral ones without a trailing .0 (so 6/3 reads 2)."""
    if isinstance(x, float) and x.is_integer() and abs(x) < 2**53:
        return str(int(x))
    return repr(x)


class Calculator(Tool):
    """Exact integer and float arithmetic (see the module docstring for what is allowed)."""

    name = "calculator"
    description = "Evaluate an arithmetic expression with + - * / // % ** and parentheses; returns the exact value."
    parameters: dict[str, Any] = {
        "type": "object",
        "properties": {"expression": {"type": "string", "description": "e.g. 48213*9127 or (3+4)**2/7"}},
        "required": ["expression"],
    }

    def call(self, arguments: dict[str, Any]) -> str:
        expr = arguments["expression"]
        return format_number(evaluate(str(expr)))
