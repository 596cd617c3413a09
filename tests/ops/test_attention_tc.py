"""attention_tc family (kernels/attention_tc.cu): the tensor-core prefill attention's twin
against plain float64 softmax attention over a shuffled paged cache; sliding windows with
evicted blocks; chunked prefill == whole prefill and batch invariance, bit for bit; which
kernel `prefill_attention_auto` picks; bad arguments; the kernel against its twin on the
device backends (emu runs it on the CPU) at ragged sizes, real-model shapes on a GPU."""
import math

import numpy as np
import pytest

from metrale.errors import InvalidArgument
from metrale.gpu_runtime import HostBackend
from metrale.ops import attention_tc as tc
from metrale.ops.bf16 import bf16_to_f32
from tests.conftest import assert_close, real
from tests.helpers import Buffers
from tests.ops.test_attention import PREFILL_LAYOUTS, Case, anti_aligned, ref_prefill

# (H, KV, D, block_size): GQA, MQA (G = 12 does not divide the 64-row tile), MHA, every
# tensor-core head dim, odd block sizes.
TC_HEADS = [(8, 2, 64, 16), (4, 1, 128, 16), (2, 2, 32, 16), (4, 2, 96, 7), (4, 2, 16, 3),
            (6, 3, 80, 5), (2, 1, 256, 16), (12, 1, 64, 16)]


def run(backend, c, scale, window=0, launch=tc.prefill_attention_tc, max_q_len=None):
    with Buffers(backend) as b:
        op = b.put(np.full((c.n_tokens, c.h * c.d), 0x7FC0, np.uint16))  # NaN until written
        args = [b.put(c.qkv), b.put(c.k), b.put(c.v), b.put(c.tables),
                b.put(np.asarray(c.kv_lens, np.int32)), b.put(c.qo)]
        mq = max_q_len or max(max(c.q_lens), 1)
        launch(backend, backend.default_stream(), op, *args, c.n_seqs, c.n_tokens, mq, c.h,
               c.kv, c.d, c.bs, c.max_blocks, scale, window)
        return b.get(op, (c.n_tokens, c.h * c.d), np.uint16)


def chunk(whole, start, n):
    """Rows start .. start+n-1 of a one-sequence case, as one chunk against its prefix."""
    c = whole.subset(0)
    c.q_lens, c.kv_lens = [n], [start + n]
    c.qkv = whole.qkv[start:start + n].copy()
    c.n_tokens = n
    c.qo = np.array([0, n], np.int32)
    return c


def chunked(backend, whole, sizes, scale, window=0):
    out, start = [], 0
    for n in sizes:
        out.append(run(backend, chunk(whole, start, n), scale, window))
        start += n
    return np.concatenate(out)


# ------------------------------------------------------------------------------------------
# twin (CPU)
# ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("layout", list(PREFILL_LAYOUTS))
@pytest.mark.parametrize("h,kv,d,bs", TC_HEADS)
def test_twin_matches_float64(host, rng, layout, h, kv, d, bs):
    # the BF16 P moves results by ~2^-9 relative per weight; measured <= 0.28 of twin_bf16
    q_lens, kv_lens = PREFILL_LAYOUTS[layout]
    c = Case(rng, q_lens, kv_lens, h, kv, d, bs)
    scale = 1 / math.sqrt(d)
    assert_close(bf16_to_f32(run(host, c, scale)), ref_prefill(c, scale), "twin_bf16")


@pytest.mark.parametrize("window", [1, 5, 16, 40, 64, 65])
def test_twin_sliding_window_with_evicted_blocks(host, rng, window):
    c = Case(rng, [19, 111, 4], [19 + 30, 111, 4 + 200], 4, 2, 64, 16)
    want = ref_prefill(c, 0.125, window)
    for s in range(c.n_seqs):  # blocks wholly before every row's window may be evicted
        lo = max(0, c.kv_lens[s] - c.q_lens[s] - window + 1)
        c.tables[s, :lo // c.bs] = -1
    assert_close(bf16_to_f32(run(host, c, 0.125, window)), want, "twin_bf16")


def test_twin_chunked_equals_whole_and_batch_invariant(host, rng):
    whole = Case(rng, [111], [111], 8, 2, 64, 16)
    want = run(host, whole, 0.125)
    assert np.array_equal(chunked(host, whole, (40, 50, 21), 0.125), want)
    assert np.array_equal(chunked(host, whole, (1, 63, 47), 0.125), want)
    c = Case(rng, [7, 19, 1, 111], [7 + 33, 19, 1 + 200, 111 + 1], 8, 2, 64, 16)
    batch = run(host, c, 0.125)
    for s in range(c.n_seqs):
        assert np.array_equal(batch[c.qo[s]:c.qo[s + 1]], run(host, c.subset(s), 0.125))


@pytest.mark.parametrize("h,kv,d,bs", [(8, 2, 64, 16), (4, 2, 16, 3)])
def test_twin_all_scores_far_below_zero(host, rng, h, kv, d, bs):
    """Queries anti-aligned with every key: the running max starts at -inf, not 0, and the
    BF16 P is rounded against it (rows seeing one key, one tile, several tiles)."""
    c = anti_aligned(Case(rng, [1, 7, 19], [1, 7 + 40, 19 + 100], h, kv, d, bs), rng)
    scale = 1 / math.sqrt(d)
    want = ref_prefill(c, scale)
    assert np.abs(want).max() > 0.5
    assert_close(bf16_to_f32(run(host, c, scale)), want, "twin_bf16")


# ------------------------------------------------------------------------------------------
# choice, sizes, bad arguments
# ------------------------------------------------------------------------------------------
class Recording(HostBackend):
    def __init__(self):
        super().__init__()
        self.launched: list[str] = []

    def launch(self, kernel, grid, block, shared_mem, stream, args):
        self.launched.append((kernel.name, tuple(grid), shared_mem))
        super().launch(kernel, grid, block, shared_mem, stream, args)


@pytest.mark.parametrize("d,want", [(8, "attention.prefill_attention_p1"),
                                    (6, "attention.prefill_attention_p1"),
                                    (48, "attention.prefill_attention_p1"),
                                    (16, "attention_tc.prefill_attention_tc_d16"),
                                    (96, "attention_tc.prefill_attention_tc_d96"),
                                    (128, "attention_tc.prefill_attention_tc_d128")])
def test_auto_picks_tensor_cores_for_their_head_dims(rng, d, want):
    be = Recording()
    c = Case(rng, [5, 70], [5, 70 + 3], 8, 2, d, 16)
    got = run(be, c, 0.2, launch=tc.prefill_attention_auto)
    assert [n for n, _, _ in be.launched] == [want]
    if want.startswith("attention_tc"):
        # grid: 64-row tiles of (token, head) rows of one kv head; 70 tokens x G 4 -> 5
        assert be.launched[0][1:] == ((5, 2, 2), tc.smem_bytes(d))
        assert np.array_equal(got, run(HostBackend(), c, 0.2))


def test_tc_applies_and_smem_sizes():
    assert all(tc.tc_applies(d, 0, 256, 4096) for d in tc.TC_HEAD_DIMS)
    assert not tc.tc_applies(64, 8, 256, 4096)     # qkv only 8-byte aligned: CUDA cores
    assert not tc.tc_applies(112, 0, 256, 4096)
    sizes = {d: tc.smem_bytes(d) for d in tc.TC_HEAD_DIMS}
    assert sizes[128] == sizes[256] == 48 * 1024   # the most any launch may ask without opt-in
    assert sizes[96] == (64 + 128) * 13 * 16       # padded rows: 12 chunks + 1
    assert max(sizes.values()) <= tc.MAX_DYNAMIC_SMEM


def test_bad_arguments_raise_before_launch():
    be = Recording()
    P = 4096

    def call(**kw):
        a = dict(n_seqs=2, n_tokens=10, max_q_len=8, num_heads=8, num_kv_heads=2,
                 head_dim=64, block_size=16, max_blocks_per_seq=4, scale=0.125,
                 sliding_window=0)
        ptrs = dict(out=P, qkv=P, k=P, v=P)
        for k in list(kw):
            if k in ptrs:
                ptrs[k] = kw.pop(k)
        a.update(kw)
        tc.prefill_attention_tc(be, 0, ptrs["out"], ptrs["qkv"], ptrs["k"], ptrs["v"], P, P, P,
                                **a)

    for kw, msg in [({"head_dim": 48}, "tensor-core"), ({"head_dim": 6}, "tensor-core"),
                    ({"qkv": P + 4}, "qkv.*16-byte"), ({"v": P + 8}, "v_cache.*16-byte"),
                    ({"num_kv_heads": 3}, "multiple"), ({"max_q_len": 11}, "max_q_len"),
                    ({"out": P + 2}, "aligned"), ({"sliding_window": -1}, "sliding_window"),
                    ({"n_tokens": 2**31 - 1, "max_q_len": 2**30, "num_kv_heads": 1},
                     "2\\^31")]:
        with pytest.raises(InvalidArgument, match=msg):
            call(**kw)
    assert be.launched == []


# ------------------------------------------------------------------------------------------
# device backends (emu on the CPU; a GPU where there is one)
# ------------------------------------------------------------------------------------------
# Llama-3.1-8B (32/8 x 128), Qwen2.5-7B (28/4 x 128), Qwen2.5-0.5B (14/2 x 64), Gemma-like
# 256: GPU only; the emulator runs the same code paths at the small shapes.
GPU_TC_HEADS = [real(32, 8, 128, 16), real(28, 4, 128, 16), real(14, 2, 64, 16),
                real(8, 4, 256, 16), (8, 1, 128, 32), (12, 1, 64, 16), (4, 4, 96, 7),
                (6, 3, 80, 5), (4, 2, 256, 16), (4, 2, 32, 16), (4, 2, 16, 3)]


@pytest.mark.gpu
@pytest.mark.parametrize("h,kv,d,bs", GPU_TC_HEADS)
def test_gpu_matches_twin_and_is_batch_invariant(device, host, rng, h, kv, d, bs):
    c = Case(rng, [7, 1, 19, 111, 40], [7, 1 + 50, 19 + 13, 111, 40 + 300], h, kv, d, bs)
    scale = 1 / math.sqrt(d)
    for window in (0, 37):
        g = run(device, c, scale, window)
        t = run(host, c, scale, window)
        assert_close(bf16_to_f32(g), bf16_to_f32(t), "gpu_vs_twin_bf16", f"window {window}")
    for s in range(c.n_seqs):  # bit-identical alone (g: the last launch, window 37)
        assert np.array_equal(g[c.qo[s]:c.qo[s + 1]], run(device, c.subset(s), scale, 37))
    assert np.array_equal(run(device, c, scale, 37, max_q_len=c.n_tokens), g)


@pytest.mark.gpu
@pytest.mark.parametrize("h,kv,d,bs", [(8, 2, 64, 16), (4, 2, 16, 3), (2, 1, 256, 16)])
def test_gpu_all_scores_far_below_zero_match_twin(device, host, rng, h, kv, d, bs):
    c = anti_aligned(Case(rng, [1, 7, 19], [1, 7 + 40, 19 + 100], h, kv, d, bs), rng)
    scale = 1 / math.sqrt(d)
    assert_close(bf16_to_f32(run(device, c, scale)), bf16_to_f32(run(host, c, scale)),
                 "gpu_vs_twin_bf16")


@pytest.mark.gpu
@pytest.mark.parametrize("window", [0, 50])
def test_gpu_chunked_prefill_equals_whole(device, rng, window):
    """A 111-token prompt after nothing cached: chunked against its cached prefix in several
    ways, bit-identical to the whole prompt (key tiles at absolute positions)."""
    whole = Case(rng, [111], [111], 8, 2, 64, 16)
    want = run(device, whole, 0.125, window)
    for sizes in ((40, 50, 21), (1, 7, 19, 84)):
        assert np.array_equal(chunked(device, whole, sizes, 0.125, window), want), sizes


@pytest.mark.gpu
def test_gpu_inconsistent_sequence_gets_nan_rows(device, rng):
    c = Case(rng, [5, 3], [5, 3 + 9], 4, 2, 32, 16)
    c.kv_lens[0] = 4  # fewer cached tokens than queries: the kernel's loud answer
    got = bf16_to_f32(run(device, c, 0.2))
    assert np.isnan(got[:5]).all()
    good = c.subset(1)
    assert np.array_equal(run(device, c, 0.2)[5:], run(device, good, 0.2))
