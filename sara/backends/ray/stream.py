"""Streaming through a Ray pool: ``StreamingPool`` (the base of both pools) implements ``submit`` / ``poll`` /
``abort`` / ``inflight`` of ``sara.envs.base.StreamingBackend`` / ``StreamingEnv`` over the actors.

Single requests go in under integer tags and are routed, one by one, to the actor with the most free slots (an
actor's capacity is its engine's ``slots``; the pool's ``slots`` is the sum). Every actor with work in flight has
exactly one ``poll`` call outstanding; the pool's ``poll`` waits (``ray.wait``) on those calls and hands back every
finished ``(tag, completion)``. Actors run one call at a time, so a submit, abort or weight load sent to an actor runs
after its outstanding poll; ``abort`` therefore also collects that poll's results (a rollout that finished before
the abort reached its actor is not returned, and its tokens count as aborted).

Faults: when an actor dies, hangs past ``call_timeout_s`` or raises, its in-flight rollouts are re-issued ONCE, with
the same tag and request (same seed), to the least-loaded other actor, and the dead actor is replaced (``RayPool``'s
restart policy). A rollout whose actor fails again after it was re-issued ends the run with ``WorkerFailedError``.

Which rollouts one ``poll`` returns together depends on timing (``stream_order="finish"``); ``stream_order="tag"``
hands out only the oldest in-flight rollout once it finished, so a driver sees the same sequence in every run.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from sara.backends.ray.actor import WorkerFailedError
from sara.backends.ray.base import RayPool, last_error_line

__all__ = ["StreamingPool"]


class StreamingPool(RayPool):
    """``RayPool`` plus the streaming members (see the module docstring).

    Attributes:
        native_stream: Whether the actors' backends / envs stream themselves; otherwise each actor streams by batch
            calls over its queued requests (``MicroBatchStream``, ``micro_batch`` requests per call).
    """

    def _stream_init(self) -> None:
        """Empty streaming state (called before the actors start: a failed start may already call ``_on_lost``)."""
        self._caps: list[int] = []
        self._items: dict[int, tuple[Any, tuple[Any, ...]]] = {}  # tag -> (request, extra args); every tag in flight
        self._owner: dict[int, int] = {}  # tag -> worker holding it
        self._load: list[int] = []  # tags per worker
        self._polls: dict[Any, tuple[int, float, list[Any]]] = {}  # poll ref -> (worker, sent at, submits before it)
        self._poll_of: dict[int, Any] = {}  # worker -> its outstanding poll ref
        self._submits: dict[int, list[Any]] = {}  # worker -> submit refs sent since its last poll
        self._pending: list[tuple[int, int]] = []  # (tag, worker it was lost on): to re-issue
        self._reissued: set[int] = set()  # tags in flight that were re-issued once already
        self._ready: list[tuple[int, Any]] = []  # finished, not yet handed out by poll
        self._wasted = 0  # tokens of aborted rollouts found finished in a poll result
        self.stream_counts = {"submitted": 0, "returned": 0, "aborted": 0, "aborted_tokens": 0, "reissued": 0}
        """Streaming counters: rollouts submitted / returned / aborted / re-issued, tokens of aborted rollouts."""

    def _stream_start(self) -> None:
        """Read every actor's capacity (``slots``) once the actors run (closes the pool if that fails)."""
        ray = self._ray
        try:
            infos = [self._guard(w, "starting", lambda w=w: ray.get(self.actors[w].info.remote()))
                     for w in range(self.num_workers)]
        except BaseException:
            self.close()
            raise
        self._caps = [int(i["slots"]) for i in infos]
        self._load = [0] * self.num_workers
        self.native_stream = all(i["native_stream"] for i in infos)

    @property
    def slots(self) -> int:
        """Completions generated concurrently at full occupancy: the sum of the actors' ``slots``."""
        return sum(self._caps)

    def inflight(self) -> int:
        """Rollouts submitted and neither returned by ``poll`` nor aborted."""
        return len(self._items) + len(self._ready)

    def inflight_per_worker(self) -> list[int]:
        """Rollouts each worker holds (submitted to it, not yet returned, aborted or re-issued)."""
        return list(self._load)

    # ---- routing
    def _stream_submit(self, items: Sequence[tuple[int, Any]], extra: tuple[Any, ...]) -> None:
        self._check_open()
        items = list(items)
        seen: set[int] = {t for t, _ in self._ready}
        for tag, request in items:
            if request.n != 1:
                raise ValueError(f"Ray {self._kind}: submit takes one seed per item; tag {tag} has {request.n}")
            if int(tag) in self._items or int(tag) in seen:
                raise ValueError(f"Ray {self._kind}: tag {tag} is already in flight")
            seen.add(int(tag))
        for tag, request in items:
            self._items[int(tag)] = (request, extra)
        self.stream_counts["submitted"] += len(items)
        self._send([(int(tag), -1) for tag, _ in items])

    def _pick(self, avoid: int) -> int:
        """The worker with the most free slots (ties: lowest index), other than ``avoid`` when there is another."""
        cands = [w for w in range(self.num_workers) if w != avoid] or list(range(self.num_workers))
        return max(cands, key=lambda w: (self._caps[w] - self._load[w], -w))

    def _send(self, entries: list[tuple[int, int]]) -> None:
        """Route ``(tag, worker to avoid)`` entries and send one submit per (worker, sampling)."""
        batches: dict[tuple[int, tuple[Any, ...]], list[tuple[int, Any]]] = {}
        for tag, avoid in entries:
            w = self._pick(avoid)
            self._owner[tag] = w
            self._load[w] += 1
            request, extra = self._items[tag]
            batches.setdefault((w, extra), []).append((tag, request))
        for (w, extra), batch in batches.items():
            ref = self.actors[w].stream_submit.remote(self.version, batch, *extra)
            self._submits.setdefault(w, []).append(ref)

    def _flush(self) -> None:
        """Re-issue the rollouts of failed workers (each once, to another worker when there is one)."""
        pending, self._pending = self._pending, []
        self._send([(t, w) for t, w in pending if t in self._items])

    def _release(self, tags: Sequence[int]) -> None:
        for t in tags:
            w = self._owner.pop(t, None)
            if w is not None:
                self._load[w] -= 1

    # ---- polling
    def _doing(self, w: int) -> str:
        return f"streaming ({self._load[w]} rollouts in flight, weights version {self.version})"

    def _ensure_polls(self) -> None:
        for w in range(self.num_workers):
            if self._load[w] > 0 and w not in self._poll_of:
                ref = self.actors[w].stream_poll.remote(self.config.stream_poll_s)
                self._polls[ref] = (w, time.monotonic(), self._submits.pop(w, []))
                self._poll_of[w] = ref

    def _collect(self, ref: Any) -> None:
        """Take a finished poll call's results into ``_ready``; a failed call fails its worker (re-issue)."""
        ray = self._ray
        w, _, submits = self._polls.pop(ref)
        del self._poll_of[w]
        try:
            if submits:
                ray.get(submits)  # ran before the poll: done; raises if a submit failed
            results = ray.get(ref)
        except ray.exceptions.RayError as exc:
            self._check_stale(exc)
            self._fail(w, self._doing(w), exc)
            return
        self._failures[w] = 0
        for tag, item in results:
            if self._owner.get(tag) != w:
                continue  # aborted earlier, or not this worker's (never happens with a well-behaved engine)
            self._release([tag])
            if tag not in self._items:  # being aborted: finished before the abort reached the actor
                self._wasted += int(item.num_tokens)
                continue
            del self._items[tag]
            self._reissued.discard(tag)
            self._ready.append((tag, item))

    def _check_timeouts(self) -> None:
        limit = self.config.call_timeout_s
        if limit is None:
            return
        now = time.monotonic()
        for ref, (w, t0, _) in list(self._polls.items()):
            if ref in self._polls and now - t0 >= limit:
                self._polls.pop(ref)
                del self._poll_of[w]
                self._fail(w, self._doing(w), TimeoutError(f"no result after {limit} s"))  # kills the stuck actor

    def poll(self, timeout: float | None = None) -> list[tuple[int, Any]]:
        """Wait until at least one rollout finished (at most ``timeout`` seconds; None = as long as it takes) and
        return every finished ``(tag, completion)`` (``stream_order="tag"``: only the oldest in-flight rollout, once
        it finished). Empty when nothing is in flight or on timeout."""
        self._check_open()
        ray = self._ray
        deadline = None if timeout is None else time.monotonic() + max(0.0, float(timeout))
        limit = self.config.call_timeout_s
        while True:
            self._flush()
            out = self._take_ready()
            if out:
                return out
            if not self._owner:
                return []
            self._ensure_polls()
            now = time.monotonic()
            waits = [] if deadline is None else [deadline - now]
            if limit is not None:
                waits.append(min(t0 for _, t0, _ in self._polls.values()) + limit - now)
            wait_s = max(0.0, min(waits)) if waits else None
            refs = list(self._polls)
            ready, rest = ray.wait(refs, num_returns=1, timeout=wait_s)
            if ready and rest:
                more, _ = ray.wait(rest, num_returns=len(rest), timeout=0)
                ready += more
            for ref in ready:
                self._collect(ref)
            out = self._take_ready()
            if out:
                return out
            self._check_timeouts()
            if deadline is not None and time.monotonic() >= deadline:
                return []

    def _take_ready(self) -> list[tuple[int, Any]]:
        """What ``poll`` hands out now: everything finished (``finish``), or the oldest in-flight rollout once it
        finished (``tag``)."""
        if not self._ready:
            return []
        if self.config.stream_order == "finish":
            out, self._ready = self._ready, []
        else:
            head = min([t for t, _ in self._ready] + ([min(self._items)] if self._items else []))
            out = [(t, c) for t, c in self._ready if t == head]
            self._ready = [(t, c) for t, c in self._ready if t != head]
        self.stream_counts["returned"] += len(out)
        return out

    def abort(self, tags: Sequence[int]) -> int:
        """Cancel in-flight rollouts (unknown / finished tags are ignored); returns the tokens they had generated
        (those of a rollout lost with a dead actor are unknown and not counted)."""
        self._check_open()
        finished = {t for t, _ in self._ready}  # finished, not handed out yet (stream_order="tag", or after an abort)
        drop = {int(t) for t in tags if int(t) in self._items or int(t) in finished}
        if not drop:
            return 0
        ray = self._ray
        for t in drop:
            self._items.pop(t, None)
            self._reissued.discard(t)
        tokens = sum(int(c.num_tokens) for t, c in self._ready if t in drop)
        self._ready = [(t, c) for t, c in self._ready if t not in drop]
        by_worker: dict[int, list[int]] = {}
        for t in sorted(drop):
            if t in self._owner:
                by_worker.setdefault(self._owner[t], []).append(t)
        refs = {w: self.actors[w].stream_abort.remote(ts) for w, ts in by_worker.items()}
        self._wasted = 0
        for w, ref in refs.items():
            try:
                tokens += int(ray.get(ref))
            except ray.exceptions.RayError as exc:
                self._release(by_worker[w])
                self._check_stale(exc)
                self._fail(w, f"aborting {len(by_worker[w])} rollouts", exc)
                continue
            if w in self._poll_of:  # the actor ran its outstanding poll before the abort: take its results now
                self._collect(self._poll_of[w])
            self._release(by_worker[w])
        tokens += self._wasted
        self.stream_counts["aborted"] += len(drop)
        self.stream_counts["aborted_tokens"] += tokens
        return tokens

    # ---- faults
    def _on_lost(self, w: int, doing: str, exc: BaseException) -> None:
        """Worker ``w`` failed: queue its in-flight rollouts for ONE re-issue; a rollout lost twice ends the run."""
        if not hasattr(self, "_owner"):
            return
        ref = self._poll_of.pop(w, None)
        dropped = list(self._submits.pop(w, []))
        if ref is not None:
            dropped += [ref, *self._polls.pop(ref, (0, 0.0, []))[2]]
        _discard(self._ray, dropped)
        held = sorted(t for t, o in self._owner.items() if o == w)
        self._release(held)
        lost = [t for t in held if t in self._items]
        twice = [t for t in lost if t in self._reissued]
        if twice:
            raise WorkerFailedError(
                f"Ray worker {w} of {self.num_workers} ({self._describe_factory()}) failed while {doing}, holding "
                f"{len(twice)} rollouts (tags {twice[:8]}{' ...' if len(twice) > 8 else ''}) that had already been "
                f"re-issued once after another failure; giving up on them. Last error: {last_error_line(exc)}") from exc
        self._reissued.update(lost)
        self._pending.extend((t, w) for t in lost)
        self.stream_counts["reissued"] += len(lost)

    def metrics(self) -> dict[str, float]:
        """``RayPool.metrics`` plus ``ray/stream_*``: slots, rollouts in flight, submitted, returned, aborted (and
        their tokens), re-issued after a worker failure."""
        out = super().metrics()
        out.update({"ray/stream_slots": float(self.slots), "ray/stream_inflight": float(self.inflight())})
        out.update({f"ray/stream_{k}": float(v) for k, v in self.stream_counts.items()})
        return out


def _discard(ray: Any, refs: list[Any]) -> None:
    """Read the finished ones of a failed worker's dropped calls, so Ray does not log their errors as unhandled."""
    if not refs:
        return
    done, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
    for r in done:
        try:
            ray.get(r)
        except Exception:  # noqa: BLE001 - the worker failed; its calls' errors are expected
            pass
