"""TreeTaskEnv: sara_tree's node handles grown into real text trees on a (fake) prefix-aware backend."""

from __future__ import annotations

import re

import numpy as np
import pytest

from sara import UniformSampler, collect, make_allocator
from sara.envs.base import GenerationRequest, SamplingConfig
from sara.envs.tree import TreeTaskEnv, cut_segment
from sara.handles import format_handle
from sara.testing import check_allocator
from sara.testing.scripted import ScriptedBackend
from sara.types import RolloutRequest


class ContinuingBackend(ScriptedBackend):
    """Arithmetic answers ``"V\\n"`` (V off by 100 when ``seed % 3 == 0``); a prompt that already holds a partial trace
    after '=' is continued from where the trace stops. Records every call."""

    logprob = -0.1
    prompt_ids = False

    def answer(self, request: GenerationRequest, seed: int) -> str:
        head, trace = request.prompt.rsplit("=", 1)
        a, op, b = re.findall(r"([0-9]+)([+-])([0-9]+)$", head)[-1]
        value = int(a) + int(b) if op == "+" else int(a) - int(b)
        full = f"{value if seed % 3 else value + 100}\n"
        return full[len(trace):] if full.startswith(trace) else full


def _env(backend: ContinuingBackend | None = None) -> TreeTaskEnv:
    return TreeTaskEnv("sara/Arithmetic-v0", backend or ContinuingBackend(), scorer_mode="inline",
                       task_options={"pool_size": 64, "eval_size": 8})


def test_cut_segment_ends_between_words():
    assert cut_segment("the answer is 12\n", 0.5) == "the "
    assert cut_segment("12345678", 0.5) == "1234"
    assert cut_segment("x", 0.5) == "x" and cut_segment("", 0.5) == ""


def test_openers_set_traces_and_deepeners_continue_them():
    backend = ContinuingBackend()
    env = _env(backend)
    p = env.prompts[5]  # '72-5=' -> 67
    answer = str(p.answer["answer"])
    # Round 1: leaves 0, 1 open branches 0 and 1; leaf 2 deepens branch 0 (opened in this very round).
    r1 = RolloutRequest(unit_id=0, pool_index=5, prompt=p, seeds=(1, 2, 4),
                        prefix=format_handle(0, 0, 4, [0, 1, 0], [True, True, False]))
    (g1,) = env.rollout([r1])
    assert len(backend.calls) == 2  # openers first, then the branch opened this round
    trace = env.trace(0, 0, 0)
    assert trace == answer[:1] and env.trace(0, 0, 1) == answer[:1]
    assert [r.metadata["branch"] for r in g1] == [0, 1, 0]
    assert g1[2].metadata["prefix"] == trace and g1[2].completion == answer[1:] + "\n"
    assert backend.calls[1][0][0].prompt.endswith("=" + trace) and backend.calls[1][0][0].seeds == (4,)
    assert g1[2].num_tokens < g1[0].num_tokens  # the shared segment is paid once, by the opener
    assert [r.reward for r in g1] == [1.0, 1.0, 1.0]  # the deepener is scored on trace + continuation
    # Round 2: two more leaves under branch 1 (one request, one call) and a plain request beside it.
    r2 = RolloutRequest(unit_id=0, pool_index=5, prompt=p, seeds=(6, 7),
                        prefix=format_handle(0, 0, 4, [1, 1], [False, False]))
    plain = RolloutRequest(unit_id=1, pool_index=6, prompt=env.prompts[6], seeds=(8, 9))
    g2, g3 = env.rollout([r2, plain])
    assert len(backend.calls) == 3 and len(backend.calls[2][0]) == 2
    assert [r.reward for r in g2] == [0.0, 1.0]  # seed 6 % 3 == 0 -> a wrong answer
    assert all(r.metadata == {"branch": 1, "prefix": trace} for r in g2)
    assert [r.metadata for r in g3] == [{}, {}] and [r.reward for r in g3] == [1.0, 0.0]  # seed 9: wrong


def test_deepening_an_unopened_branch_is_an_error():
    env = _env()
    r = RolloutRequest(unit_id=0, pool_index=1, prompt=env.prompts[1], seeds=(1,),
                       prefix=format_handle(0, 3, 4, [2], [False]))
    with pytest.raises(ValueError, match="never opened"):
        env.rollout([r])


def test_sara_tree_grows_text_trees_through_collect():
    env = _env()
    alloc = make_allocator("sara_tree:node_prefix=true,rho=0.1", k=8)
    res = collect(alloc, env, UniformSampler(len(env.prompts), seed=0), target_groups=6, seed=0)
    assert res.stats.effective_groups >= 6
    for g in res.groups:
        branches = [r.metadata["branch"] for r in g.rollouts]
        assert np.bincount(branches).tolist() == alloc.node_shape(g.group_id)
        assert all(r.metadata.get("prefix", "") in ("", env.trace(alloc.step, g.group_id, b))
                   for r, b in zip(g.rollouts, branches))
    check_allocator(make_allocator("sara_tree:node_prefix=true", k=6), target_groups=4, steps=2, seeds=(0,),
                    env_factory=lambda s: _env())


def test_real_tiny_backend_continues_traces():
    pytest.importorskip("torch")
    from sara.backends.tiny import TinyBackend
    from sara.policies.tiny import TinyPolicy

    backend = TinyBackend(TinyPolicy({"d_model": 32, "n_layers": 1, "n_heads": 2}))
    env = TreeTaskEnv("sara/Arithmetic-v0", backend, SamplingConfig(max_new_tokens=6), scorer_mode="inline",
                      task_options={"pool_size": 16, "eval_size": 4})
    r = RolloutRequest(unit_id=0, pool_index=3, prompt=env.prompts[3], seeds=(11, 12, 13),
                       prefix=format_handle(2, 0, 2, [0, 0, 1], [True, False, True]))
    (g,) = env.rollout([r])
    trace = env.trace(2, 0, 0)
    assert trace is not None and [x.metadata["branch"] for x in g] == [0, 0, 1]
    assert g[1].metadata.get("prefix", "") == trace
    if trace:  # the continuation was generated after prompt + trace
        assert len(g[1].prompt_token_ids or ()) == len(g[0].prompt_token_ids or ()) + len(trace)


def test_trainer_uses_tree_env_and_trains_on_leaves_consistently(tmp_path):
    pytest.importorskip("torch")
    from sara.train import TrainConfig, Trainer

    cfg = TrainConfig(task="sara/Arithmetic-v0:max_digits=1,pool_size=150,eval_size=20",
                      policy_options={"d_model": 32, "n_layers": 1, "n_heads": 2, "warm_start": {"steps": 0}},
                      algo="grpo", allocator="sara_tree:node_prefix=true,rho=0.1", k=4, groups_per_step=3, steps=1,
                      eval={"num_prompts": 10, "samples": 1}, out_dir=str(tmp_path), progress=False, scorer="inline")
    with Trainer(cfg) as trainer:
        assert isinstance(trainer.env, TreeTaskEnv)
        m = trainer.train_step()
    assert m["alloc/committed_rollouts"] > 0
    assert abs(m["algo/gen_logprob_gap"]) < 1e-4  # leaves under a trace: generator and trainer agree on log-probs


class ChatBackend(ScriptedBackend):
    """Answers every prompt with a fixed text, continued after the partial trace of a rendered chat prompt."""

    logprob = -0.1
    prompt_ids = False
    full = "let me think about it\n"

    def answer(self, request: GenerationRequest, seed: int) -> str:
        if not isinstance(request.prompt, str):  # chat messages: the engine applies its template (no trace)
            return self.full
        trace = request.prompt.split("<|assistant|>", 1)[1]
        return self.full[len(trace):] if self.full.startswith(trace) else self.full


def test_tree_on_a_chat_task_renders_messages_before_appending_traces():
    """sara_tree:node_prefix=true on sara/Countdown-v0 (chat messages): with render_chat the deepening leaf continues
    the chat-rendered prompt + trace; without it, appending a trace is the documented error."""
    def render(messages):
        return "".join(f"<|{m['role']}|>{m['content']}" for m in messages) + "<|assistant|>"

    opts = {"pool_size": 8, "eval_size": 2}
    env = TreeTaskEnv("sara/Countdown-v0", ChatBackend(), scorer_mode="inline", task_options=opts, render_chat=render)
    assert env.task.chat
    p = env.prompts[0]
    r = RolloutRequest(unit_id=0, pool_index=0, prompt=p, seeds=(1, 2),
                       prefix=format_handle(0, 0, 4, [0, 0], [True, False]))
    (group,) = env.rollout([r])
    trace = env.trace(0, 0, 0)
    assert trace == "let me " and group[1].metadata["prefix"] == trace
    assert trace + group[1].completion == ChatBackend.full
    bare = TreeTaskEnv("sara/Countdown-v0", ChatBackend(), scorer_mode="inline", task_options=opts)
    with pytest.raises(ValueError, match="renders chat messages; pass render_chat="):
        bare.rollout([RolloutRequest(unit_id=0, pool_index=0, prompt=p, seeds=(1, 2),
                                     prefix=format_handle(0, 0, 4, [0, 0], [True, False]))])
