"""What keeps a training run honest and stoppable: SIGINT / SIGTERM handling, verifier health, bounded steps and
finite weights.

``StopSignals``: while active, the first SIGINT or SIGTERM only sets ``received`` (the trainer finishes the running
step, writes a checkpoint and returns); a second one gets the default behaviour (``KeyboardInterrupt`` / termination).
So does the first one when the run has not stopped ``grace_s`` seconds after it (``STOP_GRACE_S``, or the environment
variable ``SARA_STOP_GRACE_S``): a step that never ends cannot keep a run alive, and no checkpoint is written of it.
The countdown is kept by a watchdog thread (``sara.train.stopping``), so it holds while the main thread is inside one
long native call too.

``VerifierHealth``: per step, the verifier errors and timeouts among that step's rollouts (``env/verifier_errors``,
``env/verifier_timeouts``), their run totals, and a ``VerifierFailure`` when a step's share exceeds the configured
limit, naming the verifier and one failing example, so a broken verifier stops the run instead of training on zeros.

``check_step_limit``: a step the driver stopped at ``driver.max_step_rollouts`` (nothing, or nearly nothing, was
effective) stops the run with a ``StepLimitReached`` naming the step and the likely cause, before it is trained on.

``check_finite``: after a step's update, a non-finite loss or any non-finite weight stops the run with a
``NonFiniteTraining`` naming the step and the likely cause, before the weights reach the generator or a checkpoint.
"""

from __future__ import annotations

import math
import os
import signal
import threading
from typing import TYPE_CHECKING, Any

from sara.config import ConfigError, SaraError
from sara.envs.task_env import ReportsVerifierFailures
from sara.step import CollectObserver
from sara.train.stopping import StopWatchdog

if TYPE_CHECKING:
    import numpy as np

    from sara.envs.task_env import TaskEnv
    from sara.envs.tasks.base import Verifier
    from sara.policies.base import Policy
    from sara.step import StepState
    from sara.train.config import TrainConfig
    from sara.types import CollectStats

__all__ = ["NonFiniteTraining", "STOP_GRACE_S", "StepLimitReached", "StopSignals", "VerifierFailure", "VerifierHealth",
           "check_finite", "check_step_limit", "stop_grace_s"]

STOP_GRACE_S = 20.0
"""Seconds a run may take to stop after its first SIGINT / SIGTERM before the signal is delivered again (default of
``SARA_STOP_GRACE_S``). Less than the 30 s that Kubernetes and Slurm wait between SIGTERM and SIGKILL by default, so a
run stopped there exits on its own, with a message."""
MAX_STOP_GRACE_S = 86_400.0
"""Largest ``SARA_STOP_GRACE_S``."""


class VerifierFailure(SaraError, RuntimeError):
    """The task's verifier failed (raised or timed out) on too many rollouts; the message names it and an example."""


class StepLimitReached(SaraError, RuntimeError):
    """A step drew ``driver.max_step_rollouts`` rollouts without committing its groups; names the step and why."""


class NonFiniteTraining(SaraError, RuntimeError):
    """A step's loss or the weights after its update are not finite; names the step and the likely cause."""


def check_step_limit(stats: CollectStats, step: int, config: TrainConfig) -> None:
    """Stop the run when the driver ended ``step`` (0-based) at its rollout bound (``stop_reason ==
    "max_step_rollouts"``).

    Raises:
        StepLimitReached: naming the step, what it drew and committed, and what to check.
    """
    if stats.stop_reason != "max_step_rollouts":
        return
    raise StepLimitReached(
        f"step {step + 1} drew {stats.rollouts:,} rollouts, the bound driver.max_step_rollouts, and committed "
        f"{stats.committed_groups} groups ({stats.effective_groups} effective) of the {config.groups_per_step} asked: "
        "almost every group is all-correct or all-wrong, so the allocator found nothing to train on. Likely cause: a "
        "backend or a policy that always fails (or always solves) the task, or a verifier that scores everything "
        "alike; check them (sara bench generation), or raise driver.max_step_rollouts")


def check_finite(step: int, metrics: dict[str, float], policy: Policy, config: TrainConfig) -> None:
    """Stop the run when step ``step`` (0-based) left a non-finite loss or non-finite weights.

    Raises:
        NonFiniteTraining: naming the step, what is not finite, and the likely cause.
    """
    import math

    import torch

    loss = metrics.get("algo/loss", 0.0)
    bad = sum(1 for p in policy.parameters() if not bool(torch.isfinite(p.detach()).all()))
    if bad == 0 and math.isfinite(loss):
        return
    o = config.optim
    what = [f"the loss is {loss}"] if not math.isfinite(loss) else []
    what += [f"{bad} weight tensors hold nan or inf after the update"] if bad else []
    raise NonFiniteTraining(
        f"step {step + 1}: {' and '.join(what)} (grad norm {metrics.get('algo/grad_norm', float('nan')):g}); the "
        f"weights were not sent to the generator nor checkpointed. Likely cause: a learning rate too large for this "
        f"model (optim.lr={o.lr:g}, optim.grad_clip={o.grad_clip}) or rewards / advantages out of range; lower "
        "optim.lr or set optim.grad_clip, then --resume from the last checkpoint")


def stop_grace_s() -> float:
    """``SARA_STOP_GRACE_S`` when set (seconds in (0, ``MAX_STOP_GRACE_S``]), else ``STOP_GRACE_S``.

    Raises:
        ConfigError: the variable is not such a number.
    """
    raw = os.environ.get("SARA_STOP_GRACE_S", "").strip()
    if not raw:
        return STOP_GRACE_S
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not 0 < value <= MAX_STOP_GRACE_S:
        raise ConfigError(f"SARA_STOP_GRACE_S={raw!r}: give the seconds a run may take to stop after SIGINT / "
                          f"SIGTERM, a number in (0, {MAX_STOP_GRACE_S:g}] (default {STOP_GRACE_S:g})")
    return value


class StopSignals:
    """Context manager: the first SIGINT / SIGTERM sets ``received`` to the signal's name; the second is not caught.

    The first one also starts a countdown of ``grace_s`` seconds, kept by a watchdog thread
    (``sara.train.stopping.StopWatchdog``) that learns of the signal when it arrives, even while the main thread is
    inside one long native call: if the block is still running when the countdown ends, a line on stderr says so and
    the signal gets the behaviour a second one would (``KeyboardInterrupt`` for SIGINT, the process's earlier SIGTERM
    handling, by default termination); a process that has not ended ``EXIT_MARGIN_S`` later, or whose main thread never
    returned to the interpreter, exits with status 128 + the signal. Outside the main thread (where Python cannot
    install handlers) it does nothing and ``received`` stays None.

    Args:
        grace_s: Seconds the block may take to end after the first signal (default: ``stop_grace_s()``).
    """

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self, grace_s: float | None = None) -> None:
        self.grace_s = stop_grace_s() if grace_s is None else float(grace_s)
        self.received: str | None = None
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}
        self._watchdog: StopWatchdog | None = None

    def _handle(self, signum: int, frame: Any) -> None:
        self.received, self.signum = signal.Signals(signum).name, signum
        for s, handler in self._previous.items():  # a second signal is not deferred
            signal.signal(s, handler)
        if self._watchdog is not None:
            self._watchdog.handled = True

    @staticmethod
    def _redeliver(signum: int) -> None:
        os.kill(os.getpid(), signum)

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for s in self.SIGNALS:
                self._previous[s] = signal.signal(s, self._handle)
            self._watchdog = StopWatchdog(self.grace_s, self._redeliver).start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._watchdog is not None:
            self._watchdog.stop()
            self._watchdog = None
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous = {}


class VerifierHealth(CollectObserver):
    """Counts a task verifier's errors and timeouts per training step and stops a run whose verifier is broken.

    A ``collect`` observer: it checks after every round that closed units once ``min_rollouts`` rollouts are in
    (a broken verifier makes every group saturated, so the step would otherwise run to ``max_rounds``), and at the end
    of the step (``end``) whatever the count.

    Args:
        env: The training ``TaskEnv`` (its ``metrics()`` holds the cumulative verifier counters of its scorer; as a
            ``ReportsVerifierFailures``, its ``last_verifier_failure`` is the example the error shows).
        verifier: The verifier, for the error message.
        max_share: Largest tolerated share of a step's rollouts with a verifier error or timeout.
        min_rollouts: Rollouts a step needs before it is judged mid-step.
    """

    def __init__(self, env: TaskEnv, verifier: Verifier, max_share: float, min_rollouts: int = 32) -> None:
        self.env, self.max_share, self.min_rollouts = env, float(max_share), int(min_rollouts)
        self.name = getattr(verifier, "__qualname__", None) or type(verifier).__qualname__
        module = getattr(verifier, "__module__", None)
        self.name = f"{module}.{self.name}" if module else self.name
        self._mark = self._counts()

    def _counts(self) -> tuple[float, float]:
        m = self.env.metrics()
        return m.get("env/verifier_errors", 0.0), m.get("env/verifier_timeouts", 0.0)

    def begin(self, state: StepState | None = None) -> None:
        """Mark the start of a step's collection (evaluation in between is not counted)."""
        self._mark = self._counts()

    def closed(self, state: StepState, unit_ids: np.ndarray, decisions: np.ndarray) -> None:
        if state.rollouts >= self.min_rollouts:
            self.end(state.rollouts)

    def end(self, rollouts: int) -> dict[str, float]:
        """This step's ``env/verifier_errors`` / ``env/verifier_timeouts`` so far.

        Raises:
            VerifierFailure: more than ``max_share`` of the step's ``rollouts`` failed in the verifier.
        """
        errors, timeouts = (now - then for now, then in zip(self._counts(), self._mark))
        failed = errors + timeouts
        if rollouts and failed / rollouts > self.max_share:
            example = self.env.last_verifier_failure if isinstance(self.env, ReportsVerifierFailures) else None
            what = (f"; e.g. on completion {example[0][:200]!r}: {example[1][:300]}" if example else "")
            raise VerifierFailure(
                f"verifier {self.name} failed on {int(failed)} of {rollouts} rollouts this step ({int(errors)} "
                f"errors, {int(timeouts)} timeouts), more than max_verifier_failure_share={self.max_share:g}"
                f"{what}. Fix the verifier (or raise the limit)")
        return {"env/verifier_errors": float(errors), "env/verifier_timeouts": float(timeouts)}

