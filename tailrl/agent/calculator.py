"""The built-in `calculator` tool: exact arithmetic over a parsed expression, never `eval`.

The expression is parsed with `ast` and only numbers, `+ - * / // % **`, unary `+`/`-` and parentheses are
evaluated, in exact rationals (`fractions.Fraction`), so `123456789 * 987654321` prints every digit and
`1/3 + 2/3` is `1`. Guards: the expression's length, the exponent (checked before the power is computed, from
the result's size in bits) and the magnitude of every intermediate result; a non-integer power falls back to
float. Errors are raised as `ToolError`: the pool returns them to the model as `error: ...` (status "error").
"""

from __future__ import annotations

import ast
import math
import operator
from fractions import Fraction

from .tool import ToolError

MAX_LENGTH = 500  # characters of expression
MAX_BITS = 1024  # of any intermediate numerator or denominator (about 308 decimal digits)
MAX_EXPONENT = 10_000

_BINOPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod}
_HINTS = {ast.BitXor: "use ** for a power, not ^", ast.Name: "names are not allowed",
          ast.Call: "function calls are not allowed", ast.Attribute: "attributes are not allowed"}


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression exactly.

    Args:
        expression: An expression of numbers with + - * / // % ** and parentheses, e.g. "(347 + 12) * 29".
    """
    if not isinstance(expression, str):
        raise ToolError("the expression must be a string")
    text = expression.strip().replace("×", "*").replace("÷", "/").replace("−", "-").rstrip("=").strip()
    if not text:
        raise ToolError("empty expression")
    if len(text) > MAX_LENGTH:
        raise ToolError(f"expression too long ({len(text)} characters, at most {MAX_LENGTH})")
    try:
        tree = ast.parse(text, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        raise ToolError(f"not an arithmetic expression: {text[:80]!r}") from None
    try:
        value = _eval(tree.body)
    except RecursionError:
        raise ToolError("expression nested too deeply") from None
    return format_number(value)


def format_number(value: Fraction | float) -> str:
    """An integer exactly; another rational as a decimal of 12 significant digits (`7/2` -> 3.5)."""
    if isinstance(value, Fraction) and value.denominator == 1:
        return str(value.numerator)
    return format(float(value), ".12g")


def _check(value):
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ToolError("result is not a finite number")
        return value
    if value.numerator.bit_length() > MAX_BITS or value.denominator.bit_length() > MAX_BITS:
        raise ToolError(f"number too large (more than {MAX_BITS} bits)")
    return value


def _eval(node):
    if isinstance(node, ast.Constant):
        v = node.value
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ToolError(f"unsupported constant {v!r}")
        return _check(Fraction(v) if isinstance(v, int) else Fraction(repr(v)))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.UAdd, ast.USub)):
        v = _eval(node.operand)
        return -v if isinstance(node.op, ast.USub) else v
    if isinstance(node, ast.BinOp):
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow):
            return _check(_power(left, right))
        op = _BINOPS.get(type(node.op))
        if op is None:
            raise ToolError(_HINTS.get(type(node.op), f"operator {type(node.op).__name__} is not supported"))
        if right == 0 and op in (operator.truediv, operator.floordiv, operator.mod):
            raise ToolError("division by zero")
        return _check(op(left, right))
    raise ToolError(_HINTS.get(type(node), f"{type(node).__name__} is not allowed in an arithmetic expression"))


def _power(base, exp):
    if isinstance(exp, Fraction) and exp.denominator == 1 and isinstance(base, Fraction):
        e = abs(exp.numerator)
        if e > MAX_EXPONENT:
            raise ToolError(f"exponent too large ({exp}, at most {MAX_EXPONENT})")
        if base == 0 and exp < 0:
            raise ToolError("division by zero")
        bits = max(base.numerator.bit_length(), base.denominator.bit_length())
        if bits > 1 and (bits - 1) * e > MAX_BITS:  # |base| >= 2**(bits-1), so the result has more than MAX_BITS
            raise ToolError(f"number too large (more than {MAX_BITS} bits)")
        return base ** exp.numerator
    b, x = float(base), float(exp)
    if b < 0:
        raise ToolError("a negative number to a fractional power is not a real number")
    if b == 0 and x < 0:
        raise ToolError("division by zero")
    try:
        return b ** x
    except OverflowError:
        raise ToolError("result is too large") from None
