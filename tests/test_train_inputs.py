"""Property: any ``sara train`` input (TrainConfig fields; allocator / algo / sampler / task spec strings with known
and unknown options, valid and invalid values) either runs a step or exits 2 with ONE line ``sara: error: ...``;
never a traceback. Derandomized and bounded, so CI runs the same examples every time."""

from __future__ import annotations

import tempfile

import pytest

pytest.importorskip("torch")
hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from sara.cli import main  # noqa: E402
from sara.metrics import read_jsonl  # noqa: E402

BASE = ["task=sara/Arithmetic-v0:max_digits=1,pool_size=30,eval_size=6", "groups_per_step=2", "k=2", "steps=1",
        "max_rollouts_per_step=16", "eval.num_prompts=3", "eval.samples=1", "threads=1", "scorer=inline",
        "tensorboard=false", "policy_options={d_model: 16, n_layers: 1, n_heads: 2, warm_start: {steps: 0}}"]

VALUES = ["-1", "0", "1", "2", "3", "0.5", "1.5", "abc", "", "null", "true", "1e9", "[1, 2]", "{a: 1}", "nan"]
SMALL = ["-1", "0", "1", "2", "3", "0.5", "abc", "", "null", "true", "[1]", "nan"]  # no huge sizes: one step is cheap
FIELDS = {  # field -> values drawn for it (sizes stay small so that a valid input runs one step quickly)
    "k": SMALL, "groups_per_step": SMALL, "max_rollouts_per_step": SMALL, "rollout_budget": SMALL,
    "steps": ["0", "1", "-1", "abc", "null"], "temperature": VALUES, "max_new_tokens": SMALL, "seed": VALUES,
    "scorer": ["thread", "process", "inline", "auto", "gpu", ""], "optim.lr": VALUES, "optim.epochs": SMALL,
    "optim.minibatch_rollouts": SMALL, "optim.warmup_steps": SMALL, "optim.schedule": ["cosine", "linear", "x"],
    "optim.grad_clip": VALUES, "optim.betas": ["[0.9, 0.99]", "[2, 3]", "1", "abc"], "optim.total_optimizer_steps": SMALL,
    "eval.every": SMALL, "eval.num_prompts": SMALL, "eval.samples": SMALL, "eval.greedy": ["true", "maybe"],
    "checkpoint_every": SMALL, "keep_checkpoints": SMALL, "name": ["x", "", "a/b"], "threads": SMALL,
    "policy": ["tiny", "hf:model=does-not-exist", "nope", "tiny:d_model=banana", "tiny:max_len=3", ""],
    "backend": ["tiny", "nope", "tiny:max_batch=0", "hf", ""], "policy_options": ["1", "[1]", "{d_model: -3}"],
    "backend_options": ["1", "{max_batch: 0}"], "ray.num_workers": ["0", "-1", "abc"], "unknown_field": ["1"],
    "eval": ["3"], "optim": ["abc"],
}


def _component_options() -> dict[str, dict[str, list[str]]]:
    """Per spec field: component name -> option names (from the registries' config classes; an allocator's as a
    spec gives them, its internals flat), plus bogus ones."""
    from sara.algos import ALGOS, AlgoSpec
    from sara.allocators import ALLOCATORS
    from sara.envs.tasks.arithmetic import ArithmeticConfig
    from sara.samplers.predictive import PredictiveSamplerConfig

    extra = ["bogus"]
    return {
        "allocator": {n: [*ALLOCATORS.get(n).Config.option_names(), *extra] for n in ALLOCATORS._items},
        "algo": {n: [*AlgoSpec.model_fields, *extra] for n in ALGOS._items},
        "sampler": {"uniform": ["epochs", *extra], "predictive": [*PredictiveSamplerConfig.model_fields, *extra]},
        "task": {"sara/Arithmetic-v0": [*ArithmeticConfig.model_fields, *extra],
                 "sara/Countdown-v0": ["chat", "pool_size", *extra], "sara/GSM8K-v0": ["eval_size", *extra],
                 "sara/MATH-v0": ["eval_size", "chat", *extra], "nope/Task-v0": [], "sara.data:data_path": []},
    }


OPTIONS = _component_options()
OPTION_VALUES = ["-1", "0", "0.45", "1", "2", "3", "abc", "", "2/1", "true", "empirical", "complete", "as_is", "auto",
                 "1e9", "nan"]


@st.composite
def spec_override(draw):
    field = draw(st.sampled_from(sorted(OPTIONS)))
    name = draw(st.sampled_from(sorted(OPTIONS[field])))
    names = OPTIONS[field][name]
    opts = draw(st.lists(st.sampled_from(names), max_size=3, unique=True)) if names else []
    if field == "task" and name == "sara/Arithmetic-v0":  # keep the pool small: a valid task builds quickly
        opts = [o for o in opts if o not in ("pool_size", "eval_size")] + ["pool_size", "eval_size"]
    values = {"pool_size": st.sampled_from(["30", "0", "-1", "abc"]), "eval_size": st.sampled_from(["6", "0", "1e9"])}
    body = ",".join(f"{o}={draw(values.get(o, st.sampled_from(OPTION_VALUES)))}" for o in opts)
    return f"{field}={name}:{body}" if body else f"{field}={name}"


field_override = st.sampled_from(sorted(FIELDS)).flatmap(lambda f: st.sampled_from(FIELDS[f]).map(lambda v: f"{f}={v}"))
overrides = st.lists(st.one_of(field_override, spec_override()), min_size=1, max_size=3)


@settings(max_examples=120, derandomize=True, deadline=None, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(extra=overrides)
def test_train_input_runs_a_step_or_fails_in_one_line(extra, capsys):
    capsys.readouterr()
    with tempfile.TemporaryDirectory() as out:
        argv = ["train", "--quiet", "--out", out]
        for s in [*BASE, *extra]:
            argv += ["--set", s]
        try:
            rc = main(argv)
        except SystemExit as exc:  # argparse itself (not expected with --set values)
            rc = exc.code
        captured = capsys.readouterr()
        if rc == 0:
            records = read_jsonl(f"{out}/metrics.jsonl")
            assert records and records[-1]["step"] <= 1, extra
            return
        lines = [line for line in captured.err.splitlines() if line.strip()]
        assert rc == 2, (extra, captured.err)
        assert lines and lines[-1].startswith("sara: error: "), (extra, captured.err)
        assert all(line.startswith("sara: ") for line in lines), (extra, captured.err)
