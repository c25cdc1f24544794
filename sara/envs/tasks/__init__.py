"""Verifiable tasks: a registry of versioned task ids -> task factories.

Example:
    >>> from sara.envs.tasks import make_task
    >>> task = make_task("sara/Arithmetic-v0", max_digits=2, pool_size=100, eval_size=20, seed=0)
    >>> p = task.prompts[0]
    >>> task.score(str(p.answer["answer"]), p)
    1.0

A factory is any callable ``factory(**options) -> Task``; register one by object or by ``"module:attr"`` string
(imported on first use), under a versioned id ``"namespace/Name-vN"`` (the gymnasium convention)::

    register_task("me/Palindrome-v0", "my_package.tasks:make_palindrome_task")

A ``Task`` object registers as itself (``make_task`` returns it; it takes no options), and ``task_spec`` gives any
``Task`` object a name a config can carry (``TrainConfig(task=<Task>)`` uses it).

Built-in tasks are registered lazily, so ``import sara.envs.tasks`` imports neither math-verify nor gymnasium.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable
from typing import Any

from sara.config import ConfigError, parse_spec
from sara.envs.tasks.base import Task, Verifier
from sara.registry import Registry, brief, clip, returns

__all__ = ["TASKS", "Task", "Verifier", "make_task", "register_task", "task_ids", "task_spec"]

TASKS: Registry[Callable[..., Task]] = Registry(
    "task", accepts=returns(Task), expects="a function annotated '-> sara.envs.tasks.Task'")
"""Task id -> factory ``(**options) -> Task``. A ``"module:attr"`` task must be annotated to return a ``Task`` (or be
marked ``@sara.registry.entry_point("task")``): it is kind-checked before it is called."""

_ID = re.compile(r"^(?:[A-Za-z0-9_.-]+/)?[A-Za-z0-9_.-]+-v(?:0|[1-9][0-9]*)$")


class FixedTask:
    """The factory of a registered ``Task`` object: returns that object and takes no options."""

    def __init__(self, task: Task) -> None:
        self.task = task

    def __call__(self) -> Task:
        return self.task

    def __repr__(self) -> str:
        return f"FixedTask({self.task!r})"


def register_task(task_id: str, factory: Callable[..., Task] | Task | str, *, override: bool = False) -> None:
    """Register a task factory (an object or a ``"module:attr"`` string), or a ``Task`` object, under a versioned id.

    Args:
        task_id: ``"namespace/Name-vN"`` or ``"Name-vN"``; bump ``N`` whenever prompts or scoring change.
        factory: ``factory(**options) -> Task``, its ``"module:attr"`` entry point, or a ``Task`` (``make_task``
            then returns that object, and refuses options).
        override: Replace an existing registration.

    Raises:
        ValueError: The id is not versioned, or is already registered (and ``override`` is false).
        TypeError: ``factory`` is neither a ``Task``, a callable nor a string.
    """
    if not isinstance(task_id, str) or not _ID.match(task_id):
        raise ValueError(f"task id {brief(task_id)} must be versioned like 'namespace/Name-v0'")
    if isinstance(factory, Task):
        factory = FixedTask(factory)
    elif not (callable(factory) or isinstance(factory, str)):
        raise TypeError(f"register_task({task_id!r}, ...): expected a Task, a factory (**options) -> Task or a "
                        f"'module:attr' string, got {brief(factory)}")
    TASKS.register(task_id, factory, override=override)


def task_spec(task: Task) -> str:
    """A registered name for the ``Task`` object ``task``, for a config's ``task`` field: its id when that id is free
    or already names this object, else ``"<id>#<n>"`` (the first free ``n`` from 2), so no registration is replaced.
    """
    if not isinstance(task, Task):
        raise TypeError(f"task_spec: expected a sara.envs.tasks.Task, got {brief(task)}")
    n = 1
    while True:
        name = task.id if n == 1 else f"{task.id}#{n}"
        entry = TASKS._items.get(name)
        if entry is None:
            TASKS.register(name, FixedTask(task))
            return name
        if entry is task or (isinstance(entry, FixedTask) and entry.task is task):
            return name
        n += 1


def task_ids() -> list[str]:
    """Registered task ids, sorted."""
    return TASKS.names()


def make_task(spec: str, **options: Any) -> Task:
    """Build a task from its id (or ``"module:attr"``), with options as keywords or in the spec.

    ``make_task("sara/Arithmetic-v0:max_digits=2", seed=1)`` and
    ``make_task("sara/Arithmetic-v0", max_digits=2, seed=1)`` are the same; keywords win over spec options.

    Raises:
        ConfigError: Unknown id, or an invalid option (the message names the field).
    """
    name, spec_options = parse_spec(spec)
    try:
        factory = TASKS.get(name)
    except KeyError as exc:
        raise ConfigError(str(exc.args[0])) from None
    kwargs = {**spec_options, **options}
    if isinstance(factory, Task):  # put in the registry directly rather than through register_task
        factory = FixedTask(factory)
    if isinstance(factory, FixedTask):
        if kwargs:
            raise ConfigError(f"task {name!r} is a registered Task object and takes no options (got "
                              f"{', '.join(sorted(kwargs))}); register a factory (**options) -> Task to take them")
        return factory()
    if not callable(factory):
        raise ConfigError(f"task {name!r}: registered as {brief(factory)}, which is neither a Task nor a factory "
                          "(**options) -> Task; register one of those")
    try:
        inspect.signature(factory).bind(**kwargs)
    except TypeError as exc:  # the factory cannot take these options (or is not a task factory)
        raise ConfigError(f"task {name!r}: {clip(str(exc))}") from None
    except ValueError:  # no signature to check (a builtin)
        pass
    task = factory(**kwargs)
    if not isinstance(task, Task):
        raise ConfigError(f"task {name!r}: factory returned {type(task).__name__}, expected sara.envs.tasks.Task")
    return task


register_task("sara/Arithmetic-v0", "sara.envs.tasks.arithmetic:make_arithmetic_task")
register_task("sara/Chain-v0", "sara.envs.tasks.chain:make_chain_task")
register_task("sara/Countdown-v0", "sara.envs.tasks.countdown:make_countdown_task")
register_task("sara/GSM8K-v0", "sara.envs.tasks.gsm8k:make_gsm8k_task")
register_task("sara/MATH-v0", "sara.envs.tasks.math:make_math_task")
register_task("sara/AIME-v0", "sara.envs.tasks.math:make_aime_task")
register_task("sara/Mixture-v0", "sara.envs.tasks.mixture:make_mixture_task")
