"""Guarantee: every public entry point checks its arguments before launching anything.
Any input gives a result or a MetraleError — never another exception — and no kernel ever
sees an out-of-range index (HostBackend bounds-checks every access a twin makes, so an
out-of-range index that slipped through would surface as a KernelError from a twin)."""
import json

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from metrale import CacheConfig, KernelError, MetraleError
from metrale.engine import SamplingParams
from metrale.formats import ModelMetadata
from metrale.gpu_runtime import DevicePtr
from tests.model.common import load

MODEL = load("qwen3", kv_blocks=32, block_size=4, max_batch=4)
S = MODEL.default_stream()
SETTINGS = settings(max_examples=150, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])

anything = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70),
                     st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=5),
                     st.lists(st.integers(-300, 300), max_size=40),
                     st.lists(st.floats(), max_size=3))


def call(fn, *args):
    """Run fn; a MetraleError is an accepted outcome, anything else fails the test."""
    try:
        return fn(*args)
    except KernelError as e:   # a twin saw a bad index: the argument check missed it
        raise AssertionError(f"reached a kernel with bad input: {e}") from e
    except MetraleError:
        return None


def fresh_state():
    MODEL.reclaim_prefix_blocks(MODEL.num_total_blocks())
    assert MODEL.num_free_blocks() == MODEL.num_total_blocks()


@SETTINGS
@given(tokens=anything, prefix=st.integers(0, 30))
def test_prefill_and_decode_token_lists(tokens, prefix):
    seq = MODEL.alloc_sequence()
    try:
        call(MODEL.prefill, tokens, seq, S)
        if seq.seq_len:
            call(MODEL.decode, tokens[0] if isinstance(tokens, list) and tokens else tokens, seq, S)
            call(MODEL.decode_verify, tokens, seq, S)
    finally:
        MODEL.free_sequence(seq)
    fresh_state()


@SETTINGS
@given(start=st.integers(-5, 40), length=st.integers(-5, 40), last=st.booleans(),
       n=st.integers(0, 30))
def test_prefill_chunk_ranges(start, length, last, n):
    seq = MODEL.alloc_sequence()
    try:
        call(MODEL.prefill_chunk, list(range(4, 4 + n)), seq, start, length, last, S)
    finally:
        MODEL.free_sequence(seq)
    fresh_state()


@SETTINGS
@given(offset=st.integers(-10**6, 10**6), nbytes=st.integers(0, 4096), n=anything)
def test_logits_pointers_and_sizes(offset, nbytes, n):
    base = int(MODEL.logits_buffer_ptr())
    ptr = DevicePtr(max(0, base + offset))
    call(MODEL.copy_logits_to_host, ptr, bytearray(nbytes))
    call(MODEL.argmax_on_device, ptr, S)
    call(MODEL.argmax_batch, ptr, n, S)


@SETTINGS
@given(tokens=st.lists(st.integers(-2, 300), min_size=1, max_size=6),
       lens=st.lists(st.integers(1, 12), min_size=1, max_size=6))
def test_decode_batch(tokens, lens):
    seqs = [MODEL.alloc_sequence() for _ in lens]
    try:
        for seq, L in zip(seqs, lens):
            call(MODEL.prefill, list(range(4, 4 + L)), seq, S)
        call(MODEL.decode_batch, tokens, seqs, S)
        call(MODEL.rollback, seqs[0], tokens[0])
    finally:
        for seq in seqs:
            MODEL.free_sequence(seq)
    fresh_state()


@SETTINGS
@given(kind=anything, max_seq_len=anything, block_size=anything)
def test_cache_config(kind, max_seq_len, block_size):
    call(CacheConfig, kind, max_seq_len, block_size)


@SETTINGS
@given(fields=st.dictionaries(st.sampled_from(["temperature", "top_k", "top_p", "min_p",
                                               "repetition_penalty", "seed"]), anything))
def test_sampling_params(fields):
    call(lambda: SamplingParams(**fields))


_BASE = json.loads((__import__("pathlib").Path(__file__).parents[1] / "fixtures" / "qwen3" /
                    "config.json").read_text())


@SETTINGS
@given(key=st.sampled_from(sorted(_BASE)), value=anything, drop=st.booleans())
def test_config_json_values(key, value, drop):
    cfg = dict(_BASE)
    if drop:
        cfg.pop(key)
    else:
        cfg[key] = value
    call(ModelMetadata.from_config, cfg)


@SETTINGS
@given(raw=st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=4),
                        lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=12), c,
                                                                            max_size=4),
                        max_leaves=12))
def test_config_json_shapes(raw):
    call(ModelMetadata.from_config, raw if isinstance(raw, dict) else {"model_type": raw})


def test_fuzzed_model_is_still_exact():
    fresh_state()
    seq = MODEL.alloc_sequence()
    p = MODEL.prefill([5, 6, 7], seq, S)
    row = np.empty(MODEL.vocab_size(), np.uint16)
    MODEL.copy_logits_to_host(p, row.view(np.uint8))
    assert not np.isnan(row.view(np.uint16)).any()
    MODEL.free_sequence(seq)
