"""A short soak (the long one is `sara bench soak`): random allocators, targets, budgets and injected environment
exceptions; exact accounting on every step, every generated rollout accounted for, memory not growing."""

from __future__ import annotations

import pytest

from sara.bench.soak import SOAK_ALLOCATORS, soak


@pytest.mark.slow
def test_short_soak_accounts_every_rollout():
    out = soak(150, seed=3, warmup=30, max_rss_growth_mb=64.0)
    assert out["ok"] + out["failed"] == 150 and out["failed"] > 0 and out["ok"] > 100  # faults were injected
    assert out["rollouts"] > 0 and set(out["stop_reasons"]) >= {"target_reached", "max_rollouts"}
    assert out["allocators"] == list(SOAK_ALLOCATORS)


def test_soak_catches_a_lost_rollout(monkeypatch):
    """The checks can fail: an environment that under-reports what it generated trips the accounting."""
    import sara.bench.soak as s

    real = s._FaultyEnv.rollout

    def leaky(self, requests):
        out = real(self, requests)
        self.generated += 1
        return out

    monkeypatch.setattr(s._FaultyEnv, "rollout", leaky)
    with pytest.raises(AssertionError):
        soak(3, seed=0, fault_rate=0.0)
