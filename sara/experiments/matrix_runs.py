"""Running a matrix's runs so that a stopped matrix reports nothing it did not finish and a rerun picks it up.

``<out>/matrix-plan.json`` records every run's config before the first starts (``claim_plan``); a rerun on the same
``--out`` must plan the same runs (else a one-line ``ConfigError`` naming the first difference). A run that finishes
writes ``cells/<cell>/seed<s>/result.json`` (its config and its measures, atomically): the run's completion marker.
A rerun uses a finished run's ``result.json`` as it is and trains only the others, continuing a run from its
checkpoint when a signal stopped it (``Trainer`` writes one then).

``run_all`` trains the runs in this process (one worker) or in spawned worker processes. SIGINT and SIGTERM (the
first of them) stop the matrix: queued runs never start, and each running worker gets one SIGTERM (its trainer
finishes the step, writes a checkpoint and returns an unfinished run; a worker between runs starts no other), is
waited for ``STOP_GRACE_S`` seconds and then killed. Workers run in their own session, so a terminal's Ctrl-C reaches
the parent only, and each watches its parent: a worker whose parent is gone (even by SIGKILL) stops itself the same
way. ``run_all`` then raises ``MatrixInterrupted``; the caller reports no results.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from sara.config import ConfigError, SaraError
from sara.storage import atomic_write

__all__ = ["PLAN_NAME", "RESULT_NAME", "STOP_GRACE_S", "MatrixInterrupted", "claim_plan", "finished_result",
           "save_result", "run_all", "WorkerLost"]

PLAN_NAME = "matrix-plan.json"
RESULT_NAME = "result.json"
STOP_GRACE_S = 15.0
"""Seconds a stopped worker gets to finish its step and write its checkpoint before it is killed."""


class MatrixInterrupted(SaraError, RuntimeError):
    """A signal stopped the matrix before every run finished; nothing was reported as a result.

    Attributes:
        signal_name: ``"SIGINT"`` or ``"SIGTERM"``.
        finished: Runs finished (now or by an earlier attempt), of ``total``.
        unfinished: ``"<cell> seed <s>"`` of every run that did not finish.
    """

    def __init__(self, signal_name: str, finished: int, total: int, unfinished: Sequence[str]) -> None:
        self.signal_name, self.finished, self.total, self.unfinished = signal_name, finished, total, list(unfinished)
        super().__init__(f"stopped by {signal_name}: {finished} of {total} runs finished, {total - finished} "
                         "unfinished (not reported); rerun the same command to finish them")


def _jsonable(value: Any) -> Any:
    return json.loads(json.dumps(value, default=str))


def _first_difference(old: Any, new: Any, path: str = "") -> str:
    if isinstance(old, dict) and isinstance(new, dict):
        for key in sorted(set(old) | set(new)):
            if old.get(key) != new.get(key):
                return _first_difference(old.get(key), new.get(key), f"{path}.{key}" if path else key)
    return f"field '{path}' was {json.dumps(old)}, now {json.dumps(new)}"


def _results_view(plan: Any) -> Any:
    """A plan with each run's config reduced to what decides its results (``store.without_volatile``)."""
    from sara.experiments.store import without_volatile

    if not isinstance(plan, dict) or not isinstance(plan.get("runs"), list):
        return plan
    return {**plan, "runs": [{**r, "config": without_volatile(r["config"])} if isinstance(r, dict) and
                             isinstance(r.get("config"), dict) else r for r in plan["runs"]]}


def claim_plan(out: str | Path, runs: Sequence[tuple[str, int, Mapping[str, Any]]]) -> int:
    """Record the matrix's runs in ``<out>/matrix-plan.json``, or check that an unfinished matrix there planned the
    same ones (fields that change only where or how fast a run goes, ``store.VOLATILE``, may differ: the plan is
    rewritten); returns how many of them finished earlier.

    Args:
        out: The matrix's output directory (locked by the caller).
        runs: ``(cell name, seed, config)`` of every run.

    Raises:
        ConfigError: the directory holds an unfinished matrix with other runs or configs (naming the first
            difference).
    """
    path = Path(out) / PLAN_NAME
    plan = _jsonable({"version": 1, "runs": [{"cell": c, "seed": s, "config": cfg} for c, s, cfg in runs]})
    if path.is_file():
        try:
            old = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError, RecursionError):  # unreadable, torn or nested past the parser: damaged
            old = None
        if old != plan and _results_view(old) == _results_view(plan):  # only where or how fast the runs go changed
            atomic_write(path, lambda fh: fh.write((json.dumps(plan, indent=1) + "\n").encode()))
        elif old != plan:
            if not isinstance(old, dict) or [(r.get("cell"), r.get("seed")) for r in old.get("runs", [])] != [
                    (r["cell"], r["seed"]) for r in plan["runs"]]:
                why = "other cells or seeds"
            else:
                i, (a, b) = next((i, ab) for i, ab in enumerate(zip(old["runs"], plan["runs"])) if ab[0] != ab[1])
                why = f"{b['cell']} seed {b['seed']}: {_first_difference(a['config'], b['config'])}"
            raise ConfigError(f"sara matrix: {out} holds an unfinished matrix planned differently ({why}); rerun it "
                              "with its own arguments to finish it, pass --overwrite to replace it, or --out DIR")
        return sum(finished_result(r["config"]) is not None for r in plan["runs"])
    atomic_write(path, lambda fh: fh.write((json.dumps(plan, indent=1) + "\n").encode()))
    return 0


def runs_in_progress(out: str | Path) -> str:
    """``<cell> seed <s>: step N, R rollouts`` for every run under ``out/cells/<cell>/seed<s>/`` that has written a
    record and no ``result.json`` yet, from its ``metrics.jsonl``'s last line ('' when there is none); a line that
    does not read as a record is skipped (the file is data)."""
    said = []
    for log in sorted(Path(out).glob("cells/*/seed*/metrics.jsonl")):
        if (log.parent / "result.json").exists():
            continue
        try:
            tail = log.read_bytes()[-65536:].splitlines()
            rec = json.loads(tail[-1]) if tail else None
        except (OSError, ValueError, RecursionError, IndexError):
            continue
        if isinstance(rec, dict) and isinstance(rec.get("step"), int):
            rollouts = rec.get("env/cum_rollouts")
            more = f", {int(rollouts):,} rollouts" if isinstance(rollouts, (int, float)) and rollouts >= 0 else ""
            said.append(f"{log.parent.parent.name} {log.parent.name.replace('seed', 'seed ')}: step {rec['step']}{more}")
    return "; ".join(said)


def finished_result(cfg: Mapping[str, Any]) -> dict[str, Any] | None:
    """The measures a finished run left in ``<out_dir>/result.json``, or None (unfinished, or another config's: one
    that differs in more than where or how fast it ran, ``store.VOLATILE``, or in its seed)."""
    from sara.experiments.store import without_volatile

    try:
        data = json.loads((Path(cfg["out_dir"]) / RESULT_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):  # unreadable, torn or nested past the parser: unfinished
        return None
    if not (isinstance(data, dict) and isinstance(data.get("config"), dict) and isinstance(data.get("result"), dict)):
        return None
    same = (without_volatile(data["config"]) == without_volatile(cfg)
            and data["config"].get("seed") == _jsonable(cfg).get("seed"))
    return data["result"] if same else None


def save_result(cfg: Mapping[str, Any], result: Mapping[str, Any]) -> dict[str, Any]:
    """Write a finished run's ``result.json`` (its completion marker) and return ``result`` as read back."""
    text = json.dumps({"config": cfg, "result": result}, default=str)
    atomic_write(Path(cfg["out_dir"]) / RESULT_NAME, lambda fh: fh.write(text.encode()))
    return json.loads(text)["result"]


def _watch_parent(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(0.5)
    os.kill(os.getpid(), signal.SIGTERM)  # the trainer finishes its step and checkpoints; else _STOPPING is set
    _STOPPING.wait(STOP_GRACE_S)  # set once the stopped run has returned (its checkpoint written)
    os._exit(1)


_STOPPING = threading.Event()  # in a worker: a run of it was stopped by a signal, so the queued ones never start


def _call(work: Callable[..., dict[str, Any] | str], cfg: Mapping[str, Any]) -> dict[str, Any] | str:
    """A run in a worker process: ``work(cfg)``, or ``"SIGTERM"`` once a run of this worker was stopped."""
    if _STOPPING.is_set():
        return "SIGTERM"
    res = work(cfg, stopped=lambda: "SIGTERM" if _STOPPING.is_set() else None)
    if isinstance(res, str):
        _STOPPING.set()
    return res


def _stop_soon(signum: int, frame: Any) -> None:
    _STOPPING.set()


def _worker_init(parent: int) -> None:
    """Worker process start: a session of its own (a terminal's Ctrl-C reaches the parent only, which relays one
    SIGTERM), SIGTERM outside training only stops the worker's queued runs (it must not die: the pool would kill the
    other workers, mid-checkpoint), and a thread that stops the worker when its parent is gone."""
    try:
        os.setsid()
    except OSError:  # pragma: no cover - already a session leader
        pass
    signal.signal(signal.SIGTERM, _stop_soon)  # while training, the trainer's own handler takes it
    threading.Thread(target=_watch_parent, args=(parent,), daemon=True, name="sara-parent-watch").start()


def _stop_workers(pool: Any) -> None:
    procs = [p for p in list((getattr(pool, "_processes", None) or {}).values()) if p.is_alive()]
    pool.shutdown(wait=False, cancel_futures=True)  # queued runs never start
    for p in procs:
        try:
            os.kill(p.pid, signal.SIGTERM)
        except OSError:
            pass
    deadline = time.monotonic() + STOP_GRACE_S
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(5.0)


def run_all(work: Callable[..., dict[str, Any] | str], configs: Sequence[Mapping[str, Any]], *, workers: int,
            on_result: Callable[[int, dict[str, Any]], None], labels: Sequence[str]) -> list[dict[str, Any]]:
    """``work(config, stopped=...)`` for every config not finished earlier, in this process (``workers == 1``) or
    in spawned worker processes; ``on_result(i, result)`` as each finishes (earlier ones first).

    ``work`` returns a run's result, or the name of the signal that stopped it; ``stopped()`` (the name of a signal
    that arrived, else None) is for it to check once its trainer is built, before training starts.

    Raises:
        MatrixInterrupted: SIGINT / SIGTERM (or a run stopped by a signal of its own); naming the unfinished runs.
        Exception: the first error of a run, after the other workers were stopped.
    """
    from sara.train.guards import StopSignals

    results: list[dict[str, Any] | None] = [finished_result(cfg) for cfg in configs]
    for i, res in enumerate(results):
        if res is not None:
            on_result(i, res)
    todo = [i for i, res in enumerate(results) if res is None]
    with StopSignals() as stop:
        if workers == 1:
            for i in todo:
                if stop.received:
                    break
                res = work(configs[i], stopped=lambda: stop.received)
                if isinstance(res, str):  # the trainer's own handler took the signal
                    stop.received = stop.received or res
                    break
                results[i] = res
                on_result(i, res)
        elif todo:
            _run_pool(work, configs, todo, workers, results, on_result, stop)
    if stop.received is None and all(r is not None for r in results):
        return results  # type: ignore[return-value]
    unfinished = [labels[i] for i, r in enumerate(results) if r is None]
    raise MatrixInterrupted(stop.received or "SIGINT", len(results) - len(unfinished), len(results), unfinished)


class WorkerLost(SaraError, RuntimeError):
    """A matrix worker process died (killed from outside, or out of memory) while running a run."""


def _run_pool(work: Callable[..., Any], configs: Sequence[Mapping[str, Any]], todo: list[int], workers: int,
              results: list[Any], on_result: Callable[[int, dict[str, Any]], None], stop: Any) -> None:
    import multiprocessing as mp
    from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
    from concurrent.futures.process import BrokenProcessPool

    pool = ProcessPoolExecutor(max_workers=min(workers, len(todo)), mp_context=mp.get_context("spawn"),
                               initializer=_worker_init, initargs=(os.getpid(),))
    finished = False
    try:
        futures = {pool.submit(_call, work, configs[i]): i for i in todo}
        pending = set(futures)
        while pending and stop.received is None:
            done, pending = wait(pending, timeout=0.25, return_when=FIRST_COMPLETED)
            for future in sorted(done, key=futures.__getitem__):
                try:
                    res = future.result()  # a run's error propagates (the finally stops the others)
                except BrokenProcessPool:
                    raise WorkerLost("sara matrix: a worker process died (killed from outside, or out of "
                                     "memory); the finished runs are kept, rerun the same command to finish the "
                                     "others") from None
                if isinstance(res, str):  # a signal reached the worker itself
                    stop.received = stop.received or res
                    continue
                results[futures[future]] = res
                on_result(futures[future], res)
        finished = not pending
    finally:
        if finished and stop.received is None:
            pool.shutdown(wait=True)
        else:
            _stop_workers(pool)
