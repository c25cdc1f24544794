"""GSM8K: grade-school word problems; the answer is a number after ``####``.

Records are GSM8K-formatted (``question``; ``answer`` = reasoning ending in ``#### <number>``), read from a local
file, an offline Hugging Face cache (``hf_dataset="openai/gsm8k", hf_config="main"``) or, by default, the dozen
problems bundled with sara (``sara/data/gsm8k_small.jsonl``, written for this project).

Verifier modes (only the last ``MAX_SCAN_CHARS`` characters of a completion are read):
    ``strict``: the number after the last ``####`` (an optional ``$`` is allowed before it).
    ``flexible``: the last number anywhere.
Commas, a ``$`` sign and trailing units/words are dropped; numbers compare exactly (``"18.00"`` equals ``18``).
Only ASCII digits count, and a number has at most ``MAX_NUMBER_CHARS`` characters.
"""

from __future__ import annotations

import functools
import re
from fractions import Fraction
from typing import Any, Literal

from sara.config import ConfigError, validate_config
from sara.data import data_path
from sara.envs.tasks.base import Task
from sara.envs.tasks.data import DataConfig, load_splits
from sara.types import Prompt

__all__ = ["GSM8KConfig", "INSTRUCTION", "MAX_SCAN_CHARS", "extract_answer", "make_gsm8k_task", "parse_number",
           "verify"]

TASK_ID = "sara/GSM8K-v0"
MAX_SCAN_CHARS = 4096
"""Only the tail of a completion is searched (answers come last)."""
MAX_NUMBER_CHARS = 40
"""Longest number accepted, commas included."""
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'

_NUM = rf"(-?)\$?\s*([0-9][0-9,]{{0,{MAX_NUMBER_CHARS}}}(?:\.[0-9]{{1,{MAX_NUMBER_CHARS}}})?)"
_STRICT = re.compile(r"####\s*" + _NUM, re.ASCII)
_FLEXIBLE = re.compile(_NUM, re.ASCII)


def parse_number(text: str) -> Fraction | None:
    """Exact value of a number like ``"-1,234.50"`` (commas dropped), or ``None``."""
    text = text.strip().replace(",", "").removeprefix("$")
    if not text or len(text) > MAX_NUMBER_CHARS or not re.fullmatch(r"-?[0-9]+(?:\.[0-9]+)?", text, re.ASCII):
        return None
    return Fraction(text)


def extract_answer(completion: str, mode: Literal["strict", "flexible"] = "strict") -> Fraction | None:
    """The answer number of a completion (see the module docstring), or ``None``."""
    tail = completion[-MAX_SCAN_CHARS:]
    pattern = _STRICT if mode == "strict" else _FLEXIBLE
    last = None
    for last in pattern.finditer(tail):  # noqa: B007 - we want the last match
        pass
    if last is None:
        return None
    return parse_number(last.group(1) + last.group(2))


def verify(completion: str, *, answer: str | int | float, mode: Literal["strict", "flexible"] = "strict") -> float:
    """1.0 if the completion's answer number equals ``answer`` exactly, else 0.0.

    Args:
        completion: Model output (untrusted).
        answer: The gold number (``"1,000"``, ``72``, ``"-3.5"``).
        mode: ``"strict"`` (after ``####``) or ``"flexible"`` (last number).
    """
    if not isinstance(completion, str) or mode not in ("strict", "flexible"):
        return 0.0
    gold = parse_number(str(answer))
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
    if not isinstance(question, str) or solution is None:
        raise ConfigError(f"{what}: record {i} of the {split} split needs 'question' and 'answer' fields")
    gold = str(solution).rsplit("####", 1)[-1].strip()
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
