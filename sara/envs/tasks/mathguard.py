"""What a MATH answer may hold before sympy works on it: bounded text, no relation but ``=``, bounded expressions.

Three checks, cheapest first:

- ``safe_for_sympy(text)``: the text itself: at most ``MAX_BOXED_CHARS`` characters and ``MAX_BRACE_DEPTH`` nested
  brackets, no nested exponents (``9^{9^{9}}``), exponents of at most ``MAX_EXPONENT_DIGITS`` digits, numbers of at
  most ``MAX_NUMBER_DIGITS`` digits, no factorial of a number above ``MAX_FACTORIAL``, and none of the constructs
  that the LaTeX parser evaluates while it parses or that sympy cannot bound (integrals, sums, limits, binomials,
  the gamma function applied to an argument, determinants, gcd / lcm, matrix constructors).
- ``relations(text)``: the relations an answer states, other than ``=``: LaTeX relation, arrow and logic commands
  (``\\le``, ``\\equiv``, ``\\to``, ``\\iff``, ``\\sim``, ``\\in``, ``\\not``, ``\\lor``, ... every command
  whose name is a relation, an arrow, a logical connective or a negated one), ASCII ``<``, ``>``, ``!=``, ``~``,
  an augmented assignment (``+=``, ...) and an unpaired ``|``, and any Unicode mathematical symbol except a few
  operators (``±``, ``×``, ``÷``, ``−``, ``√``, ``∞``, ``∪``, ``∩``, ...). Orders and their inverses are one relation
  (``<`` / ``>``, ``\\le`` / ``\\ge``).
- ``within_bounds(expr)``: the parsed (unevaluated) sympy expression, bottom-up: an upper bound on the decimal
  digits of every number it evaluates to (every variable counted as at most 2, every constant as at most 10) stays
  within ``MAX_DIGITS``, and an upper bound on its terms once expanded within ``MAX_TERMS``; exponents are at most
  ``MAX_EXPONENT``, arguments of factorials and the other combinatorial and special functions at most
  ``MAX_FACTORIAL``, and integrals, sums, products, limits and derivatives are refused. A tower
  (``((9^{999})^{999})^{999}``), a huge factorial (``(9^{99}+1)!``) or a polynomial to a large power
  (``(x+y+z+1)^{9999}``) is refused before any of it is computed.
"""

from __future__ import annotations

import functools
import math
import re
import unicodedata
from types import SimpleNamespace
from typing import Any

__all__ = ["MAX_BOXED_CHARS", "MAX_BRACE_DEPTH", "MAX_DIGITS", "MAX_EXPONENT_DIGITS", "MAX_FACTORIAL",
           "MAX_NUMBER_DIGITS", "MAX_TERMS", "relations", "safe_for_sympy", "within_bounds"]

MAX_BOXED_CHARS = 256
MAX_BRACE_DEPTH = 12
MAX_EXPONENT_DIGITS = 4
MAX_NUMBER_DIGITS = 64
MAX_FACTORIAL = 1000
MAX_DIGITS = 1000
"""Most decimal digits of any number an answer may evaluate to."""
MAX_TERMS = 10_000
"""Most terms an answer may expand to."""
MAX_EXPONENT = 1e15
"""Largest exponent an answer may raise anything to."""
_SYMBOL = math.log10(2)  # every variable is counted as at most 2 (coefficients are bounded by the value there)

# ------------------------------------------------------------------------------------------------------ text
_NESTED_EXP = re.compile(r"\^\s*\{[^{}]*\^|\^\s*\([^()]*\^|\^\s*[0-9A-Za-z.]*\^|\*\*\s*\(?[0-9A-Za-z.\s]*\*\*")
_EXPONENT = re.compile(r"(?:\^|\*\*)\s*\{?\s*\(?\s*-?\s*([0-9]+)")
_DIGITS = re.compile(r"[0-9]+")
_FACTORIAL = re.compile(r"([0-9]+)\s*\)?\s*!")
_HEAVY = ("\\int", "\\sum", "\\prod", "\\lim", "\\oint", "\\iint", "factorial", "binom", "\\choose", "\\det", "\\gcd",
          "\\lcm")
"""Constructs sympy would try to evaluate without a bound (never in a final MATH answer)."""
_EVALUATED_AT_PARSE = re.compile(
    r"\\operatorname\*?\s*\{\s*(?:eye|zeros|ones|diag|hstack|vstack|rank|trace|tr|rref|nullspace|norm|cols|rows|eig"
    r"|eigen|diagonalize|eigenvals|eigenvalues|eigenvects|eigenvectors|svd|SVD|orth|ortho|orthogonal|orthogonalize"
    r"|gcd|lcm|gamma|Gamma)\s*\}")
_GAMMA = re.compile(r"\\[Gg]amma|[\u0393\u03b3]")


def _bracket_depth(text: str) -> int:
    depth = deepest = 0
    for ch in text:
        if ch in "([{":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in ")]}":
            depth -= 1
    return deepest


def safe_for_sympy(content: str) -> bool:
    """Cheap checks on the text that keep what sympy cannot bound (towers, huge powers and factorials, constructs the
    parser evaluates) away from it."""
    if len(content) > MAX_BOXED_CHARS or "\x00" in content or _bracket_depth(content) > MAX_BRACE_DEPTH:
        return False
    if any(cmd in content for cmd in _HEAVY) or _EVALUATED_AT_PARSE.search(content):
        return False
    if _GAMMA.search(content) and ("(" in content or "[" in content):  # the gamma function, evaluated when parsed
        return False
    if _NESTED_EXP.search(content):
        return False
    if any(len(m.group(1)) > MAX_EXPONENT_DIGITS for m in _EXPONENT.finditer(content)):
        return False
    if any(len(m.group(0)) > MAX_NUMBER_DIGITS for m in _DIGITS.finditer(content)):
        return False
    if any(int(m.group(1)) > MAX_FACTORIAL for m in _FACTORIAL.finditer(content)):
        return False
    return True


# ------------------------------------------------------------------------------------------------- relations
_COMMAND = re.compile(r"\\([A-Za-z]+)")
_RELATION_NAME = re.compile(
    r"arrow|Arrow|harpoon|eq$|eqq$|eqslant$|^eq|^doteq|sim|approx|equiv|cong|prec|succ|less|gtr|subset|supset"
    r"|Subset|Supset|dash|parallel|perp|propto|asymp|bowtie|Join|smile|frown|between|pitchfork|therefore|because"
    r"|backepsilon|multimap|mapsto|implies|impliedby|leadsto|triangle(?:left|right|q)|relbar|Relbar|lhd|rhd"
    r"|land|lor|wedge|vee"
    r"|^(?:n?(?:le|ge|lt|gt|ne|in|ni|mid|shortmid|ll|gg|lll|ggg)|notin|owns|to|gets|iff|models|not|neg|lnot"
    r"|mathrel|stackrel|llless|gggtr|Lsh|Rsh|divides)$", re.IGNORECASE)
_ACCENT = ("over", "under", "wide")  # \overrightarrow{AB} is a vector, not a relation
_ASCII = re.compile(r"<=|>=|!=|[-+*/%^]=|<|>|~")
_CANONICAL = {"lt": "<", "gt": "<", ">": "<", "le": "<=", "leq": "<=", "ge": "<=", "geq": "<=", "leqslant": "<=",
              "geqslant": "<=", "leqq": "<=", "geqq": "<=", ">=": "<=", "\u2264": "<=", "\u2265": "<=",
              "\u2a7d": "<=", "\u2a7e": "<=", "ne": "!=", "neq": "!=", "\u2260": "!=", "sim": "~", "\u223c": "~"}
_OPERATORS = frozenset("\u00b1\u00d7\u00f7\u2212\u2213\u2216\u2217\u2218\u2219\u221a\u221b\u221c\u221e\u2229"
                       "\u222a\u22c5\u2044")
_ARROW_BLOCKS = ((0x2190, 0x21FF), (0x27F0, 0x27FF), (0x2900, 0x297F), (0x2B00, 0x2BFF), (0x1F800, 0x1F8FF))


def _unicode_relation(ch: str) -> bool:
    code = ord(ch)
    if any(lo <= code <= hi for lo, hi in _ARROW_BLOCKS):
        return True
    return unicodedata.category(ch) == "Sm" and ch not in _OPERATORS


def relations(text: str) -> frozenset[str]:
    """The relations ``text`` states other than ``=`` (canonical names; empty for a plain expression).

    Args:
        text: LaTeX (the content of a ``\\boxed{}``, or a gold answer).
    """
    found = set()
    for m in _COMMAND.finditer(text):
        name = m.group(1)
        if _RELATION_NAME.search(name) and not name.startswith(_ACCENT):
            found.add(_CANONICAL.get(name, name))
    plain = _COMMAND.sub(" ", text.replace("\\|", " ").replace("\\{", " ").replace("\\}", " "))
    for m in _ASCII.finditer(plain):
        found.add(_CANONICAL.get(m.group(0), m.group(0)))
    if plain.count("|") % 2:
        found.add("mid")
    found.update(_CANONICAL.get(ch, ch) for ch in text if ord(ch) > 127 and _unicode_relation(ch))
    return frozenset(found)


# ------------------------------------------------------------------------------------------ parsed expression
class _Unbounded(Exception):
    """The expression may not be evaluated in bounded time and memory."""


@functools.lru_cache(maxsize=1)
def _sympy() -> SimpleNamespace:
    """The sympy classes the bounds tell apart (imported on first use)."""
    import sympy
    from sympy.core.function import AppliedUndef
    from sympy.matrices.expressions import MatAdd, MatMul, MatPow

    names = ("Basic", "MatrixBase", "Number", "Rational", "Float", "Integral", "Sum", "Product", "Limit", "Derivative",
             "Pow", "Mul", "Add", "Function", "Mod", "exp", "sinh", "cosh")
    return SimpleNamespace(**{n: getattr(sympy, n) for n in names}, AppliedUndef=AppliedUndef, MatAdd=MatAdd,
                           MatMul=MatMul, MatPow=MatPow)


def within_bounds(expr: Any) -> bool:
    """Whether sympy may evaluate ``expr`` (a parsed, unevaluated expression) in bounded time and memory.

    Args:
        expr: What ``math_verify.parse`` returned for an answer (sympy objects; anything else passes).
    """
    sp = _sympy()
    if not isinstance(expr, (sp.Basic, sp.MatrixBase)):
        return True
    try:
        _size(expr, sp)
    except (_Unbounded, RecursionError, OverflowError, ValueError):
        return False
    return True


def _checked(digits: float, terms: float) -> tuple[float, float]:
    if not digits <= MAX_DIGITS or not terms <= MAX_TERMS:
        raise _Unbounded
    return digits, terms


def _value(expr: Any, digits: float, sp: Any) -> float:
    """An upper bound on ``|expr|``: exact for a number, ``10**digits`` otherwise."""
    if isinstance(expr, sp.Number) and expr.is_finite:
        return abs(float(expr))
    return 10.0 ** digits if digits < 300 else math.inf


def _expanded_terms(terms: float, power: float) -> float:
    """Terms of a sum of ``terms`` terms raised to ``power`` once expanded (multinomial count)."""
    if terms <= 1 or power < 1:
        return terms
    n = math.ceil(power)
    return math.exp(math.lgamma(n + terms) - math.lgamma(terms) - math.lgamma(n + 1))


def _size(expr: Any, sp: Any) -> tuple[float, float]:
    """``(digits, terms)``: upper bounds on the decimal digits of ``expr``'s value and on its expanded terms."""
    if isinstance(expr, sp.MatrixBase):
        parts = [_size(x, sp) for x in expr]
        width = math.log10(max(expr.shape) or 1)
        return _checked(max((d for d, _ in parts), default=0.0) + width, sum(t for _, t in parts))
    if not isinstance(expr, sp.Basic):
        return 0.0, 1.0
    if isinstance(expr, sp.Rational):
        return _checked(max(_digits(expr.p), _digits(expr.q)), 1.0)
    if isinstance(expr, sp.Float):
        mpf = expr._mpf_
        return _checked(abs(mpf[2] + mpf[3]) * math.log10(2) if expr.is_finite and expr else 1.0, 1.0)
    if expr.is_Symbol:
        return _SYMBOL, 1.0
    if expr.is_Atom:
        return 1.0, 1.0
    if isinstance(expr, (sp.Integral, sp.Sum, sp.Product, sp.Limit, sp.Derivative)):
        raise _Unbounded
    if isinstance(expr, (sp.Pow, sp.MatPow)):
        (base_digits, base_terms), (exp_digits, _) = _size(expr.args[0], sp), _size(expr.args[1], sp)
        power = _value(expr.args[1], exp_digits, sp)
        if not power <= MAX_EXPONENT:
            raise _Unbounded
        return _checked(base_digits * max(power, 1.0), _expanded_terms(base_terms, power))
    parts = [_size(a, sp) for a in expr.args]
    digits, terms = max((d for d, _ in parts), default=0.0), sum(t for _, t in parts)
    if isinstance(expr, (sp.Mul, sp.MatMul)):
        return _checked(sum(d for d, _ in parts), math.prod(t for _, t in parts))
    if isinstance(expr, (sp.Add, sp.MatAdd)):
        return _checked(digits + math.log10(len(parts) or 1), terms)
    if isinstance(expr, sp.AppliedUndef):
        return _checked(digits, 1.0)
    if isinstance(expr, sp.Function):
        return _function(expr, parts, sp)
    return _checked(digits, terms)


def _function(expr: Any, parts: list[tuple[float, float]], sp: Any) -> tuple[float, float]:
    """Bounds of a sympy function applied to arguments of bounds ``parts``."""
    digits, terms = max((d for d, _ in parts), default=0.0), max((t for _, t in parts), default=1.0)
    arg = max((_value(a, d, sp) for a, (d, _) in zip(expr.args, parts)), default=0.0)
    if isinstance(expr, (sp.exp, sp.sinh, sp.cosh)):  # grows like e**arg
        return _checked(arg * math.log10(math.e) + 1.0, terms)
    module = type(expr).__module__
    if module.startswith("sympy.functions.elementary") or isinstance(expr, sp.Mod):
        return _checked(digits + 1.0, terms)
    if not arg <= MAX_FACTORIAL:  # factorials, binomials, gamma and the other combinatorial / special functions
        raise _Unbounded
    return _checked(math.lgamma(sum(_value(a, d, sp) for a, (d, _) in zip(expr.args, parts)) + 2) / math.log(10),
                    terms)


def _digits(n: int) -> float:
    n = abs(n)
    return math.log10(n) if 0 < n < 2**1000 else n.bit_length() * math.log10(2)
