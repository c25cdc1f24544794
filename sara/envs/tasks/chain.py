"""Chain: a worked running total, ``"Q: 9 - 6 + 1 + 2"`` -> ``" 9-6=3, 3+1=4, 4+2=6. answer: 6"``.

A reasoning-length task a small pretrained LLM can follow from few-shot examples: a start digit and ``steps``
additions or subtractions of a digit, drawn so that every running value stays in 0..9. The worked solution writes one
``v op x = w`` line per step (about six tokens each with a digit-per-token tokenizer) and then the answer, so a
completion grows with the number of steps; the prompt pool mixes chains of ``min_steps`` to ``max_steps`` steps,
which are its difficulty bands (``Prompt.metadata["component"]``, ``eval.by`` reports each).

Format (plain text, no chat template): ``shots`` worked examples, each ``"Q: <chain>\\nA: <solution>"`` and a blank
line, then ``"Q: <chain>\\nA:"``; generation stops at a newline. The examples are drawn from the same distribution
and are disjoint from the training and held-out chains.

Verifier: reads the final answer only, the last ``answer:`` in the first ``MAX_SCAN_CHARS`` characters followed by an
ASCII integer token of at most ``MAX_ANSWER_CHARS`` characters (a whole token: ``6.5``, ``6/7``, ``6e2``, ``6-1`` are no
integer answer, a sentence's full stop after it is fine); the worked steps are not checked (a right answer from
wrong steps scores 1, as in any outcome-reward task). Scoring is a bounded regex scan (microseconds).
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np
from pydantic import Field, model_validator

from sara.config import ConfigError, SaraModel, validate_config
from sara.envs.tasks.base import Task
from sara.types import Prompt

__all__ = ["ALPHABET", "ChainConfig", "MAX_ANSWER_CHARS", "MAX_SCAN_CHARS", "make_chain_task", "solve", "verify"]

TASK_ID = "sara/Chain-v0"
MAX_ANSWER_CHARS = 8
"""Longest answer token read."""
MAX_SCAN_CHARS = 1024
"""Only this many leading characters of a completion are looked at."""

ALPHABET = "\n +,-.0123456789:=AQaenrsw"
"""Every character of every rendered prompt and worked solution (a character-level policy reads the task)."""
_ANSWER = re.compile(r"answer:[ \t]*(-?[0-9]+)(?![0-9A-Za-z_/^*+-]|[.,][0-9])", re.ASCII)
"""``answer: N`` where N is a whole number token: not the head of a decimal, fraction, power or expression."""


def verify(completion: str, *, answer: int) -> float:
    """1.0 if the last ``answer: N`` of the completion (within ``MAX_SCAN_CHARS``) is ``answer``, else 0.0.

    Args:
        completion: Model output (untrusted).
        answer: The chain's final value.
    """
    if not isinstance(completion, str) or isinstance(answer, bool) or not isinstance(answer, int):
        return 0.0
    found = _ANSWER.findall(completion[:MAX_SCAN_CHARS])
    if not found or len(found[-1]) > MAX_ANSWER_CHARS:
        return 0.0
    return 1.0 if int(found[-1]) == answer else 0.0


class ChainConfig(SaraModel):
    """Difficulty and size of the chain prompt pool."""

    min_steps: int = Field(2, ge=1, le=16)
    """Fewest steps of a chain (each chain's step count is drawn uniformly in [min, max])."""
    max_steps: int = Field(6, ge=1, le=16)
    """Most steps of a chain."""
    pool_size: int = Field(1500, ge=1, le=200_000)
    """Number of distinct training chains."""
    eval_size: int = Field(300, ge=0, le=50_000)
    """Number of distinct held-out chains (disjoint from the training pool)."""
    shots: int = Field(3, ge=0, le=16)
    """Worked examples before every prompt (the same for every prompt)."""
    seed: int = Field(0, ge=0)
    """Seed of the generator."""

    @model_validator(mode="after")
    def _check(self) -> ChainConfig:
        if self.min_steps > self.max_steps:
            raise ValueError(f"min_steps ({self.min_steps}) must be <= max_steps ({self.max_steps})")
        return self


Chain = tuple[int, tuple[tuple[str, int], ...]]
"""A start digit and its steps ``(op, digit)``."""


def solve(chain: Chain) -> tuple[str, int]:
    """The worked solution (``" 9-6=3, 3+1=4. answer: 4"``, with its leading space) and the final value."""
    v, parts = chain[0], []
    for op, x in chain[1]:
        w = v + x if op == "+" else v - x
        parts.append(f"{v}{op}{x}={w}")
        v = w
    return " " + ", ".join(parts) + f". answer: {v}", v


def question(chain: Chain) -> str:
    """``"9 - 6 + 1 + 2"``."""
    return str(chain[0]) + "".join(f" {op} {x}" for op, x in chain[1])


def _draw(rng: np.random.Generator, steps: int) -> Chain:
    v = int(rng.integers(0, 10))
    start, out = v, []
    for _ in range(steps):
        ups, downs = list(range(1, 10 - v)), list(range(1, v + 1))  # digits keeping the value in 0..9
        moves = [("+", x) for x in ups] + [("-", x) for x in downs]
        op, x = moves[int(rng.integers(0, len(moves)))]
        out.append((op, x))
        v = v + x if op == "+" else v - x
    return start, tuple(out)


def _draw_chains(cfg: ChainConfig) -> list[Chain]:
    """``pool_size + eval_size + shots`` distinct chains in order of first draw (seeded)."""
    needed = cfg.pool_size + cfg.eval_size + cfg.shots
    rng = np.random.default_rng([cfg.seed, 0xC4A1])
    seen: dict[Chain, None] = {}
    for _ in range(50 * needed + 1000):
        seen.setdefault(_draw(rng, int(rng.integers(cfg.min_steps, cfg.max_steps + 1))))
        if len(seen) >= needed:
            return list(seen)
    raise ConfigError(f"task {TASK_ID!r}: field 'pool_size': could not draw {needed} distinct chains of "
                      f"{cfg.min_steps}-{cfg.max_steps} steps; lower pool_size or raise max_steps")


def _prompt(chain: Chain, split: str, j: int) -> Prompt:
    return Prompt(id=f"chain-{j:06d}" if split == "train" else f"chain-eval-{j:06d}", prompt=question(chain),
                  answer={"answer": solve(chain)[1]},
                  metadata={"component": f"steps{len(chain[1])}", "steps": len(chain[1]), "split": split})


def make_chain_task(**options: Any) -> Task:
    """The ``sara/Chain-v0`` task; options are ``ChainConfig`` fields."""
    cfg = validate_config(ChainConfig, options, what=f"task {TASK_ID!r}")
    chains = _draw_chains(cfg)
    train = [_prompt(c, "train", i) for i, c in enumerate(chains[:cfg.pool_size])]
    held_out = [_prompt(c, "eval", i) for i, c in enumerate(chains[cfg.pool_size:cfg.pool_size + cfg.eval_size])]
    examples = "".join(f"Q: {question(c)}\nA:{solve(c)[0]}\n\n" for c in chains[cfg.pool_size + cfg.eval_size:])
    return Task(
        id=TASK_ID, prompts=train, eval_prompts=held_out, verifier=verify, template=examples + "Q: {prompt}\nA:",
        chat=False, thread_safe=True, timeout_s=1.0, stop=("\n",), max_new_tokens=8 * cfg.max_steps + 16,
        description="a running total of digit steps, worked step by step; answer = the final value",
        metadata={"config": cfg.model_dump(), "alphabet": ALPHABET},
    )
