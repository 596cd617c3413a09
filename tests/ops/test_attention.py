"""attention family: prefill and decode twins against plain float64 softmax attention over
K/V gathered from a paged cache with shuffled physical blocks; batch invariance (a sequence's
result is bit-identical alone or in a batch); chunked prefill; sliding windows; split-K decode
over long contexts; bad arguments; the decode twins in HostBackend's native library against
their numpy path; GPU kernels against the twins."""
import ctypes
import ctypes.util
import math
import re

import numpy as np
import pytest

from metrale.errors import InvalidArgument, KernelError
from metrale.gpu_runtime import NULL, HostBackend, native
from metrale.ops import attention as att
from metrale.ops.bf16 import bf16_to_f32, f32_to_bf16
from tests.conftest import assert_close, real
from tests.helpers import Buffers, _variant


class Case:
    """A ragged batch: per-sequence query lengths and cached lengths (incl. the queries),
    a paged cache whose physical blocks are a random permutation, unused table entries -1."""

    def __init__(self, rng, q_lens, kv_lens, h, kv, d, bs, extra_blocks=3, spare_cols=1):
        assert all(q <= k for q, k in zip(q_lens, kv_lens))
        self.q_lens, self.kv_lens = list(q_lens), list(kv_lens)
        self.h, self.kv, self.d, self.bs = h, kv, d, bs
        self.n_seqs, self.n_tokens = len(q_lens), max(sum(q_lens), 1)
        nblk = [max(-(-k // bs), 0) for k in kv_lens]
        self.num_blocks = sum(nblk) + extra_blocks
        self.max_blocks = max(max(nblk), 1) + spare_cols
        perm = rng.permutation(self.num_blocks).astype(np.int32)
        self.tables = np.full((self.n_seqs, self.max_blocks), -1, np.int32)
        i = 0
        for s, n in enumerate(nblk):
            self.tables[s, :n] = perm[i:i + n]
            i += n
        shape = (self.num_blocks, bs, kv, d)
        self.k = f32_to_bf16(rng.standard_normal(shape).astype(np.float32))
        self.v = f32_to_bf16(rng.standard_normal(shape).astype(np.float32))
        self.qkv = f32_to_bf16(
            rng.standard_normal((self.n_tokens, (h + 2 * kv) * d)).astype(np.float32))
        self.qo = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)

    def subset(self, s):
        """Sequence s alone: same cache, its own table row, its own query rows."""
        c = object.__new__(Case)
        c.__dict__.update(self.__dict__)
        c.q_lens, c.kv_lens = [self.q_lens[s]], [self.kv_lens[s]]
        c.n_seqs = 1
        c.n_tokens = max(self.q_lens[s], 1)
        c.tables = self.tables[s:s + 1].copy()
        c.qkv = self.qkv[self.qo[s]:self.qo[s + 1]].copy() if self.q_lens[s] else \
            self.qkv[s:s + 1].copy()
        c.qo = np.array([0, self.q_lens[s]], np.int32)
        return c

    def gathered(self, s):
        """float64 K, V [kv_len, KV, D] of sequence s in logical order."""
        n = self.kv_lens[s]
        blocks = self.tables[s, :-(-n // self.bs)]
        k = bf16_to_f32(self.k[blocks]).reshape(-1, self.kv, self.d)[:n]
        v = bf16_to_f32(self.v[blocks]).reshape(-1, self.kv, self.d)[:n]
        return k.astype(np.float64), v.astype(np.float64)


def anti_aligned(c, rng, a=32.0):
    """Case c with every query +a and every key -a plus 0..3 BF16 ulps of a (exact in BF16):
    each score (q . k * scale * log2 e) lies thousands below zero with a spread of a few
    units, so an online max started at 0 instead of -inf makes every exp2 underflow, in
    float32 and in float64 alike."""
    c.qkv[:] = f32_to_bf16(np.full(c.qkv.shape, a, np.float32))
    ulp = a / 128
    c.k = f32_to_bf16((-a + ulp * rng.integers(0, 4, c.k.shape)).astype(np.float32))
    return c


def ref_attention(q, k, v, qpos, h, kv, scale, window):
    """Plain float64 softmax attention. q [R, H, D]; k, v [T, KV, D]; qpos [R]."""
    g = h // kv
    out = np.zeros(q.shape)
    for r in range(q.shape[0]):
        keys = np.arange(k.shape[0])
        ok = keys <= qpos[r]
        if window:
            ok &= keys > qpos[r] - window
        for head in range(h):
            kk, vv = k[ok, head // g], v[ok, head // g]
            sc = kk @ q[r, head] * scale
            p = np.exp(sc - sc.max())
            out[r, head] = (p / p.sum()) @ vv
    return out


def ref_prefill(c, scale, window=0):
    out = np.zeros((c.n_tokens, c.h, c.d))
    for s in range(c.n_seqs):
        ql, kl = c.q_lens[s], c.kv_lens[s]
        if ql == 0:
            continue
        q = bf16_to_f32(c.qkv[c.qo[s]:c.qo[s + 1], :c.h * c.d]).astype(np.float64)
        k, v = c.gathered(s)
        out[c.qo[s]:c.qo[s + 1]] = ref_attention(q.reshape(ql, c.h, c.d), k, v,
                                                 np.arange(kl - ql, kl), c.h, c.kv, scale,
                                                 window)
    return out.reshape(c.n_tokens, -1)


def ref_decode(c, scale, window=0):
    out = np.zeros((c.n_seqs, c.h, c.d))
    for s in range(c.n_seqs):
        kl = c.kv_lens[s]
        if kl <= 0:
            continue
        q = bf16_to_f32(c.qkv[s, :c.h * c.d]).astype(np.float64).reshape(1, c.h, c.d)
        k, v = c.gathered(s)
        out[s] = ref_attention(q, k, v, [kl - 1], c.h, c.kv, scale, window)[0]
    return out.reshape(c.n_seqs, -1)


def run_prefill(backend, c, scale, window=0, max_q_len=None):
    with Buffers(backend) as b:
        op = b.empty((c.n_tokens, c.h * c.d), np.uint16)
        args = [b.put(c.qkv), b.put(c.k), b.put(c.v), b.put(c.tables),
                b.put(np.asarray(c.kv_lens, np.int32)), b.put(c.qo)]
        mq = max_q_len or max(max(c.q_lens), 1)
        att.prefill_attention(backend, backend.default_stream(), op, *args, c.n_seqs,
                              c.n_tokens, mq, c.h, c.kv, c.d, c.bs, c.max_blocks, scale,
                              window)
        return b.get(op, (c.n_tokens, c.h * c.d), np.uint16)


def run_decode(backend, c, scale, window=0, max_splits=None, null_workspace=False):
    ms = max_splits or att.decode_max_splits(max(max(c.kv_lens), 1))
    with Buffers(backend) as b:
        op = b.put(np.full((c.n_seqs, c.h * c.d), 0x7FC0, np.uint16))  # NaN until written
        ws = NULL if null_workspace else b.empty(
            (att.decode_workspace_bytes(c.n_seqs, c.h, c.d, ms),), np.uint8)
        att.decode_attention(backend, backend.default_stream(), op, b.put(c.qkv), b.put(c.k),
                             b.put(c.v), b.put(c.tables), b.put(np.asarray(c.kv_lens, np.int32)),
                             c.n_seqs, c.h, c.kv, c.d, c.bs, c.max_blocks, scale, ws, ms,
                             window)
        return b.get(op, (c.n_seqs, c.h * c.d), np.uint16)


HEADS = [(8, 2, 64, 16), (4, 1, 128, 16), (2, 2, 32, 16), (4, 2, 96, 7), (2, 1, 6, 3)]
PREFILL_LAYOUTS = {
    "full-1": ([1], [1]),
    "full-7": ([7], [7]),
    "full-19": ([19], [19]),
    "full-111": ([111], [111]),
    "ragged-chunked": ([7, 1, 19, 111, 3], [7 + 40, 1 + 16, 19, 111 + 5, 3 + 300]),
}


# ------------------------------------------------------------------------------------------
# prefill
# ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("layout", list(PREFILL_LAYOUTS))
@pytest.mark.parametrize("h,kv,d,bs", HEADS)
def test_prefill_twin_matches_float64(host, rng, layout, h, kv, d, bs):
    q_lens, kv_lens = PREFILL_LAYOUTS[layout]
    c = Case(rng, q_lens, kv_lens, h, kv, d, bs)
    scale = 1 / math.sqrt(d)
    got = run_prefill(host, c, scale)
    assert_close(bf16_to_f32(got), ref_prefill(c, scale), "twin_bf16")


@pytest.mark.parametrize("window", [1, 5, 16, 40])
def test_prefill_sliding_window(host, rng, window):
    c = Case(rng, [19, 111, 4], [19 + 30, 111, 4 + 7], 4, 2, 64, 16)
    want = ref_prefill(c, 0.125, window)
    for s in range(c.n_seqs):  # blocks wholly before every row's window may be evicted
        lo = max(0, c.kv_lens[s] - c.q_lens[s] - window + 1)
        c.tables[s, :lo // c.bs] = -1
    got = run_prefill(host, c, 0.125, window)
    assert_close(bf16_to_f32(got), want, "twin_bf16")


def test_prefill_batch_invariant(host, rng):
    c = Case(rng, [7, 19, 1, 111], [7 + 33, 19, 1 + 200, 111 + 1], 8, 2, 64, 16)
    batch = run_prefill(host, c, 0.125)
    for s in range(c.n_seqs):
        alone = run_prefill(host, c.subset(s), 0.125)
        assert np.array_equal(batch[c.qo[s]:c.qo[s + 1]], alone), f"sequence {s}"
    # a larger max_q_len (a bigger grid) changes nothing either
    assert np.array_equal(run_prefill(host, c, 0.125, max_q_len=c.n_tokens), batch)


def test_chunked_prefill_matches_whole(host, rng):
    """A 111-token prompt prefilled in chunks of 40 + 50 + 21 against its cached prefix."""
    whole = Case(rng, [111], [111], 4, 1, 64, 16)
    want = ref_prefill(whole, 0.125)
    got = []
    start = 0
    for n in (40, 50, 21):
        c = whole.subset(0)
        c.q_lens, c.kv_lens = [n], [start + n]
        c.qkv = whole.qkv[start:start + n].copy()
        c.n_tokens = n
        c.qo = np.array([0, n], np.int32)
        got.append(run_prefill(host, c, 0.125))
        start += n
    got = np.concatenate(got)
    assert_close(bf16_to_f32(got), want, "twin_bf16")
    assert_close(bf16_to_f32(got), bf16_to_f32(run_prefill(host, whole, 0.125)), "twin_bf16")


@pytest.mark.parametrize("h,kv,d,bs", [(4, 2, 64, 16), (2, 1, 6, 3)])
def test_prefill_twin_all_scores_far_below_zero(host, rng, h, kv, d, bs):
    """Queries anti-aligned with every key (scores ~ -1e3 to -1e4): the softmax is taken
    against the row's own max, never against 0 (row 0 of a sequence sees one key only)."""
    c = anti_aligned(Case(rng, [1, 7, 19], [1, 7 + 40, 19 + 100], h, kv, d, bs), rng)
    scale = 1 / math.sqrt(d)
    want = ref_prefill(c, scale)
    assert np.abs(want).max() > 0.5
    assert_close(bf16_to_f32(run_prefill(host, c, scale)), want, "twin_bf16")


def test_prefill_empty_sequence_in_batch(host, rng):
    c = Case(rng, [5, 0, 3], [5, 9, 3 + 2], 2, 1, 32, 16)
    got = run_prefill(host, c, 0.2)
    assert_close(bf16_to_f32(got), ref_prefill(c, 0.2), "twin_bf16")


def test_prefill_inconsistent_lengths_raise_in_twin(host, rng):
    c = Case(rng, [5], [5], 2, 1, 32, 16)
    c.kv_lens = [4]  # fewer cached tokens than queries
    with pytest.raises(KernelError, match="inconsistent"):
        run_prefill(host, c, 0.2)
    c = Case(rng, [5], [5], 2, 1, 32, 16, spare_cols=0)
    c.kv_lens = [17]  # past the table's capacity
    with pytest.raises(KernelError, match="inconsistent"):
        run_prefill(host, c, 0.2)


# ------------------------------------------------------------------------------------------
# decode
# ------------------------------------------------------------------------------------------
def native_backend() -> HostBackend:
    """HostBackend with its native library (the decode twins in native/attention_f32.cpp)."""
    be = HostBackend()
    if be.native is None:
        pytest.skip("no C++ compiler: the native library cannot be built")
    return be


@pytest.fixture(params=["native", "numpy"])
def decode_host(request):
    """HostBackend running the decode twins natively, or in numpy (native=False)."""
    return native_backend() if request.param == "native" else HostBackend(native=False)


@pytest.mark.parametrize("h,kv,d,bs", HEADS)
def test_decode_twin_matches_float64(decode_host, rng, h, kv, d, bs):
    c = Case(rng, [1] * 5, [1, 7, 19, 111, 600], h, kv, d, bs)
    scale = 1 / math.sqrt(d)
    got = run_decode(decode_host, c, scale)
    assert_close(bf16_to_f32(got), ref_decode(c, scale), "twin_bf16")


@pytest.mark.parametrize("h,kv", [(2, 1), (4, 2)])
def test_decode_long_context_split_k(decode_host, rng, h, kv):
    c = Case(rng, [1, 1], [4097, 256], h, kv, 64, 16)
    got = run_decode(decode_host, c, 0.125, max_splits=att.decode_max_splits(5000))
    assert_close(bf16_to_f32(got), ref_decode(c, 0.125), "twin_bf16")


@pytest.mark.parametrize("window", [1, 100, 256, 257, 1000])
def test_decode_sliding_window(decode_host, rng, window):
    c = Case(rng, [1] * 4, [1, 255, 700, 1500], 4, 1, 64, 16)
    want = ref_decode(c, 0.125, window)
    for s in range(c.n_seqs):  # blocks wholly before the window may be evicted
        c.tables[s, :max(0, c.kv_lens[s] - window) // c.bs] = -1
    got = run_decode(decode_host, c, 0.125, window)
    assert_close(bf16_to_f32(got), want, "twin_bf16")


def test_decode_batch_invariant(decode_host, rng):
    c = Case(rng, [1] * 5, [1, 19, 111, 257, 1025], 8, 2, 64, 16)
    batch = run_decode(decode_host, c, 0.125)
    for s in range(c.n_seqs):
        alone = run_decode(decode_host, c.subset(s), 0.125,
                           max_splits=att.decode_max_splits(1025))
        assert np.array_equal(batch[s], alone[0]), f"sequence {s}"


def test_decode_zero_length_rows_and_null_workspace(decode_host, rng):
    c = Case(rng, [1, 1, 1], [5, 1, 200], 4, 2, 32, 16)
    c.kv_lens[1] = 0
    got = run_decode(decode_host, c, 0.3, max_splits=1, null_workspace=True)
    assert not got[1].any()  # padding row: zeros
    want = ref_decode(c, 0.3)
    assert_close(bf16_to_f32(got[[0, 2]]), want[[0, 2]], "twin_bf16")


def test_decode_twin_all_scores_far_below_zero(decode_host, rng):
    """As the prefill test, on both decode twins: one split (1, 19 keys) and two or three
    splits combined (300, 600 keys), whose per-split maxima are all far below zero."""
    c = anti_aligned(Case(rng, [1] * 4, [1, 19, 300, 600], 4, 2, 64, 16), rng)
    want = ref_decode(c, 0.125)
    assert np.abs(want).max() > 0.5
    assert_close(bf16_to_f32(run_decode(decode_host, c, 0.125)), want, "twin_bf16")


def test_decode_capacity_exceeded_raises_in_twin(decode_host, rng):
    c = Case(rng, [1], [600], 2, 1, 32, 16)
    with pytest.raises(KernelError, match="capacity"):
        run_decode(decode_host, c, 0.2, max_splits=2)  # 600 > 2 * 256


@pytest.mark.parametrize("run", [run_decode, run_prefill])
def test_a_bad_block_table_entry_raises_in_twin(decode_host, rng, run):
    # a -1 inside the sequence names the entry; a block past the cache's allocation fails
    # the bounds-checked read instead of reading a neighbour
    c = Case(rng, [5], [40], 2, 1, 32, 16)
    c.tables[0, 1] = -1
    with pytest.raises(KernelError, match="block table entry 1 is -1"):
        run(decode_host, c, 0.2)
    c = Case(rng, [5], [40], 2, 1, 32, 16)
    c.tables[0, 2] = c.num_blocks + 3
    with pytest.raises(KernelError, match="runs past the end of its allocation"):
        run(decode_host, c, 0.2)


def test_decode_sizes():
    assert att.decode_max_splits(1) == 1
    assert att.decode_max_splits(256) == 1
    assert att.decode_max_splits(257) == 2
    assert att.decode_workspace_bytes(3, 4, 64, 5) == 3 * 4 * 5 * 66 * 4
    with pytest.raises(InvalidArgument):
        att.decode_max_splits(0)


# ------------------------------------------------------------------------------------------
# decode in HostBackend's native library (native/attention_f32.cpp) against the numpy path
# ------------------------------------------------------------------------------------------
# GQA groups 1, 3, 8 and 2; head_dim 64, 128 and ones that are not multiples of 8 (6, 250:
# zero-padded lanes) or of 64 (96); block sizes 16, 1 and odd ones
NATIVE_HEADS = [(8, 8, 64, 16), (9, 3, 64, 16), (8, 1, 128, 16), (16, 2, 128, 1),
                (6, 3, 6, 16), (4, 2, 96, 7), (3, 1, 250, 5)]


def windowed(c, window):
    """Case c with every block wholly before its sequence's window evicted (-1)."""
    for s in range(c.n_seqs):
        if window:
            c.tables[s, :max(0, c.kv_lens[s] - window) // c.bs] = -1
    return c


@pytest.mark.parametrize("window", [0, 300])
@pytest.mark.parametrize("h,kv,d,bs", NATIVE_HEADS)
def test_native_decode_matches_numpy(rng, h, kv, d, bs, window):
    c = Case(rng, [1] * 7, [1, 7, 19, 111, 1, 600, 4097], h, kv, d, bs)
    c.kv_lens[4] = 0   # a padding row between live ones
    windowed(c, window)
    scale = 1 / math.sqrt(d)
    ms = att.decode_max_splits(8192)
    got = run_decode(native_backend(), c, scale, window, max_splits=ms)
    want = run_decode(HostBackend(native=False), c, scale, window, max_splits=ms)
    assert not got[4].any()
    # another fp32 summation order than numpy's BLAS: the kernel-vs-twin bound
    assert_close(bf16_to_f32(got), bf16_to_f32(want), "gpu_vs_twin_bf16")
    assert_close(bf16_to_f32(got), ref_decode(c, scale, window), "twin_bf16")


@pytest.mark.parametrize("spread", [0.0, 0.5, 40.0])
def test_native_decode_very_negative_scores(rng, spread):
    """Every score far below zero (q = 8, k = -8 + noise: q . k * scale * log2(e) ~ -740),
    with `spread` from none (all equal) to a range where exp2 underflows to 0 or subnormals
    for most positions (exp2r's subnormal and zero range)."""
    c = Case(rng, [1] * 3, [19, 300, 1000], 4, 2, 64, 16)
    c.qkv[:] = f32_to_bf16(np.full(c.qkv.shape, 8, np.float32))
    c.k = f32_to_bf16((-8 + spread * rng.standard_normal(c.k.shape)).astype(np.float32))
    got = run_decode(native_backend(), c, 0.125)
    assert_close(bf16_to_f32(got), bf16_to_f32(run_decode(HostBackend(native=False), c, 0.125)),
                 "gpu_vs_twin_bf16")
    assert_close(bf16_to_f32(got), ref_decode(c, 0.125), "twin_bf16")


def test_native_decode_batch_grid_and_thread_invariant(rng):
    """A sequence's bits alone, in a batch, with a larger grid (max_splits) and on one or four
    threads (the library's tasks go to whichever thread is free)."""
    be = native_backend()
    c = Case(rng, [1] * 6, [1, 19, 111, 257, 1025, 4097], 9, 3, 64, 16)
    ms = att.decode_max_splits(4097)
    lib = be.native._lib
    for window in (0, 300):
        windowed(c, window)
        batch = run_decode(be, c, 0.125, window, max_splits=ms)
        for s in range(c.n_seqs):
            alone = run_decode(be, c.subset(s), 0.125, window, max_splits=ms)
            assert np.array_equal(batch[s], alone[0]), f"sequence {s}, window {window}"
        assert np.array_equal(run_decode(be, c, 0.125, window, max_splits=4 * ms), batch)
        try:
            for threads in (1, 4):
                lib.md_set_threads(threads)
                assert np.array_equal(run_decode(be, c, 0.125, window, max_splits=ms), batch)
        finally:
            lib.md_set_threads(native.usable_cpus())


@pytest.mark.parametrize("h,kv,d", [(6, 2, 96), (8, 1, 64), (4, 4, 128), (8, 2, 64),
                                    (5, 1, 6)])
def test_native_decode_portable_build_same_bits(rng, h, kv, d):
    """The scalar path (-DMD_PORTABLE: what CPUs without AVX2 and FMA run) gives the 8-lane
    path's bits: the same FMAs, sums and exp2r in the same order (head tiles of 3, 2
    and 1 register-tiled; a head_dim not a multiple of 8 through the widened rows)."""
    be = native_backend()
    c = Case(rng, [1] * 5, [1, 7, 111, 600, 4097], h, kv, d, 16)
    ms = att.decode_max_splits(4097)
    want = [run_decode(be, c, 0.125, w, max_splits=ms) for w in (0, 300)]
    be.native = _variant("portable")
    got = [run_decode(be, c, 0.125, w, max_splits=ms) for w in (0, 300)]
    assert np.array_equal(got, want)


def test_native_combine_is_numpy_arithmetic(rng):
    """The combine launch alone over one workspace: numpy's float32 steps in numpy's order,
    so the same bits wherever numpy's float32 exp2 is libm's exp2f (checked on the weights
    used; else within the kernel-vs-twin bound)."""
    ns, h, d, mb, bs = 4, 3, 40, 128, 16
    kv_lens = np.array([1000, 0, 1300, 200], np.int32)   # 4, -, 6 and 1 splits
    ms = att.decode_max_splits(1300)
    acc = rng.standard_normal((ns, h, ms, d)).astype(np.float32)
    ml = np.stack([rng.uniform(-60, 20, (ns, h, ms)), rng.uniform(0.5, 300, (ns, h, ms))],
                  -1).astype(np.float32)
    ws_bytes = np.concatenate([acc.ravel(), ml.ravel()])
    outs = []
    for be in (native_backend(), HostBackend(native=False)):
        with Buffers(be) as b:
            out = b.put(np.full((ns, h * d), 0x7FC0, np.uint16))
            args = (out, b.put(ws_bytes), b.put(kv_lens), np.int32(ns), np.int32(h),
                    np.int32(d), np.int32(bs), np.int32(mb), np.int32(ms), np.int32(0), NULL)
            be.launch(be.kernel("attention", "decode_attention_combine"), (ns, h), (128,), 0,
                      0, args)
            outs.append(b.get(out, (ns, h * d), np.uint16))
    got, want = outs
    assert np.array_equal(got[[1, 3]], np.full((2, h * d), 0x7FC0)), "left alone"
    libm = ctypes.CDLL(ctypes.util.find_library("m"))
    libm.exp2f.restype, libm.exp2f.argtypes = ctypes.c_float, [ctypes.c_float]
    x = (ml[..., 0] - ml[..., 0].max(axis=-1, keepdims=True)).ravel()
    if all(np.float32(libm.exp2f(float(v))) == np.exp2(v) for v in x):
        assert np.array_equal(got, want)
    else:
        assert_close(bf16_to_f32(got), bf16_to_f32(want), "gpu_vs_twin_bf16")


@pytest.mark.parametrize("bad", ["capacity", "negative entry", "past the cache", "window"])
def test_native_decode_raises_the_twins_errors(rng, bad):
    """With the native library on, a bad second sequence raises the numpy twin's error with
    its message (pointers aside) and nothing of the first is written natively."""
    c = Case(rng, [1, 1], [40, 40], 2, 1, 32, 16, spare_cols=4)
    ms, window = 2, 0
    if bad == "capacity":
        c.kv_lens[1] = 600   # > max_splits * 256
    elif bad == "negative entry":
        c.tables[1, 1] = -1
    elif bad == "past the cache":
        c.tables[1, 2] = c.num_blocks + 3
    else:   # an evicted block inside the window
        window = 30
        c.tables[1, 1] = -1
    msgs = []
    for be in (native_backend(), HostBackend(native=False)):
        with pytest.raises(KernelError) as e:
            run_decode(be, c, 0.2, window, max_splits=ms)
        msgs.append(re.sub(r"0x[0-9a-f]+", "0x?", str(e.value)))
    assert msgs[0] == msgs[1]


# ------------------------------------------------------------------------------------------
# bad arguments
# ------------------------------------------------------------------------------------------
def test_bad_arguments_raise_before_launch(host):
    P = 256  # any aligned non-NULL value: nothing is launched

    def prefill(**kw):
        a = dict(n_seqs=2, n_tokens=10, max_q_len=8, num_heads=8, num_kv_heads=2,
                 head_dim=64, block_size=16, max_blocks_per_seq=4, scale=0.125,
                 sliding_window=0)
        a.update(kw)
        att.prefill_attention(host, 0, a.pop("out", P), P, P, P, P, P, P, **a)

    def decode(**kw):
        a = dict(n_seqs=2, num_heads=8, num_kv_heads=2, head_dim=64, block_size=16,
                 max_blocks_per_seq=4, scale=0.125, workspace_ptr=P, max_splits=2,
                 sliding_window=0)
        a.update(kw)
        att.decode_attention(host, 0, a.pop("out", P), P, P, P, P, P, **a)

    cases = [({"num_kv_heads": 3}, "multiple"), ({"head_dim": 65}, "head_dim"),
             ({"head_dim": 258}, "head_dim"), ({"num_heads": 0}, "num_heads"),
             ({"n_seqs": 0}, "n_seqs"), ({"block_size": 0}, "block_size"),
             ({"max_blocks_per_seq": 0}, "max_blocks_per_seq"), ({"scale": float("nan")}, "scale"),
             ({"sliding_window": -1}, "sliding_window"), ({"out": NULL}, "NULL"),
             ({"out": P + 2}, "aligned")]
    for kw, msg in cases:
        with pytest.raises(InvalidArgument, match=msg):
            prefill(**kw)
        with pytest.raises(InvalidArgument, match=msg):
            decode(**kw)
    with pytest.raises(InvalidArgument, match="max_q_len"):
        prefill(max_q_len=11)
    with pytest.raises(InvalidArgument, match="max_q_len"):
        prefill(max_q_len=0)
    with pytest.raises(InvalidArgument, match="n_tokens"):
        prefill(n_tokens=0)
    with pytest.raises(InvalidArgument, match="max_splits"):
        decode(max_splits=0)
    with pytest.raises(InvalidArgument, match="workspace"):
        decode(workspace_ptr=NULL)


# ------------------------------------------------------------------------------------------
# GPU
# ------------------------------------------------------------------------------------------
GPU_HEADS = [real(32, 8, 128, 16), real(28, 4, 128, 16), real(16, 8, 128, 16),
             real(32, 32, 64, 16), (8, 1, 128, 32), (12, 1, 64, 16), (4, 2, 256, 16),
             (4, 2, 96, 7), (2, 1, 6, 3)]


@pytest.mark.gpu
@pytest.mark.parametrize("h,kv,d,bs", GPU_HEADS)
def test_gpu_prefill_matches_twin(device, host, rng, h, kv, d, bs):
    c = Case(rng, [7, 1, 19, 111, 40], [7, 1 + 50, 19 + 13, 111, 40 + 300], h, kv, d, bs)
    scale = 1 / math.sqrt(d)
    for window in (0, 37):
        g = run_prefill(device, c, scale, window)
        t = run_prefill(host, c, scale, window)
        assert_close(bf16_to_f32(g), bf16_to_f32(t), "gpu_vs_twin_bf16", f"window {window}")
    # batch invariance on the GPU: bit-identical alone
    g = run_prefill(device, c, scale)
    for s in range(c.n_seqs):
        assert np.array_equal(g[c.qo[s]:c.qo[s + 1]], run_prefill(device, c.subset(s), scale))


@pytest.mark.gpu
@pytest.mark.parametrize("h,kv,d,bs", GPU_HEADS)
def test_gpu_decode_matches_twin(device, host, rng, h, kv, d, bs):
    c = Case(rng, [1] * 6, [1, 7, 19, 111, 257, 4097], h, kv, d, bs)
    scale = 1 / math.sqrt(d)
    ms = att.decode_max_splits(8192)
    for window in (0, 300):
        g = run_decode(device, c, scale, window, max_splits=ms)
        t = run_decode(host, c, scale, window, max_splits=ms)
        assert_close(bf16_to_f32(g), bf16_to_f32(t), "gpu_vs_twin_bf16", f"window {window}")
    g = run_decode(device, c, scale, max_splits=ms)
    for s in range(c.n_seqs):
        assert np.array_equal(g[s], run_decode(device, c.subset(s), scale, max_splits=ms)[0])
    c.kv_lens[1] = 0  # padding row
    assert not run_decode(device, c, scale, max_splits=ms)[1].any()


@pytest.mark.gpu
@pytest.mark.parametrize("h,kv,d,bs", [(4, 2, 64, 16), (2, 1, 6, 3)])
def test_gpu_all_scores_far_below_zero_match_twin(device, host, rng, h, kv, d, bs):
    """Prefill (the tile's online max) and decode (each split's max, the combine's max over
    splits: 300 and 600 keys) with every query anti-aligned with every key."""
    scale = 1 / math.sqrt(d)
    c = anti_aligned(Case(rng, [1, 7, 19], [1, 7 + 40, 19 + 100], h, kv, d, bs), rng)
    assert_close(bf16_to_f32(run_prefill(device, c, scale)),
                 bf16_to_f32(run_prefill(host, c, scale)), "gpu_vs_twin_bf16", "prefill")
    c = anti_aligned(Case(rng, [1] * 4, [1, 19, 300, 600], h, kv, d, bs), rng)
    assert_close(bf16_to_f32(run_decode(device, c, scale)),
                 bf16_to_f32(run_decode(host, c, scale)), "gpu_vs_twin_bf16", "decode")


def test_native_exp2r_within_one_ulp_of_2_to_the_x():
    """The softmax's exp2 (attention_f32.cpp exp2r): within one float32 ulp of 2^x rounded
    once, over the range a score difference takes (subnormal results included); 0 below
    -150, inf from 128, NaN kept; the 8-lane and the one-lane paths alike."""
    lib = native_backend().native._lib
    lib.md_exp2r.restype = None
    lib.md_exp2r.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p]
    rng = np.random.default_rng(7)
    x = np.concatenate([rng.uniform(-160, 130, 200_000), np.arange(-151, 129, 0.25),
                        [0.0, -0.0, 1e-30, -1e-30, -np.inf, np.inf, np.nan, -1e30, 1e30]]
                       ).astype(np.float32)
    out = np.empty_like(x)
    lib.md_exp2r(x.ctypes.data, len(x), out.ctypes.data)
    one = np.empty(1, np.float32)
    for i in (0, 5, len(x) - 3):   # the one-lane path gives the same bits
        lib.md_exp2r(x[i:].ctypes.data, 1, one.ctypes.data)
        assert one.view(np.uint32)[0] == out.view(np.uint32)[i] or np.isnan(out[i])
    with np.errstate(over="ignore"):
        want = np.exp2(x.astype(np.float64)).astype(np.float32)
    fin = np.isfinite(want) & np.isfinite(x)
    ulps = np.abs(out[fin].view(np.int32).astype(np.int64) - want[fin].view(np.int32))
    assert ulps.max() <= 1, x[fin][np.argmax(ulps)]
    assert (ulps > 0).mean() < 0.01
    assert np.isnan(out[np.isnan(x)]).all()
    assert (out[x < -150] == 0).all() and np.isposinf(out[x >= 128]).all()
