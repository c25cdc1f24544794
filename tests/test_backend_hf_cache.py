"""``sara.backends.hf_cache``: decode steps write into spare positions in place (no ``torch.cat`` copy of the cache
per token), and a model decoding through ``SpareLayer``s computes exactly what it computes through a
``DynamicCache``, across batch reorders (rows finishing) and past the reserved room."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.isa  # results depend on the CPU's kernels: .ci/run runs these under AVX2 too

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")


def _decode(model, cache_fn, *, steps=9, spare=4):
    """Prefill 3 left-padded prompts, then decode greedily ``steps`` tokens, dropping row 1 after step 3; return every
    step's logits and the cache."""
    from transformers import DynamicCache

    ids = torch.tensor([[0, 0, 5, 6, 7], [8, 9, 10, 11, 12], [0, 13, 14, 15, 16]])
    mask = (torch.arange(5)[None] >= torch.tensor([[2], [0], [1]])).long()
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    out = model(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=DynamicCache(), use_cache=True)
    cache = cache_fn(out.past_key_values, spare)
    logits, seen = out.logits[:, -1], []
    nxt = mask.sum(-1, keepdim=True)
    for t in range(steps):
        tok = logits.argmax(-1, keepdim=True)
        if t == 3:  # row 1 finishes: the batch shrinks
            keep = torch.tensor([0, 2])
            cache.reorder_cache(keep)
            tok, mask, nxt = tok[keep], mask[keep], nxt[keep]
        mask = torch.cat([mask, torch.ones(len(mask), 1, dtype=mask.dtype)], 1)
        out = model(input_ids=tok, attention_mask=mask, position_ids=nxt, past_key_values=cache, use_cache=True)
        logits, nxt = out.logits[:, -1], nxt + 1
        seen.append(logits)
    return seen, cache


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_spare_layers_decode_exactly_as_dynamic_ones(tiny_model_dir, dtype):
    from transformers import AutoModelForCausalLM

    from sara.backends.hf_cache import SpareLayer, with_spare

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=getattr(torch, dtype)).eval()
    with torch.inference_mode():
        plain, _ = _decode(model, lambda c, spare: c)
        spared, cache = _decode(model, with_spare, spare=4)  # 9 steps: the room of 4 runs out and grows
    assert all(isinstance(layer, SpareLayer) for layer in cache.layers)
    assert cache.get_seq_length() == 5 + 9
    for a, b in zip(plain, spared):
        assert torch.equal(a, b)


def test_a_step_within_the_room_writes_in_place(tiny_model_dir):
    from transformers import AutoModelForCausalLM, DynamicCache

    from sara.backends.hf_cache import with_spare

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    with torch.inference_mode():
        ids = torch.tensor([[5, 6, 7], [8, 9, 10]])
        cache = with_spare(model(input_ids=ids, past_key_values=DynamicCache(), use_cache=True).past_key_values, 8)
        layer = cache.layers[0]
        buffers = layer._bk.data_ptr(), layer._bv.data_ptr()
        for t in range(8):
            model(input_ids=torch.tensor([[1], [2]]), position_ids=torch.tensor([[3 + t], [3 + t]]),
                  past_key_values=cache, use_cache=True)
            assert (layer._bk.data_ptr(), layer._bv.data_ptr()) == buffers  # no copy of the cache this step
        assert layer.keys.shape[-2] == 11
        model(input_ids=torch.tensor([[1], [2]]), position_ids=torch.tensor([[11], [11]]), past_key_values=cache,
              use_cache=True)  # past the room: grown once, by more than one position
        assert layer._bk.data_ptr() != buffers[0] and layer._bk.shape[-2] > 12 and layer.keys.shape[-2] == 12
        cache.reorder_cache(torch.tensor([1]))  # rows dropped, the room kept
        assert layer.keys.shape[:3] == (1, layer._bk.shape[1], 12) and layer._bk.shape[-2] > 12


def test_assigned_tensors_are_adopted_not_written(tiny_model_dir):
    from sara.backends.hf_cache import SpareLayer

    keys, values = torch.randn(2, 1, 3, 4), torch.randn(2, 1, 3, 4)
    layer = SpareLayer(keys, values, spare=2)
    outside = torch.randn(2, 1, 5, 4)
    layer.keys, layer.values = outside, outside.clone()  # what the streaming loop does when it joins caches
    before = outside.clone()
    k, _ = layer.update(torch.ones(2, 1, 1, 4), torch.ones(2, 1, 1, 4))
    assert torch.equal(outside, before) and k.shape[-2] == 6 and torch.equal(k[..., :5, :], before)


@pytest.mark.parametrize("keep,size", [([0, 2, 5], 6), ([3, 4], 5), ([0, 1, 2], 3), ([1], 4), ([], 3)])
def test_fill_from_end_moves_only_rows_past_the_kept_count(keep, size):
    from sara.backends.hf_cache import fill_from_end

    order = fill_from_end(keep, size)
    assert sorted(order) == keep  # the kept rows, each once
    assert all(order[i] == i for i in range(len(keep)) if i in keep)  # a kept row in front stays put
    assert all(b >= len(keep) for i, b in enumerate(order) if b != i)  # the movers come from behind


def test_a_fill_from_end_reorder_copies_moved_rows_in_place():
    from sara.backends.hf_cache import SpareLayer, fill_from_end

    keys = torch.arange(6 * 2 * 3 * 4, dtype=torch.float32).reshape(6, 2, 3, 4)
    layer = SpareLayer(keys.clone(), keys.clone(), spare=5)
    buffer = layer._bk.data_ptr()
    order = fill_from_end([0, 2, 5], 6)  # rows 1, 3, 4 finish: row 5 moves to slot 1
    layer.reorder_cache(torch.tensor(order))
    assert layer._bk.data_ptr() == buffer  # no new buffer
    assert torch.equal(layer.keys, keys[order]) and torch.equal(layer.values, keys[order])
    layer.reorder_cache(torch.tensor([2, 1, 0]))  # most rows move: a fresh buffer, the same values
    assert torch.equal(layer.keys, keys[order][[2, 1, 0]]) and layer._bk.shape[-2] == 8


def _cache(*layers):
    from types import SimpleNamespace

    return SimpleNamespace(layers=list(layers))


def _padded(x, width):
    return torch.cat([x.new_zeros((*x.shape[:2], width - x.shape[-2], x.shape[-1])), x], dim=-2)


def test_join_rows_writes_newcomers_in_place_when_the_buffers_have_room():
    """A join equals ``torch.cat`` of the left-padded caches; the first join copies both into a buffer with room for
    the engine's rows, and once rows have left (an in-place reorder) a join writes only the newcomers into it."""
    from transformers.cache_utils import DynamicLayer

    from sara.backends.hf_cache import SpareLayer, fill_from_end, join_rows

    g = torch.Generator().manual_seed(0)
    run = torch.randn(3, 2, 6, 4, generator=g)
    new = torch.randn(2, 2, 4, 4, generator=g)
    cache = _cache(SpareLayer(run.clone(), run.clone() + 1, spare=8))
    fresh = DynamicLayer()
    fresh.keys, fresh.values, fresh.is_initialized = new.clone(), new.clone() + 1, True
    join_rows(cache, _cache(fresh), width=6, spare=8, rows=6)
    want = torch.cat([run, _padded(new, 6)])
    layer = cache.layers[0]
    assert torch.equal(layer.keys, want) and torch.equal(layer.values, want + torch.cat([torch.ones_like(run), _padded(
        torch.ones_like(new), 6)]))
    buffer = layer._bk.data_ptr()
    layer.reorder_cache(torch.tensor(fill_from_end([0, 1, 4], 5)))  # rows 2, 3 leave: row 4 moves, in place
    kept = want[[0, 1, 4]]
    more = torch.randn(3, 2, 5, 4, generator=g)
    again = DynamicLayer()
    again.keys, again.values, again.is_initialized = more.clone(), more.clone(), True
    join_rows(cache, _cache(again), width=6, spare=8, rows=6)
    assert cache.layers[0] is layer and layer._bk.data_ptr() == buffer  # the newcomers written into its free rows
    assert torch.equal(layer.keys, torch.cat([kept, _padded(more, 6)]))
    wide = torch.randn(1, 2, 9, 4, generator=g)  # wider than the running cache: a fresh buffer, left-padded
    last = DynamicLayer()
    last.keys, last.values, last.is_initialized = wide.clone(), wide.clone(), True
    join_rows(cache, _cache(last), width=9, spare=8, rows=6)
    assert torch.equal(cache.layers[0].keys, torch.cat([_padded(torch.cat([kept, _padded(more, 6)]), 9), wide]))
