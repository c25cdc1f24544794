"""``TaskEnv``: a verifiable task on a generation backend, as the ``RolloutEnv`` the driver runs rounds on; on a
``StreamingBackend``, ``TaskEnv(task, backend)`` is a ``StreamingTaskEnv``, also a ``StreamingEnv``: ``submit`` /
``poll`` / ``abort`` single rollouts under integer tags; ``poll`` scores what finished in one scorer call and builds
the ``Rollout`` objects exactly as ``rollout`` does.

One ``rollout`` call = one allocation round: every request's prompt is rendered (task template, then
``request.prefix`` appended), the whole round goes to ONE ``backend.generate`` call, and the completions are scored by
the batch scorer (per-call time limit; worker processes for verifiers that are not thread-safe). A verifier that
raises, times out or returns garbage gives reward 0 and is counted in ``metrics()``; it never fails the step.

The verifier scores ``request.prefix + completion`` (for tree rollouts the prefix is the start of the answer); the
``Rollout`` keeps only the generated text and tokens (what the policy is trained on).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, Protocol, runtime_checkable

import numpy as np

from sara.envs.base import (
    Completion,
    EmbedsPrompts,
    EnvWrapper,
    GenerationBackend,
    GenerationRequest,
    SamplingConfig,
    StreamingBackend,
)
from sara.envs.tasks import Task, make_task
from sara.envs.tasks.scoring import ERROR, NOT_APPLICABLE, OK, TIMEOUT, BatchScorer
from sara.envs.tasks.scoring import scorer_mode as _scorer_mode
from sara.types import Prompt, Rollout, RolloutRequest

__all__ = ["ChatRenderer", "ReportsVerifierFailures", "StreamingTaskEnv", "TaskEnv", "pool_embedder"]


@runtime_checkable
class ChatRenderer(Protocol):
    """A backend that turns chat messages into prompt text with its tokenizer's template (hf, vllm)."""

    def render_chat(self, messages: Sequence[Mapping[str, str]]) -> str: ...


@runtime_checkable
class ReportsVerifierFailures(Protocol):
    """An environment that keeps the latest ``(completion, what went wrong)`` its verifier raised or timed out on
    (``TaskEnv``), so a run stopped by a broken verifier can show an example."""

    last_verifier_failure: tuple[str, str] | None


_STATUS = {OK: "ok", NOT_APPLICABLE: "not_applicable", ERROR: "error", TIMEOUT: "timeout"}


class TaskEnv:
    """A ``RolloutEnv`` made of a task and a ``GenerationBackend``.

    Args:
        task: A ``Task`` or a task id / spec for ``make_task`` (e.g. ``"sara/Arithmetic-v0:max_digits=2"``).
        backend: Any object with ``generate(requests, sampling) -> list[list[Completion]]``.
        sampling: Sampling settings; default ``SamplingConfig`` with the task's suggested ``max_new_tokens`` and
            ``stop``.
        split: ``"train"`` (the task's prompt pool) or ``"eval"`` (its held-out prompts).
        scorer_mode: ``"auto"`` (``"thread"`` for thread-safe verifiers, else ``"process"``), or a ``BatchScorer``
            mode (``thread`` / ``inline`` for a verifier that is not thread-safe: ``ConfigError``).
        timeout_s: Per-call verifier time limit (default: the task's).
        workers: Verifier worker processes in ``process`` mode.
        render_chat: ``messages -> text`` (e.g. a tokenizer's ``apply_chat_template(..., tokenize=False,
            add_generation_prompt=True)``). When given, chat prompts are sent to the backend as text; it is required
            to append a ``request.prefix`` to a chat prompt.
        task_options: Options for ``make_task`` when ``task`` is a string.
        scorer: A ``BatchScorer`` to use (e.g. shared by a training and an evaluation env, so worker processes are
            started once); its owner closes it. Overrides ``scorer_mode``, ``timeout_s`` and ``workers``.
    """

    def __new__(cls, task: Task | str | None = None, backend: GenerationBackend | None = None, *args: Any,
                **kwargs: Any) -> TaskEnv:
        """``TaskEnv(task, backend)`` on a ``StreamingBackend`` is a ``StreamingTaskEnv`` (a ``StreamingEnv``); a
        subclass is what it subclasses (``TreeTaskEnv`` runs rounds only)."""
        backend = kwargs.get("backend", backend)
        if cls is TaskEnv and isinstance(backend, StreamingBackend):
            return super().__new__(StreamingTaskEnv)
        return super().__new__(cls)

    def __init__(self, task: Task | str, backend: GenerationBackend, sampling: SamplingConfig | None = None, *,
                 split: Literal["train", "eval"] = "train",
                 scorer_mode: Literal["auto", "thread", "process", "inline"] = "auto",
                 timeout_s: float | None = None, workers: int | None = None,
                 render_chat: Callable[[list[dict[str, str]]], str] | None = None,
                 task_options: Mapping[str, Any] | None = None, scorer: BatchScorer | None = None) -> None:
        self.task = make_task(task, **(task_options or {})) if isinstance(task, str) else task
        if not isinstance(self.task, Task):
            raise TypeError(f"TaskEnv: task must be a Task or a task id, got {type(task).__name__}")
        self.backend = backend
        self.sampling = sampling or SamplingConfig(max_new_tokens=self.task.max_new_tokens or 64, stop=self.task.stop)
        self.prompts: Sequence[Prompt] = self.task.split(split)
        if len(self.prompts) == 0:
            raise ValueError(f"TaskEnv: task {self.task.id!r} has no {split!r} prompts")
        self._owns_scorer = scorer is None
        if scorer is None:
            mode = _scorer_mode(scorer_mode, self.task)  # thread / inline are refused for a verifier not thread-safe
            scorer = BatchScorer(self.task.verifier, mode=mode, timeout_s=timeout_s or self.task.timeout_s,
                                 workers=workers)
        self.scorer = scorer
        self.render_chat = render_chat
        self._counts = {"rounds": 0, "rollouts": 0, "tokens": 0, "truncated": 0, "reward_sum": 0.0,
                        "generate_seconds": 0.0, "score_seconds": 0.0}
        self._pending: dict[int, RolloutRequest] = {}  # streaming: the request of every tag in flight
        self.last_verifier_failure: tuple[str, str] | None = None
        """The latest ``(completion, what went wrong)`` the verifier raised or timed out on (None: never)."""

    def render(self, request: RolloutRequest) -> str | list[dict[str, str]]:
        """The backend input for one request: the rendered prompt followed by ``request.prefix``."""
        rendered = self.task.render(request.prompt)
        if not isinstance(rendered, str):
            if self.render_chat is not None:
                rendered = self.render_chat(rendered)
            elif request.prefix:
                raise ValueError(f"TaskEnv: task {self.task.id!r} renders chat messages; pass render_chat= to "
                                 "append a request prefix to them")
            else:
                return rendered
        return rendered + request.prefix

    def rollout(self, requests: Sequence[RolloutRequest]) -> list[list[Rollout]]:
        """Generate (one backend call) and score one round; ``out[i]`` holds ``requests[i].n`` rollouts."""
        if not requests:
            return []
        gen = [GenerationRequest(prompt=self.render(r), seeds=tuple(int(s) for s in r.seeds),
                                 max_new_tokens=r.max_new_tokens) for r in requests]
        t0 = time.perf_counter()
        outputs = self.backend.generate(gen, self.sampling)
        self._counts["generate_seconds"] += time.perf_counter() - t0
        if len(outputs) != len(requests) or any(len(o) != r.n for o, r in zip(outputs, requests)):
            raise RuntimeError(f"{type(self.backend).__name__}.generate returned a wrong number of completions")
        flat = self._score([(r, int(seed), c) for r, o in zip(requests, outputs) for seed, c in zip(r.seeds, o)])
        out, k = [], 0
        for r in requests:
            out.append(flat[k: k + r.n])
            k += r.n
        return out

    def _score(self, items: Sequence[tuple[RolloutRequest, int, Completion]]) -> list[Rollout]:
        """Score ``(request, seed, completion)`` triples in one scorer call; the ``Rollout`` of each, counted as one
        round in ``metrics()``."""
        t1 = time.perf_counter()
        texts = [r.prefix + c.text for r, _, c in items]
        scored = self.scorer.score(texts, [r.prompt.answer for r, _, _ in items])
        self._counts["score_seconds"] += time.perf_counter() - t1
        failed = np.flatnonzero((scored.status == ERROR) | (scored.status == TIMEOUT))
        if len(failed):
            i = int(failed[0])
            self.last_verifier_failure = (texts[i], (f"raised {scored.errors[0]}" if scored.status[i] == ERROR and
                                                     scored.errors else f"timed out after {self.scorer.timeout_s:g} s"))
        out = []
        for k, (req, seed, c) in enumerate(items):
            st = int(scored.status[k])
            meta: dict[str, Any] = {} if st == OK else {"verifier": _STATUS[st]}
            if req.prefix:
                meta["prefix"] = req.prefix
            out.append(Rollout(
                prompt_id=req.prompt.id, pool_index=req.pool_index, completion=c.text,
                reward=float(scored.rewards[k]), num_tokens=c.num_tokens, seed=int(seed),
                token_ids=tuple(c.token_ids), logprobs=tuple(c.logprobs),
                prompt_token_ids=tuple(c.prompt_token_ids) if len(c.prompt_token_ids) else None,
                finish_reason=c.finish_reason, policy_version=c.policy_version, metadata=meta,
            ))
            self._counts["tokens"] += c.num_tokens
            self._counts["truncated"] += c.finish_reason == "length"
        self._counts["rounds"] += 1
        self._counts["rollouts"] += len(items)
        self._counts["reward_sum"] += float(scored.rewards.sum())
        return out

    def metrics(self) -> dict[str, float]:
        """Cumulative ``env/...`` counters since construction (verifier errors and timeouts included)."""
        c = self._counts
        v = self.scorer.metrics(prefix="")
        return {
            "env/rounds": float(c["rounds"]),
            "env/rollouts": float(c["rollouts"]),
            "env/tokens": float(c["tokens"]),
            "env/truncated": float(c["truncated"]),
            "env/reward_mean": c["reward_sum"] / c["rollouts"] if c["rollouts"] else 0.0,
            "env/verifier_errors": v["errors"],
            "env/verifier_timeouts": v["timeouts"],
            "env/verifier_not_applicable": v["not_applicable"],
            "env/verifier_worker_restarts": v["worker_restarts"],
            "env/generate_seconds": c["generate_seconds"],
            "env/score_seconds": c["score_seconds"],
        }

    def close(self) -> None:
        """Stop the verifier workers unless the scorer was passed in (the backend belongs to the caller)."""
        if self._owns_scorer:
            self.scorer.close()

    def __enter__(self) -> TaskEnv:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class StreamingTaskEnv(TaskEnv):
    """A ``TaskEnv`` on a ``StreamingBackend``, and so a ``StreamingEnv``: single rollouts go in under integer tags
    (``submit``), ``poll`` scores what finished in one scorer call and builds each ``Rollout`` exactly as ``rollout``
    builds it (same ``env/...`` counters; a poll that delivered is one ``env/rounds``), ``abort`` cancels.
    ``TaskEnv(task, backend)`` builds one when the backend streams; its arguments are ``TaskEnv``'s.
    """

    backend: StreamingBackend

    @property
    def slots(self) -> int:
        """The streaming backend's capacity (rollouts decoded together)."""
        return int(self.backend.slots)

    def submit(self, items: Sequence[tuple[int, RolloutRequest]]) -> None:
        """Start one rollout per ``(tag, request)`` (``request.n == 1``), rendered exactly as ``rollout`` renders."""
        gen = []
        for tag, r in items:
            if r.n != 1:
                raise ValueError(f"TaskEnv.submit: tag {tag}: a streamed request has exactly one seed, got {r.n}")
            gen.append((int(tag), GenerationRequest(prompt=self.render(r), seeds=(int(r.seeds[0]),),
                                                    max_new_tokens=r.max_new_tokens)))
            self._pending[int(tag)] = r
        t0 = time.perf_counter()
        self.backend.submit(gen, self.sampling)
        self._counts["generate_seconds"] += time.perf_counter() - t0

    def poll(self, timeout: float | None = None) -> list[tuple[int, Rollout]]:
        """Every finished ``(tag, rollout)``, scored in one scorer call (built exactly as ``rollout`` builds them)."""
        t0 = time.perf_counter()
        done = self.backend.poll(timeout)
        self._counts["generate_seconds"] += time.perf_counter() - t0
        done = [(tag, c) for tag, c in done if int(tag) in self._pending]  # an aborted tag that finished meanwhile
        if not done:
            return []
        reqs = [self._pending.pop(int(tag)) for tag, _ in done]
        rollouts = self._score([(r, int(r.seeds[0]), c) for r, (_, c) in zip(reqs, done)])
        return [(int(tag), r) for (tag, _), r in zip(done, rollouts)]

    def abort(self, tags: Sequence[int]) -> int:
        """Cancel in-flight rollouts; returns the tokens they had generated (the backend's count)."""
        for t in tags:
            self._pending.pop(int(t), None)
        return int(self.backend.abort(list(tags))) if tags else 0


def pool_embedder(env: Any, fallback: EmbedsPrompts | None = None,
                  announce: Callable[[str], None] | None = None) -> Callable[[], np.ndarray] | None:
    """``embed() -> [pool, D]``: the backend's representation of every prompt of ``env``'s pool, rendered as it is for
    generation (``sara.envs.base.EmbedsPrompts``; what ``sara:group_by=<embedding>`` learns from), or ``fallback``'s
    when the backend cannot embed (the trainer passes its policy's, ``sara.backends.embed.policy_embedder``). None
    when ``env`` (through any ``EnvWrapper``) is not a ``TaskEnv`` or neither can embed. ``announce`` gets a line
    before the embedding starts (how many prompts, by what) and one after it (how long it took): the trainer's
    verbose setup messages."""
    while isinstance(env, EnvWrapper):
        env = env.env
    if not isinstance(env, TaskEnv):
        return None
    backend = env.backend if isinstance(env.backend, EmbedsPrompts) else fallback
    if backend is None:
        return None
    task_env = env

    def embed() -> np.ndarray:
        if announce is not None:
            announce(f"embedding {len(task_env.prompts):,} training prompts for sara:group_by=<embedding> "
                     f"({type(backend).__name__}: one forward pass over the pool) ...")
        start = time.perf_counter()
        out = backend.embed_prompts([task_env.render(RolloutRequest(unit_id=0, pool_index=i, prompt=p, seeds=()))
                                     for i, p in enumerate(task_env.prompts)])
        if announce is not None:
            announce(f"embedded {len(out):,} training prompts for sara:group_by=<embedding> "
                     f"({type(backend).__name__}, {time.perf_counter() - start:.1f} s)")
        return out

    return embed
