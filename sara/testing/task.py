"""``check_task``: the conformance check every task (built-in or yours) should pass.

It builds the task (when given an id), checks the prompt pool and the template, runs the verifier on reference
completions (when you can produce them) and on ``ADVERSARIAL_COMPLETIONS`` — untrusted-input cases every verifier
must survive: each call must return ``None`` or a finite number, raise nothing and finish within ``max_seconds``.
Optionally it runs gymnasium's ``env_checker`` on the task's gymnasium environment.
"""

from __future__ import annotations

import json
import math
import pickle
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from sara.envs.tasks import Task, make_task
from sara.types import Prompt

__all__ = ["ADVERSARIAL_COMPLETIONS", "check_task"]

_MB = 1 << 20


def _injection_cases() -> list[str]:
    return json.loads((Path(__file__).with_name("injection_cases.json")).read_text())["cases"]


def _adversarial() -> list[str]:
    cases = [
        "", " ", "\n" * 1000, "\t\r\n\x0b\x0c", "\x00", "\x00" * 1000, "1\x002", "\ufeff1", "\u200b", "\u202e1",
        # code injection (payloads kept in injection_cases.json): must never be executed
        *_injection_cases(),
        # huge numbers and powers
        "9**9**9**9", "<answer>9**9**9**9</answer>", "\\boxed{9^{9^{9^{9}}}}", "#### 9**9**9**9",
        "<answer>" + "9" * 5000 + "</answer>", "9" * 100_000, "#### " + "9" * 100_000, "\\boxed{" + "9" * 5000 + "}",
        "<answer>10**100000</answer>", "\\boxed{10^{100000}}", "\\boxed{100000!}", "<answer>2<<100000</answer>",
        "1e308", "1e309", "-1e309", "#### 1e999999",
        # deep nesting
        "(" * 100_000 + "1" + ")" * 100_000, "<answer>" + "(" * 100_000 + "1" + ")" * 100_000 + "</answer>",
        "<answer>" + "(" * 1000 + "</answer>", "\\boxed{" * 100_000, "\\boxed{" + "{" * 100_000 + "}",
        "{" * 100_000, "[" * 100_000, "-" * 100_000 + "1", "<answer>" + "-" * 10_000 + "1</answer>",
        "<answer>" + "+".join(["1"] * 50_000) + "</answer>",
        # big strings
        "x" * _MB, "1" * _MB, " " * _MB + "1", "<answer>" * 100_000, "</answer>" * 100_000,
        "<answer>1</answer>" * 50_000, "####" * 100_000, "\\boxed{1}" * 100_000, "a\n" * 500_000,
        # unicode digits and look-alikes
        "\u0661\u0662\u0663", "\uff11\uff12\uff13", "\u00b2", "\u2460", "\U0001d7d9\U0001d7da", "\u0967\u0968",
        "<answer>\u0661+\u0662</answer>", "#### \uff11\uff12", "\\boxed{\u0661\u0662}", "\u2212" + "5", "１＋１",
        # NaN / inf
        "nan", "NaN", "inf", "-inf", "Infinity", "<answer>nan</answer>", "#### nan", "\\boxed{nan}", "\\boxed{\\infty}",
        "<answer>1/0</answer>", "<answer>0/0</answer>", "#### inf", "\\boxed{\\frac{1}{0}}", "\\boxed{0/0}",
        # unbalanced / repeated tags
        "<answer>", "</answer>", "<answer>1", "1</answer>", "</answer>1<answer>", "<answer><answer>1</answer>",
        "<answer>1</answer></answer>", "<ANSWER>1</ANSWER>", "<answer> </answer>", "<answer></answer>",
        "\\boxed{", "\\boxed}", "\\boxed{}", "\\boxed{1", "\\boxed", "\\boxed{}{}{}", "####", "#### ", "###### 1",
        "#### -", "#### ,,,", "#### 1,2,3,4,5,6,7,8,9,0,1,2,3,4,5,6,7,8,9,0,1,2,3,4,5,6,7,8,9,0",
        # other syntax an expression parser must refuse
        "<answer>1.5 + 2</answer>", "<answer>0x10</answer>", "<answer>1_000</answer>", "<answer>1j</answer>",
        "<answer>-1 + 2</answer>", "<answer>1 // 2</answer>", "<answer>1 % 2</answer>", "<answer>True + 1</answer>",
        "<answer>1 ** 2</answer>", "<answer>1 << 2</answer>", "<answer>'1'</answer>", "<answer>01 + 2</answer>",
        "<answer>1 2</answer>", "<answer>(1, 2)</answer>", "<answer>[1]</answer>", "<answer>x</answer>",
        "-0", "+1", "--1", "0" * 1000 + "1", "1" * 30, "-" + "1" * 30,
    ]
    return cases


ADVERSARIAL_COMPLETIONS: tuple[str, ...] = tuple(_adversarial())
"""Untrusted completions every verifier must survive (returning a finite score or ``None``, quickly)."""


class TaskCheckError(AssertionError):
    """A task failed ``check_task``; the message lists every failure."""


def check_task(task: Task | str, *, reference: Callable[[Prompt], str] | None = None,
               completions: Sequence[str] = ADVERSARIAL_COMPLETIONS, num_prompts: int = 8,
               max_seconds: float | None = None, gym: bool = False, require_eval: bool = True,
               **task_options: Any) -> dict[str, float]:
    """Check a task against what ``sara train`` needs; raise ``TaskCheckError`` listing every problem, else return a
    few numbers.

    Args:
        task: A ``Task`` or a task id for ``make_task`` (then it is also built twice to check determinism).
        reference: ``prompt -> completion`` that must get the top score (e.g. from a known solution).
        completions: Adversarial completions (scored against each of the first ``num_prompts`` prompts' answers).
        num_prompts: How many prompts to check in depth.
        max_seconds: Longest allowed single verifier call (default: the task's ``timeout_s``).
        gym: Also run ``gymnasium.utils.env_checker.check_env`` on the task's gymnasium environment.
        require_eval: Require held-out prompts (``Task.eval_prompts``): the trainer evaluates on them before,
            during and after training. Pass False for a task used only for collection or benchmarks.
        **task_options: Options for ``make_task``.

    Returns:
        ``{"prompts", "eval_prompts", "calls", "max_call_seconds", "reference_mean"}``.
    """
    problems: list[str] = []
    built = make_task(task, **task_options) if isinstance(task, str) else task
    if not isinstance(built, Task):
        raise TaskCheckError(f"expected a sara Task, got {type(built).__name__}")
    t = built
    if isinstance(task, str):
        again = make_task(task, **task_options)
        if list(again.prompts) != list(t.prompts) or list(again.eval_prompts) != list(t.eval_prompts):
            problems.append("building the task twice gave different prompts (seed every random choice)")
    # prompt pool
    if len(t.prompts) == 0:
        problems.append("the training prompt pool is empty")
    if require_eval and len(t.eval_prompts) == 0:
        problems.append("no held-out prompts (Task.eval_prompts is empty): sara train evaluates on them; split off "
                        "an eval set, or pass require_eval=False if the task is never trained on")
    ids = [p.id for p in [*t.prompts, *t.eval_prompts]]
    if len(set(ids)) != len(ids):
        problems.append("prompt ids are not unique across the train and eval splits")
    train_text = {str(p.prompt) for p in t.prompts}
    if any(str(p.prompt) in train_text for p in t.eval_prompts):
        problems.append("some eval prompts also appear in the training pool")
    sample = list(t.prompts[:num_prompts]) + list(t.eval_prompts[:max(1, num_prompts // 4)])
    for p in sample:
        if not isinstance(p, Prompt):
            problems.append(f"pool item {p!r} is not a sara.types.Prompt")
            continue
        rendered = t.render(p)
        ok = (isinstance(rendered, str) and rendered.strip()) or (
            isinstance(rendered, list) and rendered and all({"role", "content"} <= set(m) for m in rendered))
        if not ok:
            problems.append(f"prompt {p.id!r} renders to {rendered!r}")
    if not t.thread_safe:
        try:
            pickle.dumps(t.verifier)
        except Exception as exc:
            problems.append(f"verifier is not thread-safe but cannot be pickled for worker processes: {exc}")
    limit = max_seconds if max_seconds is not None else t.timeout_s
    calls, slowest, ref_scores = 0, 0.0, []

    def call(completion: str, p: Prompt, what: str) -> float | None:
        nonlocal calls, slowest
        t0 = time.perf_counter()
        try:
            value = t.verifier(completion, **p.answer)
        except Exception as exc:
            problems.append(f"verifier raised {type(exc).__name__}: {str(exc)[:120]} on {what} (prompt {p.id!r})")
            return None
        dt = time.perf_counter() - t0
        calls += 1
        slowest = max(slowest, dt)
        if dt > limit:
            problems.append(f"verifier took {dt:.3f}s (> {limit}s) on {what} (prompt {p.id!r})")
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or not math.isfinite(value)):
            problems.append(f"verifier returned {value!r} on {what}; expected a finite float or None")
            return None
        return value

    for p in sample:
        empty = call("", p, "the empty completion")
        if reference is not None:
            ref = call(reference(p), p, "the reference completion")
            if ref is None or (empty is not None and ref <= empty):
                problems.append(f"reference completion of {p.id!r} scored {ref!r}, not above the empty one ({empty})")
            else:
                ref_scores.append(float(ref))
    for p in sample[:2]:
        for i, c in enumerate(completions):
            call(c, p, f"adversarial completion #{i} ({c[:40]!r}...)")
    if gym:
        problems.extend(_check_gym(t))
    if problems:
        shown = problems[:20] + ([f"... and {len(problems) - 20} more"] if len(problems) > 20 else [])
        raise TaskCheckError(f"task {t.id!r} failed check_task:\n  - " + "\n  - ".join(shown))
    return {"prompts": float(len(t.prompts)), "eval_prompts": float(len(t.eval_prompts)), "calls": float(calls),
            "max_call_seconds": slowest,
            "reference_mean": sum(ref_scores) / len(ref_scores) if ref_scores else float("nan")}


def _check_gym(task: Task) -> list[str]:
    from gymnasium.utils.env_checker import check_env

    from sara.envs.gym import TextTaskEnv

    env = TextTaskEnv(task=task)
    try:
        check_env(env, skip_render_check=True)
    except Exception as exc:
        return [f"gymnasium env_checker: {type(exc).__name__}: {exc}"]
    finally:
        env.close()
    return []
