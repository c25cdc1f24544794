"""Countdown: combine the given numbers with + - * / to reach a target (the paper's planning task).

Instances are Countdown-Tasks-3to4 style: 3-4 numbers and a target, built from a random expression over the numbers
so every instance is solvable (one solution is kept in ``Prompt.metadata["solution"]``). The prompt asks for the
equation inside ``<answer> </answer>`` tags.

The verifier never evaluates model text as code. It takes the content of the LAST ``<answer>...</answer>`` pair
(checking its length before copying it), checks its characters, parses it with ``ast`` (parsing executes nothing) and walks the tree, accepting
only integer literals, binary ``+ - * /`` and parentheses (no unary minus, no ``**``/``//``, no names or calls), then
computes the value with exact rational arithmetic (``fractions.Fraction``). Each given number must be used exactly
once (a multiset: ``[5, 5, 3]`` needs both 5s). Bounded: ``MAX_EXPR_CHARS`` characters and ``MAX_DEPTH`` nested
parentheses, so any completion is scored in well under a millisecond after the tag search.
"""

from __future__ import annotations

import ast
import functools
import re
from collections import Counter
from collections.abc import Sequence
from fractions import Fraction
from typing import Any

import numpy as np
from pydantic import Field, model_validator

from sara.config import ConfigError, SaraModel, validate_config
from sara.envs.tasks.base import Task
from sara.types import Prompt

__all__ = [
    "CountdownConfig",
    "MAX_DEPTH",
    "MAX_EXPR_CHARS",
    "PROMPT",
    "evaluate_expression",
    "extract_answer",
    "generate_instances",
    "make_countdown_task",
    "verify",
]

TASK_ID = "sara/Countdown-v0"
MAX_EXPR_CHARS = 200
"""Longest accepted equation (inside the answer tag, after stripping)."""
MAX_DEPTH = 32
"""Deepest accepted parenthesis nesting."""
OPEN, CLOSE = "<answer>", "</answer>"

PROMPT = ("Using the numbers {numbers}, create an equation that equals {target}. You can use basic arithmetic "
          "operations (+, -, *, /) and each number exactly once. Show your work in <think> </think> tags. And return "
          "the final answer in <answer> </answer> tags, for example <answer> (1 + 2) / 3 </answer>.")
BASE_TEMPLATE = ("A conversation between User and Assistant. The user asks a question, and the Assistant solves it. "
                 "The assistant first thinks about the reasoning process in the mind and then provides the user with "
                 "the answer.\nUser: {prompt}\nAssistant: Let me solve this step by step.\n<think>")
"""Template for base (non-chat) models, as in TinyZero."""

_CHARS = re.compile(r"[0-9+\-*/() \t\n]*", re.ASCII)
_NON_SPACE = re.compile(r"\S")
_OPS = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/"}


def extract_answer(completion: str, max_chars: int | None = None) -> str | None:
    """Content of the last ``<answer>...</answer>`` pair, or ``None``.

    With ``max_chars``, the content is returned stripped of surrounding whitespace, and ``None`` when it is longer
    than that; nothing longer is ever copied (a 10**9-character answer costs a scan, not a copy).
    """
    end = completion.rfind(CLOSE)
    if end < 0:
        return None
    start = completion.rfind(OPEN, 0, end)
    if start < 0:
        return None
    start += len(OPEN)
    if max_chars is None:
        return completion[start:end]
    first = _NON_SPACE.search(completion, start, end)
    if first is None:
        return ""
    if _NON_SPACE.search(completion, first.start() + max_chars, end) is not None:
        return None
    return completion[first.start():min(end, first.start() + max_chars)].rstrip()


def _paren_depth(text: str) -> int:
    depth = deepest = 0
    for ch in text:
        if ch == "(":
            depth += 1
            deepest = max(deepest, depth)
        elif ch == ")":
            depth -= 1
    return deepest


def evaluate_expression(expr: str) -> tuple[Fraction, list[int]] | None:
    """Exact value and integer literals (in order) of a ``+ - * /`` expression, or ``None`` if not allowed.

    Returns ``None`` for anything outside the grammar, over the size limits, or dividing by zero. Never executes
    the text.
    """
    expr = expr.strip()
    if not expr or len(expr) > MAX_EXPR_CHARS or not _CHARS.fullmatch(expr) or _paren_depth(expr) > MAX_DEPTH:
        return None
    try:
        tree = ast.parse(expr, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    literals: list[int] = []

    def walk(node: ast.AST) -> Fraction:
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            left, right = walk(node.left), walk(node.right)
            op = type(node.op)
            if op is ast.Add:
                return left + right
            if op is ast.Sub:
                return left - right
            if op is ast.Mult:
                return left * right
            if right == 0:
                raise ZeroDivisionError
            return left / right
        if isinstance(node, ast.Constant) and type(node.value) is int:
            literals.append(node.value)
            return Fraction(node.value)
        raise ValueError(f"disallowed syntax: {type(node).__name__}")

    try:
        value = walk(tree.body)
    except (ValueError, ZeroDivisionError, RecursionError):
        return None
    return value, literals


def verify(completion: str, *, numbers: Sequence[int], target: int, format_score: float = 0.0) -> float:
    """1.0 if the last answer tag holds an equation that uses each number exactly once and equals ``target``.

    Args:
        completion: Model output (untrusted).
        numbers: The given numbers (a multiset).
        target: The target value.
        format_score: Reward for a well-formed equation that is wrong (off by default).
    """
    if not isinstance(completion, str):
        return 0.0
    content = extract_answer(completion, MAX_EXPR_CHARS)
    if content is None:
        return 0.0
    result = evaluate_expression(content)
    if result is None:
        return 0.0
    value, literals = result
    if Counter(literals) == Counter(int(x) for x in numbers) and value == target:
        return 1.0
    return float(format_score)


class CountdownConfig(SaraModel):
    """Instance generator and prompt format of Countdown."""

    min_numbers: int = Field(3, ge=2, le=6)
    """Fewest given numbers per instance."""
    max_numbers: int = Field(4, ge=2, le=6)
    """Most given numbers per instance."""
    max_value: int = Field(99, ge=2, le=1000)
    """Given numbers are drawn uniformly in [1, max_value]."""
    min_target: int = Field(1, ge=0)
    """Smallest target."""
    max_target: int = Field(100, ge=1, le=100_000)
    """Largest target."""
    pool_size: int = Field(10_000, ge=1, le=1_000_000)
    """Number of distinct training instances."""
    eval_size: int = Field(500, ge=0, le=100_000)
    """Number of distinct held-out instances (disjoint from the training pool)."""
    seed: int = Field(0, ge=0)
    """Seed of the generator."""
    format_score: float = Field(0.0, ge=0.0, le=1.0)
    """Reward of a well-formed but wrong equation."""
    chat: bool = True
    """Render as chat messages (instruct models); ``False`` uses the TinyZero base-model template."""

    @model_validator(mode="after")
    def _check(self) -> CountdownConfig:
        if self.min_numbers > self.max_numbers:
            raise ValueError(f"min_numbers ({self.min_numbers}) must be <= max_numbers ({self.max_numbers})")
        if self.min_target > self.max_target:
            raise ValueError(f"min_target ({self.min_target}) must be <= max_target ({self.max_target})")
        return self


def _random_solution(rng: np.random.Generator, numbers: list[int], lo: int, hi: int) -> tuple[int, str] | None:
    """Combine the numbers (random order and tree shape) with random ops, as in the Countdown game: every
    intermediate value is a positive integer (differences taken larger minus smaller, exact divisions only) and the
    last operation is drawn among those landing in ``[lo, hi]``. Returns ``(target, expression)`` or ``None``."""
    items = [(x, str(x)) for x in (numbers[i] for i in rng.permutation(len(numbers)))]
    cap = max(hi, 1000)
    while len(items) > 1:
        i = int(rng.integers(0, len(items) - 1))
        (a, ea), (b, eb) = items[i], items[i + 1]
        (big, e_big), (small, e_small) = ((a, ea), (b, eb)) if a >= b else ((b, eb), (a, ea))
        cands = [(a + b, f"{ea} + {eb}"), (a * b, f"{ea} * {eb}")]
        if big != small:
            cands.append((big - small, f"{e_big} - {e_small}"))
        if big % small == 0 and small != 1:
            cands.append((big // small, f"{e_big} / {e_small}"))
        if len(items) == 2:
            cands = [c for c in cands if lo <= c[0] <= hi]
        else:
            cands = [c for c in cands if 0 < c[0] <= cap]
        if not cands:
            return None
        value, expr = cands[int(rng.integers(0, len(cands)))]
        items[i:i + 2] = [(value, f"({expr})")]
    value, expr = items[0]
    return value, expr[1:-1] if expr.startswith("(") else expr


def generate_instances(cfg: CountdownConfig) -> tuple[list[Prompt], list[Prompt]]:
    """Distinct, solvable ``(train, eval)`` instances, a pure function of the config."""
    rng = np.random.default_rng([cfg.seed, 0xC0DE])
    needed = cfg.pool_size + cfg.eval_size
    seen: set[tuple[tuple[int, ...], int]] = set()
    out: list[Prompt] = []
    attempts = 0
    while len(out) < needed:
        attempts += 1
        if attempts > 20 * needed + 2_000:
            raise ConfigError(f"task {TASK_ID!r}: field 'pool_size': could not generate {needed} distinct solvable "
                              "instances with these settings; lower pool_size/eval_size or widen the ranges")
        count = int(rng.integers(cfg.min_numbers, cfg.max_numbers + 1))
        numbers = [int(x) for x in rng.integers(1, cfg.max_value + 1, size=count)]
        found = _random_solution(rng, numbers, cfg.min_target, cfg.max_target)
        if found is None:
            continue
        target, solution = found
        key = (tuple(sorted(numbers)), target)
        if key in seen:
            continue
        seen.add(key)
        i = len(out)
        split = "train" if i < cfg.pool_size else "eval"
        j = i if split == "train" else i - cfg.pool_size
        out.append(Prompt(
            id=f"countdown-{j:06d}" if split == "train" else f"countdown-eval-{j:06d}",
            prompt=PROMPT.format(numbers=numbers, target=target),
            answer={"numbers": numbers, "target": target},
            metadata={"solution": solution, "split": split},
        ))
    return out[:cfg.pool_size], out[cfg.pool_size:]


def make_countdown_task(**options: Any) -> Task:
    """The ``sara/Countdown-v0`` task; options are ``CountdownConfig`` fields."""
    cfg = validate_config(CountdownConfig, options, what=f"task {TASK_ID!r}")
    train, held_out = generate_instances(cfg)
    verifier = verify if cfg.format_score == 0.0 else functools.partial(verify, format_score=cfg.format_score)
    return Task(
        id=TASK_ID,
        prompts=train,
        eval_prompts=held_out,
        verifier=verifier,
        template="{prompt}" if cfg.chat else BASE_TEMPLATE,
        chat=cfg.chat,
        thread_safe=True,
        timeout_s=1.0,
        max_new_tokens=1024,
        description="reach the target with + - * / using each given number once; equation in <answer> tags",
        metadata={"config": cfg.model_dump()},
    )
