"""verl's agent loop and TransferQueue as a sara ``StreamingEnv``, so ``sara.driver.collect`` runs the step.

``VerlRolloutEnv`` turns the driver's rollouts into verl submissions and TransferQueue reads:

- ``submit``: the rollouts of one unit in one call become ONE row with ``__rollout_n__`` = their number and one seed
  per session (``SaraAgentLoopManager.launch``). A unit's first row runs under the prompt's own uid (the one verl's
  ``_submit_batch_to_rollout`` registered); later rows (more probes, the rest of a committed group, retries) under
  ``{uid}-s{serial}`` with their own ``pending`` prompt tag (uids never contain ``_``: trajectory keys are
  ``{uid}_{session}_{index}``);
- ``poll``: sessions whose trajectory tag is ``status == "success"`` are delivered, in (unit, j) order, with the reward
  ``rm_scores.sum()``; a session missing when its prompt key went terminal (``finished`` / ``failure``) failed and is
  started again with the same seed (``max_retries``);
- ``abort``: ``SaraAgentLoopManager.cancel``; a session that could not be cancelled is dropped when it lands (its keys
  cleared), so every rollout started ends delivered, cancelled or dropped, exactly once;
- ``drain`` / ``finish`` (after the driver): wait until every prompt key is terminal, rewrite the ``uid`` field of the
  committed rollouts to their unit's uid (GRPO groups by it), clear every other key the step created, and return the
  committed trajectory keys as verl's ``KVBatchMeta``.

Prompt rows come from a prompt source (``sara.integrations.verl_sources``), offered by pool index and bound to a unit
when its first rollout starts.
"""

from __future__ import annotations

import time
from collections import Counter, defaultdict, deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from sara.integrations.verl_tq import TQ, Submission, held_uid, prompt_tags
from sara.types import Prompt, Rollout, RolloutRequest

__all__ = ["PromptPool", "VerlRolloutEnv"]


class PromptPool(Sequence[Prompt]):
    """The pool the driver indexes: a ``Prompt`` per pool index (verl keeps the rows; the driver needs ids only)."""

    def __init__(self, size: int) -> None:
        self.size = int(size)

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(self.size))]
        return Prompt(id=f"verl-{int(i)}")

    def __iter__(self) -> Iterator[Prompt]:
        return (self[i] for i in range(self.size))


@dataclass
class _Flight:
    """One rollout of the driver (its tag): where it runs and how it ended."""

    unit: int
    j: int
    seed: int
    pool_index: int
    loc: tuple[str, int]
    state: str = "live"  # live -> delivered | cancelled | dropping -> dropped
    tries: int = 1


class VerlRolloutEnv:
    """A ``StreamingEnv`` over ``SaraAgentLoopManager`` + TransferQueue for one ``sample()`` call (see the module).

    Args:
        manager: The ``SaraAgentLoopManager``.
        global_steps: verl's step (tags of the prompt keys it registers).
        slots: Rollouts kept in flight at most.
        pool_size: Size of the pool the prompt source draws from.
        poll_interval: Seconds between TransferQueue reads while nothing lands.
        stall_timeout: Seconds without any progress before ``poll`` / ``drain`` give up (RuntimeError).
        max_retries: Times a failed session is started again before the step fails.
        idle: Called instead of sleeping ``poll_interval`` (tests release scripted rollouts there).
        tq: TransferQueue access (default: the in-process client, ``transfer_queue``).
    """

    def __init__(self, manager: Any, *, global_steps: int, slots: int, pool_size: int, poll_interval: float = 0.1,
                 stall_timeout: float = 1800.0, max_retries: int = 2, idle: Callable[[], None] | None = None,
                 tq: TQ | None = None) -> None:
        self.manager, self.global_steps, self.slots = manager, int(global_steps), int(slots)
        self.prompts = PromptPool(pool_size)
        self.poll_interval, self.stall_timeout, self.max_retries = poll_interval, stall_timeout, max_retries
        self._idle = idle or (lambda: time.sleep(self.poll_interval))
        self.tq = tq or TQ()
        self._offered: dict[int, deque[tuple[str, Any]]] = defaultdict(deque)  # pool index -> (uid, row) unbound
        self._unit_row: dict[int, tuple[str, Any]] = {}
        self._serial: Counter[int] = Counter()
        self.subs: dict[str, Submission] = {}  # TransferQueue prompt key -> its sessions' tags
        self.flights: dict[int, _Flight] = {}  # driver tag -> rollout
        self._landed: dict[int, list[str]] = {}  # tag -> its trajectory keys (delivered or dropped)
        self._released: list[str] = []  # prompt keys offered and never started
        self.counts: Counter[str] = Counter()
        self.launched: list[tuple[int, int, int, str, bool]] = []  # (submit call, unit, __rollout_n__, uid, retry)
        self._calls = 0
        self._round_tags = 0
        self._last_progress = time.monotonic()

    # ---- prompts ----------------------------------------------------------------------------------------------
    def offer(self, pool_index: int, uid: str, row: Any) -> None:
        """A prompt row (already registered in TransferQueue under ``uid``) for the next unit of ``pool_index``."""
        self._offered[int(pool_index)].append((uid, row))

    def release(self, uids: Sequence[str]) -> None:
        """Prompt keys registered for this step that will never start (cleared in ``finish``)."""
        self._released.extend(uids)

    def rollout_id(self, uid: str, session: int) -> tuple[int, int] | None:
        """``(unit, j)`` of the session ``(uid, session)``: a stable name, whatever verl's uuids."""
        sub = self.subs.get(uid)
        if sub is None or session >= len(sub.tags):
            return None
        f = self.flights[sub.tags[session]]
        return f.unit, f.j

    # ---- StreamingEnv -----------------------------------------------------------------------------------------
    def submit(self, items: Sequence[tuple[int, RolloutRequest]]) -> None:
        """Start rollouts: one row per unit with ``__rollout_n__`` = its rollouts in ``items``."""
        by_unit: dict[int, list[int]] = {}
        for tag, req in items:
            if req.n != 1 or req.prefix:
                raise ValueError("VerlRolloutEnv.submit: one rollout per item and no prefix (tree allocators are "
                                 "not supported by the verl integration)")
            u = int(req.unit_id)
            if u not in self._unit_row:
                if not self._offered[req.pool_index]:
                    raise RuntimeError(f"VerlRolloutEnv: no prompt row offered for pool index {req.pool_index}")
                self._unit_row[u] = self._offered[req.pool_index].popleft()
            self.flights[tag] = _Flight(unit=u, j=req.index, seed=int(req.seeds[0]), pool_index=req.pool_index,
                                        loc=("", 0))
            by_unit.setdefault(u, []).append(tag)
        self._launch(list(by_unit.items()), retry=False)

    def _launch(self, work: list[tuple[int, list[int]]], *, retry: bool) -> None:
        self._calls += 1
        rows, aliases = [], []
        for u, tags in work:
            base, row = self._unit_row[u]
            serial = self._serial[u]
            self._serial[u] += 1
            uid = base if serial == 0 else f"{base}-s{serial}"
            self.subs[uid] = Submission(uid=uid, base=base, tags=list(tags))
            for s, tag in enumerate(tags):
                self.flights[tag].loc = (uid, s)
            rows.append(self.tq.launch_row(row, uid, [self.flights[t].seed for t in tags]))
            if serial:
                aliases.append(uid)
            self.launched.append((self._calls, u, len(tags), uid, retry))
        if aliases:
            self.tq.put_prompt_tags(aliases, prompt_tags(len(aliases), self.global_steps))
        if rows:
            self.manager.launch(rows)
            self.counts["rows_launched"] += len(rows)

    def poll(self, timeout: float | None = None) -> list[tuple[int, Rollout]]:
        """Wait until rollouts land (or ``timeout`` seconds pass) and return them as ``(tag, Rollout)``."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            out = self._scan()
            if out or not any(f.state == "live" for f in self.flights.values()):
                return out
            if deadline is not None and time.monotonic() >= deadline:
                return []
            self._wait()

    def rollout(self, requests: Sequence[RolloutRequest]) -> list[list[Rollout]]:
        """A synchronous round: every request's rollouts, started together and waited for."""
        items, tags = [], []
        for req in requests:
            ts = []
            for i, s in enumerate(req.seeds):
                self._round_tags -= 1  # negative: never a driver's streaming tag
                items.append((self._round_tags, RolloutRequest(unit_id=req.unit_id, pool_index=req.pool_index,
                                                               prompt=req.prompt, seeds=(s,), prefix=req.prefix,
                                                               index=req.index + i)))
                ts.append(self._round_tags)
            tags.append(ts)
        self.submit(items)
        got: dict[int, Rollout] = {}
        while len(got) < len(items):
            got.update(self.poll())
        return [[got[t] for t in ts] for ts in tags]

    def abort(self, tags: Sequence[int]) -> int:
        """Cancel in-flight rollouts; those that cannot be cancelled are dropped when they land. Returns 0 (verl
        does not report the tokens a cancelled session had generated)."""
        live = [t for t in tags if t in self.flights and self.flights[t].state == "live"]
        if not live:
            return 0
        got = self.manager.cancel([self.flights[t].loc for t in live])
        for t in live:
            f = self.flights[t]
            f.state = "cancelled" if f.loc in got else "dropping"
            self.counts["cancelled" if f.loc in got else "dropping"] += 1
        return 0

    # ---- after the driver -------------------------------------------------------------------------------------
    def drain(self) -> None:
        """Wait until every prompt key this step started is terminal; rollouts landing now are dropped."""
        while True:
            if any(self.flights[t].state == "delivered" for t, _ in self._scan()):
                raise AssertionError("VerlRolloutEnv.drain: a rollout was delivered after the step ended")
            if all(s.terminal for s in self.subs.values()):
                return
            self._wait()

    def finish(self, committed: Sequence[Sequence[Rollout]]) -> Any:
        """The committed groups' trajectory keys as verl's ``KVBatchMeta`` (call after ``drain``); every other key
        of the step is cleared."""
        listing = self.tq.listing()
        keys, rewrite, bases = [], [], []
        for group in committed:
            for r in group:
                ks = list(r.metadata["tq_keys"])
                keys.extend(ks)
                if r.metadata["tq_uid"] != r.metadata["tq_base"]:
                    rewrite.extend(ks)
                    bases.extend([r.metadata["tq_base"]] * len(ks))
        if rewrite:
            self.tq.put_uids(rewrite, bases)
        keep = set(keys)
        ours = set(self.subs) | set(self._released)
        junk = [k for k in listing if held_uid(k) in ours and k not in keep]
        self.tq.clear(junk)
        self.manager.forget(list(self.subs))
        leaked = [k for k in self.tq.listing() if held_uid(k) in ours and k not in keep]
        if leaked:
            raise AssertionError(f"VerlRolloutEnv: {len(leaked)} TransferQueue keys of the step left: {leaked[:4]}")
        if len(keys) != len(keep):
            raise AssertionError("VerlRolloutEnv: a trajectory key is in two committed rollouts")
        return self.tq.batch_meta(keys, [listing[k] for k in keys])

    # ---- internals --------------------------------------------------------------------------------------------
    def _wait(self) -> None:
        if time.monotonic() - self._last_progress > self.stall_timeout:
            live = sum(f.state in ("live", "dropping") for f in self.flights.values())
            raise RuntimeError(f"VerlRolloutEnv: nothing landed for {self.stall_timeout:.0f} s with {live} rollouts "
                               "started (are the rollout servers up? raise sampler_kwargs.stall_timeout if generation "
                               "is this slow)")
        self._idle()

    def _progress(self) -> None:
        self._last_progress = time.monotonic()

    def _scan(self) -> list[tuple[int, Rollout]]:
        """One TransferQueue read: deliver landed live sessions, drop landed aborted ones, retry failed ones."""
        sessions, status = self.tq.sessions_and_status(self.subs)
        fresh = sorted(((self.subs[uid].tags[s], ks) for (uid, s), ks in sessions.items()
                        if self.subs[uid].tags[s] not in self._landed),
                       key=lambda x: (self.flights[x[0]].unit, self.flights[x[0]].j))
        out: list[tuple[int, Rollout]] = []
        deliver = [(t, ks) for t, ks in fresh if self.flights[t].state == "live"]
        rewards = self.tq.rewards([ks[-1][0] for _, ks in deliver]) if deliver else []
        if rewards is None:  # "fields not ready": read again at the next poll
            self.counts["not_ready_reads"] += 1
            deliver, rewards = [], []
        for (t, ks), reward in zip(deliver, rewards):
            f = self.flights[t]
            f.state = "delivered"
            self._landed[t] = [k for k, _ in ks]
            out.append((t, self._rollout(f, reward, ks)))
        dropped = [(t, ks) for t, ks in fresh if self.flights[t].state in ("dropping", "cancelled")]
        for t, ks in dropped:
            if self.flights[t].state == "cancelled":
                raise AssertionError(f"VerlRolloutEnv: cancelled session {self.flights[t].loc} wrote an output")
            self.flights[t].state = "dropped"
            self._landed[t] = [k for k, _ in ks]
            self.counts["dropped_landed"] += 1
            self.counts["dropped_tokens"] += sum(int(tag.get("response_len", 0)) for _, tag in ks)
            out.append((t, self._rollout(self.flights[t], 0.0, ks)))
        if dropped:
            self.tq.clear([k for t, _ in dropped for k in self._landed[t]])
        self._terminal(status, {(uid, s) for uid, s in sessions})
        if out or dropped:
            self._progress()
        return out

    def _terminal(self, status: dict[str, str], landed: set[tuple[str, int]]) -> None:
        """Prompt keys that went terminal: their sessions that never landed failed (or were aborted)."""
        retry: dict[int, list[int]] = defaultdict(list)
        for uid, st in status.items():
            sub = self.subs[uid]
            if sub.terminal or st not in ("finished", "failure"):
                continue
            sub.terminal = True
            self._progress()
            for s, t in enumerate(sub.tags):
                f = self.flights[t]
                if (uid, s) in landed or t in self._landed:
                    continue
                if f.state == "dropping":
                    f.state = "dropped"
                    self.counts["dropped_failed"] += 1
                elif f.state == "live":
                    if f.tries > self.max_retries:
                        raise RuntimeError(f"VerlRolloutEnv: rollout {f.j} of pool index {f.pool_index} failed "
                                           f"{f.tries} times in verl's agent loop (see the worker logs)")
                    f.tries += 1
                    self.counts["retried"] += 1
                    retry[f.unit].append(t)
        if retry:
            self._launch(sorted(retry.items()), retry=True)

    def _rollout(self, f: _Flight, reward: float, ks: list[tuple[str, dict]]) -> Rollout:
        uid = f.loc[0]
        return Rollout(prompt_id=f"verl-{f.pool_index}", pool_index=f.pool_index, completion="", reward=float(reward),
                       num_tokens=sum(int(tag.get("response_len", 0)) for _, tag in ks), seed=f.seed,
                       metadata={"tq_keys": tuple(k for k, _ in ks), "tq_uid": uid, "tq_base": self.subs[uid].base,
                                 "j": f.j})
