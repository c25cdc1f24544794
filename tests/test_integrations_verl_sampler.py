"""SaraSampler inside verl 0.9.1's real V1 trainer on CPU (``bash .ci/verl``; skipped without verl).

Each test builds ``PPOTrainerSync`` from verl's config with the sampler and manager plugged in, runs several steps with
scripted rollouts (``test_integrations_verl_harness``) and checks, per step: every rollout started is delivered
(committed / abandoned / discarded) or aborted (cancelled on the worker, or dropped when it landed) exactly once, as
the workers saw it; the batch is exactly the committed rollouts' keys with one ``uid`` per committed group (what GRPO
groups by); the rows carry ``__rollout_n__`` = the rollouts the allocator dispatched for that prompt, and verl ran that
many sessions; every session's seed is sara's ``(seed, step, prompt, occurrence, j)``; nothing is left in
TransferQueue after ``fit``'s ``kv_clear``; GRPO advantages sum to 0 per group.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter, defaultdict
from typing import Any

import numpy as np
import pytest

pytest.importorskip("verl.trainer.ppo.v1.replay_buffer", reason="needs verl 0.9.1 (bash .ci/verl)")

from test_integrations_verl_harness import Rig, compose, overrides, prompt_rows  # noqa: E402

from sara.allocators import Decision, SequentialAllocator  # noqa: E402
from sara.config import ConfigError  # noqa: E402
from sara.seeding import derive_seeds  # noqa: E402

MASK = (1 << 63) - 1


def spy_dispatch(rig: Rig) -> list[np.ndarray]:
    """Record every ``allocator.dispatch`` result (the rollouts the allocator asked for)."""
    calls: list[np.ndarray] = []
    alloc = rig.sampler.allocator
    orig = alloc.dispatch

    def dispatch(free: int, only: Any = None) -> np.ndarray:
        ids = orig(free, only)
        calls.append(np.asarray(ids).copy())
        return ids

    alloc.dispatch = dispatch  # type: ignore[method-assign]
    return calls


def check_step(rig: Rig, rep: dict[str, Any], dispatched: list[np.ndarray], *, seed: int = 0) -> None:
    res, env = rep["result"], rep["env"]
    s = res.stats
    k = rig.sampler.k
    # the driver's own accounting
    assert s.rollouts == s.committed_rollouts + s.abandoned_rollouts + s.discarded_rollouts
    assert s.committed_groups >= 1  # surplus groups committed in the poll that reached the target go along
    # verl's side, as the workers saw it: every session launched ended once, landed / cancelled / failed
    launched = sum(n for _, n, _ in rep["launches"])
    assert launched == s.rollouts + s.aborted_rollouts + env.counts["retried"]
    ends = Counter(w.outcomes[(uid, j)] for w in rig.workers for uid, n, _ in w.launches
                   if any(uid == u for u, _, _ in rep["launches"]) for j in range(n))
    assert sum(ends.values()) == launched, "a launched session never ran, or ran twice"
    assert ends["landed"] == s.rollouts + env.counts["dropped_landed"]
    assert ends["cancelled"] == env.counts["cancelled"]
    assert ends["failed"] == env.counts["retried"] + env.counts["dropped_failed"]
    assert env.counts["cancelled"] + env.counts["dropped_landed"] + env.counts["dropped_failed"] == s.aborted_rollouts
    # the batch: exactly the committed rollouts' keys; GRPO's uid = one per committed group
    kept = [g for g in res.groups if g.size >= 2]  # a group of one is left out (verl's GRPO: raw reward)
    assert env.counts["singletons_left_out"] == len(res.groups) - len(kept)
    keys = [key for g in kept for r in g.rollouts for key in r.metadata["tq_keys"]]
    assert rep["batch_keys"] == keys and len(set(keys)) == len(keys) == sum(g.size for g in kept)
    by_uid = Counter(rep["uid_field"])
    assert len(by_uid) == len(kept)
    assert sorted(by_uid.values()) == sorted(g.size for g in kept)
    for g in kept:
        assert {r.metadata["tq_base"] for r in g.rollouts} == {rep["uid_field"][rep["batch_keys"].index(
            g.rollouts[0].metadata["tq_keys"][0])]}
    # __rollout_n__: one row per prompt per submission, sized by the allocator's dispatch; verl ran that many
    per_call = defaultdict(list)
    for call, unit, n, _uid, _retry in env.launched:
        per_call[call].append(unit)
        assert n >= 1
    assert all(len(us) == len(set(us)) for us in per_call.values()), "a prompt got several rows in one submission"
    asked = Counter(np.concatenate(dispatched).tolist()) if dispatched else Counter()
    rows = Counter()
    for _call, unit, n, _uid, retry in env.launched:
        if not retry:
            rows[unit] += n
    assert rows == asked, "__rollout_n__ differs from what the allocator dispatched"
    ran = Counter(uid for w in rig.workers for uid, _ in w.outcomes)
    assert {uid: n for uid, n, _ in rep["launches"]} == {uid: ran[uid] for uid, _, _ in rep["launches"]}
    assert {uid: n for _, _, n, uid, _ in env.launched} == {uid: n for uid, n, _ in rep["launches"]}
    bases = {}
    for _call, unit, _n, uid, _retry in env.launched:
        base = bases.setdefault(unit, uid)
        assert "_" not in uid and (uid == base or uid.startswith(base + "-s"))
    # seeds: sara's (seed, step, prompt, occurrence, j) for every session
    units = sorted({f.unit: f.pool_index for f in env.flights.values()}.items())
    occ, seen = {}, Counter()
    for unit, pool in units:
        occ[unit] = seen[pool]
        seen[pool] += 1
    step_index = rep["step"] - 1
    for f in env.flights.values():
        want = int(derive_seeds(seed, step_index, f.pool_index, occ[f.unit], f.j)) & MASK
        assert f.seed & MASK == want
        for w in rig.workers:
            if f.loc in w.seeds_seen:
                assert w.seeds_seen[f.loc] == want
    # nothing left in TransferQueue once fit() cleared the batch; GRPO advantages sum to 0 per group
    assert rep["leftover"] == {}, f"TransferQueue leaked {list(rep['leftover'])[:4]}"
    for uid, rows_ in rep["advantages"].items():
        if not uid.startswith("pad"):
            assert abs(sum(a for _, a in rows_)) < 1e-3
    m = rep["metrics"]
    assert m["sara/committed_groups"] == s.committed_groups and m["sara/batch_rollouts"] == len(keys)
    assert m.get("sara/verl/singletons_left_out", 0.0) == env.counts["singletons_left_out"]
    assert all(key.startswith("sara/") for key in m)
    assert all(g.size <= k for g in res.groups)


def run(sampler_kwargs: dict[str, Any] | None = None, *, steps: int = 3, groups: int = 4, n: int = 4,
        **rig_kwargs: Any) -> tuple[Rig, list[dict[str, Any]]]:
    rig = Rig(compose(items=overrides(groups=groups, n=n, sampler_kwargs=sampler_kwargs)), **rig_kwargs)
    dispatched = spy_dispatch(rig)
    reps = []
    try:
        for step in range(1, steps + 1):
            dispatched.clear()
            rep = rig.step(step)
            check_step(rig, rep, dispatched, seed=int((sampler_kwargs or {}).get("seed", 0)))
            reps.append(rep)
    finally:
        rig.close()
    return rig, reps


def digest(reps: list[dict[str, Any]]) -> str:
    """Everything decided in a run, in stable names (verl's uids are uuid4)."""
    out = []
    for rep in reps:
        res, env = rep["result"], rep["env"]
        out.append({
            kind: [(g.pool_index, [r.metadata["j"] for r in g.rollouts], g.rewards.tolist()) for g in groups]
            for kind, groups in (("c", res.groups), ("a", res.abandoned), ("d", res.discarded))
        } | {"rows": [(c, u, n, r) for c, u, n, _, r in env.launched], "counts": sorted(env.counts.items()),
             "stop": res.stats.stop_reason})
    return hashlib.sha256(json.dumps(out).encode()).hexdigest()[:16]


def test_probes_commit_abandon_and_every_rollout_is_accounted():
    rig, reps = run({"allocator": "'sara_paper:tau_low=0.45'"}, steps=3, n=8)
    stats = [rep["result"].stats for rep in reps]
    assert sum(s.committed_groups for s in stats) >= 12
    assert sum(s.abandoned_groups for s in stats) >= 1  # saturated prompts abandoned after a few probes
    assert sum(n for rep in reps for _, _, n, _, _ in rep["env"].launched) < 8 * sum(
        s.committed_groups + s.abandoned_groups + s.discarded_groups for s in stats)  # probes, not full groups


def test_sara_cancels_what_closed_prompts_still_run():
    rig, reps = run({"allocator": "sara"}, steps=3, n=8)
    assert sum(rep["env"].counts["cancelled"] for rep in reps) >= 1
    sizes = {g.size for rep in reps for g in rep["result"].groups}
    assert 8 in sizes


def test_two_runs_decide_the_same():
    first, second = run({"allocator": "sara"}, steps=2, n=8)[1], run({"allocator": "sara"}, steps=2, n=8)[1]
    assert digest(first) == digest(second)


@pytest.mark.parametrize("spec", ["sara_paper:tau_low=0.45", "ds", "uniform"])
def test_other_allocators_by_spec(spec):
    rig, reps = run({"allocator": f"'{spec}'"}, steps=2)
    if spec == "uniform":
        for rep in reps:
            assert {n for _, _, n, _, _ in rep["env"].launched} == {rig.sampler.k}
            assert all(g.size == rig.sampler.k for g in rep["result"].groups)


class CommitEighthAtOnce(SequentialAllocator):
    """A stopping rule that commits every eighth prompt after its first rollout (a group of one)."""

    name = "commit_eighth_at_once"

    def decide(self, units):
        eighth = self.units.pool_index[units.ids] % 8 == 0
        return np.where(eighth, Decision.COMMIT, Decision.CONTINUE).astype(np.int8)


def test_groups_of_one_stay_out_of_the_batch():
    rig, reps = run({"allocator": "'test_integrations_verl_sampler:CommitEighthAtOnce:completion=as_is'"}, steps=2)
    assert sum(rep["env"].counts["singletons_left_out"] for rep in reps) >= 1
    assert all(min(Counter(rep["uid_field"]).values()) >= 2 for rep in reps)


def test_real_concurrency_keeps_the_accounting():
    run({"allocator": "sara"}, steps=2, threaded=True)


def test_without_worker_cancellation_late_rollouts_are_dropped():
    rig, reps = run({"allocator": "sara"}, steps=2, cancel=False)
    assert sum(rep["env"].counts["cancelled"] for rep in reps) == 0
    assert sum(rep["result"].stats.aborted_rollouts for rep in reps) == sum(
        rep["env"].counts["dropped_landed"] + rep["env"].counts["dropped_failed"] for rep in reps) > 0


def test_a_failed_session_runs_again_with_its_seed():
    rig, reps = run({"allocator": "sara"}, steps=2, fail_once=(2, 3))
    assert sum(rep["env"].counts["retried"] for rep in reps) >= 1


@pytest.mark.parametrize("sampler", ["uniform", "predictive"])
def test_a_sara_sampler_picks_the_prompts(sampler):
    rig, reps = run({"allocator": "sara", "sampler": sampler, "seed": 5}, steps=2)
    assert rig.sampler.prompt_sampler is not None and rig.sampler.prompt_sampler.name == sampler
    drawn = [f.pool_index for rep in reps for f in rep["env"].flights.values()]
    assert drawn and max(drawn) < 64


def test_synchronous_rounds():
    run({"allocator": "sara", "driver": "rounds"}, steps=2)


def test_validation_is_verls_own_sampler():
    import transfer_queue as tq
    from verl.utils import tensordict_utils as tu
    from verl.utils.dataset.rl_dataset import collate_fn

    rig = Rig(compose(items=overrides(sampler_kwargs={"allocator": "sara"})))
    try:
        rig.clock.threaded = True  # validation sessions do not wait for the clock
        batch = collate_fn(prompt_rows(3))
        batch["uid"] = np.array([f"val{i}" for i in range(3)], dtype=object)
        td = tu.get_tensordict(batch)
        tu.assign_non_tensor_data(td, "global_steps", 0)
        tu.assign_non_tensor_data(td, "validate", True)
        tq.kv_batch_put(keys=list(td["uid"]), partition_id="val",
                        tags=[{"is_prompt": True, "status": "pending", "global_steps": 0}] * 3)
        rig.manager.generate_sequences(td)  # straight to the workers: nothing held
        assert rig.manager.take_held() == []
        meta, _ = rig.sampler.sample(global_steps=0, partition_id="val", batch_size=3)
        n = int(rig.config.actor_rollout_ref.rollout.val_kwargs.n)
        assert sorted({k.split("_")[0] for k in meta.keys}) == ["val0", "val1", "val2"] and len(meta.keys) == 3 * n
        tq.kv_clear(keys=meta.keys, partition_id="val")
    finally:
        rig.close()


@pytest.mark.parametrize("items, field", [
    (["trainer.v1.trainer_mode=colocate_async"], "trainer_mode"),
    (["algorithm.filter_groups.enable=true", "algorithm.filter_groups.metric=acc"], "filter_groups"),
    (["+trainer.v1.sampler.sampler_kwargs.no_such_option=1"], "no_such_option"),
    (["+trainer.v1.sampler.sampler_kwargs.allocator=nope"], "nope"),
])
def test_settings_it_cannot_run_with_are_errors(items, field):
    from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync

    with pytest.raises(ConfigError, match=field):
        PPOTrainerSync(compose(items=overrides() + items))


def test_the_manager_is_required():
    from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync

    items = [o for o in overrides() if "agent_loop_manager_class" not in o]
    with pytest.raises(ConfigError, match="agent_loop_manager_class"):
        PPOTrainerSync(compose(items=items))
