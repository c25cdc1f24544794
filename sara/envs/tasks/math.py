"""MATH and AIME: competition problems; the final answer goes in ``\\boxed{}``.

Records have ``problem`` and ``answer`` (or a ``solution`` whose last ``\\boxed{}`` is the answer), read from a local
file, an offline Hugging Face cache, or by default the small sets bundled with sara (``sara/data/math_small.jsonl``,
``aime_small.jsonl``, written for this project).

MATH verifier: the content of the last ``\\boxed{...}`` of the completion (found by a bounded brace scan from the
end) is compared with the gold answer by ``math-verify`` (gold wrapped as ``\\boxed{gold}``; ``verify(gold, pred)``
is asymmetric and the gold goes first). Cheap guards run first so adversarial input never reaches sympy: the boxed
content has at most ``MAX_BOXED_CHARS`` characters and ``MAX_BRACE_DEPTH`` nested braces, no nested exponents
(``9^{9^{9}}``), exponents of at most ``MAX_EXPONENT_DIGITS`` digits, numbers of at most ``MAX_NUMBER_DIGITS``
digits, and no factorial of a number above ``MAX_FACTORIAL``. Those guards cannot catch everything sympy may expand
(``(x+y+z+1)^{9999}``, ``\\Gamma(9999^{9999})``), so ``verify`` is marked not thread-safe (``verify.thread_safe =
False``): the batch scorer runs it only in worker processes, which are killed past the time limit and capped in memory
(``sara.envs.tasks.workers``), and refuses the thread and inline modes for it. math-verify's own timeouts use
``signal.alarm`` (main thread only): in the main thread (a worker's calls run there) they are set to 1 s.

An equation is an answer only when its sides agree: when the gold answer has no ``=`` and the boxed content does,
every side without a variable (letters outside LaTeX commands) must equal the gold too (``\\boxed{6=5}`` is not 5,
``\\boxed{2+4=6}`` is 6), while ``\\boxed{x=5}`` is still read as 5.

AIME verifier: the last boxed content must be an integer (ASCII digits, optional sign) equal to the gold; no sympy,
thread-safe.
"""

from __future__ import annotations

import functools
import logging
import re
import threading
from typing import Any

from sara.config import ConfigError, validate_config
from sara.data import data_path
from sara.envs.tasks.base import Task
from sara.envs.tasks.data import DataConfig, load_splits
from sara.types import Prompt

__all__ = [
    "INSTRUCTION",
    "MathConfig",
    "last_boxed",
    "make_aime_task",
    "make_math_task",
    "safe_for_sympy",
    "verify",
    "verify_integer",
]

MAX_BOXED_CHARS = 256
MAX_BRACE_DEPTH = 12
MAX_EXPONENT_DIGITS = 4
MAX_NUMBER_DIGITS = 64
MAX_FACTORIAL = 1000
MAX_INTEGER_CHARS = 12
MAX_EQUATION_SIDES = 4
INSTRUCTION = "Let's think step by step and output the final answer within \\boxed{}."

_BOXED = ("\\boxed", "\\fbox")


def last_boxed(completion: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``, or ``\\boxed 5``), or ``None``.

    The brace scan stops after ``MAX_BOXED_CHARS`` characters or ``MAX_BRACE_DEPTH`` nested braces (-> ``None``).
    """
    start = max(completion.rfind(tag) for tag in _BOXED)
    if start < 0:
        return None
    i = start + (6 if completion.startswith("\\boxed", start) else 5)
    rest = completion[i:i + MAX_BOXED_CHARS + 2]
    if rest[:1] == " ":  # "\boxed 5"
        m = re.match(r" +([^\s$]{1,%d})" % MAX_BOXED_CHARS, rest)  # noqa: UP031
        return m.group(1) if m else None
    if rest[:1] != "{":
        return None
    depth = 0
    for j, ch in enumerate(rest):
        if ch == "{":
            depth += 1
            if depth > MAX_BRACE_DEPTH:
                return None
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return rest[1:j]
    return None


_NESTED_EXP = re.compile(r"\^\s*\{[^{}]*\^|\^\s*\([^()]*\^|\^\s*[0-9A-Za-z.]*\^|\*\*\s*\(?[0-9A-Za-z.\s]*\*\*")
_EXPONENT = re.compile(r"(?:\^|\*\*)\s*\{?\s*\(?\s*-?\s*([0-9]+)")
_DIGITS = re.compile(r"[0-9]+")
_FACTORIAL = re.compile(r"([0-9]+)\s*\)?\s*!")
_COMMAND = re.compile(r"\\[A-Za-z]+")
_LETTER = re.compile(r"[A-Za-z]")
_HEAVY = ("\\int", "\\sum", "\\prod", "\\lim", "\\oint", "\\iint", "factorial", "binomial", "\\binom")
"""LaTeX commands sympy would try to evaluate (never in a final MATH answer)."""


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
    """Cheap checks that keep pathological expressions (towers, huge powers and factorials) away from sympy."""
    if len(content) > MAX_BOXED_CHARS or "\x00" in content or _bracket_depth(content) > MAX_BRACE_DEPTH:
        return False
    if any(cmd in content for cmd in _HEAVY):
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


logging.getLogger("math_verify").setLevel(logging.CRITICAL)  # it logs whole inputs on timeouts; we count them


@functools.lru_cache(maxsize=4096)
def _gold(answer: str) -> Any:
    from math_verify import parse

    text = answer if "\\boxed" in answer else "\\boxed{" + answer + "}"
    return parse(text, **_timeouts("parsing_timeout"))


def _timeouts(name: str) -> dict[str, Any]:
    """math-verify's alarm-based timeout: 1 s in the main thread, off elsewhere (the scorer bounds time there)."""
    return {name: 1 if threading.current_thread() is threading.main_thread() else None}


def verify(completion: str, *, answer: str) -> float:
    """1.0 if the last ``\\boxed{}`` of the completion is mathematically equal to ``answer`` (math-verify).

    Args:
        completion: Model output (untrusted).
        answer: Gold answer in LaTeX, e.g. ``"\\frac{3}{4}"`` (or text containing ``\\boxed{...}``).
    """
    if not isinstance(completion, str):
        return 0.0
    content = last_boxed(completion)
    if content is None or not content.strip() or not safe_for_sympy(content):
        return 0.0
    from math_verify import parse
    from math_verify import verify as mv_verify

    gold = _gold(str(answer))
    if not gold:
        return 0.0

    def equal(text: str) -> bool:
        pred = parse("\\boxed{" + text + "}", **_timeouts("parsing_timeout"))
        return bool(pred) and bool(mv_verify(gold, pred, **_timeouts("timeout_seconds")))

    sides = content.split("=")
    if len(sides) > 1 and "=" not in str(answer):  # an equation: each side without a variable must be the answer too
        if len(sides) > MAX_EQUATION_SIDES:
            return 0.0
        if not all(equal(side) for side in sides[:-1] if not _LETTER.search(_COMMAND.sub("", side))):
            return 0.0
    return 1.0 if equal(content) else 0.0


verify.thread_safe = False  # type: ignore[attr-defined]  # sympy's work is bounded only in a worker process


def verify_integer(completion: str, *, answer: int | str) -> float:
    """AIME-style: 1.0 if the last ``\\boxed{}`` holds exactly the integer ``answer`` (e.g. ``"\\boxed{033}"``)."""
    if not isinstance(completion, str):
        return 0.0
    content = last_boxed(completion)
    if content is None:
        return 0.0
    text = content.strip().strip("$").strip()
    if len(text) > MAX_INTEGER_CHARS or not re.fullmatch(r"-?[0-9]+", text, re.ASCII):
        return 0.0
    try:
        return 1.0 if int(text) == int(str(answer).strip()) else 0.0
    except ValueError:
        return 0.0


class MathConfig(DataConfig):
    """Data source and prompt of MATH / AIME."""

    chat: bool = True
    """Render as chat messages (instruct models) rather than raw text."""
    instruction: str = INSTRUCTION
    """Appended to each problem."""
    timeout_s: float = 5.0
    """Per-call verifier time limit of the batch scorer (MATH runs in worker processes)."""


def _gold_of(rec: dict[str, Any]) -> str | None:
    answer = rec.get("answer")
    if isinstance(answer, (int, float)) and not isinstance(answer, bool):
        answer = repr(answer)
    if isinstance(answer, str) and answer.strip():
        return answer.strip()
    if isinstance(rec.get("solution"), str):
        return last_boxed(rec["solution"])
    return None


def _prompts(records: list[dict[str, Any]], split: str, prefix: str, what: str, integer: bool) -> list[Prompt]:
    out = []
    for i, rec in enumerate(records):
        problem = rec.get("problem", rec.get("question"))
        gold = _gold_of(rec)
        if not isinstance(problem, str) or gold is None:
            raise ConfigError(f"{what}: record {i} of the {split} split needs 'problem' and 'answer' (or a "
                              "'solution' with \\boxed{})")
        if integer and not re.fullmatch(r"-?[0-9]{1,%d}" % MAX_INTEGER_CHARS, gold, re.ASCII):  # noqa: UP031
            raise ConfigError(f"{what}: record {i} of the {split} split: AIME answers must be integers of at most "
                              f"{MAX_INTEGER_CHARS} digits, got {gold[:40]!r}")
        meta = {k: rec[k] for k in ("level", "type", "source", "year") if k in rec}
        out.append(Prompt(id=str(rec.get("id", f"{prefix}-{split}-{i:06d}")), prompt=problem,
                          answer={"answer": int(gold) if integer else gold}, metadata={"split": split, **meta}))
    return out


def _make(task_id: str, bundled: str, integer: bool, options: dict[str, Any]) -> Task:
    what = f"task {task_id!r}"
    cfg = validate_config(MathConfig, options, what=what)
    train, held_out = load_splits(cfg, data_path(bundled), what=what)
    prefix = "aime" if integer else "math"
    return Task(
        id=task_id,
        prompts=_prompts(train, "train", prefix, what, integer),
        eval_prompts=_prompts(held_out, "eval", prefix, what, integer),
        verifier=verify_integer if integer else verify,
        template="{prompt}\n" + cfg.instruction if cfg.instruction else "{prompt}",
        chat=cfg.chat,
        thread_safe=integer,  # math-verify: alarm-based timeouts and sympy work that may need a hard kill
        timeout_s=cfg.timeout_s,
        max_new_tokens=2048,
        description=("competition math, integer answer in \\boxed{}" if integer
                     else "competition math, \\boxed{} answer checked with math-verify"),
        metadata={"config": cfg.model_dump()},
    )


def make_math_task(**options: Any) -> Task:
    """The ``sara/MATH-v0`` task; options are ``MathConfig`` fields."""
    return _make("sara/MATH-v0", "math_small.jsonl", False, options)


def make_aime_task(**options: Any) -> Task:
    """The ``sara/AIME-v0`` task (integer answers); options are ``MathConfig`` fields."""
    return _make("sara/AIME-v0", "aime_small.jsonl", True, options)
