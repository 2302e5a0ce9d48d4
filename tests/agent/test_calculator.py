"""The built-in calculator tool: exact arithmetic on valid input, a clear ToolError on invalid and hostile input."""

import pytest

from tailrl.agent.calculator import calculator
from tailrl.agent.tool import ToolError


@pytest.mark.parametrize("expr,expected", [
    ("347*29", "10063"), ("123456789 * 987654321", "121932631112635269"), ("(2 + 3) * -4", "-20"),
    ("7/2", "3.5"), ("6/3", "2"), ("1/3 + 2/3", "1"), ("2/3", "0.666666666667"), ("0.1 + 0.2", "0.3"),
    ("17 // 5", "3"), ("-7 % 3", "2"), ("2**10", "1024"), ("2**-2", "0.25"), ("-3**2", "-9"),
    ("2**0.5", "1.41421356237"), ("2**100", str(2**100)), (" 12 × 3 = ", "36")])
def test_calculator_valid(expr, expected):
    assert calculator(expr) == expected


@pytest.mark.parametrize("expr,pattern", [
    ("__import__('os').system('echo hi')", "not allowed"), ("x + 1", "names are not allowed"),
    ("(lambda: 1)()", "not allowed"), ("[1] * 10**9", "not allowed"), ("'a' * 3", "unsupported constant"),
    ("9**9**9", "exponent too large"), ("2**100000", "too large"), ("10**400", "too large"),
    ("(10**300) * (10**300)", "too large"), ("1" * 600, "too long"),
    ("(" * 240 + "1" + ")" * 240, "not an arithmetic expression|nested"),
    ("1/0", "division by zero"), ("5 % 0", "division by zero"), ("0**-1", "division by zero"),
    ("2^3", r"use \*\*"), ("(-8)**(1/3)", "not a real number"), ("1 +", "not an arithmetic expression"),
    ("", "empty"), ("True + 1", "unsupported constant"), ("1 << 3", "not supported"), ("1e308 * 1e308", "too large")])
def test_calculator_invalid_and_hostile(expr, pattern):
    with pytest.raises(ToolError, match=pattern):
        calculator(expr)
