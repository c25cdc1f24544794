"""TaskEnv: a task on a (fake) generation backend, as the RolloutEnv that collect drives."""

from __future__ import annotations

import re
import time
from collections.abc import Sequence

import numpy as np
import pytest

from sara import UniformSampler, collect, make_allocator
from sara.envs.base import Completion, GenerationBackend, GenerationRequest, RolloutEnv, SamplingConfig
from sara.envs.task_env import TaskEnv
from sara.envs.tasks import Task, make_task
from sara.testing.scripted import ScriptedBackend, prompt_text
from sara.types import Prompt, RolloutRequest


class FakeBackend(ScriptedBackend):
    """Answers arithmetic prompts; a completion is right unless ``seed % 3 == 0``; records every call."""

    def answer(self, request: GenerationRequest, seed: int) -> Completion:
        a, op, b = re.findall(r"([0-9]+)([+-])([0-9]+)=", prompt_text(request))[-1]
        value = int(a) + int(b) if op == "+" else int(a) - int(b)
        return self.completion(request, seed, str(value if seed % 3 else value + 1) + "\n",
                               finish_reason="stop" if seed % 5 else "length")


def _requests(env: TaskEnv, spec: Sequence[tuple[int, Sequence[int]]], prefix: str = "") -> list[RolloutRequest]:
    return [RolloutRequest(unit_id=i, pool_index=p, prompt=env.prompts[p], seeds=tuple(seeds), prefix=prefix)
            for i, (p, seeds) in enumerate(spec)]


@pytest.fixture
def env() -> TaskEnv:
    return TaskEnv("sara/Arithmetic-v0", FakeBackend(), task_options={"pool_size": 64, "eval_size": 8})


def test_protocols(env: TaskEnv) -> None:
    assert isinstance(env, RolloutEnv) and isinstance(env.backend, GenerationBackend)
    assert env.sampling.max_new_tokens == env.task.max_new_tokens


def test_one_backend_call_per_round_and_rollout_fields(env: TaskEnv) -> None:
    reqs = _requests(env, [(0, [1, 2, 3]), (5, [3, 4]), (0, [6])])
    out = env.rollout(reqs)
    backend = env.backend
    assert isinstance(backend, FakeBackend) and len(backend.calls) == 1
    sent, sampling = backend.calls[0]
    assert [g.prompt for g in sent] == [env.prompts[0].prompt, env.prompts[5].prompt, env.prompts[0].prompt]
    assert [g.seeds for g in sent] == [(1, 2, 3), (3, 4), (6,)] and sampling is env.sampling
    assert [len(g) for g in out] == [3, 2, 1]
    for req, group in zip(reqs, out):
        for seed, r in zip(req.seeds, group):
            assert r.prompt_id == req.prompt.id and r.pool_index == req.pool_index and r.seed == seed
            assert r.reward == (0.0 if seed % 3 == 0 else 1.0)
            assert r.token_ids == tuple(ord(c) for c in r.completion) and r.num_tokens == len(r.completion)
            assert r.logprobs is not None and len(r.logprobs) == r.num_tokens
            assert r.prompt_token_ids == tuple(ord(c) for c in str(req.prompt.prompt))
            assert r.finish_reason == ("length" if seed % 5 == 0 else "stop")
    m = env.metrics()
    assert m["env/rounds"] == 1 and m["env/rollouts"] == 6 and m["env/truncated"] == 0
    assert m["env/reward_mean"] == pytest.approx(3 / 6)
    assert m["env/verifier_errors"] == 0 and m["env/verifier_timeouts"] == 0
    assert env.rollout([]) == [] and len(backend.calls) == 1


def test_prefix_is_sent_and_scored() -> None:
    """The backend sees prompt + prefix; the verifier scores prefix + completion."""
    seen: list[str] = []

    def verify(completion: str, *, answer: int) -> float:
        seen.append(completion)
        return 1.0

    base = make_task("sara/Arithmetic-v0", pool_size=8, eval_size=0)
    task = Task(id="test/Prefix-v0", prompts=base.prompts, verifier=verify, template="Q: {prompt}")
    backend = FakeBackend()
    env = TaskEnv(task, backend)
    env.rollout(_requests(env, [(2, [1])], prefix="PRE"))
    assert backend.calls[0][0][0].prompt == "Q: " + str(task.prompts[2].prompt) + "PRE"
    assert seen[0].startswith("PRE") and seen[0].removeprefix("PRE") != ""


def _flaky(completion: str, *, answer: int) -> float | None:
    value = int(completion.strip())
    if value % 4 == 0:
        raise ValueError("verifier bug")
    if value % 4 == 1:
        return None
    if value % 4 == 2:
        time.sleep(0.5)
    return 1.0


def test_verifier_errors_and_timeouts_are_counted_not_raised() -> None:
    prompts = [Prompt(id=f"p{i}", prompt=f"{i}+0=", answer={"answer": i}) for i in range(8)]
    task = Task(id="test/Flaky-v0", prompts=prompts, verifier=_flaky, timeout_s=0.1)
    env = TaskEnv(task, FakeBackend(), sampling=SamplingConfig(max_new_tokens=4))
    out = env.rollout(_requests(env, [(i, [1]) for i in range(8)]))
    rewards = [g[0].reward for g in out]
    assert rewards == [0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 1.0]
    assert [g[0].metadata.get("verifier") for g in out[:4]] == ["error", "not_applicable", "timeout", None]
    m = env.metrics()
    assert (m["env/verifier_errors"], m["env/verifier_not_applicable"], m["env/verifier_timeouts"]) == (2, 2, 2)


def test_chat_rendering() -> None:
    base = make_task("sara/Arithmetic-v0", pool_size=4, eval_size=0)
    task = Task(id="test/Chat-v0", prompts=base.prompts, verifier=base.verifier, chat=True, system_prompt="Be brief.")
    env = TaskEnv(task, FakeBackend())
    rendered = env.render(_requests(env, [(0, [1])])[0])
    assert rendered == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": base.prompts[0].prompt}]
    assert env.rollout(_requests(env, [(0, [1, 2])]))[0][1].reward == 1.0
    with pytest.raises(ValueError, match="render_chat"):
        env.rollout(_requests(env, [(0, [1])], prefix="x"))

    def to_text(messages: list[dict[str, str]]) -> str:
        return "\n".join(m["content"] for m in messages)

    env2 = TaskEnv(task, FakeBackend(), render_chat=to_text)
    assert env2.render(_requests(env2, [(0, [1])], prefix="")[0]) == "Be brief.\n" + str(base.prompts[0].prompt)


def test_eval_split_and_bad_backend() -> None:
    env = TaskEnv("sara/Arithmetic-v0", FakeBackend(), split="eval", task_options={"pool_size": 10, "eval_size": 3})
    assert len(env.prompts) == 3 and env.prompts[0].id.startswith("arith-eval-")

    class Short(FakeBackend):
        def generate(self, requests, sampling):  # type: ignore[no-untyped-def]
            return super().generate(requests, sampling)[:-1]

    bad = TaskEnv("sara/Arithmetic-v0", Short(), task_options={"pool_size": 10, "eval_size": 0})
    with pytest.raises(RuntimeError, match="wrong number"):
        bad.rollout(_requests(bad, [(0, [1]), (1, [2])]))


def test_collect_end_to_end(env: TaskEnv) -> None:
    allocator = make_allocator("sara", k=6)
    result = collect(allocator, env, UniformSampler(len(env.prompts), seed=0), target_groups=4, seed=1)
    assert result.stats.committed_groups >= 1
    assert result.stats.rounds == len(env.backend.calls)  # type: ignore[attr-defined]
    rewards, _ = result.flat()
    assert set(np.unique(rewards)) <= {0.0, 1.0}
    assert env.metrics()["env/rollouts"] == result.stats.rollouts


def test_shared_scorer_is_not_closed_by_the_env() -> None:
    from sara.envs import TaskEnv as Exported
    from sara.envs.tasks.scoring import BatchScorer

    task = make_task("sara/Arithmetic-v0", pool_size=10, eval_size=4)
    with BatchScorer(task.verifier, mode="inline") as scorer:
        train = Exported(task, FakeBackend(), scorer=scorer)
        held_out = TaskEnv(task, FakeBackend(), split="eval", scorer=scorer)
        assert train.scorer is held_out.scorer is scorer
        train.rollout(_requests(train, [(0, [1, 2])]))
        held_out.rollout(_requests(held_out, [(1, [3])]))
        train.close()
        assert scorer.metrics()["verifier/calls"] == 3 and train.metrics()["env/rollouts"] == 2
