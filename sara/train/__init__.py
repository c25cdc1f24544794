"""Training: ``TrainConfig`` (config), ``make_batch`` (padding), the ``Learner`` (log-probs, advantages, update, LR
schedule) and the ``Trainer`` (the loop: collect -> learn -> sync -> metrics -> eval -> checkpoint).

Example:
    >>> from sara.train import TrainConfig, Trainer            # doctest: +SKIP
    >>> with Trainer(TrainConfig(steps=3)) as trainer:         # doctest: +SKIP
    ...     summary = trainer.train()
"""

from sara.train.batch import Batch, make_batch
from sara.train.config import TrainConfig, apply_overrides, load_config
from sara.train.learner import Learner, lr_at
from sara.train.sections import EvalConfig, OptimConfig
from sara.train.trainer import RunSummary, Trainer, default_threads

__all__ = [
    "Batch",
    "EvalConfig",
    "Learner",
    "OptimConfig",
    "RunSummary",
    "TrainConfig",
    "Trainer",
    "apply_overrides",
    "default_threads",
    "load_config",
    "lr_at",
    "make_batch",
]
