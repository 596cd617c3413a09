"""The mixture-of-experts options of gpt-oss (issue 40): the router's bias (moe_topk_softmax
`bias_ptr`, one float32 add to each logit), the experts' biases (moe_gemm `bias_ptr`, added to
the FP32 product before its one rounding) and the clamped SwiGLU of act_mul
("swiglu_clamp": (clamp(u) + 1) * min(g, limit) * sigmoid(alpha * min(g, limit))): twins
against float64, options off = the launches without them, batch invariance of the biased
grouped GEMM, the kernels (emu / CUDA) against the twins."""
import numpy as np
import pytest

from metrale.errors import InvalidArgument
from metrale.gpu_runtime import NULL
from metrale.ops import activation, moe_gemm as G, moe_router as R
from metrale.ops.bf16 import bf16_to_f32, f32_to_bf16
from metrale.ops.moe_router import route
from tests.conftest import assert_close
from tests.helpers import Buffers
from tests.ops.test_gemm import rand_bf16
from tests.ops.test_moe_gemm import routing


def run_router(backend, logits, top_k, bias=None, renorm=True, pass_bias=True):
    n, E = logits.shape
    with Buffers(backend) as b:
        ids, w = b.empty((n, top_k), np.int32), b.empty((n, top_k), np.float32)
        kw = {"bias_ptr": NULL if bias is None else b.put(bias)} if pass_bias else {}
        R.moe_topk_softmax(backend, backend.default_stream(), ids, w, b.put(logits), n, E,
                           top_k, renorm, **kw)
        return b.get(ids, (n, top_k), np.int32), b.get(w, (n, top_k), np.float32)


def run_moe(backend, x, w, ids, row_div, bias=None, out_fp32=False, tile=None):
    E, n, k = w.shape
    t = G.TILES[tile] if tile else G.pick_tile(ids.size, E)
    pairs, offsets, tiles = route(ids.reshape(-1), E, t.bm)
    dt = np.float32 if out_fp32 else np.uint16
    with Buffers(backend) as b:
        yp = b.empty((ids.size, n), dt)
        G.moe_gemm(backend, backend.default_stream(), yp, b.put(x), b.put(w), b.put(pairs),
                   b.put(offsets), b.put(tiles), ids.size, E, n, k, row_div, out_fp32, t.name,
                   bias_ptr=NULL if bias is None else b.put(bias))
        return b.get(yp, (ids.size, n), dt)


def run_swiglu(backend, gu, alpha=1.702, limit=7.0):
    r, two_i = gu.shape
    with Buffers(backend) as b:
        op = b.empty((r, two_i // 2), np.uint16)
        activation.act_mul(backend, backend.default_stream(), op, b.put(gu), r, two_i // 2,
                           "swiglu_clamp", alpha, limit)
        return b.get(op, (r, two_i // 2), np.uint16)


# --------------------------------------------------------------------------------- router
@pytest.mark.parametrize("E,k", [(4, 2), (32, 4), (128, 4), (7, 3)])
def test_router_bias_is_added_to_the_logits(host, rng, E, k):
    logits = (rng.standard_normal((19, E)) * 2).astype(np.float32)
    bias = f32_to_bf16((rng.standard_normal(E) * 3).astype(np.float32))
    ids, w = run_router(host, logits, k, bias)
    ref_ids, ref_w = R.topk_softmax_f32(logits + bf16_to_f32(bias)[None], k, True)
    assert np.array_equal(ids, ref_ids) and np.array_equal(w, ref_w)
    # gpt-oss: a softmax over the top-k biased logits (float64)
    full = logits.astype(np.float64) + bf16_to_f32(bias).astype(np.float64)[None]
    top = np.take_along_axis(full, ids.astype(np.int64), axis=1)
    p = np.exp(top - top.max(1, keepdims=True))
    assert_close(w, p / p.sum(1, keepdims=True), "twin_fp32")
    assert not np.array_equal(ids, run_router(host, logits, k)[0])   # the bias reroutes
    plain = run_router(host, logits, k, pass_bias=False)
    assert all(np.array_equal(a, b) for a, b in zip(run_router(host, logits, k), plain))


# ------------------------------------------------------------------------------ moe_gemm
@pytest.mark.parametrize("out_fp32", [False, True])
@pytest.mark.parametrize("E,n,k,tokens,top_k", [(4, 32, 64, 7, 2), (8, 48, 40, 19, 3),
                                                (3, 5, 9, 4, 1)])
def test_expert_bias_matches_float64(host, rng, E, n, k, tokens, top_k, out_fp32):
    x, w = rand_bf16(rng, (tokens, k)), rand_bf16(rng, (E, n, k), 1.0 / np.sqrt(k))
    bias = rand_bf16(rng, (E, n))
    ids = routing(rng, tokens, E, top_k)
    got = run_moe(host, x, w, ids, top_k, bias, out_fp32)
    xf, wf, bf = (bf16_to_f32(a).astype(np.float64) for a in (x, w, bias))
    flat = ids.reshape(-1)
    want = np.stack([xf[p // top_k] @ wf[e].T + bf[e] for p, e in enumerate(flat)])
    assert_close(got if out_fp32 else bf16_to_f32(got), want,
                 "twin_fp32" if out_fp32 else "twin_bf16")
    # off: the launch without a bias; and the bias moves every row
    assert not np.array_equal(run_moe(host, x, w, ids, top_k, None, out_fp32), got)


def test_expert_bias_rows_are_batch_invariant(host, rng):
    E, n, k, top_k = 6, 40, 64, 2
    x, w = rand_bf16(rng, (23, k)), rand_bf16(rng, (E, n, k), 0.125)
    bias = rand_bf16(rng, (E, n))
    ids = routing(rng, 23, E, top_k)
    whole = run_moe(host, x, w, ids, top_k, bias)
    for t in (0, 11, 22):
        alone = run_moe(host, x[t:t + 1], w, ids[t:t + 1], top_k, bias)
        assert np.array_equal(alone, whole[t * top_k:(t + 1) * top_k])
    for tile in G.TILES:
        assert np.array_equal(run_moe(host, x, w, ids, top_k, bias, tile=tile), whole)


# ------------------------------------------------------------------------- swiglu_clamp
@pytest.mark.parametrize("shape", [(1, 2), (7, 22), (19, 64), (3, 2880)])
def test_swiglu_clamp_matches_float64(host, rng, shape):
    gu = f32_to_bf16((rng.standard_normal(shape) * 6).astype(np.float32))  # past the limit
    got = bf16_to_f32(run_swiglu(host, gu))
    g = bf16_to_f32(gu[:, :shape[1] // 2]).astype(np.float64)
    u = bf16_to_f32(gu[:, shape[1] // 2:]).astype(np.float64)
    gc, uc = np.minimum(g, 7.0), np.clip(u, -7.0, 7.0)
    want = (uc + 1) * gc / (1 + np.exp(-1.702 * gc))
    assert_close(got, want, "twin_bf16")
    if g.size >= 64:   # both clamps exercised
        assert g.max() > 7 and np.abs(u).max() > 7


def test_swiglu_clamp_bad_arguments(host):
    for alpha, limit in ((1.0, 0.0), (float("nan"), 7.0), (1.0, float("inf"))):
        with pytest.raises(InvalidArgument, match="swiglu_clamp"):
            activation.act_mul(host, 0, 64, 64, 1, 4, "swiglu_clamp", alpha, limit)
    with pytest.raises(InvalidArgument, match="act"):
        activation.act_mul(host, 0, 64, 64, 1, 4, "swiglu")


# ------------------------------------------------------------------------------------ GPU
@pytest.mark.gpu
@pytest.mark.parametrize("E,k", [(4, 2), (128, 4), (32, 4)])
def test_gpu_router_bias_matches_twin(device, host, rng, E, k):
    logits = (rng.standard_normal((37, E)) * 2).astype(np.float32)
    bias = f32_to_bf16((rng.standard_normal(E) * 3).astype(np.float32))
    gi, gw = run_router(device, logits, k, bias)
    hi, hw = run_router(host, logits, k, bias)
    assert np.array_equal(gi, hi)
    assert_close(gw, hw, "gpu_vs_twin_fp32")


@pytest.mark.gpu
@pytest.mark.parametrize("tile", list(G.TILES))
@pytest.mark.parametrize("out_fp32", [False, True])
def test_gpu_expert_bias_matches_twin(device, host, rng, tile, out_fp32):
    E, n, k, top_k = 6, 40, 72, 2
    x, w = rand_bf16(rng, (21, k)), rand_bf16(rng, (E, n, k), 0.125)
    bias = rand_bf16(rng, (E, n))
    ids = routing(rng, 21, E, top_k)
    g = run_moe(device, x, w, ids, top_k, bias, out_fp32, tile)
    t = run_moe(host, x, w, ids, top_k, bias, out_fp32, tile)
    if out_fp32:
        assert_close(g, t, "gpu_vs_twin_fp32")
    else:
        assert_close(bf16_to_f32(g), bf16_to_f32(t), "gpu_vs_twin_bf16")


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(1, 2), (7, 22), (19, 64), (3, 2880)])
def test_gpu_swiglu_clamp_matches_twin(device, host, rng, shape):
    gu = f32_to_bf16((rng.standard_normal(shape) * 6).astype(np.float32))
    assert_close(bf16_to_f32(run_swiglu(device, gu)), bf16_to_f32(run_swiglu(host, gu)),
                 "gpu_vs_twin_bf16")


# ------------------------------------------------------------------------- MXFP4 experts
def mxfp4_weights(rng, E, n, k):
    """Random MXFP4 experts: every code, scales around 2^-4 (and the range's ends)."""
    blocks = rng.integers(0, 256, (E, n, k // 2), dtype=np.uint8)
    scales = rng.integers(120, 128, (E, n, k // 32), dtype=np.uint8)
    scales[0, 0, 0], scales[-1, -1, -1] = 2, 252 - 127 + 120   # a tiny and a large block
    return blocks, scales


def run_mxfp4(backend, x, blocks, scales, ids, row_div, bias=None, out_fp32=False, tile=None):
    E, n, half = blocks.shape
    k = 2 * half
    t = G.TILES[tile] if tile else G.pick_tile(ids.size, E)
    pairs, offsets, tiles = route(ids.reshape(-1), E, t.bm)
    dt = np.float32 if out_fp32 else np.uint16
    with Buffers(backend) as b:
        yp = b.empty((ids.size, n), dt)
        G.moe_gemm_mxfp4(backend, backend.default_stream(), yp, b.put(x), b.put(blocks),
                         b.put(scales), b.put(pairs), b.put(offsets), b.put(tiles), ids.size,
                         E, n, k, row_div, out_fp32, t.name,
                         bias_ptr=NULL if bias is None else b.put(bias))
        return b.get(yp, (ids.size, n), dt)


def test_mxfp4_dequant_matches_transformers_table():
    """Each byte: the low nibble first; code 8 is -0.0; a scale byte s is 2^(s - 127)."""
    from metrale.ops.mxfp4 import dequant_f32
    blocks = np.arange(256, dtype=np.uint8).reshape(1, 16, 16)   # every byte once
    scales = np.full((1, 16, 1), 127, np.uint8)
    got = dequant_f32(blocks, scales)
    table = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0,
             -4.0, -6.0]
    flat = got.reshape(-1, 2)
    for byte in range(256):
        assert flat[byte, 0] == table[byte & 15] and flat[byte, 1] == table[byte >> 4]
    assert np.signbit(flat[8, 0])
    assert dequant_f32(blocks[:, :1], np.full((1, 1, 1), 130, np.uint8))[0, 0, 2] == 4.0


@pytest.mark.parametrize("out_fp32", [False, True])
def test_mxfp4_gemm_is_the_bf16_gemm_of_the_dequantized_weights(host, rng, out_fp32):
    from metrale.ops.mxfp4 import dequant_bf16
    E, n, k, top_k = 4, 40, 96, 2
    blocks, scales = mxfp4_weights(rng, E, n, k)
    x = rand_bf16(rng, (13, k))
    bias = rand_bf16(rng, (E, n))
    ids = routing(rng, 13, E, top_k)
    got = run_mxfp4(host, x, blocks, scales, ids, top_k, bias, out_fp32)
    want = run_moe(host, x, dequant_bf16(blocks, scales), ids, top_k, bias, out_fp32)
    assert np.array_equal(got, want)


def test_mxfp4_bad_arguments(host):
    with pytest.raises(InvalidArgument, match="multiple of 32"):
        G.moe_gemm_mxfp4(host, 0, 64, 64, 64, 64, 64, 64, 64, 2, 2, 8, 48, 1)
    with pytest.raises(InvalidArgument, match="blocks_ptr"):
        G.moe_gemm_mxfp4(host, 0, 64, 64, 72, 64, 64, 64, 64, 2, 2, 8, 64, 1)


@pytest.mark.gpu
@pytest.mark.parametrize("tile", list(G.TILES))
@pytest.mark.parametrize("out_fp32", [False, True])
def test_gpu_mxfp4_matches_the_bf16_kernel_bits(device, host, rng, tile, out_fp32):
    """On the device the MXFP4 tile gives exactly the BF16 kernel's bits on the dequantized
    weights (the dequantization is exact), and the twin within tolerance."""
    from metrale.ops.mxfp4 import dequant_bf16
    E, n, k, top_k = 5, 48, 128, 2
    blocks, scales = mxfp4_weights(rng, E, n, k)
    x = rand_bf16(rng, (17, k))
    bias = rand_bf16(rng, (E, n))
    ids = routing(rng, 17, E, top_k)
    g = run_mxfp4(device, x, blocks, scales, ids, top_k, bias, out_fp32, tile)
    assert np.array_equal(g, run_moe(device, x, dequant_bf16(blocks, scales), ids, top_k,
                                     bias, out_fp32, tile))
    t = run_mxfp4(host, x, blocks, scales, ids, top_k, bias, out_fp32, tile)
    if out_fp32:
        assert_close(g, t, "gpu_vs_twin_fp32")
    else:
        assert_close(bf16_to_f32(g), bf16_to_f32(t), "gpu_vs_twin_bf16")
