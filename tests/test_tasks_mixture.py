"""Weighted task mixtures (sara/Mixture-v0): spelling, sizes, determinism, per-prompt verifiers; and pool_outcomes."""

from __future__ import annotations

import pickle
import re

import pytest

from sara.bench.pool import pool_outcomes
from sara.config import ConfigError
from sara.envs.tasks import make_task
from sara.envs.tasks.mixture import (
    MIXTURES,
    make_mixture_task,
    parse_components,
    register_mixture,
    split_by_weight,
)
from sara.testing import check_task
from sara.testing.scripted import ScriptedBackend, prompt_text

ARITH_CD = ("arith=sara/Arithmetic-v0(max_digits=1;ops=+)@1|cd=sara/Countdown-v0(chat=false;max_numbers=3)@3")
SPEC = f"sara/Mixture-v0:components={ARITH_CD},pool_size=40,eval_size=12,seed=3"


def reference(prompt) -> str:
    if prompt.metadata["component"] == "cd":
        return f"<answer> {prompt.metadata['solution']} </answer>"
    return f"{prompt.answer['answer']}\n"


def test_spelling_sizes_ids_and_verifier_dispatch() -> None:
    task = make_task(SPEC)
    comps = {c["label"]: c for c in task.metadata["components"]}
    assert (comps["arith"]["train"], comps["cd"]["train"]) == (10, 30)  # 40 split 1:3
    assert (comps["arith"]["eval"], comps["cd"]["eval"]) == (3, 9)
    ids = [p.id for p in [*task.prompts, *task.eval_prompts]]
    assert len(set(ids)) == len(ids) == 52
    for p in task.prompts:
        label = p.metadata["component"]
        assert p.id.startswith(f"{label}/") and p.answer["mixture_component"] == (0 if label == "arith" else 1)
        assert task.score(reference(p), p) == 1.0
    arith = next(p for p in task.prompts if p.metadata["component"] == "arith")
    cd = next(p for p in task.prompts if p.metadata["component"] == "cd")
    assert re.fullmatch(r"[0-9]\+[0-9]=", arith.prompt)  # Arithmetic's template: the raw text
    assert cd.prompt.startswith("A conversation between User and Assistant")  # rendered by Countdown's template
    assert task.render(cd) == cd.prompt and not task.chat
    assert task.score(reference(cd), arith) == 0.0 and task.score(reference(arith), cd) == 0.0  # each its own
    assert task.max_new_tokens == 1024 and "alphabet" not in task.metadata  # Countdown: long, no char alphabet
    # shuffled: the first prompts already mix the components
    assert {p.metadata["component"] for p in task.prompts[:10]} == {"arith", "cd"}


def test_check_task_and_determinism() -> None:
    stats = check_task(SPEC, reference=reference)
    assert stats["reference_mean"] == 1.0 and stats["prompts"] == 40
    again, other = make_task(SPEC), make_task(SPEC.replace("seed=3", "seed=4"))
    assert [p.id for p in again.prompts] == [p.id for p in make_task(SPEC).prompts]
    assert [p.prompt for p in other.prompts] != [p.prompt for p in again.prompts]


def test_python_api_equals_the_spec_string_and_named_mixtures() -> None:
    listed = make_mixture_task([("arith", "sara/Arithmetic-v0:max_digits=1,ops=+", 1),
                                ("cd", "sara/Countdown-v0:chat=false,max_numbers=3", 3)],
                               pool_size=40, eval_size=12, seed=3)
    assert [(p.id, p.prompt) for p in listed.prompts] == [(p.id, p.prompt) for p in make_task(SPEC).prompts]
    unlabeled = make_mixture_task([("sara/Arithmetic-v0:max_digits=2", 1)], pool_size=5, eval_size=1)
    assert all(p.id.startswith("c0/arith-") for p in unlabeled.prompts)
    register_mixture("test-mix", ARITH_CD)
    try:
        named = make_task("sara/Mixture-v0:components=test-mix,pool_size=40,eval_size=12,seed=3")
        assert [p.id for p in named.prompts] == [p.id for p in listed.prompts]
        with pytest.raises(ValueError, match="already registered"):
            register_mixture("test-mix", ARITH_CD)
    finally:
        MIXTURES.pop("test-mix", None)
    default = make_task("sara/Mixture-v0")  # the arithmetic-bands mixture
    assert {c["label"] for c in default.metadata["components"]} == {"easy", "two", "three", "four"}


@pytest.mark.parametrize(("components", "match"), [
    ("sara/Arithmetic-v0(max_digits=1", "must look like"),
    ("sara/Arithmetic-v0@0|sara/Countdown-v0", "weight"),
    ("sara/Arithmetic-v0@heavy", "weight"),
    ("a=sara/Arithmetic-v0|a=sara/Arithmetic-v0(max_digits=1)", "distinct"),
    ("sara/Nope-v0", r"component 'c0' \(sara/Nope-v0\).*unknown task"),
    ("sara/Arithmetic-v0(max_digits=banana)", "max_digits"),
    ("sara/Arithmetic-v0(max_digits=1;pool_size=5)", r"field 'pool_size': component 'c0'.*has 5 training"),
    ("sara/Arithmetic-v0(max_digits=1)|sara/Countdown-v0", "mix chat and plain-text"),
])
def test_bad_components_raise_config_errors_naming_the_problem(components: str, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        make_task(f"sara/Mixture-v0:components={components},pool_size=20,eval_size=4")


def test_bad_sizes_and_weights() -> None:
    with pytest.raises(ConfigError, match="pool_size"):
        make_task("sara/Mixture-v0:pool_size=0")
    with pytest.raises(ConfigError, match=r"item 0"):
        make_mixture_task([("a", "b", "c", "d")])
    assert split_by_weight(10, [1, 1, 1]) == [4, 3, 3] and sum(split_by_weight(7, [0.2, 0.5, 0.3])) == 7
    assert split_by_weight(40, [1, 3]) == [10, 30]
    assert parse_components("x=sara/Arithmetic-v0( max_digits=2 ; ops=+ )@2.5") == [
        ("x", "sara/Arithmetic-v0:max_digits=2,ops=+", 2.5)]


def test_overlapping_components_never_leak_eval_prompts_into_training() -> None:
    # two 1-digit addition components with different seeds draw many of the same 100 problems
    task = make_task("sara/Mixture-v0:components=a=sara/Arithmetic-v0(max_digits=1;ops=+;seed=1)"
                     "|b=sara/Arithmetic-v0(max_digits=1;ops=+;seed=2),pool_size=80,eval_size=20")
    train = {p.prompt for p in task.prompts}
    assert len(train) == len(task.prompts) < 80  # repeated texts dropped
    assert not any(p.prompt in train for p in task.eval_prompts)
    assert sum(c["train"] for c in task.metadata["components"]) == len(task.prompts)


def test_a_process_scored_component_makes_the_mixture_process_scored_and_picklable() -> None:
    task = make_task("sara/Mixture-v0:components=sara/MATH-v0(eval_size=2)@1|sara/GSM8K-v0(eval_size=2)@1,"
                     "pool_size=6,eval_size=2")
    assert task.chat and not task.thread_safe
    verifier = pickle.loads(pickle.dumps(task.verifier))
    math_prompt = next(p for p in task.prompts if p.metadata["component"] == "c0")
    assert verifier(f"so \\boxed{{{math_prompt.answer['answer']}}}", **math_prompt.answer) == 1.0
    assert isinstance(task.render(math_prompt), list)  # chat messages, rendered by the MATH component


class ByComponent(ScriptedBackend):
    """Right on 'easy' prompts, wrong on 'hard', right for odd seeds on 'mid' (mixed groups)."""

    def answer(self, request, seed):
        a, b = map(int, re.findall(r"([0-9]+)\+([0-9]+)=", prompt_text(request))[-1])
        digits = max(len(str(a)), len(str(b)))
        right = digits == 1 or (digits == 2 and seed % 2 == 1)
        return f"{a + b if right else a + b + 1}\n"


def test_pool_outcomes_counts_solved_unsolved_and_mixed_groups_per_component() -> None:
    task = make_task("sara/Mixture-v0:components=easy=sara/Arithmetic-v0(max_digits=1;ops=+)@1"
                     "|mid=sara/Arithmetic-v0(min_digits=2;max_digits=2;ops=+)@2"
                     "|hard=sara/Arithmetic-v0(min_digits=3;max_digits=3;ops=+)@1,pool_size=80,eval_size=8")
    out = pool_outcomes(None, task, k=8, seed=0, backend=ByComponent())
    assert (out.prompts, out.k) == (80, 8)
    assert out.by_component["easy"]["solved"] == 1.0 and out.by_component["hard"]["unsolved"] == 1.0
    assert out.by_component["mid"]["mixed"] > 0.9  # 8 seeds all even or all odd: rare
    assert out.solved >= 0.25 and out.unsolved >= 0.25 and out.mixed == pytest.approx(
        0.5 * out.by_component["mid"]["mixed"])
    assert out.saturated + out.mixed == pytest.approx(1.0) and 0.25 < out.accuracy < 0.75
    assert out.table().count("\n") == 5 and "| easy | 20 | 100.0% |" in out.table()
    again = pool_outcomes(None, task, k=8, seed=0, backend=ByComponent())
    assert again == out
    held = pool_outcomes(None, task, k=4, seed=0, backend=ByComponent(), split="eval", max_prompts=5)
    assert held.prompts == 5 and held.k == 4
