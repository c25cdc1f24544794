"""The Learner: committed groups in, one policy update out (padding, log-probs, advantages, loss, optimizer, LR).

Unit-testable without a generation backend or an environment: give it a policy, an ``AlgoSpec`` and groups of
rollouts that carry token ids. ``train_step`` calls its three phases by name so each is timed:

    batch = learner.make_batch(groups, version=v)            # pad prompt + response tokens, grouped by id
    advantages, returns, extra = learner.advantages(batch)   # rollout-time log-probs / values, then the estimator
    metrics = learner.update(batch, advantages, returns, extra, step=step)   # epochs x mini-batches

Every forward runs over micro-batches (``sara.train.microbatch``: at most ``OptimConfig.microbatch_tokens`` positions
each, rows grouped by shared prompt prefix) and a mini-batch's micro-batch gradients are accumulated, with the
mini-batch's loss denominators, before its ONE optimizer step. A ``PrefixScorer`` policy (``HFPolicy``) forwards the
prefix all rows of a mini-batch share once for all its micro-batches (``sara.train.prefix_grad``), the rest of each
micro-batch's shared prefix once per micro-batch, and projects to the vocabulary only at response positions; other
policies run ``Policy.score`` and the response positions are gathered. Log-probs come with the entropy only when the
algorithm's loss uses it (``AlgoSpec.needs_entropy``) and values only when it trains a critic.

Old log-probs: with one optimizer step per batch (one epoch, one mini-batch) they equal the update's own log-probs
before its step, so they are that forward's, detached (verl does the same), and ``advantages`` runs no policy forward
unless the estimator needs rollout-time log-probs or values (KL in the reward, a critic). Otherwise ``advantages``
recomputes them once, without gradient. Stale rows (``Batch.stale``) always take their generator's log-probs.

Shapes: ``N`` rollouts, ``T`` prompt + response positions, ``R`` response positions.
"""

from __future__ import annotations

import copy
import math
from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from sara.memory import device_memory_bytes
from sara.train.batch import Batch, make_batch, rows_of
from sara.train.heap import bound_heap, bound_kernel_caches, trim_heap
from sara.train.microbatch import MicroBatch, microbatch_budget, plan_microbatches, shared_prefix
from sara.train.prefix_grad import SharedPrefix
from sara.train.sections import OptimConfig

if TYPE_CHECKING:
    import torch

    from sara.algos.specs import AlgoSpec
    from sara.policies.base import Policy
    from sara.types import Group

__all__ = ["Learner", "lr_at", "planned_optimizer_steps"]


def planned_optimizer_steps(steps: int, groups_per_step: int, k: int, epochs: int, minibatch_rollouts: int | None
                            ) -> int:
    """Optimizer steps a run of ``steps`` full batches makes (the horizon of the decay schedules)."""
    per_batch = math.ceil(groups_per_step * k / minibatch_rollouts) if minibatch_rollouts else 1
    return max(1, steps * epochs * per_batch)


def lr_at(cfg: OptimConfig, optimizer_steps: int, horizon: int) -> float:
    """The learning rate after ``optimizer_steps`` updates: linear warmup, then constant / linear / cosine decay to 0
    at ``horizon`` optimizer steps (``cfg.total_optimizer_steps`` wins when set)."""
    s = optimizer_steps
    if cfg.warmup_steps and s < cfg.warmup_steps:
        return cfg.lr * (s + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return cfg.lr
    horizon = cfg.total_optimizer_steps or horizon
    frac = min(1.0, (s - cfg.warmup_steps) / max(1, horizon - cfg.warmup_steps))
    if cfg.schedule == "linear":
        return cfg.lr * (1.0 - frac)
    return cfg.lr * 0.5 * (1.0 + math.cos(math.pi * frac))


class Learner:
    """Owns the trainable side of a run: the policy's optimizer, a frozen reference copy (when the algorithm needs
    one), the LR schedule and the optimizer-step counter (a schedule follows optimizer steps, never rollouts).

    Args:
        policy: A ``sara.policies.base.Policy``.
        algo: An ``AlgoSpec`` (``sara.algos.make_algo``).
        optim: Optimizer and schedule.
        seed: Seeds the mini-batch order (with the step and epoch).
        horizon: Optimizer steps of the whole run, for the decay schedules when ``optim.total_optimizer_steps`` is
            unset (see ``planned_optimizer_steps``).
    """

    def __init__(self, policy: Policy, algo: AlgoSpec, optim: OptimConfig, *, seed: int = 0, horizon: int = 1) -> None:
        import torch

        from sara.policies.base import PrefixScorer, SizesActivations

        bound_heap()  # freed activations go back to the OS at once, not to the heap's high-water mark
        bound_kernel_caches()  # a library user's process: effective if no matmul ran yet (the CLI sets it first)
        self.policy, self.algo, self.optim, self.seed, self.horizon = policy, algo, optim, seed, max(1, horizon)
        self.epochs = optim.epochs or algo.epochs
        self.shares_prefix = isinstance(policy, PrefixScorer)  # else: Policy.score, then a gather
        per_token = policy.activation_bytes_per_token() if isinstance(policy, SizesActivations) else None
        self.microbatch_tokens, self.microbatch_reason = microbatch_budget(optim.microbatch_tokens, per_token,
                                                                           device_memory_bytes(self.device))
        self.reference = None
        if algo.needs_reference:  # a frozen copy of the starting policy
            self.reference = copy.deepcopy(policy)
            for p in self.reference.parameters():
                p.requires_grad_(False)
        params = [p for p in policy.parameters() if p.requires_grad]
        fused = all(p.is_floating_point() and p.device.type in ("cpu", "cuda") for p in params)  # one kernel: ~5x faster
        self.optimizer = torch.optim.AdamW(params, lr=optim.lr, betas=optim.betas, weight_decay=optim.weight_decay,
                                           fused=fused or None)
        self.optimizer_steps = 0

    @property
    def device(self) -> torch.device:
        return cast("torch.device", next(iter(self.policy.parameters())).device)

    def lr(self) -> float:
        """The learning rate of the next optimizer step."""
        return lr_at(self.optim, self.optimizer_steps, self.horizon)

    def single_pass(self, n: int) -> bool:
        """Whether a batch of ``n`` rollouts gets ONE optimizer step (one epoch, one mini-batch): its old log-probs
        are then the update forward's own, detached."""
        return self.epochs == 1 and (self.optim.minibatch_rollouts is None or self.optim.minibatch_rollouts >= n)

    # ------------------------------------------------------------------------------------------------ phases
    def make_batch(self, groups: Sequence[Group], version: int | None = None) -> Batch | None:
        """``make_batch`` on the policy's device (``version``: mark rollouts of older weights stale)."""
        return make_batch(groups, self.device, version)

    def advantages(self, b: Batch) -> tuple[torch.Tensor, torch.Tensor | None, dict[str, Any]]:
        """Rollout-time log-probs (policy, reference) and values without gradient when needed, then the estimator.

        The policy's rollout-time pass runs only when the estimator needs its log-probs or values, or the batch gets
        more than one optimizer step (``single_pass``); otherwise ``extra["old_logprobs"]`` is None and ``update``
        takes them from its own forward.

        Returns:
            ``(advantages [N, R], returns [N, R] or None, extra)``; ``extra`` holds the rollout-time tensors the loss
            needs and ``metrics`` (``algo/gen_logprob_gap``: mean |trainer - generator| log-prob per fresh token,
            here or from ``update``'s forward; ``algo/stale_fraction``).
        """
        import torch

        from sara.algos import AdvantageInputs

        m = b.response_mask
        rollout_pass = self.algo.needs_critic or self.algo.kl_in_reward or not self.single_pass(len(m))
        with torch.no_grad():
            out = self._score_all(self.policy, b, with_values=self.algo.needs_critic) if rollout_pass else None
            ref_lp = self._score_all(self.reference, b).logprobs if self.reference is not None else None
        metrics = {"algo/stale_fraction": 0.0 if b.stale is None else float(b.stale.float().mean())}
        old_lp = values = None
        if out is not None:
            values = out.values * m if out.values is not None else None
            metrics["algo/gen_logprob_gap"] = _gen_gap(out.logprobs, b)
            old_lp = _behaviour(out.logprobs, b)
        extra = {"old_logprobs": old_lp, "ref_logprobs": ref_lp, "values": values, "metrics": metrics}
        advantages, returns = self.algo.compute_advantages(AdvantageInputs(
            rewards=b.rewards, group_ids=b.group_ids, response_mask=m, values=values, old_logprobs=old_lp,
            ref_logprobs=ref_lp))
        return advantages, returns, extra

    def update(self, b: Batch, advantages: torch.Tensor, returns: torch.Tensor | None, extra: Mapping[str, Any],
               *, step: int) -> dict[str, float]:
        """``epochs`` passes of shuffled mini-batches, one optimizer step each; mean ``algo/...`` metrics.

        Each mini-batch: its loss denominators, the prefix all its rows share forwarded once without a graph
        (``SharedPrefix``), then per micro-batch a forward with gradient on top of it, its loss (divided by the
        mini-batch's counts) and a backward; the prefix forwarded again with a graph and its summed gradient sent back
        through it once; then the mini-batch's metrics from the detached outputs (what one forward would report),
        gradient clipping and ONE optimizer step. Gradients are freed after
        the step, and the heap pages the update's activations freed go back to the OS at its end (``trim_heap``).
        """
        import torch

        cfg = self.optim
        n = b.rewards.shape[0]
        mb = cfg.minibatch_rollouts or n
        sums: dict[str, float] = defaultdict(float)
        count = 0
        for epoch in range(self.epochs):
            order = np.random.default_rng([self.seed, step, epoch, 0x5EED]).permutation(n)
            for lo in range(0, n, mb):
                idx = torch.as_tensor(order[lo : lo + mb], device=b.rewards.device)
                sub = b.rows(idx)
                targets = {"advantages": advantages[idx], "returns": rows_of(returns, idx),
                           "old_logprobs": rows_of(extra["old_logprobs"], idx),
                           "ref_logprobs": rows_of(extra["ref_logprobs"], idx), "old_values": rows_of(extra["values"], idx)}
                den = self.algo.loss_denominators(advantages[idx], sub.response_mask, sub.group_ids)
                self.optimizer.zero_grad(set_to_none=True)
                outs = []
                shared, plan = self._prepare(self.policy, sub)
                for micro in plan:
                    rows = torch.as_tensor(micro.rows, device=idx.device)
                    out = self._forward(self.policy, sub, micro, with_entropy=self.algo.needs_entropy,
                                        with_values=self.algo.needs_critic, shared=shared)
                    loss, _ = self.algo.compute_loss(self._loss_inputs(sub, targets, out, rows), den)
                    loss.backward()
                    outs.append((rows, _detached(out)))  # the micro-batch's graph goes now
                if shared is not None:
                    shared.backward()  # the shared prefix's gradient, once, before clipping
                whole = _assemble(outs, len(idx))  # detached [n, R]: the mini-batch's metrics, as one forward's
                _, m = self.algo.compute_loss(self._loss_inputs(sub, targets, whole, None), den)
                if targets["old_logprobs"] is None:
                    m["algo/gen_logprob_gap"] = _gen_gap(whole.logprobs, sub)
                for group in self.optimizer.param_groups:
                    group["lr"] = self.lr()
                if cfg.grad_clip is not None:
                    m["algo/grad_norm"] = float(torch.nn.utils.clip_grad_norm_(self.policy.parameters(),
                                                                              cfg.grad_clip))
                self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=True)  # no gradient buffers held between steps
                self.optimizer_steps += 1
                for key, v in m.items():
                    sums[key] += v
                count += 1
        trim_heap()
        out_m = {k: v / count for k, v in sums.items()}
        out_m["algo/optimizer_steps"] = float(count)
        adv_m = advantages[b.response_mask > 0]
        out_m["algo/adv_abs_mean"] = float(adv_m.abs().mean()) if adv_m.numel() else 0.0
        return out_m

    # ------------------------------------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """Policy weights (CPU copies), optimizer state and the optimizer-step counter."""
        return {"policy": {k: v.detach().cpu().clone() for k, v in self.policy.state_dict().items()},
                "optimizer": self.optimizer.state_dict(), "optimizer_steps": self.optimizer_steps}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.policy.load_state_dict(state["policy"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.optimizer_steps = int(state["optimizer_steps"])

    # ------------------------------------------------------------------------------------------------ forwards
    def _plan(self, b: Batch, given: int = 0) -> list[MicroBatch]:
        """``b``'s micro-batches (``plan_microbatches`` under ``microbatch_tokens``, ``given`` tokens given)."""
        return plan_microbatches(_prompts(b), b.tokens.attention_mask.sum(1).tolist(), self.microbatch_tokens,
                                 share=self.shares_prefix, given=given)

    def shared_length(self, b: Batch) -> int:
        """Leading tokens every row of ``b`` shares that an update forwards once (0: none, or not a ``PrefixScorer``)."""
        return shared_prefix(_prompts(b)) if self.shares_prefix else 0

    def _prepare(self, policy: Any, b: Batch) -> tuple[SharedPrefix | None, list[MicroBatch]]:
        """The prefix every row of ``b`` shares forwarded by ``policy`` without a graph (``SharedPrefix``; None: none,
        or it cannot give keys / values, e.g. under gradient checkpointing) and ``b``'s micro-batches planned on it."""
        shared = SharedPrefix.forward(policy, b.tokens, self.shared_length(b))
        return shared, self._plan(b, given=0 if shared is None else shared.kv.length)

    def _forward(self, policy: Any, b: Batch, micro: MicroBatch, *, with_entropy: bool = False,
                 with_values: bool = False, shared: SharedPrefix | None = None) -> Any:
        """One forward of ``micro``'s rows of ``b`` (on ``shared`` if set), outputs ``[n, R]`` at response positions."""
        import torch

        from sara.policies.base import PolicyOutput, TokenBatch

        t, w = b.tokens, micro.width
        rows = torch.as_tensor(micro.rows, device=t.input_ids.device)
        tokens = TokenBatch(t.input_ids[rows, :w], t.attention_mask[rows, :w], t.response_mask[rows, :w])
        at = b.resp_index[rows].clamp(max=w - 1)
        if self.shares_prefix:
            return policy.score_at(tokens, at, prefix_len=micro.prefix, with_entropy=with_entropy,
                                   with_values=with_values, prefix=None if shared is None else shared.kv)
        out = policy.score(tokens, with_entropy=with_entropy, with_values=with_values)
        return PolicyOutput(out.logprobs.gather(1, at), None if out.entropy is None else out.entropy.gather(1, at),
                            None if out.values is None else out.values.gather(1, at))

    def _score_all(self, policy: Any, b: Batch, *, with_values: bool = False) -> Any:
        """``policy``'s outputs ``[N, R]`` on every row of ``b``, micro-batch by micro-batch (call without grad)."""
        import torch

        shared, plan = self._prepare(policy, b)  # no graph: its keys / values as they are
        outs = [(torch.as_tensor(micro.rows, device=b.rewards.device),
                 self._forward(policy, b, micro, with_values=with_values, shared=shared)) for micro in plan]
        return _assemble(outs, len(b.rewards))

    def _loss_inputs(self, b: Batch, targets: Mapping[str, Any], out: Any, rows: Any) -> Any:
        """``LossInputs`` of rows ``rows`` of mini-batch ``b`` (None = all) with the policy outputs ``out``; old
        log-probs from ``out`` (detached; stale rows: the generator's) when ``targets`` has none."""
        from sara.algos import LossInputs

        sub = b if rows is None else b.rows(rows)
        old = rows_of(targets["old_logprobs"], rows)
        return LossInputs(
            logprobs=out.logprobs, advantages=targets["advantages"] if rows is None else targets["advantages"][rows],
            response_mask=sub.response_mask,
            old_logprobs=_behaviour(out.logprobs.detach(), sub) if old is None else old,
            ref_logprobs=rows_of(targets["ref_logprobs"], rows), entropy=out.entropy, values=out.values,
            old_values=rows_of(targets["old_values"], rows), returns=rows_of(targets["returns"], rows),
            group_ids=sub.group_ids)


def _prompts(b: Batch) -> list[tuple[int, ...]]:
    """Each row's prompt token ids."""
    return [tuple(row[:p]) for row, p in zip(b.tokens.input_ids.tolist(), b.prompts().tolist())]


def _assemble(outs: Sequence[tuple[Any, Any]], n: int) -> Any:
    """Detached ``PolicyOutput`` ``[n, R]`` from micro-batch outputs ``(rows, output)``."""
    from sara.policies.base import PolicyOutput

    def join(name: str) -> Any:
        parts = [(rows, getattr(out, name)) for rows, out in outs]
        if parts[0][1] is None:
            return None
        first = parts[0][1]
        full = first.new_zeros((n, *first.shape[1:]))
        for rows, x in parts:
            full[rows] = x.detach()
        return full

    return PolicyOutput(join("logprobs"), join("entropy"), join("values"))


def _detached(out: Any) -> Any:
    from sara.policies.base import PolicyOutput

    return PolicyOutput(*(None if x is None else x.detach() for x in (out.logprobs, out.entropy, out.values)))


def _behaviour(logprobs: Any, b: Batch) -> Any:
    """Old log-probs ``[N, R]``: ``logprobs``, the generator's on stale rows (their behaviour policy)."""
    import torch

    return logprobs if b.stale is None else torch.where(b.stale[:, None], b.gen_logprobs, logprobs)


def _gen_gap(logprobs: Any, b: Batch) -> float:
    """Mean |trainer - generator| log-prob per token of the fresh rows."""
    m = b.response_mask
    fresh = m if b.stale is None else m * (~b.stale)[:, None]
    return float(((logprobs - b.gen_logprobs).abs() * fresh).sum() / fresh.sum().clamp(min=1))
