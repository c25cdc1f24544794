"""GSM8K: grade-school word problems; the answer is a number after ``####``.

Records are GSM8K-formatted (``question``; ``answer`` = reasoning ending in ``#### <number>``), read from a local
file, an offline Hugging Face cache (``hf_dataset="openai/gsm8k", hf_config="main"``) or, by default, the dozen
problems bundled with sara (``sara/data/gsm8k_small.jsonl``, written for this project).

Verifier modes (the whole completion is scanned, in linear time):
    ``strict``: the number right after the last ``####`` (a ``$`` and a ``-`` may come before it, in either order).
    ``flexible``: the last number anywhere (a ``-`` or ``$`` just before it counts).
A number is a whole run of ASCII digits, commas and one decimal point, read exactly (``"18.00"`` equals ``18``):
commas must group thousands (``1,234,567``; ``1,2,3`` is no number in strict mode, and ends in the number 3 in
flexible mode), a trailing comma is punctuation, and a run longer than ``MAX_NUMBER_CHARS`` is no number (never its
tail). The gold answer may be a string in the same format, an int or a float (exact: ``1e22`` is 10**22).
"""

from __future__ import annotations

import functools
import math
import re
from fractions import Fraction
from typing import Any, Literal

from sara.config import ConfigError, validate_config
from sara.data import data_path
from sara.envs.tasks.base import Task
from sara.envs.tasks.data import DataConfig, load_splits
from sara.types import Prompt

__all__ = ["GSM8KConfig", "INSTRUCTION", "MAX_NUMBER_CHARS", "extract_answer", "make_gsm8k_task", "parse_number",
           "verify"]

TASK_ID = "sara/GSM8K-v0"
MAX_NUMBER_CHARS = 40
"""Longest number accepted, commas included."""
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'

_RUN = re.compile(r"[0-9][0-9,]*(?:\.[0-9]+)?", re.ASCII)
_PLAIN = re.compile(r"-?(?:[0-9]+|[0-9]{1,3}(?:,[0-9]{3})+)(?:\.[0-9]+)?", re.ASCII)
_SPACE = re.compile(r"\s*")


def parse_number(text: str) -> Fraction | None:
    """Exact value of a number like ``"-1,234.50"`` or ``"$12"`` (commas must group thousands), or ``None``."""
    text = text.strip().removeprefix("$")
    if not text or len(text) > MAX_NUMBER_CHARS or not _PLAIN.fullmatch(text):
        return None
    return Fraction(text.replace(",", ""))


def _gold(answer: object) -> Fraction | None:
    """The exact value of a gold answer (str, int or float), or None."""
    if isinstance(answer, bool):
        return None
    if isinstance(answer, int):
        return Fraction(answer)
    if isinstance(answer, float):
        return Fraction(repr(answer)) if math.isfinite(answer) else None
    return parse_number(str(answer))


def _value(match: re.Match[str], negative: bool, mode: str) -> Fraction | None:
    """The number a digit run (a ``_RUN`` match) stands for, with its sign (a run too long is not copied)."""
    if match.end() - match.start() > 2 * MAX_NUMBER_CHARS:
        return None
    run = match.group(0).rstrip(",")
    if len(run) > MAX_NUMBER_CHARS:
        return None
    if not _PLAIN.fullmatch(run):
        if mode == "strict" or len(run.rpartition(",")[2]) == 0:
            return None
        run = run.rpartition(",")[2]  # flexible: "1,2,3" is a list whose last number is 3
    value = Fraction(run.replace(",", ""))
    return -value if negative else value


def extract_answer(completion: str, mode: Literal["strict", "flexible"] = "strict") -> Fraction | None:
    """The answer number of a completion (see the module docstring), or ``None``."""
    if mode == "strict":
        at = completion.rfind("####")
        if at < 0:
            return None
        i, negative, dollar = at + 4, False, False
        while True:  # whitespace, then "-" and "$" in either order (each once), then the number
            i = _SPACE.match(completion, i).end()  # type: ignore[union-attr]
            ch = completion[i:i + 1]
            if ch == "-" and not negative:
                negative = True
            elif ch == "$" and not dollar:
                dollar = True
            else:
                break
            i += 1
        run = _RUN.match(completion, i)
        return _value(run, negative, mode) if run else None
    last = None
    for last in _RUN.finditer(completion):  # noqa: B007 - we want the last run
        pass
    if last is None:
        return None
    before = completion[max(0, last.start() - 8):last.start()].rstrip()
    negative = False
    for _ in range(2):  # "-5", "$5", "-$5", "$-5", with spaces between
        if before.endswith("$"):
            before = before[:-1].rstrip()
        elif before.endswith("-") and not negative:
            negative, before = True, before[:-1].rstrip()
    return _value(last, negative, mode)


def verify(completion: str, *, answer: str | int | float, mode: Literal["strict", "flexible"] = "strict") -> float:
    """1.0 if the completion's answer number equals ``answer`` exactly, else 0.0.

    Args:
        completion: Model output (untrusted).
        answer: The gold number (``"1,000"``, ``72``, ``"-3.5"``, ``1e22``).
        mode: ``"strict"`` (after ``####``) or ``"flexible"`` (last number).
    """
    if not isinstance(completion, str) or mode not in ("strict", "flexible"):
        return 0.0
    gold = _gold(answer)
    pred = extract_answer(completion, mode)
    return 1.0 if gold is not None and pred is not None and pred == gold else 0.0


class GSM8KConfig(DataConfig):
    """Data source and scoring of GSM8K."""

    mode: Literal["strict", "flexible"] = "strict"
    """Answer extraction: ``strict`` (after ``####``) or ``flexible`` (the last number)."""
    chat: bool = True
    """Render as chat messages (instruct models) rather than raw text."""
    instruction: str = INSTRUCTION
    """Appended to each question."""


def _to_prompt(rec: dict[str, Any], i: int, split: str, what: str) -> Prompt:
    question, solution = rec.get("question"), rec.get("answer")
    if not isinstance(question, str) or not isinstance(solution, (str, int, float)) or isinstance(solution, bool):
        raise ConfigError(f"{what}: record {i} of the {split} split needs 'question' and 'answer' fields (text)")
    if not isinstance(solution, str):
        value = _gold(solution)
        if value is None or abs(value) >= 10**MAX_NUMBER_CHARS:
            raise ConfigError(f"{what}: record {i} of the {split} split: answer {type(solution).__name__} is not a "
                              f"finite number of at most {MAX_NUMBER_CHARS} digits")
        solution = str(value.numerator) if value.denominator == 1 else repr(float(solution))
    gold = solution.rsplit("####", 1)[-1].strip()
    if parse_number(gold) is None:
        raise ConfigError(f"{what}: record {i} of the {split} split: no number after '####' in {str(solution)[-60:]!r}")
    rid = str(rec.get("id", f"gsm8k-{split}-{i:06d}"))
    return Prompt(id=rid, prompt=question, answer={"answer": gold.replace(",", "")},
                  metadata={"split": split, "solution": str(solution)})


def make_gsm8k_task(**options: Any) -> Task:
    """The ``sara/GSM8K-v0`` task; options are ``GSM8KConfig`` fields."""
    what = f"task {TASK_ID!r}"
    cfg = validate_config(GSM8KConfig, options, what=what)
    train, held_out = load_splits(cfg, data_path("gsm8k_small.jsonl"), what=what)
    return Task(
        id=TASK_ID,
        prompts=[_to_prompt(r, i, "train", what) for i, r in enumerate(train)],
        eval_prompts=[_to_prompt(r, i, "eval", what) for i, r in enumerate(held_out)],
        verifier=verify if cfg.mode == "strict" else functools.partial(verify, mode=cfg.mode),
        template="{prompt} " + cfg.instruction if cfg.instruction else "{prompt}",
        chat=cfg.chat,
        thread_safe=True,
        timeout_s=1.0,
        max_new_tokens=512,
        description=f"grade-school math word problems, '#### <number>' answers ({cfg.mode})",
        metadata={"config": cfg.model_dump()},
    )
