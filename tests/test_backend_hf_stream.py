"""HF backend streaming (``submit`` / ``poll`` / ``abort``, ``sara.backends.hf_stream``) on a tiny random Llama.

float32 weights: a streamed completion equals ``generate``'s for the same prompt and seed token for token (the
inverse-CDF draws are the same; the logits differ from ``generate``'s batch shape by < 1e-5, below any CDF gap the
draws land near on this model).
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="the HF backend needs torch")
pytest.importorskip("transformers", reason="the HF backend needs transformers")

from sara.envs.base import GenerationRequest, SamplingConfig, StreamingBackend  # noqa: E402
from sara.testing.backend import check_backend  # noqa: E402

PROMPTS = ["1+1=", "The quick brown fox jumps over the lazy", "Hi", "Name a color please, any color at all"]
SAMPLING = SamplingConfig(max_new_tokens=10)


@pytest.fixture(scope="module")
def backend(tiny_model_dir):
    from sara.backends.hf import HFBackend

    b = HFBackend(str(tiny_model_dir), dtype="float32", max_batch_size=3)
    yield b
    b.close()


def _drain(b, limit: int = 1000) -> tuple[dict[int, object], list[int]]:
    got, order = {}, []
    for _ in range(limit):
        if not b.inflight():
            break
        batch = b.poll()
        assert batch, "poll returned nothing with completions in flight"
        for tag, c in batch:
            assert tag not in got
            got[tag] = c
            order.append(tag)
    return got, order


def _alone(b, req: GenerationRequest, sampling: SamplingConfig = SAMPLING):
    return b.generate([req], sampling)[0][0]


def test_protocol_and_config(backend):
    from sara.backends.hf import HFBackend, HFBackendConfig
    from sara.config import ConfigError, validate_config

    assert isinstance(backend, StreamingBackend) and backend.slots == 3
    assert HFBackend(backend.model, backend.tokenizer, max_batch_size=5).slots == 5  # the capacity: max_batch_size
    with pytest.raises(ConfigError, match="max_batch_size"):
        validate_config(HFBackendConfig, {"max_batch_size": 0}, what="backend 'hf'")
    assert backend.poll() == [] and backend.abort([1, 2]) == 0 and backend.inflight() == 0
    with pytest.raises(ValueError, match="exactly one seed"):
        backend.submit([(1, GenerationRequest(prompt="a", seeds=(1, 2)))], SAMPLING)
    backend.submit([(1, GenerationRequest(prompt="a", seeds=(1,)))], SAMPLING)
    with pytest.raises(ValueError, match="already in flight"):
        backend.submit([(1, GenerationRequest(prompt="b", seeds=(2,)))], SAMPLING)
    backend.abort([1])
    assert backend.inflight() == 0


def test_tags_out_of_order_and_equal_to_generate(backend):
    """More completions than slots, different caps: finishing order follows the caps, not the tags; every
    completion equals ``generate``'s for its prompt and seed (refilled slots included)."""
    caps = [9, 2, 6, 3, 8, 1, 5, 4]
    items = [(1000 + 7 * i, GenerationRequest(prompt=PROMPTS[i % 4], seeds=(50 + i,), max_new_tokens=caps[i]))
             for i in range(8)]
    backend.submit(items, SAMPLING)
    assert backend.inflight() == 8
    got, order = _drain(backend)
    assert sorted(got) == sorted(t for t, _ in items)
    assert order != sorted(order)  # out of order
    assert order.index(1007) < order.index(1000)  # cap 2 (tag 1007) finishes before cap 9 (tag 1000)
    for tag, req in items:
        c, ref = got[tag], _alone(backend, req)
        assert c.token_ids == ref.token_ids, tag
        assert c.logprobs == pytest.approx(ref.logprobs, abs=1e-4)
        assert (c.seed, c.prompt_token_ids, c.finish_reason, c.text) == (ref.seed, ref.prompt_token_ids,
                                                                       ref.finish_reason, ref.text)
        assert c.num_tokens == req.max_new_tokens and c.policy_version == backend.version
    assert backend._stream.prefills >= 2  # slots were refilled (3 slots, 8 completions)


def test_rows_joining_mid_decode(backend):
    """A long prompt joins a batch already decoding a short one (its KV is wider: the running batch is padded),
    then a short one joins (padded itself); each equals its completion generated alone."""
    a = GenerationRequest(prompt=PROMPTS[2], seeds=(7,), max_new_tokens=10)
    b = GenerationRequest(prompt=PROMPTS[3] * 3, seeds=(8,), max_new_tokens=6)
    c = GenerationRequest(prompt=PROMPTS[0], seeds=(9,), max_new_tokens=3)
    backend.submit([(1, GenerationRequest(prompt=PROMPTS[0], seeds=(1,), max_new_tokens=3)), (2, a)], SAMPLING)
    first = backend.poll()
    assert [t for t, _ in first] == [1]
    backend.submit([(3, b)], SAMPLING)
    second = backend.poll()
    backend.submit([(4, c)], SAMPLING)
    got, _ = _drain(backend)
    got.update(dict(second))
    for tag, req in ((2, a), (3, b), (4, c)):
        assert got[tag].token_ids == _alone(backend, req).token_ids, tag
    eng = backend._stream
    assert eng.rows == [] and eng.cache is None  # everything left the batch


def test_padding_columns_are_trimmed(backend):
    """After the long prompt leaves, the leading columns only it used are dropped from the cache."""
    long = GenerationRequest(prompt=PROMPTS[3] * 4, seeds=(3,), max_new_tokens=1)
    short = GenerationRequest(prompt=PROMPTS[2], seeds=(4,), max_new_tokens=8)
    backend.submit([(1, long), (2, short)], SAMPLING)
    assert [t for t, _ in backend.poll()] == [1]
    eng = backend._stream
    width = eng.mask.shape[1]
    assert width == len(eng.rows[0].prompt_ids) + 1 and bool(eng.mask.all())  # prompt + its first token
    assert eng.cache.layers[0].keys.shape[-2] == width
    got, _ = _drain(backend)
    assert got[2].token_ids == _alone(backend, short).token_ids


def test_abort_returns_tokens_and_drops(backend):
    items = [(i, GenerationRequest(prompt=PROMPTS[i % 4], seeds=(i,), max_new_tokens=m))
             for i, m in enumerate([2, 9, 9, 9])]
    backend.submit(items, SAMPLING)  # 3 slots: tag 3 waits in the queue
    first = backend.poll()
    assert [t for t, _ in first] == [0]
    assert backend.abort([1, 3, 99]) == 2  # tag 1 had 2 tokens, tag 3 none (queued), 99 unknown
    assert backend.inflight() == 1
    got, _ = _drain(backend)
    assert list(got) == [2] and got[2].token_ids == _alone(backend, items[2][1]).token_ids
    assert backend.abort([2]) == 0  # already returned


def test_abort_mid_batch_moves_rows_in_place(backend):
    """Aborting the first of three running rows moves the last row into its slot in the cache's buffers (written in
    place, as outside ``poll``: abort runs outside inference mode); the others still equal ``generate``'s."""
    items = [(i, GenerationRequest(prompt=PROMPTS[i], seeds=(i,), max_new_tokens=9)) for i in range(3)]
    backend.submit(items, SAMPLING)
    eng = backend._stream
    eng._step()  # admit all three and decode one step, none finished
    assert len(eng.rows) == 3 and not eng.done
    assert backend.abort([0]) == 1
    assert [s.request for s in eng.rows] == [2, 1]  # the last row filled the freed slot
    got, _ = _drain(backend)
    for tag in (1, 2):
        assert got[tag].token_ids == _alone(backend, items[tag][1]).token_ids, tag


def test_stop_strings_and_zero_cap(backend):
    greedy = SamplingConfig(temperature=0.0, max_new_tokens=8)
    req = GenerationRequest(prompt=PROMPTS[1], seeds=(0,))
    full = _alone(backend, req, greedy)
    stop = full.text[1:3]
    sampling = SamplingConfig(temperature=0.0, max_new_tokens=8, stop=(stop,))
    backend.submit([(1, req), (2, GenerationRequest(prompt=PROMPTS[0], seeds=(1,), max_new_tokens=0))], sampling)
    got, _ = _drain(backend)
    ref = _alone(backend, req, sampling)
    assert got[1].finish_reason == "stop" and got[1].text == ref.text and got[1].token_ids == ref.token_ids
    assert got[2].num_tokens == 0 and got[2].finish_reason == "length"


def _state(backend):
    """The backend's own weights, as a trainer would push them (copies)."""
    return {k: v.clone() for k, v in backend.model.state_dict().items()}


def test_weights_update_mid_stream_is_reported(backend):
    """Weights loaded between polls reach in-flight completions at their next forward; the version that started the
    completion is reported."""
    state = _state(backend)
    req = GenerationRequest(prompt=PROMPTS[0], seeds=(5,), max_new_tokens=6)
    backend.submit([(1, GenerationRequest(prompt=PROMPTS[1], seeds=(6,), max_new_tokens=2)), (2, req)], SAMPLING)
    assert [t for t, _ in backend.poll()] == [1]
    v0 = backend.version
    backend.update_weights(state, v0 + 1)
    got, _ = _drain(backend)
    assert got[2].policy_version == v0  # the weights that started it (its later tokens came from v0 + 1)
    assert got[2].token_ids == _alone(backend, req).token_ids  # the same weights were loaded


def test_check_backend_passes(backend):
    report = check_backend(backend, state_dict=_state(backend), prompts=PROMPTS[:2], max_new_tokens=6)
    assert report["seeded"] is True and report["streamed"] == 4  # the streaming protocol checks ran
