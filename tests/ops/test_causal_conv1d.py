"""causal_conv1d family: depthwise causal conv with per-sequence state (prefill over a ragged
batch, one-token update), against a float64 formula, split/batch invariance, the kernels."""
from pathlib import Path

import numpy as np
import pytest

from metrale.errors import InvalidArgument
from metrale.gpu_runtime import kernel_source
from metrale.ops import causal_conv1d as cc
from metrale.ops.bf16 import bf16_to_f32
from tests.conftest import assert_close, real
from tests.helpers import Buffers
from tests.ops.recurrent_batch import RAGGED, Call, assert_rel_max, rand_bf16, split_rows

GOLDEN = Path(__file__).resolve().parents[1] / "fixtures" / "linear_attn" / "causal_conv1d.npz"


def prefill(be, x, call, pool, w, bias, silu=True, x_stride=None, out_stride=None,
            misalign=False):
    """Run causal_conv1d_prefill; x [n_tokens, C] bf16, pool [n_slots, W-1, C] bf16.
    Returns (out [n_tokens, C], pool after)."""
    C, W = w.shape
    xs = x_stride or C
    os_ = out_stride or C
    T = call.n_tokens
    xin = np.zeros((T, xs), np.uint16)
    xin[:, :C] = x
    with Buffers(be) as buf:
        if misalign:   # every pointer 2 bytes off: the one-channel path
            xp = buf.put(np.concatenate([[0], xin.ravel()]).astype(np.uint16)).offset(2)
        else:
            xp = buf.put(xin)
        op = buf.put(np.zeros((T, os_), np.uint16))
        wp = buf.put(w)
        bp = 0 if bias is None else buf.put(bias)
        pp = buf.put(pool)
        cu, sl, st = call.upload(buf)
        cc.causal_conv1d_prefill(be, be.default_stream(), op, os_, xp, xs, wp, bp, pp,
                                 (W - 1) * C, sl, cu, st, len(call.lens),
                                 max(max(call.lens), 1), C, W, silu)
        out = buf.get(op, (T, os_), np.uint16)[:, :C]
        return out, buf.get(pp, pool.shape, np.uint16)


def update(be, x, slots, pool, w, bias, silu=True):
    C, W = w.shape
    with Buffers(be) as buf:
        xp, op, wp = buf.put(x), buf.put(np.zeros_like(x)), buf.put(w)
        bp = 0 if bias is None else buf.put(bias)
        pp, sp = buf.put(pool), buf.put(np.asarray(slots, np.int32))
        cc.causal_conv1d_update(be, be.default_stream(), op, C, xp, C, wp, bp, pp, (W - 1) * C,
                                sp, len(slots), C, W, silu)
        return buf.get(op, x.shape, np.uint16), buf.get(pp, pool.shape, np.uint16)


def reference(x, state, w, bias, silu):
    """float64: x [n, C], state [W-1, C] (the inputs before x) -> [n, C]."""
    C, W = w.shape
    ext = np.concatenate([bf16_to_f32(state), bf16_to_f32(x)]).astype(np.float64)
    wf = bf16_to_f32(w).astype(np.float64)
    n = x.shape[0]
    y = sum(wf[:, j] * ext[j:j + n] for j in range(W))
    if bias is not None:
        y = y + bf16_to_f32(bias)
    return y / (1 + np.exp(-y)) if silu else y


def setup(rng, C, W, n_slots, bias=True):
    w = rand_bf16(rng, (C, W), 0.5)
    b = rand_bf16(rng, (C,), 0.2) if bias else None
    pool = rand_bf16(rng, (n_slots, W - 1, C))
    return w, b, pool


def test_entry_points_exist():
    assert {"causal_conv1d_prefill_v8", "causal_conv1d_prefill_v1", "causal_conv1d_update_v8",
            "causal_conv1d_update_v1"} <= set(kernel_source.entry_points(cc.MODULE))


@pytest.mark.parametrize("lens", RAGGED)
@pytest.mark.parametrize("W,bias,silu", [(4, False, True), (4, True, True), (2, True, False),
                                         (3, False, False)])
def test_twin_matches_float64(host, rng, lens, W, bias, silu):
    C = 24
    w, b, pool = setup(rng, C, W, 7, bias)
    n = len(lens)
    call = Call(list(lens), [6 - i for i in range(n)], [0 if i % 2 else 5 for i in range(n)])
    x = rand_bf16(rng, (call.n_tokens, C))
    out, after = prefill(host, x, call, pool, w, b, silu)
    for i, (xo, yo) in enumerate(zip(split_rows(x, lens), split_rows(out, lens))):
        s = call.slots[i]
        st = pool[s] if call.start[i] else np.zeros_like(pool[s])
        assert_close(bf16_to_f32(yo), reference(xo, st, w, b, silu), "twin_bf16")
        tail = np.concatenate([st, xo])[-(W - 1):]
        assert np.array_equal(after[s], tail), "state = the last W-1 inputs"
    untouched = sorted(set(range(7)) - set(call.slots))
    assert np.array_equal(after[untouched], pool[untouched])


def check_hf_golden(be, case):
    """HF's causal_conv1d_fn (fresh) / causal_conv1d_update (from a state) with SiLU; HF's
    state is [channels, W-1], this pool's [W-1, channels]."""
    z = np.load(GOLDEN)
    G = {k.split("/", 1)[1]: z[k] for k in z.files if k.startswith(case + "/")}
    n = len(G["lens"])
    pool = np.ascontiguousarray(G["s0"].transpose(0, 2, 1))
    call = Call(G["lens"].tolist(), list(range(n)), [4 if f else 0 for f in G["init"]])
    bias = G["bias"] if G["bias"].size else None
    out, after = prefill(be, G["x"], call, pool, G["w"], bias)
    assert_close(bf16_to_f32(out), G["out"], "twin_bf16")
    assert_rel_max(out, G["out"])
    assert np.array_equal(after, G["final"].transpose(0, 2, 1))


@pytest.mark.parametrize("case", ["silu", "bias"])
def test_twin_matches_hf_golden(host, case):
    check_hf_golden(host, case)


@pytest.mark.parametrize("split", [1, 2, 5, 64, 100])
def test_split_prefill_and_decode_continue_exactly(host, rng, split):
    C, W = 16, 4
    w, b, pool = setup(rng, C, W, 2)
    x = rand_bf16(rng, (111, C))
    whole, st_whole = prefill(host, x, Call([111], [1], [0]), pool, w, b)
    a, st_a = prefill(host, x[:split], Call([split], [1], [0]), pool, w, b)
    rest, st_b = prefill(host, x[split:], Call([111 - split], [1], [split]), st_a, w, b)
    assert np.array_equal(np.concatenate([a, rest]), whole)
    assert np.array_equal(st_b, st_whole)
    # decode the last 3 tokens one by one after a prefill of the first 108
    _, st = prefill(host, x[:108], Call([108], [1], [0]), pool, w, b)
    for t in range(108, 111):
        y, st = update(host, x[t:t + 1], [1], st, w, b)
        assert np.array_equal(y, whole[t:t + 1])
    assert np.array_equal(st, st_whole)


def test_batch_invariance(host, rng):
    C, W = 40, 4
    w, b, pool = setup(rng, C, W, 5)
    lens = [7, 19, 1, 111, 3]
    call = Call(lens, [4, 0, 2, 1, 3], [0, 9, 2, 0, 1])
    x = rand_bf16(rng, (call.n_tokens, C))
    out, after = prefill(host, x, call, pool, w, b)
    for i, (xo, yo) in enumerate(zip(split_rows(x, lens), split_rows(out, lens))):
        alone, st = prefill(host, xo, Call([lens[i]], [call.slots[i]], [call.start[i]]), pool,
                            w, b)
        assert np.array_equal(alone, yo)
        assert np.array_equal(st[call.slots[i]], after[call.slots[i]])


def test_strided_rows_and_scalar_path(host, rng):
    C, W = 24, 4
    w, b, pool = setup(rng, C, W, 3)
    call = Call([19, 7], [2, 0], [3, 0])
    x = rand_bf16(rng, (26, C))
    ref, _ = prefill(host, x, call, pool, w, b)
    got, _ = prefill(host, x, call, pool, w, b, x_stride=40, out_stride=32)
    assert np.array_equal(got, ref)


def test_bad_arguments_raise(host):
    ok = dict(out_stride=8, x_stride=8, slot_stride=24, channels=8, width=4)
    p = [16] * 6

    def call(**kw):
        a = {**ok, **kw}
        cc.causal_conv1d_prefill(host, 0, 16, a["out_stride"], 16, a["x_stride"], 16, 0, 16,
                                 a["slot_stride"], 16, 16, 16, 1, 4, a["channels"], a["width"])
    with pytest.raises(InvalidArgument, match="width"):
        call(width=5)
    with pytest.raises(InvalidArgument, match="width"):
        call(width=1)
    with pytest.raises(InvalidArgument, match="slot_stride"):
        call(slot_stride=16)
    with pytest.raises(InvalidArgument, match="x_stride"):
        call(x_stride=4)
    with pytest.raises(InvalidArgument, match="channels"):
        call(channels=0)
    with pytest.raises(InvalidArgument, match="slots_ptr"):
        cc.causal_conv1d_update(host, 0, *p[:1], 8, 16, 8, 16, 0, 16, 24, 0, 1, 8, 4)


# ---- the kernels ----------------------------------------------------------------------------
def _check_kernel(device, host, x, call, pool, w, b, silu, **kw):
    g_out, g_st = prefill(device, x, call, pool, w, b, silu, **kw)
    t_out, t_st = prefill(host, x, call, pool, w, b, silu, **kw)
    assert np.array_equal(g_st, t_st), "the state is a copy: bit-exact"
    if silu:   # expf (libm / the GPU's fast path) against numpy's exp: 1 BF16 ulp at most
        assert_close(bf16_to_f32(g_out), bf16_to_f32(t_out), "gpu_vs_twin_bf16")
    else:      # the twin defines the order (products and sums rounded one by one)
        assert np.array_equal(g_out, t_out)


@pytest.mark.gpu
@pytest.mark.parametrize("lens", RAGGED)
@pytest.mark.parametrize("silu", [False, True])
def test_gpu_prefill_matches_twin(device, host, rng, lens, silu):
    C, W = 48, 4
    w, b, pool = setup(rng, C, W, 6)
    n = len(lens)
    call = Call(list(lens), [5 - i for i in range(n)], [i % 2 * 3 for i in range(n)])
    x = rand_bf16(rng, (call.n_tokens, C))
    _check_kernel(device, host, x, call, pool, w, b, silu)


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["silu", "bias"])
def test_gpu_matches_hf_golden(device, case):
    check_hf_golden(device, case)


@pytest.mark.gpu
@pytest.mark.parametrize("W", [2, 3, 4])
def test_gpu_scalar_path_and_widths(device, host, rng, W):
    C = 13
    w, b, pool = setup(rng, C, W, 3, bias=W != 3)
    call = Call([19, 1, 70], [2, 0, 1], [0, 4, 1])
    x = rand_bf16(rng, (90, C))
    _check_kernel(device, host, x, call, pool, w, b, False, x_stride=17, out_stride=15)
    _check_kernel(device, host, x, call, pool, w, b, True, misalign=True)


@pytest.mark.gpu
@pytest.mark.parametrize("C,n", [(40, 5), (13, 3), real(6144, 4), real(10240, 2)])
def test_gpu_update_matches_twin(device, host, rng, C, n):
    W = 4
    w, b, pool = setup(rng, C, W, n + 1)
    x = rand_bf16(rng, (n, C))
    slots = [n - i for i in range(n)]
    for silu in (False, True):
        g, g_st = update(device, x, slots, pool, w, b, silu)
        t, t_st = update(host, x, slots, pool, w, b, silu)
        assert np.array_equal(g_st, t_st)
        if silu:
            assert_close(bf16_to_f32(g), bf16_to_f32(t), "gpu_vs_twin_bf16")
        else:
            assert np.array_equal(g, t)


@pytest.mark.gpu
@pytest.mark.parametrize("C,lens", [real(6144, (1, 7, 300)), real(10240, (111, 19))])
def test_gpu_prefill_real_sizes(device, host, rng, C, lens):
    # Qwen3.5-0.8B's q|k|v conv (16 + 16 heads x 128 + 16 x 128 = 6144 channels, W 4, no
    # bias) and Nemotron-H-8B's x|B|C conv (8192 + 2 x 8 x 128 = 10240 channels, bias)
    W = 4
    w, b, pool = setup(rng, C, W, len(lens), bias=C == 10240)
    call = Call(list(lens), list(range(len(lens))), [0] * (len(lens) - 1) + [5])
    x = rand_bf16(rng, (call.n_tokens, C))
    _check_kernel(device, host, x, call, pool, w, b, True)
