"""``sara bench generation``: generation throughput of allocators on a real backend, against one full batch.

Every allocator spec runs ``steps`` collection steps of ``groups`` target groups on ONE backend instance (weights
fixed, no training), with the same task prompts, prompt sampler seed and rollout seeds. A spec is run by
``sara.collect.collect`` (synchronous rounds) or, with the ``+stream`` suffix, by ``sara.collect_stream`` (per-rollout
decisions on a continuously batched engine), with ``+carry`` by ``sara.collect_stream`` with carry-over (``carry_lag``:
open units and running rollouts move into the next step; such a spec runs its steps back to back, since what it
leaves running belongs on the engine between its own steps, and what is left after its last step is aborted and
counted). After each step, the step's delivered rollouts (same prompts, same seeds,
same tree prefixes) are generated again as ONE ``backend.generate`` call: the engine's full-batch throughput on the same
work, measured in the same run. Allocators are interleaved step by step (step 0 of every spec, then step 1, ...), so
load that drifts during the run slows all of them alike.

Per allocator (``results[i]`` of the JSON report):

* ``tokens_per_second``: generated tokens / wall seconds of the collection steps. Tokens include the partial tokens of
  rollouts the streaming driver aborted; seconds include prompt admission, allocator decisions and scoring (the
  verifier), i.e. everything ``collect`` / ``collect_stream`` do. ``generate_seconds`` / ``score_seconds`` split the
  environment's time where the environment reports it.
* ``full_batch_tokens_per_second``: tokens / seconds of the one-batch regeneration (generation only, no scoring);
  ``throughput_ratio`` = the first over the second (1.0 = the driver keeps the engine as busy as one full batch).
* ``seconds_per_effective_group`` and ``wall_ratio_vs_ds`` (over the ``ds`` entry's); ``rollouts_per_effective_group``
  (delivered rollouts; aborted ones are counted in ``aborted_rollouts``) and ``ratio_vs_ds``.
* ``mean_inflight``: average rollouts in flight. Streaming: the driver's ``stats.mean_inflight``. Synchronous: live
  rows per decode step, ``sum(tokens) / sum over rounds of the round's longest completion``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pydantic import Field, field_validator

from sara.config import ConfigError, SaraModel, parse_spec, validate_config

__all__ = ["GenerationBenchConfig", "STREAM_SUFFIX", "DEFAULT_TASKS", "parse_allocators", "run_generation_bench",
           "format_table", "write_json"]

STREAM_SUFFIX = "+stream"
"""An allocator spec ending in this runs under ``collect_stream`` instead of ``collect``."""
CARRY_SUFFIX = "+carry"
"""An allocator spec ending in this runs under ``collect_stream`` with carry-over (``carry_lag``)."""
BACKEND_NAMES = ("tiny", "hf", "vllm")
DEFAULT_TASKS = {
    # the tiny policy on the task it was first tuned on (sara train's default before the mixture pool)
    "tiny": "sara/Arithmetic-v0:max_digits=2,ops=+,pool_size=5000",
    # 1-digit sums, as in examples/configs/smollm2_*.yaml: SmolLM2-135M solves ~3% at T=1, so some groups are mixed
    "hf": "sara/Arithmetic-v0:max_digits=1,ops=+,pool_size=80,eval_size=20",
    "vllm": "sara/Arithmetic-v0:max_digits=1,ops=+,pool_size=80,eval_size=20",
}
SLOT_OPTIONS = {"tiny": "slots", "hf": "stream_slots", "vllm": "stream_slots"}
"""The backend option ``--slots`` sets (the engine's concurrent completions when streaming)."""


class GenerationBenchConfig(SaraModel):
    """One ``sara bench generation`` run."""

    backend: str = "tiny"
    """Backend spec: ``tiny``, ``hf`` or ``vllm``, with options (``hf:dtype=float32,max_batch_size=32``); the real
    backends load the prepared ``smollm2`` model unless ``model=`` is given."""
    allocators: list[str] = Field(default_factory=lambda: ["ds", "sara", "sara+stream", "sara+carry"])
    """Allocator specs (``sara.allocators.make_allocator``), each optionally suffixed ``+stream`` (streaming driver)
    or ``+carry`` (streaming driver with carry-over)."""
    carry_lag: int = Field(1, ge=1)
    """``+carry`` specs: steps a carried unit may lag (``collect_stream``'s ``carry_lag``)."""
    task: str | None = None
    """Task spec (None = ``DEFAULT_TASKS[backend]``)."""
    groups: int = Field(32, ge=1)
    """Target (committed) groups per collection step."""
    k: int = Field(8, ge=2)
    """Group size."""
    steps: int = Field(3, ge=1)
    """Collection steps per allocator."""
    seed: int = Field(0, ge=0)
    """Seed of the prompt sampler, the rollouts and the tiny policy's warm start."""
    slots: int | None = Field(None, ge=1)
    """Streaming: the engine's concurrent completions (``SLOT_OPTIONS[backend]``, unless the backend spec sets it)
    and the rollouts the driver keeps in flight (``max_inflight``). None = the engine's default."""
    max_new_tokens: int | None = Field(None, ge=1)
    """Generation cap (None = the task's suggestion)."""
    sampler: str = "uniform"
    """Prompt sampler spec, the same for every allocator."""

    @field_validator("backend")
    @classmethod
    def _known_backend(cls, v: str) -> str:
        name, _ = parse_spec(v)
        if name not in BACKEND_NAMES:
            raise ValueError(f"unknown backend {name!r}; choose one of {', '.join(BACKEND_NAMES)}")
        return v

    @field_validator("allocators")
    @classmethod
    def _specs(cls, v: list[str]) -> list[str]:
        if not v:
            raise ValueError("give at least one allocator spec, e.g. 'ds;sara;sara+stream'")
        for spec in v:
            base, _ = split_driver(spec)
            parse_spec(base)
        return v


def split_driver(spec: str) -> tuple[str, str]:
    """``"sara:tau_low=0.3+stream"`` -> ``("sara:tau_low=0.3", "stream")`` (``+carry`` -> ``"carry"``); without a
    suffix the driver is ``"sync"``."""
    spec = spec.strip()
    for suffix, driver in ((STREAM_SUFFIX, "stream"), (CARRY_SUFFIX, "carry")):
        if spec.endswith(suffix):
            return spec[: -len(suffix)].strip(), driver
    return spec, "sync"


def parse_allocators(text: str) -> list[tuple[str, str]]:
    """Parse the ``--allocators`` value: ``;``-separated allocator specs, each optionally suffixed ``+stream`` or
    ``+carry``.

    Returns:
        ``[(allocator spec, driver), ...]`` with driver ``"sync"``, ``"stream"`` or ``"carry"``.

    Raises:
        ConfigError: an empty list or an empty spec.
    """
    parts = [p.strip() for p in text.split(";")]
    if parts and not parts[-1]:
        parts.pop()  # a trailing ';'
    if not parts or any(not split_driver(p)[0] for p in parts):
        raise ConfigError(f"bench generation: field 'allocators': {text!r} has an empty spec; write allocator specs "
                          "separated by ';', each optionally ending in '+stream', e.g. 'ds;sara;sara+stream'")
    return [split_driver(p) for p in parts]


class _Recorder:
    """The environment ``collect`` sees: forwards rounds and records the decode steps each one needed."""

    def __init__(self, env: Any) -> None:
        self.env, self.prompts = env, env.prompts
        self.tokens = self.decode_steps = 0

    def rollout(self, requests: Any) -> Any:
        out = self.env.rollout(requests)
        lens = [r.num_tokens for rs in out for r in rs]
        self.tokens += sum(lens)
        self.decode_steps += max(lens, default=0)
        return out


def _build(cfg: GenerationBenchConfig) -> tuple[Any, Any, str]:
    """(task, backend, task spec): the policy (tiny only) and backend built once through the registries."""
    from sara.backends import BACKENDS
    from sara.envs.tasks import make_task

    name, options = parse_spec(cfg.backend)
    task_spec = cfg.task or DEFAULT_TASKS[name]
    task = make_task(task_spec)
    if cfg.slots is not None:
        options.setdefault(SLOT_OPTIONS[name], cfg.slots)
    if name == "vllm" and any(split_driver(s)[1] != "sync" for s in cfg.allocators):
        options.setdefault("engine", "async")  # the streaming engine (AsyncLLM); sync specs use its generate
    if name == "tiny":
        from sara.policies import POLICIES

        policy = POLICIES.get("tiny")({}, task=task, seed=cfg.seed)
    else:  # weights stay fixed: the backend loads the model itself, no trainable copy is needed
        policy = None
        options = {"model": "smollm2", **options}
    return task, BACKENDS.get(name)(policy, options, task=task, seed=cfg.seed), task_spec


def _check_streaming(cfg: GenerationBenchConfig, backend: Any, env: Any) -> None:
    """A ``ConfigError`` naming ``allocators`` when a ``+stream`` spec meets a backend that cannot stream."""
    from sara.collect_stream import streams

    streamed = [s for s in cfg.allocators if split_driver(s)[1] != "sync"]
    if streamed and not streams(env):
        raise ConfigError(f"bench generation: field 'allocators': {streamed[0]!r} runs under the streaming driver "
                          f"and backend {cfg.backend!r} ({type(backend).__name__}) cannot stream (no submit / poll / "
                          "abort / inflight / slots); drop the '+stream' suffix or use a streaming backend")


def _full_batch(backend: Any, env: Any, result: Any) -> tuple[int, float]:
    """Regenerate the step's delivered rollouts (same prompts, prefixes, seeds) as ONE ``generate`` call."""
    from sara.envs.base import GenerationRequest
    from sara.types import RolloutRequest

    seeds: dict[tuple[int, str], list[int]] = {}
    for g in (*result.groups, *result.abandoned, *result.discarded):
        for r in g.rollouts:
            seeds.setdefault((g.pool_index, str(r.metadata.get("prefix", ""))), []).append(int(r.seed))
    requests = [GenerationRequest(prompt=env.render(RolloutRequest(unit_id=0, pool_index=p, prompt=env.prompts[p],
                                                                   seeds=tuple(s), prefix=pre)), seeds=tuple(s))
                for (p, pre), s in seeds.items()]
    if not requests:
        return 0, 0.0
    t0 = time.perf_counter()
    out = backend.generate(requests, env.sampling)
    seconds = time.perf_counter() - t0
    return sum(c.num_tokens for o in out for c in o), seconds


def _reset_cache(backend: Any) -> None:
    """Drop an offline vLLM engine's prefix cache, so no measurement reuses KV blocks computed by an earlier one (the
    async engine's reset is a coroutine on its own loop: skipped; see docs/backends.md)."""
    import inspect

    fn = getattr(getattr(backend, "llm", None), "reset_prefix_cache", None)
    if fn is not None and not inspect.iscoroutinefunction(fn):
        fn()


class _Run:
    """One allocator spec's steps and running totals (runs are interleaved step by step, so a machine whose load
    drifts during the benchmark slows every allocator alike)."""

    def __init__(self, cfg: GenerationBenchConfig, spec: str, driver: str, env: Any) -> None:
        from sara.allocators import make_allocator, make_sampler

        self.cfg, self.spec, self.driver = cfg, spec, driver
        self.allocator = make_allocator(spec, k=cfg.k)
        self.sampler = make_sampler(cfg.sampler, len(env.prompts), seed=cfg.seed, k=self.allocator.k)
        self.rec = _Recorder(env)
        self.carry: Any = None  # driver 'carry': what the last step left running
        self.pending: list[Any] = []  # driver 'carry': steps whose full batch waits until nothing runs any more
        self.acc = dict(tokens=0, rollouts=0, effective_groups=0, aborted_rollouts=0, aborted_tokens=0,
                        wall_seconds=0.0, full_tokens=0, full_seconds=0.0, inflight_weighted=0.0,
                        generate_seconds=0.0, score_seconds=0.0)

    def step(self, step: int, backend: Any, env: Any, log: Callable[[str], None] | None) -> None:
        """One timed collection step, then its rollouts as one full batch."""
        from sara.collect import collect

        cfg, acc = self.cfg, self.acc
        _reset_cache(backend)
        m0 = env.metrics()
        t0 = time.perf_counter()
        if self.driver != "sync":
            from sara.collect_stream import collect_stream

            res = collect_stream(self.allocator, env, self.sampler, target_groups=cfg.groups, max_inflight=cfg.slots,
                                 seed=cfg.seed, step=step, carry=self.carry,
                                 carry_lag=cfg.carry_lag if self.driver == "carry" else 0)
            self.carry = res.carry
        else:
            res = collect(self.allocator, self.rec, self.sampler, target_groups=cfg.groups, seed=cfg.seed, step=step)
        wall = time.perf_counter() - t0
        m1 = env.metrics()
        st = res.stats
        acc["wall_seconds"] += wall
        acc["tokens"] += st.tokens + st.aborted_tokens
        acc["rollouts"] += st.rollouts
        acc["effective_groups"] += st.effective_groups
        acc["aborted_rollouts"] += st.aborted_rollouts
        acc["aborted_tokens"] += st.aborted_tokens
        acc["inflight_weighted"] += st.mean_inflight * wall
        acc["generate_seconds"] += m1["env/generate_seconds"] - m0["env/generate_seconds"]
        acc["score_seconds"] += m1["env/score_seconds"] - m0["env/score_seconds"]
        if log is not None:
            log(f"{self.spec} ({self.driver}) step {step + 1}/{cfg.steps}: {st.rollouts} rollouts, "
                f"{st.effective_groups} effective groups, {st.tokens + st.aborted_tokens} tokens in {wall:.1f} s")
        self.pending.append(res)
        if self.driver == "carry" and step + 1 < cfg.steps:
            return  # its rollouts still run on the engine: the full batches wait for the last step
        if self.carry is not None:  # the last step: what it left running is aborted (waste, counted)
            from sara.collect_stream import release_carry

            t0 = time.perf_counter()
            left = release_carry(env, self.carry)
            acc["wall_seconds"] += time.perf_counter() - t0
            acc["tokens"] += left
            acc["aborted_tokens"] += left
            acc["aborted_rollouts"] += len(self.carry.live)
            self.carry = None
        for done in self.pending:
            _reset_cache(backend)
            tok, sec = _full_batch(backend, env, done)
            acc["full_tokens"] += tok
            acc["full_seconds"] += sec
        self.pending = []

    def result(self) -> dict[str, Any]:
        """This allocator's entry of the report (the ratios to DS are filled in by ``_ratios_vs_ds``)."""
        acc, rec = self.acc, self.rec
        if self.driver != "sync":
            mean_inflight = acc["inflight_weighted"] / acc["wall_seconds"] if acc["wall_seconds"] else 0.0
        else:
            mean_inflight = rec.tokens / rec.decode_steps if rec.decode_steps else 0.0
        eff = acc["effective_groups"]
        tps = acc["tokens"] / acc["wall_seconds"] if acc["wall_seconds"] else 0.0
        full_tps = acc["full_tokens"] / acc["full_seconds"] if acc["full_seconds"] else 0.0
        return {
            "allocator": self.spec, "driver": self.driver,
            "tokens_per_second": tps, "full_batch_tokens_per_second": full_tps,
            "throughput_ratio": tps / full_tps if full_tps else None,
            "seconds_per_effective_group": acc["wall_seconds"] / eff if eff else None,
            "wall_ratio_vs_ds": None,
            "rollouts_per_effective_group": acc["rollouts"] / eff if eff else None,
            "ratio_vs_ds": None,
            "mean_inflight": mean_inflight,
            "aborted_rollouts": acc["aborted_rollouts"], "aborted_tokens": acc["aborted_tokens"],
            "tokens": acc["tokens"], "rollouts": acc["rollouts"], "effective_groups": eff,
            "wall_seconds": acc["wall_seconds"],
            "generate_seconds": acc["generate_seconds"], "score_seconds": acc["score_seconds"],
            "full_batch_tokens": acc["full_tokens"], "full_batch_seconds": acc["full_seconds"],
        }


def _ratios_vs_ds(results: list[dict[str, Any]]) -> None:
    ds = next((r for r in results if parse_spec(r["allocator"])[0] == "ds" and r["driver"] == "sync"), None)
    if ds is None:
        return
    for r in results:
        for key, ref, out in (("seconds_per_effective_group", ds["seconds_per_effective_group"], "wall_ratio_vs_ds"),
                              ("rollouts_per_effective_group", ds["rollouts_per_effective_group"], "ratio_vs_ds")):
            r[out] = r[key] / ref if r[key] is not None and ref else None


def run_generation_bench(config: GenerationBenchConfig | dict[str, Any], *, backend: Any = None,
                         task: Any = None, log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Run every allocator spec on one backend and return the JSON report (see the module docstring).

    Args:
        config: The run (a ``GenerationBenchConfig`` or a mapping of its fields).
        backend: Use this ``GenerationBackend`` instead of building ``config.backend`` (its caller closes it); needs
            ``task``.
        task: The ``Task`` that goes with ``backend``.
        log: Called with one progress line per allocator step (e.g. ``print``).

    Raises:
        ConfigError: invalid fields; a ``+stream`` spec on a backend that cannot stream.
    """
    from sara.envs.base import SamplingConfig
    from sara.envs.task_env import TaskEnv

    cfg = config if isinstance(config, GenerationBenchConfig) else validate_config(
        GenerationBenchConfig, dict(config), what="bench generation")
    owned = backend is None
    if owned:
        task, backend, task_spec = _build(cfg)
    else:
        if task is None:
            raise ConfigError("bench generation: field 'task': pass the Task that goes with the given backend")
        task_spec = cfg.task or task.id
    try:
        sampling = SamplingConfig(max_new_tokens=cfg.max_new_tokens or task.max_new_tokens or 64, stop=task.stop)
        with TaskEnv(task, backend, sampling) as env:
            _check_streaming(cfg, backend, env)
            backend.generate([_warm_request(env)], sampling)  # warm-up (first-call set-up, not measured)
            runs = [_Run(cfg, spec, driver, env) for spec, driver in (split_driver(s) for s in cfg.allocators)]
            for step in range(cfg.steps):  # interleaved step by step, except specs that carry work over
                for run in runs:
                    if run.driver != "carry":
                        run.step(step, backend, env, log)
            for run in runs:
                for step in range(cfg.steps) if run.driver == "carry" else ():
                    run.step(step, backend, env, log)
            results = [run.result() for run in runs]
    finally:
        if owned:
            backend.close()
    _ratios_vs_ds(results)
    return {"backend": cfg.backend, "task": task_spec, "config": cfg.model_dump(), "results": results}


def _warm_request(env: Any) -> Any:
    from sara.envs.base import GenerationRequest
    from sara.types import RolloutRequest

    req = RolloutRequest(unit_id=0, pool_index=0, prompt=env.prompts[0], seeds=(0,))
    return GenerationRequest(prompt=env.render(req), seeds=tuple(range(8)))


def _fmt(x: Any, spec: str = ".2f") -> str:
    return "—" if x is None else format(x, spec)


def format_table(report: dict[str, Any]) -> str:
    """The report as a markdown table (one row per allocator)."""
    head = ("| allocator | driver | tok/s | full batch tok/s | throughput ratio | s / eff. group | wall vs DS | "
            "rollouts / eff. group | vs DS | mean in flight | aborted | eff. groups |")
    lines = [f"backend {report['backend']}, task {report['task']}", "", head,
             "|" + "---|" * (head.count("|") - 1)]
    for r in report["results"]:
        lines.append(f"| `{r['allocator']}` | {r['driver']} | {_fmt(r['tokens_per_second'], '.1f')} | "
                     f"{_fmt(r['full_batch_tokens_per_second'], '.1f')} | {_fmt(r['throughput_ratio'])} | "
                     f"{_fmt(r['seconds_per_effective_group'], '.3f')} | {_fmt(r['wall_ratio_vs_ds'])} | "
                     f"{_fmt(r['rollouts_per_effective_group'], '.1f')} | {_fmt(r['ratio_vs_ds'])} | "
                     f"{_fmt(r['mean_inflight'], '.1f')} | {r['aborted_rollouts']} | {r['effective_groups']} |")
    return "\n".join(lines)


def write_json(report: dict[str, Any], path: str | Path) -> Path:
    """Write the report as JSON (parent directories created)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")
    return path

