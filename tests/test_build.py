"""``sara.build.build_allocation``: the allocator and the sampler built whole, each given at construction what it
reads (the sampler's history, the population split by prompt group), and nothing handed over afterwards."""

import ast
from pathlib import Path

import numpy as np
import pytest

import sara
from sara.allocators import ALLOCATORS, SequentialAllocator
from sara.build import Allocation, build_allocation
from sara.config import ConfigError
from sara.driver import collect
from sara.envs.sim.binary import SimulatedEnv
from sara.priors import BorrowedHistory
from sara.priors.base import population_of
from sara.priors.grouped import GroupedGridPrior
from sara.priors.history import HistorySource
from sara.samplers import SAMPLERS, UniformSampler
from sara.types import Prompt

ROOT = Path(sara.__file__).parent
SHARED = {"prior", "population", "posterior", "base"}
"""What an allocator or a sampler reads of another component: set in a constructor only."""
K = 4


def _assignments_outside_init(source: str, label: str) -> list[str]:
    """``label:line method`` of every assignment to ``<x>.prior`` / ``.population`` / ``.posterior`` / ``.base``
    outside an ``__init__`` in ``source``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) or node.name == "__init__":
            continue
        for sub in ast.walk(node):
            targets = (sub.targets if isinstance(sub, ast.Assign)
                       else [sub.target] if isinstance(sub, ast.AnnAssign | ast.AugAssign) else [])
            for target in targets:
                if isinstance(target, ast.Attribute) and target.attr in SHARED:
                    found.append(f"{label}:{sub.lineno} {node.name}")
    return found


def test_no_allocator_or_sampler_is_finished_after_construction():
    files = sorted((ROOT / "allocators").glob("*.py")) + sorted((ROOT / "samplers").glob("*.py"))
    assert files
    assert [hit for path in files for hit in _assignments_outside_init(path.read_text(), path.name)] == []


def test_the_scan_sees_a_setter():
    """The check above fails on the pattern it forbids (a control)."""
    src = "class A:\n    def __init__(self):\n        self.prior = 1\n    def lend(self, p):\n        self.prior.base = p\n"
    assert _assignments_outside_init(src, "a.py") == ["a.py:5 lend"]


def _prompts(n: int = 40) -> list[Prompt]:
    return [Prompt(id=f"p{i}", metadata={"component": "easy" if i % 2 else "hard"}) for i in range(n)]


@pytest.mark.parametrize("name", ALLOCATORS.names())
@pytest.mark.parametrize("sampler", SAMPLERS.names())
def test_every_pair_is_built_whole_and_shares_what_it_reads(name, sampler):
    built = build_allocation(name, sampler, k=K, prompts=_prompts(), seed=3)
    assert isinstance(built, Allocation) and built.allocator.k == K and built.sampler.pool_size == 40
    allocator, smp = built
    prior = allocator.prior if isinstance(allocator, SequentialAllocator) else None
    if isinstance(prior, BorrowedHistory):  # the sampler's history, the very object the sampler updates
        assert isinstance(smp, HistorySource) and prior.history is smp.posterior
    population = getattr(smp, "population", None)
    if population is not None:  # the allocator's population, the very object the allocator fits
        assert prior is not None and population is population_of(prior)
    if name == "sara":  # the default group_by splits this pool by component, and a predictive sampler reads it
        assert isinstance(population_of(prior), GroupedGridPrior)
        assert (population is not None) == (sampler == "predictive")
        assert isinstance(prior, BorrowedHistory) == (sampler == "predictive")
    again = build_allocation(name, sampler, k=K, prompts=_prompts(), seed=3)
    assert repr(again.allocator.state_dict()) == repr(allocator.state_dict())


def test_a_pair_built_by_the_builder_runs_and_learns_through_the_shared_objects():
    env = SimulatedEnv("u-shaped", size=400, seed=0)
    allocator, smp = build_allocation("sara", "predictive", k=8, prompts=env.prompts, seed=0)
    assert isinstance(allocator.prior, BorrowedHistory)
    before = allocator.prior.history.evidence(np.arange(400))[0].sum()
    for t in range(2):
        collect(allocator, env, smp, target_groups=16, seed=0, step=t)
    assert allocator.prior.history.evidence(np.arange(400))[0].sum() > before  # the sampler's updates, read


def test_errors_name_the_field():
    with pytest.raises(ConfigError, match="prompts=env.prompts"):
        build_allocation("sara", "uniform", k=K)
    with pytest.raises(ConfigError, match="group_by"):
        build_allocation("sara:group_by=level", "uniform", k=K, prompts=_prompts())  # no prompt carries level
    with pytest.raises(ConfigError, match="field 'k'"):
        build_allocation("sara:k=8", "uniform", k=K, pool_size=10)
    with pytest.raises(ConfigError, match="covers 5 prompts"):
        build_allocation("ds", UniformSampler(5), k=K, prompts=_prompts())


def test_k_has_one_rule_wherever_a_spec_repeats_it():
    """A ``k`` inside an allocator's or a sampler's spec may repeat the run's, never differ: the same check and the
    same message from the training config, the builder, ``make_allocator`` and ``make_sampler``."""
    from sara.allocators import make_allocator
    from sara.samplers import make_sampler
    from sara.train.config import TrainConfig

    messages = []
    for call in (lambda: TrainConfig(allocator="sara:k=5", k=K),
                 lambda: TrainConfig(sampler="predictive:k=5", k=K),
                 lambda: build_allocation("sara:k=5", "uniform", k=K, pool_size=10),
                 lambda: build_allocation("sara", "predictive:k=5", k=K, pool_size=10),
                 lambda: make_allocator("ds:k=5", k=K),
                 lambda: make_sampler("predictive:k=5", 10, k=K)):
        with pytest.raises((ConfigError, ValueError)) as err:
            call()
        messages.append(str(err.value))
    assert all(f"field 'k': 5 disagrees with the run's k={K}; drop k from the" in m for m in messages), messages
    assert make_allocator(f"ds:k={K}", k=K).k == K  # repeating the run's k is allowed
    assert TrainConfig(allocator=f"sara:k={K}", k=K).allocator == f"sara:k={K}"


@pytest.mark.parametrize("name", ALLOCATORS.names())
@pytest.mark.parametrize("sampler", SAMPLERS.names())
def test_a_training_config_holds_its_allocation_typed(name, sampler):
    """``TrainConfig.allocation``: the classes the specs name and their validated options, ``k`` the run's."""
    from sara.train.config import TrainConfig

    cfg = TrainConfig(allocator=name, sampler=sampler, k=K)
    chosen = cfg.allocation
    assert chosen.allocator.cls is ALLOCATORS.get(name) and chosen.allocator.name == name
    assert type(chosen.allocator.config) is chosen.allocator.cls.Config and chosen.allocator.config.k == K
    assert chosen.sampler.cls is SAMPLERS.get(sampler) and type(chosen.sampler.config) is chosen.sampler.cls.Config
    assert chosen.sampler.options.get("k", K) == K  # a sampler that scores groups scores groups of the run's k


def test_the_run_builds_from_the_choice_its_config_made(monkeypatch):
    """Once the config is made its specs are not read again: building the run's allocation with the spec parser
    broken still works (the builder takes the typed choice), and the options it built are the choice's."""
    from sara.registry import Registry
    from sara.train.config import TrainConfig
    from sara.train.resolve import build_run_allocation, config_yaml

    cfg = TrainConfig(allocator="sara:oversample=2,group_by=component", sampler="predictive:explore=0.2", k=K)

    def broken(*_args, **_kwargs):
        raise AssertionError("a spec was parsed again after the config was made")

    monkeypatch.setattr(Registry, "from_spec", broken)
    allocator, smp = build_run_allocation(cfg, _prompts(), None)
    assert allocator.config is cfg.allocation.allocator.config and allocator.config.oversample == 2.0
    assert smp.config.explore == 0.2 and smp.config.k == K
    assert "explore: 0.2" in config_yaml(cfg)  # --print-config reads the same choice


def test_a_copy_with_other_specs_reads_them_again():
    """``model_copy(update=...)`` skips validation; the typed allocation follows the copy's specs, never the
    original's."""
    from sara.train.config import TrainConfig

    cfg = TrainConfig(allocator="sara", k=K)
    copy = cfg.model_copy(update={"allocator": "ds", "sampler": "predictive", "k": 6})
    assert copy.allocation.allocator.name == "ds" and copy.allocation.allocator.config.k == 6
    assert copy.allocation.sampler.options["k"] == 6
    assert cfg.allocation.allocator.name == "sara" and cfg.allocation.allocator.config.k == K


def test_a_sampler_without_a_config_keeps_its_options_and_validates_when_built(tmp_path, monkeypatch):
    """A user's sampler class with no ``Config``: its spec options reach its constructor as written, and an option
    it refuses fails when the training config is made, naming the field."""
    from sara.train.config import TrainConfig

    (tmp_path / "my_sampler.py").write_text(
        "from sara.samplers import UniformSampler\n"
        "class Mine(UniformSampler):\n"
        "    Config = None\n"
        "    def __init__(self, pool_size, *, seed=0, width='1'):\n"
        "        super().__init__(pool_size, seed=seed)\n"
        "        self.width = int(width)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = TrainConfig(sampler="my_sampler:Mine:width=3", k=K)
    assert cfg.allocation.sampler.config is None and cfg.allocation.sampler.options == {"width": "3"}
    with pytest.raises(ValueError, match="field 'sampler'.*height"):
        TrainConfig(sampler="my_sampler:Mine:height=3", k=K)
