import importlib.util
from pathlib import Path

from sara.testing import check_allocator

ROOT = Path(__file__).resolve().parents[1]


def test_custom_stopping_rule_example():
    spec = importlib.util.spec_from_file_location("custom_stopping_rule", ROOT / "examples" / "custom_stopping_rule.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    alloc = mod.AbandonAfterM(k=8, m=2)
    check_allocator(alloc, target_groups=24, seeds=(0,))
    from sara import SimulatedEnv, UniformSampler, collect

    env = SimulatedEnv("u-shaped", size=2000, seed=0)
    res = collect(mod.AbandonAfterM(k=8, m=2), env, UniformSampler(2000), target_groups=40)
    assert res.stats.abandoned_groups > 0 and all(g.size == 2 for g in res.abandoned)
