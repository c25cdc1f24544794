"""The bounded sections of a training run: the size limits every config field is checked against, the optimizer and
schedule (``OptimConfig``) and the held-out evaluation (``EvalConfig``); ``TrainConfig`` (``sara.train.config``)
holds them, and the learner and the evaluation read only their own section.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, field_validator

from sara.config import MAX_STEPS, SaraModel

__all__ = ["EvalConfig", "OptimConfig", "MAX_EPOCHS", "MAX_GROUP_SIZE", "MAX_GROUPS_PER_STEP", "MAX_KEPT_CHECKPOINTS",
           "MAX_OPTIMIZER_STEPS", "MAX_ROLLOUTS", "MAX_STEP_ROLLOUTS", "MAX_STEP_TOKENS", "MAX_THREADS"]

MAX_THREADS = 1024
"""Largest ``TrainConfig.threads``: more than the hardware threads of any common machine (far more threads than that
only oversubscribe the cores, and tens of thousands exhaust the process's thread limit inside OpenMP)."""
MAX_GROUP_SIZE = 1024
"""Largest group size ``k`` (and ``eval.samples``)."""
MAX_GROUPS_PER_STEP = 65_536
"""Largest ``TrainConfig.groups_per_step``."""
MAX_STEP_ROLLOUTS = 2**17
"""Largest batch a step asks for, ``k x groups_per_step`` rollouts (131,072)."""
MAX_STEP_TOKENS = 2**30
"""Largest ``k x groups_per_step x max_new_tokens``: the generated tokens a step's batch may hold."""
MAX_EPOCHS = 1000
"""Largest ``optim.epochs``: passes over one collected batch."""
MAX_OPTIMIZER_STEPS = 10**9
"""Largest ``optim.warmup_steps`` and ``optim.total_optimizer_steps`` (``MAX_STEPS`` steps x ``MAX_EPOCHS`` epochs)."""
MAX_KEPT_CHECKPOINTS = 1000
"""Largest ``keep_checkpoints``."""
MAX_ROLLOUTS = 10**12
"""Largest ``rollout_budget`` and ``max_rollouts_per_step``."""


class OptimConfig(SaraModel):
    """Optimizer and schedule (AdamW). Every count here is in optimizer steps."""

    lr: float = Field(2e-4, gt=0, le=10)
    """Peak learning rate, in (0, 10]."""
    weight_decay: float = Field(0.0, ge=0, le=1)
    """AdamW weight decay, in [0, 1]."""
    betas: tuple[Annotated[float, Field(ge=0, lt=1)], Annotated[float, Field(ge=0, lt=1)]] = (0.9, 0.999)
    """AdamW betas, each in [0, 1)."""
    grad_clip: float | None = Field(1.0, gt=0)
    """Clip the global gradient norm to this (None = no clipping)."""
    schedule: Literal["constant", "linear", "cosine"] = "constant"
    """LR after warmup: constant, or linear / cosine decay to 0 at ``total_optimizer_steps``."""
    warmup_steps: int = Field(0, ge=0, le=MAX_OPTIMIZER_STEPS)
    """Linear warmup, in optimizer steps, at most ``MAX_OPTIMIZER_STEPS``."""
    total_optimizer_steps: int | None = Field(None, ge=1, le=MAX_OPTIMIZER_STEPS)
    """Horizon of the decay schedules, at most ``MAX_OPTIMIZER_STEPS`` (None = steps x epochs x mini-batches per batch, estimated from the config)."""
    epochs: int | None = Field(None, ge=1, le=MAX_EPOCHS)
    """Passes over each collected batch, at most ``MAX_EPOCHS`` (None = the algorithm's suggestion, ``AlgoSpec.epochs``)."""
    minibatch_rollouts: int | None = Field(None, ge=1, le=MAX_STEP_ROLLOUTS)
    """Rollouts per optimizer step, at most ``MAX_STEP_ROLLOUTS`` (None = the whole batch: one optimizer step per epoch)."""
    microbatch_tokens: int | Literal["auto"] | None = "auto"
    """Most positions one forward pass runs (at most ``MAX_STEP_TOKENS``) (a shared prefix once, then every row's padded rest; see
    ``sara.train.microbatch``). A mini-batch is split into such micro-batches whose gradients are accumulated before
    its ONE optimizer step (the same step, loss normalisation included, as one forward), so activation memory stays
    bounded however many groups a step trains. ``auto``: as many positions as keep one micro-batch's activations
    within 1/24 of the memory the process may use, by what the policy says a position keeps (an HF model's shape and
    compute dtype), else 2,048 (``sara.train.microbatch.microbatch_budget``). None = one forward per mini-batch."""

    @field_validator("microbatch_tokens", mode="before")
    @classmethod
    def _budget(cls, v: object) -> object:
        if v is None or v == "auto":
            return v
        n = int(v) if isinstance(v, (int, str)) and not isinstance(v, bool) and str(v).strip().isdigit() else None
        if n is None or not 1 <= n <= MAX_STEP_TOKENS:
            raise ValueError(f"a number of positions, at least 1 and less than or equal to {MAX_STEP_TOKENS}; or "
                             "auto (sized from the model and the memory); or null (one forward per mini-batch)")
        return n


class EvalConfig(SaraModel):
    """Held-out evaluation (the task's ``eval_prompts``) with fixed seeds, so evaluations are comparable."""

    every: int = Field(10, ge=0, le=MAX_STEPS)
    """Evaluate every this many training steps, at most ``MAX_STEPS`` (0 = only before training and at the end)."""
    num_prompts: int = Field(500, ge=1, le=1_000_000)
    """Held-out prompts used (the first ones of the task's eval split), at most 1,000,000."""
    samples: int = Field(4, ge=1, le=MAX_GROUP_SIZE)
    """Sampled completions per prompt at the training temperature (``eval/acc_sample``), at most
    ``MAX_GROUP_SIZE``."""
    greedy: bool = True
    """Also report greedy accuracy (``eval/acc_greedy``)."""
    by: str | None = "component|<length>"
    """Also report ``eval/acc_sample/<value>`` per value of this ``Prompt.metadata`` key when the held-out prompts
    carry it with at most 32 distinct values (``component``: the bands of a ``sara/Mixture-v0`` pool; ``level``:
    MATH levels), or per prompt length in characters (``<length>``: by value, or in six quantile bins named
    ``<shortest>-<longest>``); several joined by ``|``, the first that labels the held-out prompts winning. The
    default labels a mixture by its components and any other pool by length; None = off. Shows which part of a
    curriculum moves, and which band an allocator starves."""
