"""Arithmetic: ``"123+45="`` -> ``"168"``, the task the tiny character-level policy learns.

Format (plain text, no chat template): the prompt is ``f"{a}{op}{b}="`` with non-negative integer operands and
``op`` in ``+ -``; the expected completion is the integer result (it may be negative), e.g. ``"-77"``. Prompts and
answers only use the alphabet ``"0123456789+-="``, so a character-level tokenizer works. With ``shots=N`` the
template puts N worked examples (``"8+2=10"`` lines) before the prompt and generation stops at a newline: the format a
small pretrained LLM (SmolLM2-135M) answers with a bare number.

Verifier: leading whitespace is skipped, the completion is read up to the first whitespace (a model may stop with a
newline or EOS), and that token must be an ASCII integer (optional leading ``-``, at most ``MAX_ANSWER_CHARS``
characters; leading zeros are accepted) exactly equal to the answer (a gold that is not a whole number, ``168.9``,
matches nothing). The token must start within the first ``MAX_SCAN_CHARS`` characters, and at most
``MAX_ANSWER_CHARS + 1`` characters of it are read (a longer token is no answer, never its head), so any completion
is scored in microseconds.
"""

from __future__ import annotations

import re
from fractions import Fraction
from typing import Any

import numpy as np
from pydantic import Field, model_validator

from sara.config import ConfigError, SaraModel, validate_config
from sara.envs.tasks.base import Task
from sara.types import Prompt

__all__ = [
    "ALPHABET",
    "ArithmeticConfig",
    "MAX_ANSWER_CHARS",
    "MAX_SCAN_CHARS",
    "few_shot_examples",
    "generate_problems",
    "make_arithmetic_task",
    "verify",
]

TASK_ID = "sara/Arithmetic-v0"
ALPHABET = "0123456789+-="
"""Every character of every prompt and expected completion."""
MAX_ANSWER_CHARS = 24
"""Longest answer token accepted (sign included); longer tokens score 0 without conversion."""
MAX_SCAN_CHARS = 256
"""Only this many leading characters of a completion are looked at."""

_INT = re.compile(r"-?[0-9]+", re.ASCII)


def verify(completion: str, *, answer: int) -> float:
    """1.0 if the completion's first whitespace-delimited token is the integer ``answer``, else 0.0.

    Args:
        completion: Model output (untrusted).
        answer: The exact integer result.
    """
    if not isinstance(completion, str):
        return 0.0
    window = completion[:MAX_SCAN_CHARS]
    start = len(window) - len(window.lstrip())
    if start >= MAX_SCAN_CHARS:
        return 0.0
    head = completion[start:start + MAX_ANSWER_CHARS + 1].split(maxsplit=1)
    if not head:
        return 0.0
    token = head[0]
    if len(token) > MAX_ANSWER_CHARS or not _INT.fullmatch(token):
        return 0.0
    gold = answer if isinstance(answer, int) and not isinstance(answer, bool) else _whole(answer)
    return 1.0 if gold is not None and int(token) == gold else 0.0


def _whole(answer: object) -> int | None:
    """A gold answer given as a float or a string, as the whole number it is (None: not a whole number)."""
    try:
        value = Fraction(answer if isinstance(answer, (float, str)) else str(answer))  # type: ignore[arg-type]
    except (ValueError, TypeError, OverflowError, ZeroDivisionError):
        return None
    return int(value) if value.denominator == 1 else None


class ArithmeticConfig(SaraModel):
    """Difficulty and size of the arithmetic prompt pool."""

    min_digits: int = Field(1, ge=1, le=9)
    """Fewest digits of an operand (the digit count of each operand is drawn uniformly in [min, max])."""
    max_digits: int = Field(3, ge=1, le=9)
    """Most digits of an operand."""
    ops: str = "+-"
    """Operations to draw from, a non-empty subset of ``"+-"``."""
    allow_negative: bool = True
    """Allow negative results (``False`` swaps the operands of ``a-b`` when ``a < b``)."""
    pool_size: int = Field(10_000, ge=1, le=1_000_000)
    """Number of distinct training prompts, at most 1,000,000."""
    eval_size: int = Field(500, ge=0, le=100_000)
    """Number of distinct held-out prompts (disjoint from the training pool), at most 100,000."""
    seed: int = Field(0, ge=0)
    """Seed of the generator."""
    shots: int = Field(0, ge=0, le=16)
    """Worked examples (``"7+1=8"`` lines) written before every prompt: few-shot prompting for a pretrained LLM,
    which rarely answers a bare ``"3+4="`` with the number alone. They are drawn from the same range, disjoint from
    the training and held-out prompts, and the same for every prompt; generation then stops at a newline. 0 = the bare
    prompt (the tiny character-level policy's alphabet has no newline)."""

    @model_validator(mode="after")
    def _check(self) -> ArithmeticConfig:
        if self.min_digits > self.max_digits:
            raise ValueError(f"min_digits ({self.min_digits}) must be <= max_digits ({self.max_digits})")
        if not self.ops or any(c not in "+-" for c in self.ops) or len(set(self.ops)) != len(self.ops):
            raise ValueError(f"field 'ops' must be a non-empty subset of '+-' without repeats, got {self.ops!r}")
        return self


def _space_size(cfg: ArithmeticConfig) -> int:
    per_operand = sum(10 if d == 1 else 9 * 10 ** (d - 1) for d in range(cfg.min_digits, cfg.max_digits + 1))
    return len(cfg.ops) * per_operand**2


def _draw_operands(rng: np.random.Generator, cfg: ArithmeticConfig, m: int) -> np.ndarray:
    digits = rng.integers(cfg.min_digits, cfg.max_digits + 1, size=m)
    low = np.where(digits == 1, 0, 10 ** (digits - 1))
    return rng.integers(low, 10**digits)  # int64; 10**9 fits


def _draw_problems(cfg: ArithmeticConfig) -> list[tuple[str, int, int]]:
    """``pool_size + eval_size + shots`` distinct ``(op, a, b)``, in order of first draw (seeded, vectorized)."""
    needed = cfg.pool_size + cfg.eval_size + cfg.shots
    space = _space_size(cfg)
    if needed > space:
        raise ConfigError(f"task {TASK_ID!r}: field 'pool_size': pool_size + eval_size + shots = {needed} exceeds "
                          f"the {space} distinct problems with {cfg.min_digits}-{cfg.max_digits} digits and ops "
                          f"{cfg.ops!r}; lower pool_size")
    rng = np.random.default_rng([cfg.seed, 0xA417])
    base = np.int64(10**9)
    keys = np.empty(0, np.int64)
    for _ in range(10_000):
        m = 2 * (needed - len(keys)) + 64
        a, b = _draw_operands(rng, cfg, m), _draw_operands(rng, cfg, m)
        op = rng.integers(0, len(cfg.ops), size=m)
        if not cfg.allow_negative:
            swap = (np.asarray(list(cfg.ops))[op] == "-") & (a < b)
            a, b = np.where(swap, b, a), np.where(swap, a, b)
        keys = np.concatenate([keys, (op * base + a) * base + b])
        _, first = np.unique(keys, return_index=True)
        keys = keys[np.sort(first)]  # distinct, in order of first draw
        if len(keys) >= needed:
            break
    else:  # pragma: no cover - only for pathological ranges, ruled out by the space check above
        raise ConfigError(f"task {TASK_ID!r}: could not draw {needed} distinct problems; lower pool_size")
    op_idx, rest = np.divmod(keys[:needed], base * base)
    a, b = np.divmod(rest, base)
    return [(cfg.ops[o], x, y) for o, x, y in zip(op_idx.tolist(), a.tolist(), b.tolist())]


def _result(op: str, a: int, b: int) -> int:
    return a + b if op == "+" else a - b


def generate_problems(cfg: ArithmeticConfig) -> tuple[list[Prompt], list[Prompt]]:
    """Distinct ``(train, eval)`` prompt lists, a pure function of the config.

    Raises:
        ConfigError: The difficulty range has fewer distinct problems than ``pool_size + eval_size + shots``.
    """
    return _prompts(cfg, _draw_problems(cfg))


def few_shot_examples(cfg: ArithmeticConfig) -> list[str]:
    """The ``shots`` worked examples (``"7+1=8"``), drawn after the prompts: disjoint from both splits."""
    return _examples(cfg, _draw_problems(cfg)) if cfg.shots else []


def _prompts(cfg: ArithmeticConfig, problems: list[tuple[str, int, int]]) -> tuple[list[Prompt], list[Prompt]]:
    out: list[Prompt] = []
    for i, (op, x, y) in enumerate(problems[: cfg.pool_size + cfg.eval_size]):
        split = "train" if i < cfg.pool_size else "eval"
        j = i if split == "train" else i - cfg.pool_size
        out.append(Prompt(
            id=f"arith-{j:06d}" if split == "train" else f"arith-eval-{j:06d}",
            prompt=f"{x}{op}{y}=",
            answer={"answer": _result(op, x, y)},
            metadata={"op": op, "digits": (len(str(x)), len(str(y))), "split": split},
        ))
    return out[:cfg.pool_size], out[cfg.pool_size:]


def _examples(cfg: ArithmeticConfig, problems: list[tuple[str, int, int]]) -> list[str]:
    return [f"{x}{op}{y}={_result(op, x, y)}" for op, x, y in problems[cfg.pool_size + cfg.eval_size:]]


def make_arithmetic_task(**options: Any) -> Task:
    """The ``sara/Arithmetic-v0`` task; options are ``ArithmeticConfig`` fields."""
    cfg = validate_config(ArithmeticConfig, options, what=f"task {TASK_ID!r}")
    problems = _draw_problems(cfg)  # drawn once: the prompts, then the worked examples
    train, held_out = _prompts(cfg, problems)
    return Task(
        id=TASK_ID,
        prompts=train,
        eval_prompts=held_out,
        verifier=verify,
        template="".join(f"{line}\n" for line in _examples(cfg, problems)) + "{prompt}",
        chat=False,
        thread_safe=True,
        timeout_s=1.0,
        stop=("\n",) if cfg.shots else (),
        max_new_tokens=cfg.max_digits + 2,
        description="a+b / a-b on non-negative integers; answer = the integer (char alphabet '0123456789+-=')",
        metadata={"config": cfg.model_dump(), "alphabet": ALPHABET},
    )
