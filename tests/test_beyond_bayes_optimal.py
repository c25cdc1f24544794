"""Bayes-optimal stopping reference (issue 5): DP figures, optimality against every threshold rule, allocator."""

import itertools

import numpy as np
import pytest
from scipy.special import betaln

from sara.allocators import Decision, make_allocator
from sara.allocators.bayes_optimal import _evaluate, _peff_table, policy_table
from sara.testing import check_allocator


def _p_same(a, b, n):
    return np.exp(betaln(a + n, b) - betaln(a, b)) + np.exp(betaln(a, b + n) - betaln(a, b))


def _threshold_rule(k, n_fail, n_succ):
    table = np.zeros((k + 1, k + 1), bool)
    for n in range(1, k):
        table[n, 0] = n >= n_fail
        table[n, n] = n >= n_succ
    return table


@pytest.mark.parametrize("cap, ratio, wrong, after", [(0.105, 0.8397, 0.1033, 4), (0.145, 0.8158, 0.1441, 3),
                                                      (0.10, 0.8764, 0.0709, 5)])
def test_reproduces_the_u_shaped_figures(cap, ratio, wrong, after):
    pol = policy_table(0.15, 0.15, 8, cap)
    assert pol.ratio_vs_ds == pytest.approx(ratio, abs=5e-4)
    assert pol.wrong_abandon_rate == pytest.approx(wrong, abs=5e-4)
    first = [n for n in range(1, 8) if pol.abandon[n, 0]]
    assert first[0] == after and pol.abandon[after, after]


def test_exact_evaluation_matches_closed_form():
    a = b = 0.15
    k = 8
    ds = k / (1 - _p_same(a, b, k))
    for big_n in range(2, 8):
        p = _p_same(a, b, big_n)
        closed = (p * big_n + (1 - p) * k) / (1 - p) / ds
        c, g, w, ab = _evaluate(_threshold_rule(k, big_n, big_n), a, b, k, _peff_table(a, b, k))
        assert c / g / ds == pytest.approx(closed, rel=1e-9)
        assert w / ab == pytest.approx(1 - _p_same(a, b, k) / p, rel=1e-9)


@pytest.mark.parametrize("a, b, cap", [(0.15, 0.15, 0.12), (0.3, 0.8, 0.2), (0.5, 0.2, 0.08)])
def test_no_threshold_rule_beats_the_dp_under_the_same_cap(a, b, cap):
    k = 8
    pe = _peff_table(a, b, k)
    best = policy_table(a, b, k, cap)
    for nf, ns in itertools.product(range(1, 9), repeat=2):
        c, g, w, ab = _evaluate(_threshold_rule(k, nf, ns), a, b, k, pe)
        if (w / ab if ab else 0.0) <= cap:
            assert best.rollouts_per_effective_group <= c / g + 1e-9


def test_uniform_prior_never_abandons():
    # Under Beta(1, 1) abandoning never pays in rollouts per effective group.
    assert not policy_table(1.0, 1.0, 8, 0.5).abandon.any()


def test_allocator_follows_the_table():
    alloc = make_allocator("bayes_optimal:max_wrong_abandon=0.105,alpha0=0.15,beta0=0.15,oversample=1", k=8)
    alloc.begin_step(1, step=0)
    alloc.admit(np.array([0]))
    for i in range(4):
        closed, dec = alloc.observe(np.array([0]), np.zeros(1))
        assert (len(closed) == 0) == (i < 3)
    assert dec.tolist() == [Decision.ABANDON]


@pytest.mark.parametrize("spec", ["bayes_optimal:alpha0=0.15,beta0=0.15", "bayes_optimal:prior=empirical"])
def test_bayes_optimal_conforms(spec):
    check_allocator(make_allocator(spec, k=8), target_groups=16, steps=2, seeds=(0,))
