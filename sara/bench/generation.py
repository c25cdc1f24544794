"""``sara bench generation``: generation throughput of allocators on a real backend, against one full batch.

Every allocator spec runs ``steps`` collection steps of ``groups`` target groups on ONE backend instance (weights
fixed, no training), with the same task prompts, prompt sampler seed and rollout seeds. The driver
(``sara.driver.collect``) runs a spec in synchronous rounds, or, with a suffix, streaming: ``+stream`` (per-rollout
decisions on a continuously batched engine), ``+fill`` (streaming with a fresh prompt for every idle slot,
``DriverConfig.fill_idle``), ``+carry`` (streaming with carry-over, ``carry_lag``: open units and running rollouts
move into the next step; such a spec runs its steps back to back, since what it leaves running belongs on the engine
between its own steps; its last step carries nothing, as a training run's last step does, and what it has in flight
then is aborted and counted). ``+carry+fill`` combines them. After each step, the step's delivered
rollouts (same prompts, same seeds, same tree prefixes) are generated again as ONE ``backend.generate`` call: the
engine's full-batch throughput on the same work, measured in the same run. Allocators are interleaved step by step
(step 0 of every spec, then step 1, ...), so load that drifts during the run slows all of them alike.

With ``seeds`` > 1 the whole run is repeated per seed (prompt sampler and rollout seeds; the tiny policy stays the one
of ``seed``), and ``results[i]`` pools the seeds, with 95% intervals of the ratios over the per-seed ratios
(``sara.bench.generation_report``).

Per allocator (``results[i]`` of the JSON report):

* ``tokens_per_second``: generated tokens / wall seconds of the collection steps. Tokens include the partial tokens of
  rollouts the streaming driver aborted; seconds include prompt admission, allocator decisions and scoring (the
  verifier), i.e. everything the driver does. ``generate_seconds`` / ``score_seconds`` split the
  environment's time where the environment reports it.
* ``full_batch_tokens_per_second``: tokens / seconds of the one-batch regeneration (generation only, no scoring);
  ``throughput_ratio`` = the first over the second (1.0 = the driver keeps the engine as busy as one full batch).
* ``full_groups`` / ``rollouts_per_full_group`` / ``full_ratio_vs_reference``: the same counting only effective groups
  of the full size k. A streaming step that reaches its target commits the groups still being filled as they are
  (smaller groups; ``sara.allocators.sequential``), and they count as effective groups above.
* ``seconds_per_effective_group`` and ``wall_ratio_vs_ds`` (over the ``ds`` entry's); ``rollouts_per_effective_group``
  (delivered rollouts; aborted ones are counted in ``aborted_rollouts``) and ``ratio_vs_ds``; ``ratio_vs_reference``:
  rollouts per effective group over the ``reference`` spec's.
* ``mean_inflight``: average rollouts in flight. Streaming: the driver's ``stats.mean_inflight``. Synchronous: live
  rows per decode step, ``sum(tokens) / sum over rounds of the round's longest completion``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from pydantic import Field, field_validator

from sara.bench.engines import build_backend, check_backend_name, reset_prefix_cache
from sara.bench.generation_report import finish_report, format_table, write_json
from sara.commands.counts import MAX_BATCH, MAX_GROUP, MAX_SEEDS, MAX_STEPS
from sara.config import MAX_SEED, ConfigError, SaraModel, parse_spec, validate_config
from sara.envs.base import EnvWrapper, StreamingEnv

__all__ = ["GenerationBenchConfig", "DRIVER_SUFFIXES", "parse_allocators", "run_generation_bench", "format_table",
           "write_json"]  # the last two live in sara.bench.generation_report

DRIVER_SUFFIXES = ("stream", "fill", "carry")
"""Suffixes of an allocator spec (``sara+stream``, ``sara+carry+fill``) that select a streaming driver."""
class GenerationBenchConfig(SaraModel):
    """One ``sara bench generation`` run."""

    backend: str = "tiny"
    """Backend spec: ``tiny``, ``hf`` or ``vllm``, with options (``hf:dtype=float32,max_batch_size=32``); the real
    backends load the prepared ``smollm2`` model unless ``model=`` is given."""
    allocators: list[str] = Field(default_factory=lambda: ["ds", "sara", "sara+stream", "sara+carry"])
    """Allocator specs (``sara.allocators.make_allocator``), each optionally suffixed to select a streaming driver
    (``DRIVER_SUFFIXES``: ``+stream``, ``+fill``, ``+carry``)."""
    carry_lag: int = Field(1, ge=1, le=MAX_STEPS)
    """``+carry`` specs: steps a carried unit may lag (``DriverConfig.carry_lag``)."""
    complete_groups: bool = False
    """Streaming specs: a step that reaches its target waits for the groups still being filled
    (``DriverConfig.complete_groups``) instead of committing them with fewer than k rollouts."""
    task: str | None = None
    """Task spec (None = ``sara.bench.engines.DEFAULT_TASKS[backend]``)."""
    groups: int = Field(32, ge=1, le=MAX_BATCH)
    """Target (committed) groups per collection step."""
    k: int = Field(8, ge=2, le=MAX_GROUP)
    """Group size."""
    steps: int = Field(3, ge=1, le=MAX_STEPS)
    """Collection steps per allocator."""
    seed: int = Field(0, ge=0, le=MAX_SEED)
    """Seed of the prompt sampler, the rollouts and the tiny policy's warm start."""
    seeds: int = Field(1, ge=1, le=MAX_SEEDS)
    """Repeat the run with the sampler and rollout seeds ``seed``, ``seed + 1``, ...; the report pools them and gives
    95% intervals of the ratios (the tiny policy stays the one of ``seed``)."""
    reference: str | None = None
    """An entry of ``allocators`` (``sara``, ``sara+carry``, ...) whose rollouts per effective group the others are
    compared with (``ratio_vs_reference``, paired per seed). None: no such column."""
    slots: int | None = Field(None, ge=1)
    """The engine's capacity (``sara.bench.engines.CAPACITY_OPTIONS[backend]``, vLLM's ``max_num_seqs``, unless the
    backend spec sets it), which streaming drivers keep in flight. None = the engine's default."""
    max_new_tokens: int | None = Field(None, ge=1)
    """Generation cap (None = the task's suggestion)."""
    task_stop: bool = True
    """Stop at the task's stop strings; False: every completion runs to ``max_new_tokens`` (the verifier reads the
    answer first, so scores do not change), which sets how much decoding a rollout costs against its prompt."""
    sampler: str = "uniform"
    """Prompt sampler spec, the same for every allocator."""

    @field_validator("backend")
    @classmethod
    def _known_backend(cls, v: str) -> str:
        return check_backend_name(v)

    @field_validator("allocators")
    @classmethod
    def _specs(cls, v: list[str]) -> list[str]:
        if not v:
            raise ValueError("give at least one allocator spec, e.g. 'ds;sara;sara+stream'")
        for spec in v:
            base, _ = split_driver(spec)
            parse_spec(base)
        return v

    @field_validator("reference")
    @classmethod
    def _reference_is_a_spec(cls, v: str | None, info: Any) -> str | None:
        specs = info.data.get("allocators") or []
        if v is not None and v not in specs:
            raise ValueError(f"{v!r} is not one of the allocators ({'; '.join(specs)}); give one of them or none")
        return v


def split_driver(spec: str) -> tuple[str, str]:
    """``"sara_paper:tau_low=0.3+stream"`` -> ``("sara_paper:tau_low=0.3", "stream")``; ``"sara+carry+fill"`` ->
    ``("sara", "carry+fill")``; without a suffix the driver is ``"sync"``."""
    base, *flags = [x.strip() for x in spec.strip().split("+")]
    if any(f not in DRIVER_SUFFIXES for f in flags):
        raise ConfigError(f"bench generation: field 'allocators': {spec!r}: a driver suffix must be one of "
                          f"{', '.join('+' + f for f in DRIVER_SUFFIXES)}")
    return base, "+".join(sorted(set(flags), key=DRIVER_SUFFIXES.index)) or "sync"


def driver_config(driver: str, cfg: GenerationBenchConfig, last: bool) -> dict[str, Any]:
    """The ``DriverConfig`` of a spec's driver label (``"sync"``, ``"stream"``, ``"carry+fill"``, ...) for one step
    (``last``: the run's last step carries nothing)."""
    if driver == "sync":
        return {}
    flags = driver.split("+")
    return {"barrier": False, "fill_idle": "fill" in flags, "complete_groups": cfg.complete_groups,
            "carry_lag": cfg.carry_lag if "carry" in flags and not last else 0}


def parse_allocators(text: str) -> list[tuple[str, str]]:
    """Parse the ``--allocators`` value: ``;``-separated allocator specs, each optionally suffixed (``+stream``,
    ``+fill``, ``+carry``).

    Returns:
        ``[(allocator spec, driver), ...]`` with driver ``"sync"`` or the suffixes joined (``"stream"``,
        ``"carry+fill"``, ...).

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


class _Recorder(EnvWrapper):
    """The environment the driver sees: forwards rounds and records the decode steps each one needed."""

    def __init__(self, env: Any) -> None:
        super().__init__(env)
        self.tokens = self.decode_steps = 0

    def rollout(self, requests: Any) -> Any:
        out = self.env.rollout(requests)
        lens = [r.num_tokens for rs in out for r in rs]
        self.tokens += sum(lens)
        self.decode_steps += max(lens, default=0)
        return out


def _check_streaming(cfg: GenerationBenchConfig, backend: Any, env: Any) -> None:
    """A ``ConfigError`` naming ``allocators`` when a streaming spec meets a backend that cannot stream."""
    streamed = [s for s in cfg.allocators if split_driver(s)[1] != "sync"]
    if streamed and not isinstance(env, StreamingEnv):
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


class _Run:
    """One allocator spec's steps at one seed and their running totals (runs are interleaved step by step, so a
    machine whose load drifts during the benchmark slows every allocator alike)."""

    def __init__(self, cfg: GenerationBenchConfig, spec: str, driver: str, env: Any, seed: int) -> None:
        from sara.build import build_allocation

        self.cfg, self.spec, self.driver, self.seed = cfg, spec, driver, seed
        built = build_allocation(spec, cfg.sampler, k=cfg.k, prompts=env.prompts, seed=seed)  # as sara.train builds
        self.allocator, self.sampler = built.allocator, built.sampler
        self.rec = _Recorder(env)
        self.carry: Any = None  # driver '+carry': what the last step left running
        self.pending: list[Any] = []  # driver '+carry': steps whose full batch waits until nothing runs any more
        self.acc: dict[str, Any] = dict(
            spec=spec, driver=driver, tokens=0, rollouts=0, effective_groups=0, full_groups=0, aborted_rollouts=0,
            aborted_tokens=0, wall_seconds=0.0, full_batch_tokens=0, full_batch_seconds=0.0, inflight_seconds=0.0,
            generate_seconds=0.0, score_seconds=0.0, decode_tokens=0, decode_steps=0)

    def step(self, step: int, backend: Any, env: Any, log: Callable[[str], None] | None) -> None:
        """One timed collection step, then (once nothing it started runs any more) its rollouts as one full batch."""
        from sara.driver import collect

        cfg, acc = self.cfg, self.acc
        reset_prefix_cache(backend)
        m0 = env.metrics()
        t0 = time.perf_counter()
        driver = driver_config(self.driver, cfg, last=step + 1 == cfg.steps)  # the last step carries nothing
        res = collect(self.allocator, self.rec, self.sampler, target_groups=cfg.groups, seed=self.seed, step=step,
                      driver=driver, carry=self.carry)
        self.carry = res.carry
        wall = time.perf_counter() - t0
        m1 = env.metrics()
        st = res.stats
        acc["wall_seconds"] += wall
        acc["tokens"] += st.tokens + st.aborted_tokens
        acc["rollouts"] += st.rollouts
        acc["effective_groups"] += st.effective_groups
        acc["full_groups"] += sum(1 for g in res.groups if g.size >= cfg.k and g.is_effective(self.allocator.eps))
        acc["aborted_rollouts"] += st.aborted_rollouts
        acc["aborted_tokens"] += st.aborted_tokens
        acc["inflight_seconds"] += st.mean_inflight * wall
        acc["generate_seconds"] += m1["env/generate_seconds"] - m0["env/generate_seconds"]
        acc["score_seconds"] += m1["env/score_seconds"] - m0["env/score_seconds"]
        acc["decode_tokens"], acc["decode_steps"] = self.rec.tokens, self.rec.decode_steps
        if log is not None:
            log(f"{self.spec} ({self.driver}) seed {self.seed} step {step + 1}/{cfg.steps}: {st.rollouts} rollouts, "
                f"{st.effective_groups} effective groups, {st.tokens + st.aborted_tokens} tokens in {wall:.1f} s")
        self.pending.append(res)
        if self.carry is not None:
            return  # its rollouts still run on the engine: the full batches wait until nothing does
        for done in self.pending:
            reset_prefix_cache(backend)
            tok, sec = _full_batch(backend, env, done)
            acc["full_batch_tokens"] += tok
            acc["full_batch_seconds"] += sec
        self.pending = []


def _run_seed(cfg: GenerationBenchConfig, env: Any, backend: Any, seed: int,
              log: Callable[[str], None] | None) -> list[dict[str, Any]]:
    """Every spec at one seed: their totals, in ``cfg.allocators`` order."""
    runs = [_Run(cfg, spec, driver, env, seed) for spec, driver in (split_driver(s) for s in cfg.allocators)]
    carries = [run for run in runs if "carry" in run.driver.split("+")]
    for step in range(cfg.steps):  # interleaved step by step, except specs that carry work over
        for run in runs:
            if run not in carries:
                run.step(step, backend, env, log)
    for run in carries:
        for step in range(cfg.steps):
            run.step(step, backend, env, log)
    return [run.acc for run in runs]


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
        ConfigError: invalid fields; a streaming spec on a backend that cannot stream.
    """
    from sara.envs.base import SamplingConfig
    from sara.envs.task_env import TaskEnv

    cfg = config if isinstance(config, GenerationBenchConfig) else validate_config(
        GenerationBenchConfig, dict(config), what="bench generation")
    owned = backend is None
    if owned:
        stream = any(split_driver(s)[1] != "sync" for s in cfg.allocators)
        task, backend, task_spec = build_backend(cfg.backend, task=cfg.task, slots=cfg.slots, seed=cfg.seed,
                                                 stream=stream)
    else:
        if task is None:
            raise ConfigError("bench generation: field 'task': pass the Task that goes with the given backend")
        task_spec = cfg.task or task.id
    try:
        sampling = SamplingConfig(max_new_tokens=cfg.max_new_tokens or task.max_new_tokens or 64,
                                  stop=task.stop if cfg.task_stop else ())
        with TaskEnv(task, backend, sampling) as env:
            _check_streaming(cfg, backend, env)
            backend.generate([_warm_request(env)], sampling)  # warm-up (first-call set-up, not measured)
            seeds = list(range(cfg.seed, cfg.seed + cfg.seeds))
            per_seed = [_run_seed(cfg, env, backend, seed, log) for seed in seeds]
    finally:
        if owned:
            backend.close()
    results = finish_report(per_seed, seeds, cfg.reference)
    return {"backend": cfg.backend, "task": task_spec, "config": cfg.model_dump(), "results": results}


def _warm_request(env: Any) -> Any:
    from sara.envs.base import GenerationRequest
    from sara.types import RolloutRequest

    req = RolloutRequest(unit_id=0, pool_index=0, prompt=env.prompts[0], seeds=(0,))
    return GenerationRequest(prompt=env.render(req), seeds=tuple(range(8)))
