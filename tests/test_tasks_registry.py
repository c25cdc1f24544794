"""The task registry, parametrized over every registered task: check_task, gymnasium, determinism."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from typing import Any

import pytest

from sara.config import ConfigError
from sara.envs.tasks import TASKS, Task, make_task, register_task, task_ids
from sara.testing import check_task
from sara.testing.task import TaskCheckError
from sara.types import Prompt

# Small options and a known-correct completion per built-in task (a new built-in task must add its entry here).
SMALL: dict[str, dict[str, Any]] = {
    "sara/Arithmetic-v0": {"pool_size": 40, "eval_size": 8},
    "sara/Chain-v0": {"pool_size": 40, "eval_size": 8},
    "sara/Countdown-v0": {"pool_size": 40, "eval_size": 8},
    "sara/GSM8K-v0": {"eval_size": 2},
    "sara/MATH-v0": {"eval_size": 4},
    "sara/AIME-v0": {"eval_size": 2},
    "sara/Mixture-v0": {"pool_size": 40, "eval_size": 8},
}
REFERENCE: dict[str, Callable[[Prompt], str]] = {
    "sara/Arithmetic-v0": lambda p: f"{p.answer['answer']}\n",
    "sara/Chain-v0": lambda p: f" the steps. answer: {p.answer['answer']}\n",
    "sara/Countdown-v0": lambda p: f"<think>try</think> <answer> {p.metadata['solution']} </answer>",
    "sara/GSM8K-v0": lambda p: str(p.metadata["solution"]),
    "sara/MATH-v0": lambda p: f"We find the answer is $\\boxed{{{p.answer['answer']}}}$.",
    "sara/AIME-v0": lambda p: f"Therefore the answer is \\boxed{{{p.answer['answer']}}}.",
    "sara/Mixture-v0": lambda p: f"{p.answer['answer']}\n",  # the default mixture: arithmetic components
}
BUILTIN = sorted(SMALL)


def test_builtin_ids_are_registered() -> None:
    assert set(BUILTIN) <= set(task_ids())


@pytest.mark.parametrize("task_id", task_ids())
def test_every_registered_task_passes_check_task(task_id: str) -> None:
    stats = check_task(task_id, reference=REFERENCE.get(task_id), gym=True, **SMALL.get(task_id, {}))
    assert stats["prompts"] > 0 and stats["calls"] > 100
    if task_id in REFERENCE:
        assert stats["reference_mean"] == 1.0


@pytest.mark.parametrize("task_id", task_ids())
def test_gymnasium_make(task_id: str) -> None:
    gymnasium = pytest.importorskip("gymnasium")
    import sara.envs.gym  # noqa: F401 - registers every task

    env = gymnasium.make(task_id, **SMALL.get(task_id, {}))
    obs, info = env.reset(seed=3)
    obs2, info2 = env.reset(seed=3)
    assert obs == obs2 and info["prompt_id"] == info2["prompt_id"]
    prompt = env.unwrapped.prompts[info["pool_index"]]  # type: ignore[attr-defined]
    assert isinstance(obs, str) and obs
    if task_id in REFERENCE:
        _, reward, terminated, truncated, step_info = env.step(REFERENCE[task_id](prompt))
        assert (reward, terminated, truncated, step_info["verifier"]) == (1.0, True, False, "ok")
    env.reset(options={"index": 0})
    _, reward, terminated, _, _ = env.step("")
    assert reward == 0.0 and terminated
    env.close()


def test_register_and_make() -> None:
    with pytest.raises(ValueError, match="versioned"):
        register_task("NoVersion", lambda: None)  # type: ignore[arg-type,return-value]
    with pytest.raises(ValueError, match="already registered"):
        register_task("sara/Arithmetic-v0", lambda: None)  # type: ignore[arg-type,return-value]
    with pytest.raises(ConfigError, match="unknown task"):
        make_task("sara/Nope-v0")
    with pytest.raises(ConfigError, match="max_digits"):
        make_task("sara/Arithmetic-v0:max_digits=banana")
    task = make_task("sara/Arithmetic-v0:max_digits=2,pool_size=30", eval_size=3, seed=5)
    assert len(task.prompts) == 30 and task.metadata["config"]["max_digits"] == 2

    def factory(**kw: Any) -> Task:
        return Task(id="test/Echo-v0", prompts=[Prompt(id="a", prompt="say hi", answer={"text": "hi"})],
                    eval_prompts=[Prompt(id="b", prompt="say hi again", answer={"text": "hi"})],
                    verifier=lambda c, *, text: float(c.strip() == text))

    register_task("test/Echo-v0", factory)
    try:
        assert check_task("test/Echo-v0", reference=lambda p: "hi")["reference_mean"] == 1.0
        # "module:attr" entry points, registered lazily or used directly
        register_task("test/ArithEP-v0", "sara.envs.tasks.arithmetic:make_arithmetic_task")
        assert len(make_task("test/ArithEP-v0", pool_size=7, eval_size=0).prompts) == 7
        assert make_task("sara.envs.tasks.gsm8k:make_gsm8k_task").id == "sara/GSM8K-v0"
        with pytest.raises(ConfigError, match="sara.data.data_path .* is no task entry point, so it was not called"):
            make_task("sara.data:data_path", name="gsm8k_small.jsonl")  # refused before it is called
    finally:
        TASKS._items.pop("test/Echo-v0", None)
        TASKS._items.pop("test/ArithEP-v0", None)


def test_check_task_reports_problems() -> None:
    def raising(completion: str) -> float:
        if "boxed" in completion:
            raise RuntimeError("crash")
        return float("nan") if completion == "nan" else 0.0

    prompts = [Prompt(id="a", prompt="q1"), Prompt(id="a", prompt="q2")]
    bad = Task(id="test/Bad-v0", prompts=prompts, eval_prompts=[Prompt(id="b", prompt="q1")], verifier=raising)
    with pytest.raises(TaskCheckError) as err:
        check_task(bad, reference=lambda p: "")
    msg = str(err.value)
    for needle in ["not unique", "also appear in the training pool", "raised RuntimeError", "returned nan",
                   "reference completion"]:
        assert needle in msg


def test_check_task_requires_a_held_out_split_unless_told_otherwise() -> None:
    prompts = [Prompt(id=f"p{i}", prompt=f"q{i}", answer={"answer": str(i)}) for i in range(20)]
    verify = lambda completion, *, answer: float(completion.strip() == answer)  # noqa: E731
    no_eval = Task(id="test/NoEval-v0", prompts=prompts, verifier=verify)
    with pytest.raises(TaskCheckError, match="no held-out prompts"):
        check_task(no_eval, completions=("1",))
    assert check_task(no_eval, completions=("1",), require_eval=False)["eval_prompts"] == 0
    split = Task(id="test/Split-v0", prompts=prompts[5:], eval_prompts=prompts[:5], verifier=verify)
    assert check_task(split, reference=lambda p: p.answer["answer"], completions=("1",))["eval_prompts"] == 5


def test_task_model_validation() -> None:
    with pytest.raises(ValueError, match="template"):
        Task(id="t/T-v0", prompts=[], verifier=lambda c: 0.0, template="no placeholder")
    with pytest.raises(TypeError, match="callable"):
        Task(id="t/T-v0", prompts=[], verifier="nope")  # type: ignore[arg-type]
    task = Task(id="t/T-v0", prompts=[Prompt(id="a", prompt="2 {x}")], verifier=lambda c: 0.0,
                template="Q: {prompt} {not a field}")
    assert task.render(task.prompts[0]) == "Q: 2 {x} {not a field}"
    with pytest.raises(ValueError, match="split"):
        task.split("test")


def test_light_imports() -> None:
    code = ("import sys, sara.envs.tasks, sara.envs.task_env; from sara.envs.tasks import make_task; "
            "make_task('sara/Countdown-v0', pool_size=5, eval_size=0); "
            "print(sorted(m for m in ('math_verify', 'gymnasium', 'torch', 'sympy') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def _reverse_task(task_id: str = "test/Reverse-v0", size: int = 3000) -> Task:
    prompts = [Prompt(id=f"r{i}", prompt=f"{'abc'[i % 3]}{'cab'[i % 2]}>", answer={"answer": "x"}) for i in range(size)]
    return Task(id=task_id, prompts=prompts[100:], eval_prompts=prompts[:100],
                verifier=lambda completion, *, answer: float(completion.strip() == answer))


def test_a_task_object_registers_as_itself_and_refuses_options() -> None:
    task = _reverse_task()
    register_task("test/Reverse-v0", task)
    try:
        assert make_task("test/Reverse-v0") is task
        with pytest.raises(ConfigError, match="takes no options") as err:
            make_task("test/Reverse-v0", seed=1)
        assert "\n" not in str(err.value) and len(str(err.value)) < 300
        assert repr(task) == "Task(id='test/Reverse-v0', prompts=2900, eval_prompts=100, verifier=_reverse_task.<locals>.<lambda>)"
    finally:
        TASKS._items.pop("test/Reverse-v0", None)
    with pytest.raises(TypeError, match="expected a Task, a factory") as err:
        register_task("test/Bad-v0", [task.prompts] * 100)  # type: ignore[arg-type]
    assert len(str(err.value)) < 300 and "test/Bad-v0" not in TASKS


def test_task_errors_are_one_bounded_line() -> None:
    task = _reverse_task(size=20_000)
    TASKS.register("test/Raw-v0", task)  # straight into the registry: still the task itself
    TASKS.register("test/NotCallable-v0", [task] * 1000)
    TASKS.register("test/Sig-v0", lambda *, size: task)
    try:
        assert make_task("test/Raw-v0") is task
        for spec in ("test/NotCallable-v0", "test/Sig-v0:size=1,colour=" + "x" * 5000):
            with pytest.raises(ConfigError) as err:
                make_task(spec)
            assert "\n" not in str(err.value) and len(str(err.value)) < 600, len(str(err.value))
    finally:
        for name in ("test/Raw-v0", "test/NotCallable-v0", "test/Sig-v0"):
            TASKS._items.pop(name, None)


def test_train_config_takes_a_task_object() -> None:
    from sara.train import TrainConfig

    first, second = _reverse_task("test/Obj-v0"), _reverse_task("test/Obj-v0")
    builtin = make_task("sara/Arithmetic-v0", pool_size=10, eval_size=2)
    try:
        cfg = TrainConfig(task=first)
        assert cfg.task == "test/Obj-v0" and make_task(cfg.task) is first
        assert TrainConfig(task=first).task == "test/Obj-v0"  # the same object: the same name
        assert TrainConfig(task=second).task == "test/Obj-v0#2"  # another object: a new name, nothing replaced
        assert make_task("test/Obj-v0") is first and make_task("test/Obj-v0#2") is second
        spec = TrainConfig(task=builtin).task  # the id names a factory: the factory stays
        assert spec == "sara/Arithmetic-v0#2" and make_task(spec) is builtin
        assert len(make_task("sara/Arithmetic-v0", pool_size=5, eval_size=0).prompts) == 5
    finally:
        for name in ("test/Obj-v0", "test/Obj-v0#2", "sara/Arithmetic-v0#2"):
            TASKS._items.pop(name, None)


def test_the_tiny_policy_names_the_missing_alphabet_key() -> None:
    pytest.importorskip("torch")
    from sara.policies import make_tiny_policy_for_task

    with pytest.raises(ConfigError) as err:
        make_tiny_policy_for_task({}, task=_reverse_task())
    msg = str(err.value)
    assert "metadata key 'alphabet'" in msg and "metadata={'alphabet': '>abcx'}" in msg
    assert msg.index("alphabet") < msg.index("smollm2") and "\n" not in msg and len(msg) < 600
