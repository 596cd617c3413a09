"""The tensor contract over TransformerModel: goldens, equality with the pointer API, the
position contract, caches (paged and contiguous), hidden states and per-position logits."""
import numpy as np
import pytest

import metrale
from metrale import CacheConfig, InvalidArgument, MetraleError, Unsupported, UnsupportedMedia
from metrale.generative import DecoderGenerativeModel, GenerativeModel, to_numpy
from metrale.gpu_runtime import HostBackend
from tests.model.common import (DECODER_FIXTURES, FAMILY_FIXTURES, FIXTURES,
                                assert_matches_golden, golden, load, logits_rows, rel_err)


def gen(name, **kw):
    return metrale.load_generative(FIXTURES / name, HostBackend(), progress=False, **kw)


@pytest.mark.parametrize("name", DECODER_FIXTURES + FAMILY_FIXTURES)
@pytest.mark.parametrize("kind", ["paged", "contiguous"])
def test_prefill_and_decode_match_golden_and_pointer_api(name, kind):
    g = golden(name)
    ids = g["input_ids"]
    gm = gen(name)
    assert isinstance(gm, GenerativeModel) and gm.supports_decode_all_logits()
    cache = gm.create_kv_cache(CacheConfig(kind=kind, max_seq_len=32))
    emb = gm.embed(ids[:, :10])
    assert emb.shape == (1, 10, gm.metadata().hidden_size) and emb.dtype == np.float32
    first = to_numpy(gm.prefill(emb, cache, range(0, 10)))
    assert first.shape == (1, gm.metadata().vocab_size)
    rows = [first[0]]
    for t in range(10, 24):
        rows.append(to_numpy(gm.decode(gm.embed(ids[:, t:t + 1]), cache))[0])
    assert cache.seq_len() == 24
    assert_matches_golden(np.stack(rows[:-1]), g["logits"][9:23], f"{name} tensor {kind}")
    # the pointer API computes the very same rows
    m = gm.model
    seq = m.alloc_sequence()
    s = m.default_stream()
    p = [logits_rows(m, m.prefill(ids[0, :10].tolist(), seq, s))[0]]
    for t in range(10, 24):
        p.append(logits_rows(m, m.decode(int(ids[0, t]), seq, s))[0])
    if kind == "paged":
        assert np.array_equal(np.stack(p), np.stack(rows))
    else:  # same kernels over a dense buffer: equal up to nothing but layout
        assert np.array_equal(np.stack(p), np.stack(rows))
    cache.free()


@pytest.mark.parametrize("name", ["llama_gqa", "qwen3"])
def test_all_logits_hidden_and_decode_all_logits(name):
    g = golden(name)
    gm = gen(name)
    ids = g["input_ids"]
    with gm.create_kv_cache(CacheConfig(max_seq_len=24)) as cache:
        all_rows = to_numpy(gm.prefill_all_logits(gm.embed(ids), cache, range(0, 24)))
    assert all_rows.shape == (1, 24, gm.metadata().vocab_size)
    assert_matches_golden(all_rows[0], g["logits"], f"{name} prefill_all_logits")
    with gm.create_kv_cache(CacheConfig(max_seq_len=24)) as cache:
        h = to_numpy(gm.prefill_hidden(gm.embed(ids), cache, range(0, 24)))
    assert h.shape == (1, 24, gm.metadata().hidden_size)
    assert rel_err(h[0], g["hidden"]) < 0.03
    with gm.create_kv_cache(CacheConfig(max_seq_len=24)) as cache:
        gm.prefill(gm.embed(ids[:, :8]), cache, range(0, 8))
        rows = to_numpy(gm.decode_all_logits(gm.embed(ids[:, 8:24]), cache))
        assert cache.seq_len() == 24
    assert_matches_golden(rows[0], g["logits"][8:24], f"{name} decode_all_logits")


def test_batch_of_two_in_one_cache():
    g = golden("mistral")
    gm = gen("mistral")
    ids = np.concatenate([g["input_ids"][:, :12], g["input_ids"][:, 12:24]])
    with gm.create_kv_cache(CacheConfig(max_seq_len=16), batch=2) as cache:
        out = to_numpy(gm.prefill(gm.embed(ids), cache, range(0, 12)))
        assert out.shape == (2, gm.metadata().vocab_size)
        nxt = to_numpy(gm.decode(gm.embed(ids[:, :1]), cache))
        assert nxt.shape == (2, gm.metadata().vocab_size)
    assert_matches_golden(out[0], g["logits"][11], "batch row 0")


def test_position_contract_and_overflow():
    gm = gen("llama_gqa")
    ids = golden("llama_gqa")["input_ids"]
    emb = gm.embed(ids[:, :6])
    cache = gm.create_kv_cache(CacheConfig(kind="contiguous", max_seq_len=8))
    with pytest.raises(InvalidArgument, match="covers"):
        gm.prefill(emb, cache, range(0, 5))
    with pytest.raises(InvalidArgument, match="cache length"):
        gm.prefill(emb, cache, range(2, 8))
    gm.prefill(emb, cache, range(0, 6))
    with pytest.raises(InvalidArgument, match="max_seq_len"):
        gm.prefill(gm.embed(ids[:, :3]), cache, range(6, 9))
    assert cache.seq_len() == 6
    cache.popn(2)
    assert cache.seq_len() == 4
    gm.prefill(gm.embed(ids[:, 4:8]), cache, range(4, 8))
    with pytest.raises(InvalidArgument):
        cache.popn(9)
    cache.reset()
    assert cache.seq_len() == 0
    cache.free()
    with pytest.raises(MetraleError):
        gm.prefill(emb, cache, range(0, 6))  # a freed cache


def test_rollback_on_contiguous_recomputes_the_same():
    gm = gen("qwen2")
    ids = golden("qwen2")["input_ids"]
    with gm.create_kv_cache(CacheConfig(kind="contiguous", max_seq_len=24)) as cache:
        gm.prefill(gm.embed(ids[:, :8]), cache, range(0, 8))
        a = to_numpy(gm.decode(gm.embed(ids[:, 8:9]), cache))
        cache.popn(1)
        b = to_numpy(gm.decode(gm.embed(ids[:, 8:9]), cache))
    assert np.array_equal(a, b)


def test_embed_multimodal_default_refuses_images():
    gm = gen("llama_gqa")
    ids = golden("llama_gqa")["input_ids"][:, :4]
    assert np.array_equal(gm.embed_multimodal(ids, []), gm.embed(ids))
    with pytest.raises(UnsupportedMedia, match="1 image"):
        gm.embed_multimodal(ids, [np.zeros((1, 3, 8, 8), np.float32)])


def test_bad_inputs():
    gm = gen("llama_gqa")
    with pytest.raises(InvalidArgument):
        gm.embed(np.array([[0, 999]], np.int32))
    with pytest.raises(InvalidArgument):
        gm.embed(np.array([0, 1], np.int32))
    with gm.create_kv_cache(CacheConfig(max_seq_len=8)) as cache:
        with pytest.raises(InvalidArgument):
            gm.prefill(np.zeros((1, 3, 5), np.float32), cache, range(0, 3))
        with pytest.raises(InvalidArgument):
            gm.decode(np.zeros((1, 2, gm.metadata().hidden_size), np.float32), cache)
    with pytest.raises(InvalidArgument):
        gm.create_kv_cache(CacheConfig(kind="contiguous", max_seq_len=10**6))
    with pytest.raises(InvalidArgument):
        gm.create_kv_cache(CacheConfig(block_size=32))


def test_default_generative_model_methods_are_unsupported():
    class Minimal(GenerativeModel):
        def metadata(self): return None
        @classmethod
        def load(cls, source, device="auto", **o): return cls()
        def create_kv_cache(self, config, batch=1): return None
        def embed(self, tokens): return tokens
        def prefill(self, input, cache, pos): return None
        def decode(self, input, cache): return None
    m = Minimal()
    assert not m.supports_decode_all_logits() and not m.supports_hidden_states()
    for call in (lambda: m.decode_all_logits(None, None), lambda: m.prefill_hidden(None, None, range(1)),
                 lambda: m.prefill_all_logits(None, None, range(1))):
        with pytest.raises(Unsupported):
            call()


def test_contract_load_classmethod_builds_the_decoder_model():
    # `GenerativeModel.load` (the seed's `load`) builds its own TransformerModel, without
    # going through metrale.api; logits equal load_generative's.
    ids = golden("llama_gqa")["input_ids"][:, :8]
    gm = DecoderGenerativeModel.load(FIXTURES / "llama_gqa", HostBackend(), progress=False)
    assert type(gm) is DecoderGenerativeModel
    ref = gen("llama_gqa")
    outs = []
    for m in (gm, ref):
        with m.create_kv_cache() as cache:
            outs.append(to_numpy(m.prefill(m.embed(ids), cache, range(0, 8))))
    np.testing.assert_array_equal(outs[0], outs[1])
    with pytest.raises(Unsupported, match="not a decoder-only"):
        DecoderGenerativeModel.load(FIXTURES / "whisper_tiny", HostBackend(), progress=False)


def test_caches_free_everything():
    be = HostBackend()
    gm = metrale.load_generative(FIXTURES / "llama_gqa", be, progress=False)
    live, free = be.live_bytes(), gm.model.num_free_blocks()
    ids = golden("llama_gqa")["input_ids"]
    for kind in ("paged", "contiguous"):
        with gm.create_kv_cache(CacheConfig(kind=kind, max_seq_len=24)) as cache:
            gm.prefill(gm.embed(ids), cache, range(0, 24))
    assert be.live_bytes() == live and gm.model.num_free_blocks() == free
