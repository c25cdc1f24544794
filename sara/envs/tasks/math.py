"""MATH and AIME: competition problems; the final answer goes in ``\\boxed{}``.

Records have ``problem`` and ``answer`` (or a ``solution`` whose last ``\\boxed{}`` is the answer), read from a local
file, an offline Hugging Face cache, or by default the small sets bundled with sara (``sara/data/math_small.jsonl``,
``aime_small.jsonl``, written for this project).

MATH verifier: the content of the last ``\\boxed{...}`` of the completion (found by a bounded brace scan from the
end) is compared with the gold answer by ``math-verify`` (gold wrapped as ``\\boxed{gold}``; ``verify(gold, pred)``
is asymmetric and the gold goes first). What the answer says is what is scored:

- the content is parsed as LaTeX only: a content that does not parse as a whole is compared as text, never read
  as the number math-verify's plain-expression fallback finds in it (``6 \\foo 5`` is not 5);
- only an assignment is read as an answer: ``=`` (``:=`` and ``\\coloneqq`` are ``=``); an answer that states any
  other relation, arrow, equivalence or logical connective (``\\equiv``, ``\\to``, ``\\iff``, ``\\sim``,
  ``<``, ``\\le``, ``\\neq``, ``\\approx``, ``\\in``, ``\\lor``, ``+=``, ...;
  ``sara.envs.tasks.mathguard.relations``) scores 0 unless the gold states it too;
- an equation is an answer only when its sides agree: when the gold answer has no ``=`` and the boxed content does,
  every side without a variable (letters outside LaTeX commands) must equal the gold too (``\\boxed{6=5}`` is not
  5, ``\\boxed{2+4=6}`` is 6), while ``\\boxed{x=5}`` is still read as 5.

Bounded on any thread and in every scoring mode: the boxed text passes cheap guards first
(``sara.envs.tasks.mathguard.safe_for_sympy``), the parsed answer and gold must be evaluable in bounded time and
memory (``within_bounds``: exponent towers, huge factorials, a polynomial to a large power are refused before
anything is computed), and the whole sympy part of a call runs under a time limit of ``time_limit_s`` seconds in a
helper thread (``sara.envs.tasks.timelimit``; math-verify's own ``signal.alarm`` timeouts are off): past it the
answer scores 0. ``verify.thread_safe`` stays ``False``: the batch scorer still runs it in worker processes, which
also cap memory and are killed past the scorer's limit.

AIME verifier: the last boxed content must be an integer (ASCII digits, optional sign) equal to the gold; no sympy,
thread-safe.
"""

from __future__ import annotations

import functools
import logging
import re
from typing import Any

from sara.config import ConfigError, validate_config
from sara.data import data_path
from sara.envs.tasks.base import Task
from sara.envs.tasks.data import DataConfig, load_splits
from sara.envs.tasks.mathguard import (
    MAX_BOXED_CHARS,
    MAX_BRACE_DEPTH,
    relations,
    safe_for_sympy,
    within_bounds,
)
from sara.envs.tasks.timelimit import call_with_time_limit
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

MAX_INTEGER_CHARS = 12
MAX_EQUATION_SIDES = 4
TIME_LIMIT_S = 3.0
"""Time limit of one MATH verification's sympy work, in seconds (any thread)."""
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


_COMMAND = re.compile(r"\\[A-Za-z]+")
_LETTER = re.compile(r"[A-Za-z]")
_ASSIGNMENT = re.compile(r":=|\\coloneqq?(?![A-Za-z])")


logging.getLogger("math_verify").setLevel(logging.CRITICAL)  # it warns that its alarms are off: we bound time


def _parse(text: str) -> list[Any]:
    """math-verify's parse of ``text`` as LaTeX (no alarm), or ``[]`` when sympy could not evaluate it within bounds.

    Only LaTeX extraction: math-verify's plain-expression fallback would read a number out of a boxed content that
    does not parse as a whole (``6 \\foo 5`` would be 5).
    """
    from math_verify import LatexExtractionConfig, parse

    parsed = parse(text if "\\boxed" in text else "\\boxed{" + text + "}", [LatexExtractionConfig()],
                   parsing_timeout=None)
    return parsed if all(within_bounds(p) for p in parsed) else []


@functools.lru_cache(maxsize=4096)
def _gold(answer: str) -> list[Any]:
    gold = _parse(answer)
    if not gold and answer.strip():
        raise ValueError(f"MATH gold answer {answer[:60]!r} cannot be parsed or evaluated within bounds")
    return gold


def _score(content: str, answer: str) -> float:
    """The sympy part of ``verify`` (run under its time limit)."""
    from math_verify import verify as mv_verify

    gold = _gold(answer)

    def equal(text: str) -> bool:
        pred = _parse(text)
        return bool(pred) and bool(mv_verify(gold, pred, timeout_seconds=None))

    sides = content.split("=")
    if len(sides) > 1 and "=" not in answer:  # an equation: each side without a variable must be the answer too
        if len(sides) > MAX_EQUATION_SIDES:
            return 0.0
        if not all(equal(side) for side in sides[:-1] if not _LETTER.search(_COMMAND.sub("", side))):
            return 0.0
    return 1.0 if equal(content) else 0.0


def verify(completion: str, *, answer: str, time_limit_s: float = TIME_LIMIT_S) -> float:
    """1.0 if the last ``\\boxed{}`` of the completion is mathematically equal to ``answer`` (math-verify).

    Args:
        completion: Model output (untrusted).
        answer: Gold answer in LaTeX, e.g. ``"\\frac{3}{4}"`` (or text containing ``\\boxed{...}``).
        time_limit_s: Time limit of the sympy work; past it the answer scores 0.

    Raises:
        ValueError: The gold answer cannot be parsed, or not evaluated within bounds.
    """
    if not isinstance(completion, str):
        return 0.0
    content = last_boxed(completion)
    if content is None or not content.strip():
        return 0.0
    content, answer = _ASSIGNMENT.sub("=", content), str(answer)
    if not safe_for_sympy(content) or relations(content) - relations(answer):
        return 0.0
    import math_verify  # noqa: F401  - imported here, outside the time limit, once

    finished, score = call_with_time_limit(lambda: _score(content, answer), time_limit_s)
    return score if finished and score is not None else 0.0


verify.thread_safe = False  # type: ignore[attr-defined]  # worker processes also cap its memory


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
        thread_safe=integer,  # math-verify: sympy work that only a worker process caps in memory
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
