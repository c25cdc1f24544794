"""A ``module:attr`` config value is kind-checked before anything is called, for every registry: ``os:system``, a
plain function with side effects, a class of another kind, a missing module are each one ``sara: error:`` line and
nothing runs (only the module import, which the docs say a ``module:attr`` value does). Kinds that fit still work:
annotated factories, ``entry_point``-marked objects; a factory of the wrong arity is a one-line error too."""

from __future__ import annotations

import os
import sys
import textwrap

import pytest

pytest.importorskip("torch")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from sara.cli import main  # noqa: E402
from sara.config import ConfigError  # noqa: E402

BASE = ["task=sara/Arithmetic-v0:max_digits=1,pool_size=30,eval_size=6", "groups_per_step=2", "k=2", "steps=1",
        "max_rollouts_per_step=16", "eval.num_prompts=3", "eval.samples=1", "threads=1", "scorer=inline",
        "tensorboard=false", "policy_options={d_model: 16, n_layers: 1, n_heads: 2, warm_start: {steps: 0}}"]

EVIL = """
import os
from sara.envs.tasks import Task
from sara.policies.base import Policy
from sara.registry import entry_point

MARK = os.environ["SARA_TEST_MARK"]

def boom(*args, **kwargs):
    open(MARK, "w").close()
    return 0

class NotAnAllocator:
    def __init__(self, *args, **kwargs):
        open(MARK, "w").close()

def returns_task_but_takes_nothing() -> Task:
    open(MARK, "w").close()

def policy_of_wrong_arity() -> Policy:
    open(MARK, "w").close()

@entry_point("task")
def marked_task(**options):
    from sara.envs.tasks import make_task
    return make_task("sara/Arithmetic-v0:max_digits=1,pool_size=30,eval_size=6")
"""


@pytest.fixture
def evil(tmp_path, monkeypatch):
    """A module ``sara_test_evil`` on the path whose callables create ``mark`` when called."""
    (tmp_path / "sara_test_evil.py").write_text(textwrap.dedent(EVIL))
    mark = tmp_path / "called"
    monkeypatch.setenv("SARA_TEST_MARK", str(mark))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    yield mark
    sys.modules.pop("sara_test_evil", None)


def _train(tmp_path, capsys, *sets: str) -> tuple[int, list[str]]:
    capsys.readouterr()
    argv = ["train", "--quiet", "--out", str(tmp_path / "run")]
    for s in [*BASE, *sets]:
        argv += ["--set", s]
    rc = main(argv)
    return rc, [line for line in capsys.readouterr().err.splitlines() if line.strip()]


FIELDS = {"task": "task={}:command=touch pwned", "policy": "policy={}", "backend": "backend={}",
          "allocator": "allocator={}", "algo": "algo={}", "sampler": "sampler={}",
          "advantage": "algo=grpo:advantage={}"}
TARGETS = ["os:system", "builtins:print", "sara_test_evil:boom", "sara_test_evil:NotAnAllocator",
           "sara.data:data_path", "sara_test_evil:missing", "no_such_module_xyz:attr", "sara_test_evil:MARK",
           "os.path:join"]


@pytest.mark.parametrize("field", sorted(FIELDS))
def test_os_system_is_refused_before_it_runs(field, evil, tmp_path, capsys):
    rc, lines = _train(tmp_path, capsys, FIELDS[field].format("os:system"))
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("sara: error: "), lines
    assert "os:system" in lines[0] and not (tmp_path / "pwned").exists()
    assert field in lines[0] or "is no" in lines[0]


@settings(max_examples=40, derandomize=True, deadline=None, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(field=st.sampled_from(sorted(FIELDS)), target=st.sampled_from(TARGETS))
def test_no_entry_point_of_another_kind_is_ever_called(field, target, evil, tmp_path, capsys):
    rc, lines = _train(tmp_path, capsys, FIELDS[field].format(target))
    assert rc == 2 and lines and all(line.startswith("sara: ") for line in lines), lines
    assert lines[-1].startswith("sara: error: ") and target in lines[-1], lines
    assert not evil.exists(), f"{field}={target} was called"
    assert not (tmp_path / "pwned").exists()


def test_registries_without_a_kind_check_accept_only_marked_objects(evil):
    from sara.envs.sim.binary import make_population

    with pytest.raises((KeyError, ConfigError), match="is no population entry point"):
        make_population("sara_test_evil:boom", 10)
    assert not evil.exists()


def test_a_factory_of_the_wrong_arity_is_one_line(evil, tmp_path, capsys):
    rc, lines = _train(tmp_path, capsys, "policy=sara_test_evil:policy_of_wrong_arity")
    assert rc == 2 and len(lines) == 1, lines
    assert "field 'policy'" in lines[0] and "cannot take the arguments" in lines[0]
    assert "(options, *, task, seed, verbose)" in lines[0] and not evil.exists()
    rc, lines = _train(tmp_path, capsys, "task=sara_test_evil:returns_task_but_takes_nothing:x=1")
    assert rc == 2 and len(lines) == 1 and "unexpected keyword argument 'x'" in lines[0] and not evil.exists()


def test_entry_points_of_the_right_kind_run(evil, tmp_path, capsys):
    rc, lines = _train(tmp_path, capsys, "task=sara_test_evil:marked_task")
    assert rc == 0, lines
    rc, lines = _train(tmp_path / "b", capsys, "task=sara.envs.tasks.arithmetic:make_arithmetic_task:max_digits=1,"
                       "pool_size=30,eval_size=6", "allocator=sara.allocators.uniform:UniformAllocator")
    assert rc == 0, lines


def test_the_docs_say_what_a_module_attr_value_does():
    from pathlib import Path

    text = (Path(__file__).parents[1] / "docs" / "security.md").read_text(encoding="utf-8").replace("*", "")
    text = " ".join(text.split())
    assert "imports that module" in text and "before anything is called" in text
    assert os.path.exists(Path(__file__).parents[1] / "README.md")
    assert "docs/security.md" in (Path(__file__).parents[1] / "README.md").read_text(encoding="utf-8")
