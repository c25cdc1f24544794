"""The HF backend's seeded sampler: the two-level inverse CDF is the inverse CDF, tokens follow the distribution,
log-probs are the raw ones, and a row's draw depends on its seed and position only."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sara.backends.sampling import BLOCK, inverse_cdf, sample_tokens
from sara.envs.base import SamplingConfig


def _reference(w: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One float64 cumulative sum over the whole row."""
    cdf = w.double().cumsum(-1)
    idx = torch.searchsorted(cdf, (u.double() * cdf[:, -1]).unsqueeze(-1), right=True).squeeze(-1)
    return idx.clamp(max=w.shape[-1] - 1)


@pytest.mark.parametrize("vocab", [7, BLOCK, 3 * BLOCK + 17, 49152])
def test_inverse_cdf_matches_one_level_search(vocab):
    g = torch.Generator().manual_seed(vocab)
    w = torch.softmax(torch.randn(16, vocab, generator=g) * 3, -1)
    w[:, ::5] = 0.0  # zero-weight tokens inside blocks
    for _ in range(20):
        u = torch.rand(16, generator=g, dtype=torch.float64)
        got = inverse_cdf(w, u)
        assert torch.equal(got, _reference(w, u))
        assert bool((w.gather(-1, got.unsqueeze(-1)) > 0).all())


def test_inverse_cdf_edges_never_pick_zero_weight():
    w = torch.zeros(4, 2 * BLOCK + 3)
    w[0, 5] = 1.0  # one token in the first block
    w[1, -1] = 2.0  # the very last token (in the padded block)
    w[2, BLOCK:BLOCK + 10] = 1.0  # a run inside the second block, zeros after it
    w[3, 0], w[3, BLOCK + 1] = 1e-30, 1.0
    for u in (0.0, 0.5, 1.0 - 2.0 ** -53):
        got = inverse_cdf(w, torch.full((4,), u, dtype=torch.float64)).tolist()
        assert got[0] == 5 and got[1] == w.shape[1] - 1 and BLOCK <= got[2] < BLOCK + 10
        assert got[3] in (0, BLOCK + 1)
    assert inverse_cdf(w, torch.zeros(4, dtype=torch.float64)).tolist()[2] == BLOCK


def test_inverse_cdf_block_sum_rounding_stays_on_positive_weight():
    # A block whose float32 sum exceeds its float64 running sum, last token zero: a uniform near 1 lands in the gap.
    g = torch.Generator().manual_seed(0)
    w = torch.zeros(1, 2 * BLOCK)
    w[0, :BLOCK - 1] = torch.rand(BLOCK - 1, generator=g)
    assert w[0, :BLOCK].sum().double() > w[0, :BLOCK].double().sum()
    got = inverse_cdf(w, torch.tensor([1.0 - 2.0 ** -53], dtype=torch.float64))
    assert got.item() == BLOCK - 2


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_tokens_follow_the_tempered_distribution_and_logp_is_raw(temperature):
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, -8.0]])
    n = 20_000
    seeds = np.arange(n, dtype=np.uint64)
    tok, lp = sample_tokens(logits.expand(n, -1).contiguous(), seeds, 3, SamplingConfig(temperature=temperature))
    want = torch.softmax(logits[0] / temperature, -1).numpy()
    freq = np.bincount(tok.numpy(), minlength=5) / n
    assert np.abs(freq - want).max() < 4 * np.sqrt(want.max() * (1 - want.max()) / n)
    raw = torch.log_softmax(logits[0], -1)
    assert torch.allclose(lp, raw[tok], atol=1e-5)


def test_top_p_keeps_the_smallest_covering_set():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    n = 4000
    tok, lp = sample_tokens(logits.expand(n, -1).contiguous(), np.arange(n, dtype=np.uint64), 0,
                            SamplingConfig(temperature=1.0, top_p=0.7))
    freq = np.bincount(tok.numpy(), minlength=4) / n
    assert freq[2] == freq[3] == 0.0 and abs(freq[0] - 0.625) < 0.03  # renormalized over {0, 1}
    assert torch.allclose(lp, logits[0][tok], atol=1e-5)  # raw log-probs, not the truncated ones


def test_greedy_and_draws_depend_on_seed_and_position_only():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 300, generator=g)
    tok, lp = sample_tokens(logits, np.arange(6, dtype=np.uint64), 0, SamplingConfig(temperature=0.0))
    assert torch.equal(tok, logits.argmax(-1))
    assert torch.allclose(lp, torch.log_softmax(logits, -1).gather(-1, tok.unsqueeze(-1)).squeeze(-1), atol=1e-5)
    seeds, steps = np.arange(10, 16, dtype=np.uint64), np.array([0, 1, 2, 3, 4, 5])
    tok, _ = sample_tokens(logits, seeds, steps, SamplingConfig())
    perm = [5, 3, 1, 0, 2, 4]
    tok_p, _ = sample_tokens(logits[perm], seeds[perm], steps[perm], SamplingConfig())
    assert torch.equal(tok_p, tok[perm])
    other, _ = sample_tokens(logits, seeds, steps + 1, SamplingConfig())
    assert not torch.equal(other, tok)  # the position enters the uniform
