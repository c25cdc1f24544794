"""``TreeTaskEnv``: tree-structured rollouts on a real text backend (the text side of ``sara_tree``).

``sara_tree:node_prefix=true`` sends, per tree and round, a node handle that names the branch node of every leaf
(``sara.handles.format_handle``). This environment turns handles into text:

* a leaf that **opens** branch c is an ordinary completion of the prompt; its first ``segment_fraction`` of
  characters (cut back to a whitespace boundary) becomes branch c's partial trace;
* a leaf that **deepens** branch c continues ``prompt + partial trace``: the verifier scores ``trace + continuation``,
  and the rollout holds only the continuation (``metadata["prefix"]`` = the trace), so the policy is trained on what
  it generated and the shared segment's tokens are paid once, by the opening leaf.

Every rollout gets ``metadata["branch"]``. A round is at most two backend calls: openers and leaves of branches that
already exist, then the leaves of branches opened in this round (their trace is only known after the first call).
Deepening leaves of one branch go out as one request with several seeds, so engines with prefix caching (vLLM)
reuse the shared prompt + trace. Requests without a handle are plain ``TaskEnv`` rollouts.

Traces are kept for the running and the previous step (keyed by the handle's step and unit).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from sara.envs.task_env import TaskEnv
from sara.handles import parse_handle
from sara.types import Rollout, RolloutRequest

__all__ = ["TreeTaskEnv", "cut_segment"]


def cut_segment(text: str, fraction: float) -> str:
    """The first ``fraction`` of ``text`` (at least one character), cut back to the last whitespace when there is
    one, so a partial trace ends between words."""
    if not text:
        return ""
    end = max(1, int(len(text) * fraction))
    cut = max(text.rfind(" ", 0, end + 1), text.rfind("\n", 0, end + 1))
    return text[: cut + 1] if cut > 0 else text[:end]


class TreeTaskEnv(TaskEnv):
    """A ``TaskEnv`` that grows rollout trees from ``sara_tree`` node handles (see the module docstring).

    Args:
        *args: ``TaskEnv`` arguments (task, backend, sampling).
        segment_fraction: Share of an opening leaf's characters that becomes its branch's partial trace.
        **kwargs: ``TaskEnv`` keyword arguments.
    """

    def __init__(self, *args: Any, segment_fraction: float = 0.5, **kwargs: Any) -> None:
        if not 0.0 < segment_fraction < 1.0:
            raise ValueError(f"TreeTaskEnv: field 'segment_fraction': must be in (0, 1) (got {segment_fraction})")
        super().__init__(*args, **kwargs)
        self.segment_fraction = float(segment_fraction)
        self._traces: dict[tuple[int, int, int], str] = {}  # (step, unit, branch) -> partial trace
        self._step = -1

    def trace(self, step: int, unit: int, branch: int) -> str | None:
        """The partial trace of a branch node (None if it was never opened or has been forgotten)."""
        return self._traces.get((step, unit, branch))

    def rollout(self, requests: Sequence[RolloutRequest]) -> list[list[Rollout]]:
        out: list[list[Rollout | None]] = [[None] * r.n for r in requests]
        plain: list[tuple[int, RolloutRequest]] = []
        leaves: list[tuple[int, int, tuple[int, int, int], bool, int]] = []  # (req, pos, node, opens, seed)
        for i, r in enumerate(requests):
            h = parse_handle(r.prefix)
            if h is None:
                plain.append((i, r))
                continue
            step, unit, _, nodes, opens = h
            if len(nodes) < r.n:
                raise ValueError(f"tree handle {r.prefix!r} names {len(nodes)} leaves for a request of {r.n}")
            if step > self._step:
                self._step = step
                self._traces = {key: v for key, v in self._traces.items() if key[0] >= step - 1}
            leaves += [(i, j, (step, unit, nodes[j]), opens[j], int(r.seeds[j])) for j in range(r.n)]

        first = [leaf for leaf in leaves if leaf[3] or leaf[2] in self._traces]
        later = [leaf for leaf in leaves if not (leaf[3] or leaf[2] in self._traces)]
        batch = [RolloutRequest(unit_id=r.unit_id, pool_index=r.pool_index, prompt=r.prompt, seeds=r.seeds,
                                max_new_tokens=r.max_new_tokens) for _, r in plain]
        self._run(requests, out, first, batch, [i for i, _ in plain])
        if later:
            self._run(requests, out, later, [], [])
        return [[x for x in group if x is not None] for group in out]  # type: ignore[misc]

    def _run(self, requests: Sequence[RolloutRequest], out: list[list[Rollout | None]],
             leaves: list[tuple[int, int, tuple[int, int, int], bool, int]], batch: list[RolloutRequest],
             plain_idx: list[int]) -> None:
        """One backend call: ``batch`` (plain requests, in order of ``plain_idx``) plus the given tree leaves."""
        n_plain = len(batch)
        openers = [leaf for leaf in leaves if leaf[3]]
        by_node: dict[tuple[int, int, int], list[tuple[int, int, tuple[int, int, int], bool, int]]] = {}
        for leaf in leaves:
            if not leaf[3]:
                by_node.setdefault(leaf[2], []).append(leaf)
        for i, _, _, _, seed in openers:
            r = requests[i]
            batch.append(RolloutRequest(unit_id=r.unit_id, pool_index=r.pool_index, prompt=r.prompt, seeds=(seed,),
                                        max_new_tokens=r.max_new_tokens))
        for node, group in by_node.items():
            if node not in self._traces:
                raise ValueError(f"tree handle deepens branch {node[2]} of tree {node[0]}.{node[1]}, which was never "
                                 "opened (or is older than the previous step)")
            r = requests[group[0][0]]
            batch.append(RolloutRequest(unit_id=r.unit_id, pool_index=r.pool_index, prompt=r.prompt,
                                        seeds=tuple(leaf[4] for leaf in group), prefix=self._traces[node],
                                        max_new_tokens=r.max_new_tokens))
        if not batch:
            return
        results = super().rollout(batch)
        for i, rs in zip(plain_idx, results[:n_plain]):
            out[i] = list(rs)
        for (i, j, node, _, _), (rollout,) in zip(openers, results[n_plain: n_plain + len(openers)]):
            self._traces[node] = cut_segment(rollout.completion, self.segment_fraction)
            out[i][j] = _with_branch(rollout, node[2])
        for group, rs in zip(by_node.values(), results[n_plain + len(openers):]):
            for (i, j, node, _, _), rollout in zip(group, rs):
                out[i][j] = _with_branch(rollout, node[2])


def _with_branch(rollout: Rollout, branch: int) -> Rollout:
    return dataclasses.replace(rollout, metadata={**rollout.metadata, "branch": int(branch)})
