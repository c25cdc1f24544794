"""Adapters that run ``sara`` inside other trainers (layer 5: may import everything below; heavy imports inside).

- ``sara.integrations.trl_async``: ``SaraRolloutWorker`` for TRL's ``AsyncGRPOTrainer(rollout_worker=...)``, with
  ``trl_sync.BackendWeightTransfer`` (weight syncs that cut in between decode steps, ``trl_sync.WeightsGate``);
  ``trl_trainer.async_grpo_trainer`` builds the trainer around it; ``trl_attention`` is a CPU implementation of TRL's
  tree attention.
- ``sara.integrations.trl_rewards``: ``reward_fn(task)`` (a task's verifier as a TRL reward function) and
  ``task_dataset(task)``.

Install with ``pip install -e ".[trl]"``; versions tested and recipes: ``docs/integrations.md``. Nothing here is
imported by ``import sara``.
"""

__all__: list[str] = []
