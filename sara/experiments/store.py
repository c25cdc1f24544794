"""A matrix's results store: each finished cell x seed as small text files, meant to be committed, so results outlive
the machine that computed them (``sara matrix --store DIR``, ``sara matrix --report DIR``).

Layout of a store (nothing else is written there; no checkpoints, no run directories)::

    DIR/store.json                          the store's mark: {"format": 1}; written once
    DIR/cells/<cell>/seed<s>.json           one finished run: cell, seed, config, config hash, sara version
                                            (and git commit, when known), machine, and the measures the report
                                            needs (summary, eval curve, seconds by phase)
    DIR/cells/<cell>/seed<s>.metrics.jsonl  that run's metrics.jsonl, one record per line

Every file is JSON with sorted keys, so a rerun that adds seeds adds files and changes none. A run's
``config_hash`` covers the matrix's shared config (``store_view``): every ``TrainConfig`` field except the cell's own
(``algo``, ``allocator``, ``sampler`` of an ``@SAMPLER`` cell), the seed, and the fields that change where or how fast
a run goes (``VOLATILE``). Runs pool only with runs of the same hash and the same sara version: ``claim`` refuses a
store that holds others, naming the first differing field, unless ``allow_mixed``, and then ``runs`` reports each
other (hash, version) as cells of their own, labelled ``[cfg <hash>, sara <version>]``.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from sara.config import ConfigError
from sara.storage import atomic_write

__all__ = ["FORMAT", "MARK", "VOLATILE", "DROPPED", "ResultStore", "store_view", "config_hash", "record_hash", "sara_version", "without_volatile",
           "sara_commit", "store_report"]

FORMAT = 1
MARK = "store.json"
VOLATILE = ("name", "out_dir", "threads", "progress", "tensorboard", "checkpoint_every", "keep_checkpoints", "seed",
            "ray.enabled", "ray.num_workers", "ray.address", "optim.microbatch_tokens")
"""Run config fields outside a run's config hash: where and how fast it runs (the micro-batch budget splits the same
loss and gradient into forwards, as threads split a matmul), and its seed (a store holds seeds). A stored run's hash
is recomputed from its stored config under this list (``record_hash``), so adding a field here keeps earlier runs
pooled."""
DROPPED = ("out_dir", "files", "checkpoint")
"""Summary fields a store leaves out: paths on the machine that ran it."""


def sara_version() -> str:
    """The installed sara's version (``sara.__version__``)."""
    import sara

    return str(sara.__version__)


def sara_commit() -> str | None:
    """The git commit the installed sara was loaded from, when it is a git checkout (provenance only: runs pool by
    config hash and version, since every commit of a store changes it); None elsewhere."""
    import subprocess

    import sara

    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(sara.__file__).parent, capture_output=True,
                             text=True, timeout=10, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return (out.stdout.strip() or None) if out.returncode == 0 else None


def _dump(value: Any) -> str:
    return json.dumps(value, sort_keys=True, indent=1, default=str) + "\n"


def _drop(cfg: Mapping[str, Any], dotted: str) -> None:
    head, _, rest = dotted.partition(".")
    if rest and isinstance(cfg.get(head), dict):
        _drop(cfg[head], rest)
    elif not rest and isinstance(cfg, dict):
        cfg.pop(head, None)


def store_view(cfg: Mapping[str, Any], base_sampler: str) -> dict[str, Any]:
    """``cfg`` (a run's ``TrainConfig`` dump) as the matrix's shared config: without ``VOLATILE`` fields, ``algo``
    and ``allocator``, and with the matrix's own sampler ``base_sampler`` (a cell's ``@SAMPLER`` is the cell's)."""
    view = without_volatile(cfg)
    for key in ("algo", "allocator"):
        _drop(view, key)
    view["sampler"] = base_sampler
    return view


def record_hash(rec: Mapping[str, Any]) -> str:
    """A stored run's config hash under today's ``VOLATILE``: its stored config without those fields (the hash it
    was stored with when the config is missing)."""
    view = _record_view(rec)
    return str(rec.get("config_hash")) if view is None else config_hash(view)


def without_volatile(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of ``cfg`` (a ``TrainConfig`` dump) without the ``VOLATILE`` fields: what decides a run's results."""
    view: dict[str, Any] = json.loads(json.dumps(dict(cfg), default=str))
    for key in VOLATILE:
        _drop(view, key)
    return view


def _record_view(rec: Mapping[str, Any]) -> dict[str, Any] | None:
    cfg = rec.get("config")
    return without_volatile(cfg) if isinstance(cfg, dict) else None


def config_hash(view: Mapping[str, Any]) -> str:
    """The first 12 hex digits of the SHA-256 of ``view`` as canonical JSON (sorted keys)."""
    text = json.dumps(view, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def _device() -> str:
    """``cuda`` where torch sees a GPU (a matrix there trains on it), else ``cpu``."""
    try:
        import torch
    except ImportError:
        return "cpu"
    return "cuda" if torch.cuda.is_available() else "cpu"


def _first_difference(old: Any, new: Any, path: str = "") -> str:
    if isinstance(old, dict) and isinstance(new, dict):
        for key in sorted(set(old) | set(new)):
            if old.get(key, "<absent>") != new.get(key, "<absent>"):
                return _first_difference(old.get(key, "<absent>"), new.get(key, "<absent>"),
                                         f"{path}.{key}" if path else key)
    return f"field '{path}' was {json.dumps(old, default=str)}, now {json.dumps(new, default=str)}"


class ResultStore:
    """The store in ``root``; ``create`` makes a missing or empty directory a store.

    Raises:
        ConfigError: ``root`` is not a store (an existing directory without ``store.json`` holding files), or holds
            a store of another format.
    """

    def __init__(self, root: str | Path, *, create: bool = False, field: str = "--store") -> None:
        self.root = Path(root)
        mark = self.root / MARK
        if not mark.is_file():
            if not create or (self.root.is_dir() and any(self.root.iterdir())):
                why = "holds other files" if self.root.is_dir() and create else "is not a results store"
                raise ConfigError(f"sara matrix: {field} {self.root} {why} (no {MARK}); name a new or empty "
                                  f"directory, e.g. {field} results/<name>")
            atomic_write(mark, lambda fh: fh.write(_dump({"format": FORMAT}).encode()))
        try:
            fmt = json.loads(mark.read_text(encoding="utf-8")).get("format")
        except (OSError, ValueError, AttributeError):
            fmt = None
        if fmt != FORMAT:
            raise ConfigError(f"sara matrix: {field} {self.root}: {mark} is not a format-{FORMAT} store mark; "
                              f"name another directory")

    def path(self, cell_name: str, seed: int) -> Path:
        """Where the run of ``cell_name`` with ``seed`` is stored."""
        return self.root / "cells" / cell_name / f"seed{int(seed)}.json"

    def records(self) -> list[dict[str, Any]]:
        """Every stored run, ordered by cell name and seed (a file that does not parse is a ``ConfigError``)."""
        out = []
        for path in sorted((self.root / "cells").glob("*/seed*.json"),
                           key=lambda p: (p.parent.name, int(p.stem[4:]) if p.stem[4:].isdigit() else -1)):
            try:
                rec = json.loads(path.read_text(encoding="utf-8"))
            except (OSError, ValueError):
                rec = None
            if not (isinstance(rec, dict) and isinstance(rec.get("cell"), dict) and "name" in rec["cell"]
                    and isinstance(rec.get("result"), dict) and "seed" in rec):
                raise ConfigError(f"sara matrix: {path} is not a stored run; restore it from git or delete it "
                                  "(its cell-seed then runs again)") from None
            out.append(rec)
        return out

    def claim(self, runs: Sequence[tuple[Any, Mapping[str, Any]]], *, base_sampler: str,
              allow_mixed: bool = False) -> dict[int, dict[str, Any] | None]:
        """The planned runs the store already holds, by index into ``runs``: the stored result, or None for a run
        stored under another config or version (``allow_mixed``: it stays, and that seed does not run again).

        Args:
            runs: ``(cell, config)`` of every planned run (``sara.experiments.cells.Cell``, a ``TrainConfig``
                dump).
            base_sampler: The matrix's own sampler (``store_view``).
            allow_mixed: Keep stored runs of another config hash or sara version (reported apart, never pooled)
                instead of refusing.

        Raises:
            ConfigError: a stored run has another config hash or sara version (naming the first differing field and
                the ways out), or another cell is stored under a planned cell's name.
        """
        stored: dict[int, dict[str, Any] | None] = {}
        if not runs:
            return stored
        view = store_view(runs[0][1], base_sampler)
        key, version = config_hash(view), sara_version()
        if not allow_mixed:
            for rec in self.records():
                if (record_hash(rec), rec.get("sara_version")) != (key, version):
                    what = (f"sara {rec.get('sara_version')}, this is sara {version}"
                            if record_hash(rec) == key else _first_difference(_record_view(rec), view))
                    raise ConfigError(
                        f"sara matrix: {self.root} holds {rec['cell']['name']} seed {rec['seed']} of "
                        f"another config or version ({what}); never pooled: use a new --store DIR, or "
                        "--allow-mixed to keep both and report them apart")
        for i, (cell, cfg) in enumerate(runs):
            path = self.path(cell.name, cfg["seed"])
            if not path.is_file():
                continue
            rec = json.loads(path.read_text(encoding="utf-8"))
            if (rec["cell"].get("algo"), rec["cell"].get("spec")) != (cell.algo, cell.spec):
                raise ConfigError(f"sara matrix: {path} holds cell {rec['cell'].get('algo')} x "
                                  f"{rec['cell'].get('spec')}, not {cell.algo} x {cell.spec}; use a new --store DIR")
            if (record_hash(rec), rec.get("sara_version")) == (key, version):
                stored[i] = self._result(rec)
            else:  # allow_mixed: the stored run stays, this seed does not run again
                stored[i] = None
        return stored

    def save(self, cell: Any, cfg: Mapping[str, Any], result: Mapping[str, Any], *, base_sampler: str,
             eval_prompts: int) -> Path:
        """Store a finished run: its record (see the module docstring) and its ``metrics.jsonl``.

        The machine is the summary's ``machine`` when the run recorded one, else this process's
        (``sara.machine.machine_info``).
        """
        from sara.machine import machine_info, machine_kind
        from sara.metrics import read_jsonl

        view = store_view(cfg, base_sampler)
        machine = dict(result.get("machine") or machine_info(_device()))
        res = {k: v for k, v in result.items() if k not in DROPPED and k != "machine"}
        record = {"format": FORMAT, "cell": {"algo": cell.algo, "allocator": cell.allocator,
                                             "sampler": cell.sampler, "spec": cell.spec, "name": cell.name},
                  "seed": int(cfg["seed"]), "config": view, "config_hash": config_hash(view),
                  "sara_version": sara_version(), "sara_commit": sara_commit(), "machine": machine, "machine_kind": machine_kind(machine),
                  "threads": cfg.get("threads"), "eval_prompts": int(eval_prompts), "result": res}
        path = self.path(cell.name, cfg["seed"])
        lines = "".join(json.dumps(r, sort_keys=True) + "\n"
                        for r in read_jsonl(Path(cfg["out_dir"]) / "metrics.jsonl"))
        atomic_write(path.with_name(f"{path.stem}.metrics.jsonl"), lambda fh: fh.write(lines.encode()))
        atomic_write(path, lambda fh: fh.write(_dump(record).encode()))  # last: the run's completion mark here
        return path

    @staticmethod
    def _result(rec: Mapping[str, Any]) -> dict[str, Any]:
        """A stored run's result as ``analyze`` takes it, with its machine kind (from its ``machine``), config hash
        and sara version."""
        from sara.machine import machine_kind

        kind = machine_kind(dict(rec["machine"])) if isinstance(rec.get("machine"), dict) else rec.get("machine_kind")
        return {**rec["result"], "machine_kind": kind, "config_hash": record_hash(rec),
                "sara_version": rec.get("sara_version")}

    def runs(self, *, order: Sequence[str] = (), main: tuple[str, str] | None = None
             ) -> tuple[list[tuple[Any, dict[str, Any]]], dict[str, Any]]:
        """Every stored run as ``(cell, result)`` for ``matrix_report.analyze``, and what the report needs besides.

        Runs of one (config hash, sara version), the ``main`` one (default: the one most runs have), pool under their
        cell; each other one is a cell of its own, its spec and name labelled ``[cfg <hash>, sara <version>]``.

        Args:
            order: Cell names to list first, in this order (the rest follow by name).
            main: The (config hash, sara version) whose runs keep their cells' names.

        Returns:
            ``(runs, info)``; ``info``: ``budget``, ``eval_prompts``, ``eval_samples`` of the main runs, ``main``,
            ``variants`` (every (hash, version) and its number of runs).

        Raises:
            ConfigError: the store holds no runs.
        """
        from sara.experiments.cells import Cell

        records = self.records()
        if not records:
            raise ConfigError(f"sara matrix: {self.root} holds no finished runs yet; run sara matrix ... --store "
                              f"{self.root} first")
        counts: dict[tuple[str, str], int] = {}
        for rec in records:
            k = (record_hash(rec), str(rec.get("sara_version")))
            counts[k] = counts.get(k, 0) + 1
        if main is None or main not in counts:
            main = min(counts, key=lambda k: (-counts[k], k))
        rank = {name: i for i, name in enumerate(order)}
        variant = lambda r: (record_hash(r), str(r.get("sara_version")))  # noqa: E731
        records.sort(key=lambda r: (rank.get(r["cell"]["name"], len(rank)), r["cell"]["name"], variant(r) != main,
                                    variant(r), r["seed"]))
        out = []
        for rec in records:
            c, k = rec["cell"], variant(rec)
            tag = "" if k == main else f" [cfg {k[0][:6]}, sara {k[1]}]"
            name = c["name"] if k == main else f"{c['name']}~{k[0][:6]}-{k[1]}"
            out.append((Cell(c["algo"], c["allocator"], c.get("sampler"), c["spec"] + tag, name), self._result(rec)))
        first = next(r for r in records if variant(r) == main)
        cfg = first["config"]
        info = {"budget": float(cfg.get("rollout_budget") or 0), "eval_prompts": int(first.get("eval_prompts") or 0),
                "eval_samples": int((cfg.get("eval") or {}).get("samples") or 0), "main": list(main),
                "variants": [{"config_hash": h, "sara_version": v, "runs": n} for (h, v), n in sorted(counts.items())]}
        return out, info


def store_report(root: str | Path, *, reference: str = "ds", target_acc: float | None = None,
                 order: Sequence[str] = (), main: tuple[str, str] | None = None) -> dict[str, Any]:
    """The matrix report (``matrix_report.analyze``) of every run stored in ``root``, from its files alone."""
    from sara.experiments.matrix_report import analyze

    runs, info = ResultStore(root).runs(order=order, main=main)
    report = analyze(runs, budget=info["budget"], reference=reference, target_acc=target_acc,
                     eval_prompts=info["eval_prompts"], eval_samples=info["eval_samples"])
    report["store"] = {"path": str(root), **info}
    return report
