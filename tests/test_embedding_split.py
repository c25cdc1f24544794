"""``sara:group_by=<embedding>``: the population prior split into bands of a success rate predicted online from the
policy's own representation of each prompt (the backend's prefill, no rollout spent): the pooling, the regression and
its bands, the backends that embed, the wiring through ``compose`` and the trainer, and the saving when the
representation carries what the outcomes depend on."""

from pathlib import Path

import numpy as np
import pytest

from sara.allocators import make_allocator
from sara.build import build_allocation
from sara.config import ConfigError
from sara.driver import collect
from sara.envs.base import EmbedsPrompts
from sara.envs.sim.binary import SimulatedEnv, make_features
from sara.priors.features import EMBEDDING, NUMERIC_BINS
from sara.priors.grouped import prompt_groups
from sara.priors.representation import RepresentationPrior, principal_components
from sara.samplers import UniformSampler
from sara.testing import check_allocator
from sara.train.state_checks import check_values
from sara.types import Prompt

pytestmark = pytest.mark.isa  # results depend on the CPU's kernels: .ci/run runs these under AVX2 too

torch = pytest.importorskip("torch")

K = 8


def test_principal_components_are_standardized_and_drop_flat_directions():
    rng = np.random.default_rng(0)
    x = np.c_[rng.normal(0, 5, (400, 3)), np.zeros((400, 2))]  # two directions without variance
    z = principal_components(x, 32)
    assert z.shape == (400, 3) and np.allclose(z.std(0), 1.0) and np.allclose(z.mean(0), 0.0, atol=1e-9)
    assert principal_components(x, 2).shape == (400, 2)
    assert principal_components(np.ones((10, 4)), 8).shape == (10, 0)  # all alike: nothing to read
    # A pool larger than the fitting sample is projected in chunks, from float32, as if whole.
    big = rng.normal(0, 1, (3000, 12)).astype(np.float32) * np.arange(1, 13, dtype=np.float32)
    whole = principal_components(big, 6, sample=500, chunk=len(big))
    np.testing.assert_allclose(principal_components(big, 6, sample=500, chunk=700), whole, rtol=1e-10, atol=1e-10)
    assert whole.shape == (3000, 6) and np.allclose(whole.std(0), 1.0)
    top = np.linalg.svd(big - big.mean(0), full_matrices=False)[2][0]  # the sample finds the pool's top direction
    assert abs(np.corrcoef(whole[:, 0], (big - big.mean(0)) @ top)[0, 1]) > 0.99


def _fed(prior, rates, *, steps=4, units=400, seed=0, start=0):
    """Feed ``prior`` complete groups of K rollouts of random pool prompts with success rates ``rates`` (steps
    ``start``, ``start + 1``, ...)."""
    rng = np.random.default_rng(seed)
    for t in range(start, start + steps):
        idx = rng.choice(len(rates), units, replace=False)
        prior.update(idx, np.full(units, K), rng.binomial(K, rates[idx]).astype(float), t)
    return prior


def test_bands_follow_the_direction_that_predicts_success():
    rng = np.random.default_rng(1)
    x = rng.normal(0, 1, (3000, 24))
    rates = 1 / (1 + np.exp(-2.5 * x[:, 3]))  # one direction of 24 decides success; the others are noise
    prior = _fed(RepresentationPrior(x), rates)
    assert prior.n_groups == NUMERIC_BINS and np.array_equal(np.unique(prior.labels), np.arange(NUMERIC_BINS))
    band_rate = [rates[prior.labels == g].mean() for g in range(NUMERIC_BINS)]
    assert np.all(np.diff(band_rate) > 0.05)  # bands ordered from hard to easy, well apart
    assert np.corrcoef(prior.predict(), rates)[0, 1] > 0.9
    fits = prior.group_weights() @ prior.grid  # each band's fitted mean follows it
    assert np.all(np.diff(fits) > 0)
    untrained = RepresentationPrior(x)  # before min_units closed prompts: one band
    assert not untrained.labels.any()


def test_a_representation_that_says_nothing_leaves_one_population_in_effect():
    rng = np.random.default_rng(2)
    rates = rng.beta(0.5, 0.5, 3000)
    prior = _fed(RepresentationPrior(rng.normal(0, 1, (3000, 16))), rates)
    fits = prior.group_weights() @ prior.grid
    assert np.ptp(fits) < 0.1  # every band's fit near the pooled one


def test_state_round_trip():
    rng = np.random.default_rng(3)
    x = rng.normal(0, 1, (500, 8))
    prior = _fed(RepresentationPrior(x), 1 / (1 + np.exp(-3 * x[:, 0])), units=100)
    fresh = RepresentationPrior(x)
    check_values(prior.state_dict(), Path("ckpt"), "allocator")  # what a resumed trainer accepts: no negatives
    fresh.load_state_dict(prior.state_dict())
    assert np.array_equal(fresh.labels, prior.labels) and np.array_equal(fresh.coef, prior.coef) and prior.gain > 0
    assert np.array_equal(fresh.group_weights(), prior.group_weights())
    nxt = (np.arange(50), np.full(50, K), np.full(50, 4.0), 9)
    prior.update(*nxt)
    fresh.update(*nxt)
    assert np.array_equal(fresh.labels, prior.labels) and np.array_equal(fresh.group_weights(), prior.group_weights())
    with pytest.raises(ValueError, match="representation prior"):
        RepresentationPrior(x[:400]).load_state_dict(prior.state_dict())


def test_pooled_states_average_after_the_common_prefix():
    from sara.backends.embed import pooled_states

    torch.manual_seed(0)
    table = torch.randn(20, 3)

    def hidden(ids, attn, p):  # position t's state: its token's row plus t (a stand-in for a causal model)
        t = torch.arange(ids.shape[1], dtype=torch.float32)[None, :, None]
        return (table[ids] + t)[:, p:]

    rows = [[1, 2, 3, 4], [1, 2, 5], [1, 2, 3, 4, 6, 7]]
    out = pooled_states(rows, hidden, pad_id=0, batch=2)
    for r, got in zip(rows, out):  # the shared prefix [1, 2] is left out
        want = torch.stack([table[tok] + t for t, tok in enumerate(r)][2:]).mean(0)
        assert np.allclose(got, want.numpy(), atol=1e-6)
    assert np.allclose(pooled_states(rows, hidden, pad_id=0, batch=1), out, atol=1e-6)  # batching changes nothing
    whole = pooled_states([[1, 2], [1, 2, 3]], hidden, pad_id=0)  # a row that is all prefix keeps its last token
    assert np.allclose(whole[0], (table[2] + 1).numpy(), atol=1e-6)
    with pytest.raises(ValueError, match="no tokens"):
        pooled_states([[1], []], hidden, pad_id=0)


def test_the_tiny_backend_embeds_prompts_without_sampling():
    from sara.backends.tiny import TinyBackend
    from sara.policies.tiny import TinyPolicy

    backend = TinyBackend(TinyPolicy({"d_model": 32, "n_layers": 1, "n_heads": 2}))
    assert isinstance(backend, EmbedsPrompts)
    out = backend.embed_prompts(["12+7=", "3+4=", "12+7="])
    assert out.shape == (3, 32) and out.dtype == np.float32
    assert np.array_equal(out[0], out[2]) and not np.allclose(out[0], out[1])
    with pytest.raises(ValueError, match="text prompts"):
        backend.embed_prompts([[{"role": "user", "content": "hi"}]])


def test_the_policy_embeds_as_its_backend_does():
    from sara.backends.embed import PolicyEmbedder, policy_embedder
    from sara.backends.tiny import TinyBackend
    from sara.policies.tiny import TinyPolicy

    policy = TinyPolicy({"d_model": 32, "n_layers": 1, "n_heads": 2})
    embedder = policy_embedder(policy)
    assert isinstance(embedder, PolicyEmbedder) and isinstance(embedder, EmbedsPrompts)
    prompts = ["12+7=", "3+4=", "99+1="]
    assert np.array_equal(embedder.embed_prompts(prompts), TinyBackend(policy).embed_prompts(prompts))
    assert policy_embedder(object()) is None


@pytest.mark.hf
def test_the_hf_policy_embeds_as_the_hf_backend_does(tiny_model_dir):
    from sara.backends.embed import policy_embedder
    from sara.backends.hf import HFBackend
    from sara.policies.hf import HFPolicy

    prompts = ["Q: 1+1=2\nQ: 3+4=", "Q: 1+1=2\nQ: 12+30=", [{"role": "user", "content": "5+5="}]]
    policy = HFPolicy(str(tiny_model_dir), dtype="float32", compute_dtype="float32")
    got = policy_embedder(policy).embed_prompts(prompts)
    want = HFBackend(str(tiny_model_dir), dtype="float32").embed_prompts(prompts)
    assert np.allclose(got, want, atol=1e-5) and policy.model.training  # the policy's train mode is left as it was


@pytest.mark.hf
def test_the_hf_backend_embeds_with_the_prefix_forwarded_once(tiny_model_dir):
    from sara.backends.hf import HFBackend
    from sara.policies.prefix import final_hidden

    backend = HFBackend(str(tiny_model_dir), dtype="float32")
    assert isinstance(backend, EmbedsPrompts)
    shots = "Q: 1+1=2\nQ: 2+2=4\nQ: "
    out = backend.embed_prompts([shots + "3+4=", shots + "12+30=", [{"role": "user", "content": "5+5="}]])
    assert out.shape == (3, backend.model.config.hidden_size) and np.isfinite(out).all()
    ids = torch.tensor([[5, 6, 7, 8, 9], [5, 6, 7, 10, 11]])
    attn = torch.ones_like(ids)
    with torch.inference_mode():  # the shared prefix forwarded once equals the plain forward after it
        assert torch.allclose(final_hidden(backend.model, ids, attn, 3), final_hidden(backend.model, ids, attn, 0)[:, 3:],
                              atol=1e-5)


def _run(spec, *, embed=None, steps=6, seed=0, size=6000):
    env = SimulatedEnv("features:informative", size=size, seed=seed)
    allocator, sampler = build_allocation(spec, UniformSampler(size, seed=seed), k=K, prompts=env.prompts, embed=embed)
    rollouts = effective = 0
    for t in range(steps):
        res = collect(allocator, env, sampler, target_groups=128, seed=seed, step=t)
        rollouts, effective = rollouts + res.stats.rollouts, effective + res.stats.effective_groups
    return rollouts / effective, allocator


def _band_representation(size=6000, seed=0, noise=0.3):
    """A representation that carries the simulator's band (one-hot, plus noise, among noise dimensions): what a
    policy's hidden state carries when it knows which prompts are alike."""
    _, features = make_features("features:informative", size, seed=seed)
    band = np.asarray(features["band"], np.int64)
    rng = np.random.default_rng(1)
    onehot = np.eye(band.max() + 1)[band] * 3.0 + rng.normal(0, noise, (size, band.max() + 1))
    return np.c_[onehot, rng.normal(0, 1, (size, 12))]


def test_a_representation_that_carries_the_band_saves_what_the_band_saves():
    none, _ = _run("sara:group_by=none")
    band, _ = _run("sara:group_by=band")
    calls = []

    def embed():
        calls.append(1)
        return _band_representation()

    cost, allocator = _run(f"sara:group_by={EMBEDDING}", embed=embed)
    assert isinstance(allocator.prior, RepresentationPrior) and len(calls) == 1
    assert prompt_groups(allocator.prior) is None  # bands move: the run's DS estimate stays one population
    assert cost < 0.95 * none and cost < 1.05 * band
    noise, _ = _run(f"sara:group_by={EMBEDDING}", embed=lambda: np.random.default_rng(2).normal(0, 1, (6000, 8)))
    assert noise <= 1.01 * none  # a representation that predicts nothing leaves one population
    assert noise == none  # here it never beats the mean out of sample: the same rule, rollout for rollout


def test_the_default_splits_by_the_representation_where_the_run_has_one_and_weighs_the_bands_back():
    # features:informative carries no `component`: the default's second key, the representation, is chosen ...
    cost, allocator = _run("sara", embed=_band_representation)
    assert isinstance(allocator.prior, RepresentationPrior)
    assert cost == _run(f"sara:group_by={EMBEDDING},reweight=ds,max_weight=2", embed=_band_representation)[0]
    idx, sizes = np.arange(0, 6000, 500), np.full(12, K)
    w = allocator.batch_weights(idx, sizes)  # ... and its bands are weighted back to DS's composition (reweight=ds)
    assert w is not None and w.mean() == pytest.approx(1.0) and np.ptp(w) > 0
    assert make_allocator("sara", k=K).config.internals.max_weight == 2.0
    unweighted, plain_rule = _run("sara:reweight=none", embed=_band_representation)
    assert unweighted == cost  # weights touch the gradient, never the rollouts
    assert plain_rule.batch_weights(idx, sizes) is None
    # Without a representation (the simulator's runs, the benches, TRL, verl) the default is one population, silently.
    plain, bare = _run("sara")
    assert type(bare.prior).__name__ == "GridPrior" and plain == _run("sara:group_by=none")[0]
    assert bare.batch_weights(idx, sizes) is None


def test_conformance():
    env = SimulatedEnv("features:informative", size=6000, seed=0)
    check_allocator(lambda: build_allocation(f"sara:group_by={EMBEDDING}", UniformSampler(6000, seed=0), k=K, prompts=env.prompts, embed=_band_representation)[0],
                    env_factory=lambda seed: SimulatedEnv("features:informative", size=6000, seed=seed))


def test_embedding_needs_a_backend_that_embeds_and_is_only_computed_when_chosen():
    prompts = [Prompt(id=f"p{i}", prompt=f"{i}+1=", metadata={"component": i % 2}) for i in range(40)]
    with pytest.raises(ConfigError, match="group_by.*<embedding>.*representation.*this run has none"):
        build_allocation("sara:group_by=<embedding>", UniformSampler(40, seed=0), k=K, prompts=prompts)
    allocator, _ = build_allocation("sara:group_by=component|<embedding>", UniformSampler(40, seed=0), k=K, prompts=prompts, embed=lambda: pytest.fail("computed although component applies"))
    assert allocator.prior.names == [0, 1]
    default, _ = build_allocation("sara", UniformSampler(40, seed=0), k=K, prompts=prompts, embed=lambda: pytest.fail("computed although component applies"))
    assert default.prior.names == [0, 1]


def test_the_trainer_splits_by_the_policys_representation(tmp_path: Path):
    from sara.envs.task_env import pool_embedder
    from sara.train.trainer import Trainer

    trainer = Trainer({"allocator": "sara", "steps": 2, "rollout_budget": 1000, "k": 4,  # the default; no component
                       "groups_per_step": 16, "out_dir": str(tmp_path / "run"),
                       "task": "sara/Arithmetic-v0:max_digits=3,pool_size=300,eval_size=20"}, verbose=False)
    try:
        prior = trainer.allocator.prior
        embed = pool_embedder(trainer.env)
        assert isinstance(prior, RepresentationPrior) and embed is not None
        assert np.allclose(prior.z[:, :-1], principal_components(embed(), 32))
        said: list[str] = []
        assert len(pool_embedder(trainer.env, announce=said.append)()) == len(trainer.env.prompts)
        n = len(trainer.env.prompts)  # what `sara train` prints at its start: a line before, one after
        assert said == [f"embedding {n} training prompts for sara:group_by=<embedding> (TinyBackend: one forward "
                        "pass over the pool) ...",
                        f"embedded {n} training prompts for sara:group_by=<embedding> "
                        f"(TinyBackend, {said[1].rsplit(', ', 1)[1]}"]
        trainer.train()  # and it trains, the regression fitted on the steps' outcomes
        assert trainer.step == 2 and prior.fitted
        # Whether two steps' outcomes already split the pool depends on the trajectory (the CPU's rounding decides it),
        # so the split is shown on outcomes the test controls: success rising along the representation's first
        # component splits the trainer's own prior into every band, ordered from hard to easy.
        rates = 1 / (1 + np.exp(-3 * prior.z[:, 0]))
        _fed(prior, rates, steps=3, units=200, seed=1, start=trainer.step)
        assert np.array_equal(np.unique(prior.labels), np.arange(NUMERIC_BINS))
        assert np.all(np.diff([rates[prior.labels == g].mean() for g in range(NUMERIC_BINS)]) > 0)
    finally:
        trainer.close()


def _plain_tiny(policy, options=None, **_):
    """A tiny backend that only generates (no ``embed_prompts``), as a vLLM engine or a Ray pool would."""
    from sara.backends.tiny import TinyBackend

    inner = TinyBackend(policy, options)

    class Plain:
        def generate(self, requests, sampling):
            return inner.generate(requests, sampling)

        def update_weights(self, state_dict, version):
            inner.update_weights(state_dict, version)

        def close(self):
            inner.close()

    return Plain()


def test_a_backend_that_cannot_embed_gets_the_policys_representation(tmp_path: Path, monkeypatch):
    from sara.backends import BACKENDS
    from sara.backends.embed import policy_embedder
    from sara.envs.task_env import pool_embedder
    from sara.train.trainer import Trainer

    # Registered for this test only (other tests list the registry's names).
    monkeypatch.setitem(BACKENDS._items, "plain_tiny_for_embedding_tests", _plain_tiny)
    trainer = Trainer({"allocator": "sara:group_by=<embedding>", "backend": "plain_tiny_for_embedding_tests",
                       "steps": 1, "rollout_budget": 200, "out_dir": str(tmp_path / "run"),
                       "task": "sara/Arithmetic-v0:max_digits=3,pool_size=200,eval_size=20"}, verbose=False)
    try:
        assert not isinstance(trainer.backend, EmbedsPrompts) and pool_embedder(trainer.env) is None
        prior = trainer.allocator.prior
        said: list[str] = []
        embed = pool_embedder(trainer.env, fallback=policy_embedder(trainer.policy), announce=said.append)
        assert isinstance(prior, RepresentationPrior) and embed is not None
        assert np.allclose(prior.z[:, :-1], principal_components(embed(), 32))
        assert len(said) == 2 and said[1].startswith("embedded 200 training prompts for sara:group_by=<embedding> "
                                                     "(PolicyEmbedder, ")  # the policy embedded them
    finally:
        trainer.close()
