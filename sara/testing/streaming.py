"""The streaming leg of ``check_allocator``: an allocator under the streaming driver (``DriverConfig(barrier=False)``).

On a scripted streaming engine (``CoinArithmetic``: completions finish out of order, 1..8 ticks per seed; a prompt
is answered right with its own probability, some prompts always, some never), or on a given environment behind a
simulated engine (``LatencyEnv``, for allocators that need a particular environment, e.g. tree handles), for each
seed, twice:
``steps`` streaming steps with carry-over (``carry_lag=1``, the last step carries nothing; none for an allocator that
does not carry over, ``BudgetAllocator.carries_over``), checking per step that
every rollout delivered or carried in ends in exactly one closed group or the carry, group buckets and decisions
agree, committed groups are not larger than allowed; at the end that the engine holds nothing and every started
rollout was delivered or aborted; and that the two runs are identical (determinism on an in-process engine).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import numpy as np

from sara.allocators.base import BudgetAllocator
from sara.envs.base import EnvWrapper, GenerationRequest
from sara.samplers.base import UniformSampler
from sara.seeding import derive_seeds
from sara.testing.scripted import StreamingScriptedBackend, prompt_text
from sara.types import CollectResult

__all__ = ["CoinArithmetic", "CountingEnv", "STREAM_TASK", "check_streaming"]

STREAM_TASK = "sara/Arithmetic-v0:max_digits=2,pool_size=600,eval_size=8"
"""The task of the streaming leg (600 prompts)."""


class CoinArithmetic(StreamingScriptedBackend):
    """Answers ``sara/Arithmetic-v0`` prompts right with a per-prompt probability in {0.0, 0.1, ..., 1.0}."""

    def answer(self, request: GenerationRequest, seed: int) -> str:
        a, op, b = re.findall(r"([0-9]+)([+-])([0-9]+)=", prompt_text(request))[-1]
        value = int(a) + int(b) if op == "+" else int(a) - int(b)
        p = (int(a) * 7 + int(b) * 3) % 11 / 10
        right = int(derive_seeds(seed, 5) % np.uint64(1000)) < 1000 * p
        return f"{value if right else value + 1}\n"


class CountingEnv(EnvWrapper):
    """Wraps an environment: counts the rollouts and tokens it generated (what the stats must account for)."""

    def __init__(self, env: Any) -> None:
        super().__init__(env)
        self.rollouts = self.tokens = 0

    def rollout(self, requests: Any) -> Any:
        out = self.env.rollout(requests)
        self.rollouts += sum(len(rs) for rs in out)
        self.tokens += sum(r.num_tokens for rs in out for r in rs)
        return out


def _engine(seed: int, slots: int, env_factory: Callable[[int], Any] | None) -> tuple[Any, Callable[[], int],
                                                                                       Callable[[], int]]:
    """``(streaming env, rollouts started so far, rollouts still running)``: the scripted engine, or ``env_factory``'s
    environment on a simulated engine (``LatencyEnv``: completions finish in order of their token counts)."""
    from sara.envs.sim.latency import LatencyEnv
    from sara.envs.task_env import TaskEnv

    if env_factory is None:
        env = TaskEnv(STREAM_TASK, CoinArithmetic(slots), scorer_mode="inline")
        return env, lambda: len(env.backend.submitted), env.backend.inflight
    inner = CountingEnv(env_factory(seed))
    timed = LatencyEnv(inner, latency={"slots": slots})
    return timed, lambda: inner.rollouts, lambda: len(timed.running())


def check_streaming(make: Callable[[], BudgetAllocator], *, error: type[AssertionError], target_groups: int = 8,
                    steps: int = 3, seeds: tuple[int, ...] = (0, 1), max_group_size: int | None = None,
                    slots: int = 32, env_factory: Callable[[int], Any] | None = None) -> dict[str, Any]:
    """Run the streaming leg (module docstring); raise ``error`` on the first violation; return per seed the
    rollouts, aborted rollouts and committed groups of the first run. ``env_factory`` (``seed -> RolloutEnv``):
    stream on that environment through a simulated engine instead of the scripted one."""
    from sara.driver import collect

    summary: dict[str, Any] = {}
    for seed in seeds:
        runs: list[list[tuple[Any, ...]]] = []
        for _ in range(2):
            alloc = make()
            env, started, running = _engine(seed, slots, env_factory)
            name = type(alloc).__name__
            sampler = UniformSampler(len(env.prompts), seed=seed)
            carry, seen, results = None, [], []
            for t in range(steps):
                try:
                    res = collect(alloc, env, sampler, target_groups=target_groups, seed=seed, step=t, carry=carry,
                                  driver={"barrier": False, "carry_lag": int(t + 1 < steps and alloc.carries_over)})
                except AssertionError as e:  # the driver's own accounting check
                    raise error(f"{name}: streaming step {t}: {e}") from e
                _check_step(res, alloc, max_group_size, error, t)
                carry = res.carry
                results.append(res)
                seen += [(g.group_id, g.pool_index, int(g.decision), tuple((r.seed, r.reward) for r in g.rollouts))
                         for g in (*res.groups, *res.abandoned, *res.discarded)]
            delivered = sum(r.stats.rollouts for r in results)
            aborted = sum(r.stats.aborted_rollouts for r in results)
            if carry is not None or running() or started() != delivered + aborted:
                raise error(f"{name}: streaming: {started()} rollouts started, {delivered} delivered, {aborted} "
                            f"aborted, {running()} still on the engine after the last step")
            if not any(r.stats.committed_groups for r in results):
                raise error(f"{name}: streaming: {steps} steps committed no group")
            runs.append(seen)
            summary.setdefault(f"seed{seed}", {
                "rollouts": delivered, "aborted_rollouts": sum(r.stats.aborted_rollouts for r in results),
                "committed_groups": sum(r.stats.committed_groups for r in results)})
        if runs[0] != runs[1]:
            raise error(f"{name}: two streaming runs with seed {seed} differ (not deterministic)")
    return summary


def _check_step(res: CollectResult, allocator: BudgetAllocator, max_group_size: int | None,
                error: type[AssertionError], t: int) -> None:
    s, name = res.stats, f"{type(allocator).__name__}: streaming step {t}"
    groups = (*res.groups, *res.abandoned, *res.discarded)
    closed = s.committed_rollouts + s.abandoned_rollouts + s.discarded_rollouts
    if s.rollouts + s.carried_in_rollouts != closed + s.carried_out_rollouts:
        raise error(f"{name}: {s.rollouts} delivered + {s.carried_in_rollouts} carried in != {closed} in closed "
                    f"groups + {s.carried_out_rollouts} carried out")
    if sum(g.size for g in groups) != closed:
        raise error(f"{name}: closed groups hold {sum(g.size for g in groups)} rollouts, stats say {closed}")
    seeds = [(g.pool_index, r.seed) for g in groups for r in g.rollouts]
    if len(seeds) != len(set(seeds)):
        raise error(f"{name}: a rollout is in two groups")
    cap = max_group_size if max_group_size is not None else allocator.k
    if any(g.size < 1 or g.size > cap for g in res.groups):
        raise error(f"{name}: committed group sizes {[g.size for g in res.groups]} outside 1..{cap}")
    if s.effective_groups != sum(g.is_effective(allocator.eps) for g in res.groups):
        raise error(f"{name}: effective_groups does not match the committed groups")
