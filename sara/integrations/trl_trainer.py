"""Build TRL's ``AsyncGRPOTrainer`` around a ``SaraRolloutWorker`` (weights synced into the worker's backend).

``async_grpo_trainer(model_dir, worker, args=AsyncGRPOConfig(...))`` passes ``rollout_worker=worker`` and
``weight_transfer=worker.weight_transfer()``, defaults the train dataset to the worker's task prompts (the trainer
only uses it for its epoch arithmetic: the worker samples prompts itself), and on a machine without CUDA swaps TRL's
FlashAttention-3 tree attention for ``sara.integrations.trl_attention.cpu_tree_attention``.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

__all__ = ["async_grpo_trainer"]


def async_grpo_trainer(model: str | os.PathLike[str], worker: Any, *, args: Any = None, train_dataset: Any = None,
                       cpu_attention: bool | None = None, **kwargs: Any) -> Any:
    """An ``AsyncGRPOTrainer`` training ``model`` (an HF model directory: TRL loads it by path) on ``worker``'s groups.

    Args:
        model: The model directory (the same weights the worker's backend starts from).
        worker: A ``SaraRolloutWorker``.
        args: An ``AsyncGRPOConfig``. ``token_budget=None`` (TRL's default: ask the vLLM server) becomes 0 (fixed
            ``per_device_train_batch_size`` samples per micro-batch), since no server is involved.
        train_dataset: Default: ``task_dataset(worker.env.task)``.
        cpu_attention: Use the pure-torch tree attention (default: when CUDA is unavailable).
        **kwargs: Passed to ``AsyncGRPOTrainer`` (``callbacks``, ``optimizers``, ``peft_config``, ...).
    """
    import torch
    from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer

    from sara.integrations.trl_attention import use_cpu_tree_attention
    from sara.integrations.trl_rewards import task_dataset

    if args is None:
        args = AsyncGRPOConfig(output_dir="runs/trl_async_grpo", report_to="none")
    if args.token_budget is None:
        args.token_budget = 0
    if train_dataset is None:
        train_dataset = task_dataset(worker.env.task)
    no_cuda = not torch.cuda.is_available()
    with _no_cuda_peak_flops(no_cuda):
        trainer = AsyncGRPOTrainer(model=str(model), args=args, train_dataset=train_dataset, rollout_worker=worker,
                                   weight_transfer=worker.weight_transfer(), **kwargs)
    if cpu_attention if cpu_attention is not None else no_cuda:
        use_cpu_tree_attention()  # after the trainer's own registration of its kernel under the same name
    return trainer


@contextlib.contextmanager
def _no_cuda_peak_flops(active: bool) -> Iterator[None]:
    """TRL 1.16 asks ``torch.cuda.get_device_name`` for the MFU table unconditionally (an error on a CPU-only torch):
    without CUDA the peak FLOPs are unknown (``None``: TRL then skips its MFU metrics, as for an unknown GPU)."""
    if not active:
        yield
        return
    import trl.experimental.async_grpo.async_grpo_trainer as mod

    original = mod.get_peak_flops_per_device
    mod.get_peak_flops_per_device = lambda accelerator, dtype: None
    try:
        yield
    finally:
        mod.get_peak_flops_per_device = original
