"""The trainer's environments: the training env (``TaskEnv``, or ``TreeTaskEnv`` for tree allocators that send node
handles) and the held-out evaluation envs (sampled and greedy), all on one backend and one shared scorer; and the
check that the chosen driver mode (``TrainConfig.driver``) can drive the training env."""

from __future__ import annotations

from typing import TYPE_CHECKING

from sara.config import ConfigError

if TYPE_CHECKING:
    from sara.allocators.base import AllocatorConfig
    from sara.envs.base import GenerationBackend, SamplingConfig
    from sara.envs.task_env import TaskEnv
    from sara.envs.tasks import Task
    from sara.envs.tasks.scoring import BatchScorer
    from sara.train.config import TrainConfig

__all__ = ["make_envs"]


def make_envs(cfg: TrainConfig, task: Task, backend: GenerationBackend, sampling: SamplingConfig,
              scorer: BatchScorer | None, allocator: AllocatorConfig
              ) -> tuple[TaskEnv, TaskEnv | None, TaskEnv | None]:
    """``(env, eval_env, greedy_env)`` of a run (the eval envs are None for a task without held-out prompts), for the
    run's allocator options ``allocator`` (the environment is built before the allocator, which needs its pool).

    Raises:
        ConfigError: a tree allocator that continues partial traces on a chat task the backend cannot render, or
            ``driver: stream`` on an environment that cannot stream (naming the field).
    """
    from sara.allocators.tree import TreeConfig
    from sara.envs.base import SamplingConfig, StreamingEnv
    from sara.envs.task_env import ChatRenderer, TaskEnv
    from sara.envs.tree import TreeTaskEnv

    # Tree allocators that send node handles need the environment that turns them into partial traces (on a chat
    # task, rendered to text by the backend's chat template so a trace can be appended).
    if isinstance(allocator, TreeConfig) and allocator.node_prefix:
        render = backend.render_chat if isinstance(backend, ChatRenderer) else None
        if task.chat and render is None:
            raise ConfigError(f"train config: field 'allocator': {cfg.allocator!r} continues partial traces, and "
                              f"task {task.id!r} renders chat messages that backend {cfg.backend!r} cannot "
                              "turn into text; use the hf or vllm backend, or the task option chat=false")
        env: TaskEnv = TreeTaskEnv(task, backend, sampling, scorer=scorer, render_chat=render)
    else:
        env = TaskEnv(task, backend, sampling, scorer=scorer)
    if not cfg.driver.barrier and not isinstance(env, StreamingEnv):
        why = (f"the tree environment of {cfg.allocator!r} (node_prefix) runs in rounds" if isinstance(env, TreeTaskEnv)
               else f"backend {cfg.backend!r} ({type(backend).__name__}) cannot stream")
        raise ConfigError(f"train config: field 'driver': streaming needs a streaming environment and {why}; use "
                          "driver=sync, or a backend that streams (tiny, hf, vllm; see docs/streaming.md)")
    eval_env = greedy_env = None
    if task.eval_prompts:
        eval_env = TaskEnv(task, backend, sampling, split="eval", scorer=scorer)
        greedy = SamplingConfig(temperature=0.0, max_new_tokens=sampling.max_new_tokens, stop=sampling.stop)
        greedy_env = TaskEnv(task, backend, greedy, split="eval", scorer=scorer)
    return env, eval_env, greedy_env
