"""The task model: a prompt source, a verifier and a prompt template.

A task is plain data. The verifier is any callable ``verify(completion: str, **answer_fields) -> float | None``
(``None`` = "not applicable", scored 0 by the env and counted); ``Prompt.answer`` holds the keyword arguments it gets.
Model output is untrusted input: a verifier must never ``eval``/``exec`` it and must bound the work it does on it
(input length, parse depth, number sizes) so that any completion is scored quickly.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from sara.types import Prompt

__all__ = ["Task", "Verifier", "render_prompt"]

Verifier = Callable[..., "float | None"]
"""``verify(completion, **answer_fields) -> float | None``."""


def render_prompt(template: str, text: str) -> str:
    """Substitute ``text`` for ``{prompt}`` in ``template`` (plain replacement: LaTeX braces stay untouched)."""
    return template.replace("{prompt}", text)


@dataclass(frozen=True, eq=False)
class Task:
    """A verifiable task.

    Attributes:
        id: Versioned id, e.g. ``"sara/Countdown-v0"`` (what ``make_task`` was called with).
        prompts: The training prompt pool.
        verifier: ``verify(completion, **prompt.answer) -> float | None``.
        template: Prompt template; ``{prompt}`` is replaced by ``Prompt.prompt`` (plain text replacement, so braces in
            LaTeX are safe). Ignored when ``Prompt.prompt`` is already a list of chat messages.
        chat: Render as chat messages (``[{"role": "user", "content": ...}]``, after an optional system message) so
            the backend applies the model's chat template; ``False`` = raw text (base models, the tiny policy).
        system_prompt: System message for chat rendering (``None`` = none).
        eval_prompts: Held-out prompts (never in ``prompts``).
        thread_safe: The verifier may run in a thread (``False`` -> it is scored in worker processes, which also cap
            its memory and can stop it in the middle of a C call, e.g. math-verify's sympy work).
        timeout_s: Default per-call time limit of the batch scorer, in seconds.
        stop: Suggested stop strings for generation.
        max_new_tokens: Suggested generation length (``None`` = the backend's setting).
        description: One line for listings.
        metadata: Free-form extras of the task (its factory's ``config``; ``alphabet``: the characters its prompts
            and answers use, read by the tiny policy; a mixture's ``components`` counts).
    """

    id: str
    prompts: Sequence[Prompt]
    verifier: Verifier
    template: str = "{prompt}"
    chat: bool = False
    system_prompt: str | None = None
    eval_prompts: Sequence[Prompt] = ()
    thread_safe: bool = True
    timeout_s: float = 1.0
    stop: tuple[str, ...] = ()
    max_new_tokens: int | None = None
    description: str = ""
    metadata: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not callable(self.verifier):
            raise TypeError(f"task {self.id!r}: verifier must be callable, got {type(self.verifier).__name__}")
        if "{prompt}" not in self.template:
            raise ValueError(f"task {self.id!r}: template must contain '{{prompt}}', got {self.template!r}")
        if not self.timeout_s > 0:
            raise ValueError(f"task {self.id!r}: timeout_s must be > 0, got {self.timeout_s!r}")

    def __repr__(self) -> str:  # short: a pool of prompts must not end up in an error message
        verifier = getattr(self.verifier, "__qualname__", None) or type(self.verifier).__name__
        return (f"Task(id={self.id!r}, prompts={len(self.prompts)}, eval_prompts={len(self.eval_prompts)}, "
                f"verifier={verifier})")

    def render(self, prompt: Prompt) -> str | list[dict[str, str]]:
        """The text (or chat messages) the model sees for ``prompt``."""
        if not isinstance(prompt.prompt, str):
            return [dict(m) for m in prompt.prompt]
        text = render_prompt(self.template, prompt.prompt)
        if not self.chat:
            return text
        messages = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        messages.append({"role": "user", "content": text})
        return messages

    def score(self, completion: str, prompt: Prompt) -> float | None:
        """Call the verifier directly (no time limit, exceptions propagate): for tests and interactive use."""
        return self.verifier(completion, **prompt.answer)

    def split(self, name: str) -> Sequence[Prompt]:
        """``"train"`` -> ``prompts``, ``"eval"`` -> ``eval_prompts``."""
        if name == "train":
            return self.prompts
        if name == "eval":
            return self.eval_prompts
        raise ValueError(f"task {self.id!r}: unknown split {name!r}; use 'train' or 'eval'")
