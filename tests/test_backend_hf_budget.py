"""The HF backend's KV-cache budget (``sara.backends.hf_budget``): the bytes a cached position takes, ``auto`` sized
from memory, the round loop's chunks and the streaming loop's admission within it, the same completions either way."""

from __future__ import annotations

import numpy as np
import pytest

from sara.backends.hf_budget import KV_SHARE, KVBudget, chunk_rows, kv_budget, kv_bytes_per_position
from sara.backends.hf_rows import Row

SMOLLM2 = {"num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "hidden_size": 576}
GIB = 1024**3


def test_bytes_per_position_from_the_models_shape():
    assert kv_bytes_per_position(SMOLLM2, 4) == 30 * 2 * 3 * 64 * 4  # 46,080: grouped-query heads of 64
    assert kv_bytes_per_position(SMOLLM2, 2) == 30 * 2 * 3 * 64 * 2
    mha = {"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 32}
    assert kv_bytes_per_position(mha, 4) == 2 * 2 * 4 * 8 * 4  # no num_key_value_heads: every head caches
    assert kv_bytes_per_position({**mha, "head_dim": 16}, 4) == 2 * 2 * 4 * 16 * 4
    assert kv_bytes_per_position({"hidden_size": 32}, 4) is None
    assert kv_bytes_per_position({**mha, "num_attention_heads": 0}, 4) is None


def test_auto_is_a_share_of_memory_and_says_so():
    per = kv_bytes_per_position(SMOLLM2, 4)
    auto = kv_budget("auto", per, 24 * GIB)
    assert auto.positions == 24 * GIB // KV_SHARE // per
    assert f"1/{KV_SHARE} of 24.0 GiB" in auto.line() and "45.0 KiB a position" in auto.line()
    assert kv_budget("auto", per, 8 * GIB).positions == auto.positions // 3  # a smaller machine, fewer positions
    assert kv_budget(0.5, per, 24 * GIB).positions == GIB // 2 // per  # as asked, whatever the memory
    assert kv_budget("auto", per, None).positions is None and "unknown" in kv_budget("auto", per, None).reason
    assert kv_budget("auto", None, 24 * GIB).positions is None
    assert "no bound" in kv_budget("auto", None, 24 * GIB).line()


def _rows(groups: list[tuple[int, int, int]]) -> list[Row]:
    """``(rows, prompt length, cap)`` per request -> the round's rows, grouped by request."""
    return [Row(q, [1] * width, s, cap) for q, (n, width, cap) in enumerate(groups) for s in range(n)]


def test_chunks_without_a_bound_keep_requests_whole_up_to_the_row_cap():
    rows = _rows([(3, 5, 4), (2, 5, 4), (4, 5, 4), (9, 5, 4)])
    chunks = chunk_rows(rows, 5, KVBudget(None, ""))
    assert [[r.request for r in c] for c in chunks] == [[0, 0, 0, 1, 1], [2, 2, 2, 2], [3] * 5, [3] * 4]


def test_chunks_fit_the_budget_and_keep_every_row_in_order():
    rng = np.random.default_rng(0)
    for _ in range(200):
        groups = [(int(rng.integers(1, 9)), int(rng.integers(1, 40)), int(rng.integers(0, 20)))
                  for _ in range(int(rng.integers(1, 8)))]
        budget = KVBudget(int(rng.integers(1, 400)), "")
        rows = _rows(groups)
        chunks = chunk_rows(rows, int(rng.integers(1, 12)), budget)
        assert [r for c in chunks for r in c] == rows  # every row once, in order
        for c in chunks:
            used = len(c) * (max(len(r.prompt_ids) for r in c) + max(r.cap for r in c))
            assert len(c) == 1 or used <= budget.positions


def test_a_request_that_fits_is_not_split():
    rows = _rows([(2, 10, 10), (3, 10, 10)])  # 20 positions a row
    assert [len(c) for c in chunk_rows(rows, 64, KVBudget(100, ""))] == [5]  # 5 rows x 20 = 100: one chunk
    assert [len(c) for c in chunk_rows(rows, 64, KVBudget(99, ""))] == [2, 3]  # the second request moves whole
    assert [len(c) for c in chunk_rows(rows, 64, KVBudget(50, ""))] == [2, 2, 1]  # too big for any chunk: split


# ------------------------------------------------------------------------------------------- on a tiny Llama
torch = pytest.importorskip("torch", reason="the HF backend needs torch")
pytest.importorskip("transformers", reason="the HF backend needs transformers")

from sara.envs.base import GenerationRequest, SamplingConfig  # noqa: E402

SAMPLING = SamplingConfig(max_new_tokens=8)
PROMPTS = ["1+1=", "The quick brown fox jumps over the lazy", "Hi", "Name a color please, any color at all"]
TINY_PER_POSITION = 2 * 2 * 2 * 8 * 4  # 2 layers x (K, V) x 2 key-value heads x head size 8 x float32


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    from sara.backends.hf import HFBackend

    b = HFBackend(str(tiny_model_dir), dtype="float32", max_batch_size=8)
    yield b.model, b.tokenizer
    b.close()


def _backend(model, positions: int | None):
    from sara.backends.hf import HFBackend

    gib = "auto" if positions is None else positions * TINY_PER_POSITION / GIB
    return HFBackend(model[0], model[1], dtype="float32", max_batch_size=8, kv_cache_gib=gib)


def test_the_estimate_is_what_the_cache_holds(model):
    """The bytes a prefill's cache holds per cached position are ``kv_bytes_per_position`` of the model's config."""
    b = _backend(model, None)
    assert b.kv.positions is not None  # auto: this machine's memory is known
    prompts = [b.tokenizer.encode(p) for p in PROMPTS]
    _, cache, mask = b._prefill_plain(prompts)
    held = sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))
    assert held / mask.numel() == kv_bytes_per_position(b.model.config.to_dict(), 4) == TINY_PER_POSITION


def test_a_tight_budget_chunks_rounds_and_gives_the_same_completions(model, monkeypatch):
    requests = [GenerationRequest(prompt=p, seeds=(10 * i, 10 * i + 1)) for i, p in enumerate(PROMPTS)]
    free = _backend(model, None).generate(requests, SAMPLING)
    tight = _backend(model, 60)  # at most 60 positions: 2 rows of the longest prompt (~10 tokens) and 8 new
    sizes: list[int] = []
    real = type(tight)._generate_chunk
    monkeypatch.setattr(type(tight), "_generate_chunk", lambda self, rows, s: (sizes.append(len(rows)),
                                                                               real(self, rows, s))[1])
    out = tight.generate(requests, SAMPLING)
    assert len(sizes) > 1 and max(sizes) < 8 and sum(sizes) == 8  # cut into chunks (8 rows would fit unbounded)
    assert [[c.token_ids for c in cs] for cs in out] == [[c.token_ids for c in cs] for cs in free]


def test_streaming_admits_only_what_fits(model):
    """Eight streamed rows under a budget for about two: never more rows decode together than fit (one alone
    always runs), and every completion is the one decoded without a bound."""
    items = [(i, GenerationRequest(prompt=PROMPTS[i % 4], seeds=(i,))) for i in range(8)]
    results = {}
    for positions in (None, 50):
        b = _backend(model, positions)
        decoded: list[int] = []  # rows of every decode forward ([B, 1] ids; prefills forward whole prompts)
        b._forward = _counting(b._forward, decoded)
        b.submit(items, SAMPLING)
        got = {}
        while b.inflight():
            got.update((tag, c.token_ids) for tag, c in b.poll())
        results[positions] = (max(decoded), got)
    assert results[None][0] > 3
    assert 1 <= results[50][0] <= 2
    assert results[50][1] == results[None][1]


def _counting(forward, decoded: list[int]):
    def wrapped(ids, *rest):
        if ids.shape[1] == 1:
            decoded.append(ids.shape[0])
        return forward(ids, *rest)

    return wrapped


def test_the_run_prints_and_print_config_shows_the_bound(tiny_model_dir):
    from sara.backends import BoundsKV
    from sara.train.config import TrainConfig
    from sara.train.dtypes import run_kv_cache

    b = _backend_from_dir(tiny_model_dir)
    assert isinstance(b, BoundsKV) and b.kv_line().startswith("generation KV cache: at most ")
    cfg = TrainConfig(policy="hf", backend="hf", policy_options={"model": str(tiny_model_dir)},
                      backend_options={"model": str(tiny_model_dir), "dtype": "float32", "kv_cache_gib": 0.001})
    line = run_kv_cache(cfg)
    assert line == f"generation KV cache: at most {int(0.001 * GIB) // TINY_PER_POSITION:,} positions " \
                   f"(kv_cache_gib=0.001: 0.2 KiB a position)"
    assert run_kv_cache(TrainConfig()) is None  # the tiny backend has no KV budget


def _backend_from_dir(path):
    from sara.backends.hf import HFBackend

    return HFBackend(str(path), dtype="float32", max_batch_size=4)
