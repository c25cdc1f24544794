"""GSM8K: grade-school word problems; the answer is a number after ``####``.

Records are GSM8K-formatted (``question``; ``answer`` = reasoning ending in ``#### <number>``), read from a local
file, an offline Hugging Face cache (``hf_dataset="openai/gsm8k", hf_config="main"``) or, by default, the dozen
problems bundled with sara (``sara/data/gsm8k_small.jsonl``, written for this project).

Verifier modes (the whole completion is scanned, in linear time); both read one answer token and score 0 unless
the whole token is a number equal to the gold:
    ``strict``: the token right after the last ``####`` (a ``$`` and a ``-`` may come before it, in either order,
        with spaces between): everything up to the next whitespace.
    ``flexible``: the last token holding a digit, where a token is a run of ASCII letters, digits and
        ``. , / ^ * + - _ $ %`` (so ``3+2=5`` ends in the token ``5``, ``<<48/2=24>>24`` in ``24``); a token that is
        an exponent, a subscript or a second LaTeX argument (after ``^{``, ``_{``, ``}{``, ``\\sqrt{``) is no number.
A number token is an optional sign and ``$`` (either order), then a whole run of ASCII digits with commas that group
thousands (``1,234,567``) and at most one decimal point (``.5``, ``18.00``), then an optional ``%``; sentence
punctuation and markdown emphasis around it (``**14**.``) are not part of it. Anything else scores 0: fractions
``1/2``, exponents ``72e5`` and ``2^10``, expressions ``10-3``, repeated dots ``5.5.5``, trailing letters ``14th``.
In flexible mode only, comma-separated numbers without thousands grouping are a list whose last number is read
(``1,2,3`` -> 3). A token longer than ``MAX_NUMBER_CHARS`` is no number (never its tail). Numbers are read exactly
(``"18.00"`` equals ``18``). The gold answer may be a string in the same format, an int or a float (exact: ``1e22`` is
10**22).
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

_NUMBER = r"(?:[0-9]+|[0-9]{1,3}(?:,[0-9]{3})+)(?:\.[0-9]+)?|\.[0-9]+"
_PLAIN = re.compile(r"-?(?:%s)" % _NUMBER, re.ASCII)  # noqa: UP031
_ANSWER = re.compile(r"([-+]?)(\$?)([-+]?)(%s)%%?" % _NUMBER, re.ASCII)  # noqa: UP031
_LIST = re.compile(r"[0-9]+(?:\.[0-9]+)?(?:,[0-9]+(?:\.[0-9]+)?)+", re.ASCII)
_GLUE = re.compile(r"[A-Za-z0-9.,/^*+\-_$%]*", re.ASCII)
_GLUE_TAIL = re.compile(r"[A-Za-z0-9.,/^*+\-_$%]*\Z", re.ASCII)
_STRICT_END = re.compile(r"\s|</|<\|")
_SPACE = re.compile(r"\s*")
_LEAD, _TRAIL = "*_([\"'", ".,;:!?)]}\"'*_$"
_ARGUMENT = ("^{", "_{", "}{", "\\sqrt{")
_MAX_TOKEN = 2 * MAX_NUMBER_CHARS + 16


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


def _number(token: str, negative: bool, dollar: bool, mode: str) -> Fraction | None:
    """The value of an answer token when the whole token is one number (with ``negative`` / ``dollar`` read before
    it in strict mode), else None."""
    token = token.lstrip(_LEAD).rstrip(_TRAIL)
    if len(token) > MAX_NUMBER_CHARS + 4:
        return None
    m = _ANSWER.fullmatch(token)
    if m is None:
        if mode == "flexible" and _LIST.fullmatch(token):  # "1,2,3": a list, whose last number is read
            return Fraction(token.rpartition(",")[2])
        return None
    sign1, cash, sign2, digits = m.group(1, 2, 3, 4)
    if (sign1 and sign2) or (negative and (sign1 or sign2)) or (dollar and cash) or len(digits) > MAX_NUMBER_CHARS:
        return None
    value = Fraction(digits.replace(",", ""))
    return -value if negative or "-" in (sign1, sign2) else value


def _strict(completion: str) -> Fraction | None:
    at = completion.rfind("####")
    if at < 0:
        return None
    i, negative, dollar = at + 4, False, False
    while True:  # whitespace, then "-" and "$" in either order (each once), then the token
        i = _SPACE.match(completion, i).end()  # type: ignore[union-attr]
        ch = completion[i:i + 1]
        if ch == "-" and not negative:
            negative = True
        elif ch == "$" and not dollar:
            dollar = True
        else:
            break
        i += 1
    end = _STRICT_END.search(completion, i, i + _MAX_TOKEN + 2)
    stop = end.start() if end else len(completion)
    if stop - i > _MAX_TOKEN:  # too long to be a number: not copied
        return None
    return _number(completion[i:stop], negative, dollar, "strict")


def _flexible(completion: str) -> Fraction | None:
    digit = max(completion.rfind(d) for d in "0123456789")  # the last digit is in the last token holding one
    if digit < 0:
        return None
    after = _GLUE.match(completion, digit, digit + _MAX_TOKEN + 1).end()  # type: ignore[union-attr]
    window = max(0, digit - _MAX_TOKEN - 1)
    start = _GLUE_TAIL.search(completion, window, digit).start()  # type: ignore[union-attr]
    if after - start > _MAX_TOKEN or (start == window and window > 0):  # too long to be a number: not copied
        return None
    if completion.endswith(_ARGUMENT, max(0, start - 6), start):
        return None
    return _number(completion[start:after], False, False, "flexible")


def extract_answer(completion: str, mode: Literal["strict", "flexible"] = "strict") -> Fraction | None:
    """The answer number of a completion (see the module docstring), or ``None``."""
    return _strict(completion) if mode == "strict" else _flexible(completion)


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
