"""gated_delta_rule family: chunked prefill and recurrent decode of gated DeltaNet, against a
float64 recurrence, HF's torch reference (committed goldens), split and batch invariance, and
the kernels against the twins."""
from pathlib import Path

import numpy as np
import pytest

from metrale.errors import InvalidArgument
from metrale.gpu_runtime import kernel_source
from metrale.ops import gated_delta_rule as gdr
from metrale.ops.bf16 import bf16_to_f32, f32_to_bf16
from tests.conftest import assert_close, real
from tests.helpers import Buffers
from tests.ops.recurrent_batch import (RAGGED, Call, assert_kernel_matches_twin, assert_rel_max,
                                      rand_bf16, split_rows)

GOLDEN = Path(__file__).resolve().parents[1] / "fixtures" / "linear_attn" / "gated_delta_rule.npz"


class Shape:
    def __init__(self, Hk, Hv, dk, dv, pad=8):
        self.Hk, self.Hv, self.dk, self.dv = Hk, Hv, dk, dv
        self.stride = 2 * Hk * dk + Hv * dv + pad       # q | k | v | unused columns

    def inputs(self, rng, n, scale=1.0):
        """(qkv rows [n, stride], ab rows [n, 2*Hv]: a then b) as BF16 bits. q is k plus
        noise, so the k.q terms are as large as the others."""
        qkv = rand_bf16(rng, (n, self.stride), scale)
        w = self.Hk * self.dk
        qkv[:, :w] = f32_to_bf16(bf16_to_f32(qkv[:, w:2 * w]) + 0.5 * bf16_to_f32(qkv[:, :w]))
        ab = rand_bf16(rng, (n, 2 * self.Hv))
        return qkv, ab

    def params(self, rng):
        a_log = np.log(np.linspace(0.02, 2.0, self.Hv)).astype(np.float32)
        return a_log, (rng.standard_normal(self.Hv) * 0.5).astype(np.float32)

    def split(self, qkv, ab):
        """float32 q [n, Hk, dk], k, v [n, Hv, dv], a, b [n, Hv]."""
        n, Hk, Hv, dk, dv = qkv.shape[0], self.Hk, self.Hv, self.dk, self.dv
        f = bf16_to_f32(qkv)
        return (f[:, :Hk * dk].reshape(n, Hk, dk), f[:, Hk * dk:2 * Hk * dk].reshape(n, Hk, dk),
                f[:, 2 * Hk * dk:2 * Hk * dk + Hv * dv].reshape(n, Hv, dv),
                bf16_to_f32(ab[:, :Hv]), bf16_to_f32(ab[:, Hv:]))

    def pool(self, rng, n_slots, scale=0.3):
        return (rng.standard_normal((n_slots, self.Hv, self.dk, self.dv)) * scale).astype(
            np.float32)


def _launch(be, sh, qkv, ab, params, pool, slots, call=None):
    """Prefill (call given) or decode (one row per slot). Returns (out, pool after)."""
    T = qkv.shape[0]
    a_log, dt_bias = params
    with Buffers(be) as buf:
        qp, abp = buf.put(qkv), buf.put(ab)
        kp, vp = qp.offset(2 * sh.Hk * sh.dk), qp.offset(4 * sh.Hk * sh.dk)
        ap, bp = abp, abp.offset(2 * sh.Hv)
        op = buf.put(np.zeros((T, sh.Hv, sh.dv), np.uint16))
        alp, dtp, pp = buf.put(a_log), buf.put(dt_bias), buf.put(pool)
        ss = sh.Hv * sh.dk * sh.dv
        common = (op, qp, kp, vp, sh.stride, ap, bp, 2 * sh.Hv, alp, dtp, pp, ss)
        if call is None:
            sp = buf.put(np.asarray(slots, np.int32))
            gdr.gdr_decode(be, be.default_stream(), *common, sp, len(slots), sh.Hk, sh.Hv,
                           sh.dk, sh.dv)
        else:
            cu, sp, st = call.upload(buf)
            gdr.gdr_prefill(be, be.default_stream(), *common, sp, cu, st, len(call.lens),
                            sh.Hk, sh.Hv, sh.dk, sh.dv)
        return buf.get(op, (T, sh.Hv, sh.dv), np.uint16), buf.get(pp, pool.shape, np.float32)


def prefill(be, sh, qkv, ab, params, pool, call):
    return _launch(be, sh, qkv, ab, params, pool, None, call)


def decode(be, sh, qkv, ab, params, pool, slots):
    return _launch(be, sh, qkv, ab, params, pool, slots)


def reference(q, k, v, a, b, a_log, dt_bias, s0):
    """float64 token-by-token recurrence of one sequence -> (out [n, Hv, dv], state)."""
    q, k, v, a, b = (np.asarray(x, np.float64) for x in (q, k, v, a, b))
    Hk, Hv = q.shape[1], v.shape[1]
    r = Hv // Hk
    x = a + dt_bias
    g = -np.exp(np.float64(a_log)) * np.where(x > 20, x, np.log1p(np.exp(np.minimum(x, 20))))
    beta = 1 / (1 + np.exp(-b))
    kn = np.repeat(k / np.sqrt((k * k).sum(-1, keepdims=True) + 1e-6), r, axis=1)
    qn = np.repeat(q / np.sqrt((q * q).sum(-1, keepdims=True) + 1e-6), r, axis=1)
    qn = qn / np.sqrt(q.shape[-1])
    S = np.array(s0, np.float64)
    out = np.empty(v.shape)
    for t in range(v.shape[0]):
        S *= np.exp(g[t])[:, None, None]
        u = beta[t][:, None] * (v[t] - np.einsum("hij,hi->hj", S, kn[t]))
        S += kn[t][:, :, None] * u[:, None, :]
        out[t] = np.einsum("hij,hi->hj", S, qn[t])
    return out, S


def check_against_reference(sh, qkv, ab, params, pool_before, pool_after, out, call):
    q, k, v, a, b = sh.split(qkv, ab)
    for i, (rows, o) in enumerate(zip(split_rows(np.arange(call.n_tokens), call.lens),
                                      split_rows(out, call.lens))):
        s = call.slots[i]
        s0 = pool_before[s] if call.start[i] else np.zeros_like(pool_before[s])
        ref_o, ref_s = reference(q[rows], k[rows], v[rows], a[rows], b[rows], *params, s0)
        assert_close(bf16_to_f32(o), ref_o, "twin_bf16", f"sequence {i}")
        assert_close(pool_after[s], ref_s, "twin_fp32", f"state of sequence {i}")


def test_entry_points_exist():
    assert {"gdr_prefill", "gdr_decode"} <= set(kernel_source.entry_points(gdr.MODULE))


def test_chunk_grid_is_absolute():
    assert gdr.chunk_bounds(0, 130) == [(0, 64), (64, 128), (128, 130)]
    assert gdr.chunk_bounds(60, 10) == [(0, 4), (4, 10)]
    assert gdr.chunk_bounds(64, 64) == [(0, 64)]


@pytest.mark.parametrize("lens", RAGGED)
def test_twin_prefill_matches_float64(host, rng, lens):
    sh = Shape(1, 2, 32, 32)
    n = len(lens)
    call = Call(list(lens), [n - i for i in range(n)], [(0, 3, 64, 100, 0)[i] for i in range(n)])
    qkv, ab = sh.inputs(rng, call.n_tokens)
    params, pool = sh.params(rng), sh.pool(rng, n + 1)
    out, after = prefill(host, sh, qkv, ab, params, pool, call)
    check_against_reference(sh, qkv, ab, params, pool, after, out, call)
    assert np.array_equal(after[0], pool[0]), "a slot no sequence names is untouched"


def test_twin_decode_matches_float64(host, rng):
    sh = Shape(2, 4, 16, 32)
    qkv, ab = sh.inputs(rng, 3)
    params, pool = sh.params(rng), sh.pool(rng, 4)
    out, after = decode(host, sh, qkv, ab, params, pool, [3, 0, 2])
    check_against_reference(sh, qkv, ab, params, pool, after, out, Call([1, 1, 1], [3, 0, 2],
                                                                        [1, 1, 1]))


def check_hf_golden(be, case):
    """Prefill (ragged, some sequences from an initial state) and one decode step against
    HF's torch_chunk_gated_delta_rule / torch_recurrent_gated_delta_rule (float32)."""
    z = np.load(GOLDEN)
    G = {k.split("/", 1)[1]: z[k] for k in z.files if k.startswith(case + "/")}
    T, Hk, dk = G["q"].shape
    Hv, dv = G["v"].shape[1:]
    sh = Shape(Hk, Hv, dk, dv, pad=0)
    qkv = np.concatenate([G["q"].reshape(T, -1), G["k"].reshape(T, -1),
                          G["v"].reshape(T, -1)], axis=1)
    ab = np.concatenate([G["a"], G["b"]], axis=1)
    params = (G["a_log"].astype(np.float32), G["dt_bias"].astype(np.float32))
    n = len(G["lens"])
    # a sequence with an initial state continues at position 5: HF's chunks start at the
    # call's first token, these at absolute multiples of 64; both are the same math
    call = Call(G["lens"].tolist(), list(range(n)), [5 if f else 0 for f in G["init"]])
    out, after = prefill(be, sh, qkv, ab, params, G["s0"].astype(np.float32), call)
    assert_close(bf16_to_f32(out), G["out"], "twin_bf16")
    assert_rel_max(out, G["out"], after, G["final"], "prefill:")
    dqkv = np.concatenate([G["dec_q"].reshape(n, -1), G["dec_k"].reshape(n, -1),
                           G["dec_v"].reshape(n, -1)], axis=1)
    dab = np.concatenate([G["dec_a"], G["dec_b"]], axis=1)
    out, after = decode(be, sh, dqkv, dab, params, G["final"].copy(), list(range(n)))
    assert_close(bf16_to_f32(out), G["dec_out"], "twin_bf16")
    assert_rel_max(out, G["dec_out"], after, G["dec_state"], "decode:")


@pytest.mark.parametrize("case", ["gqa", "wide"])
def test_twin_matches_hf_golden(host, case):
    check_hf_golden(host, case)


@pytest.mark.parametrize("cuts", [[64], [64, 128], [128], [10, 64], [30, 64, 90]])
def test_split_prefill(host, rng, cuts):
    """Calls split at multiples of 64 give the one-call bits; other splits agree closely."""
    sh = Shape(1, 2, 32, 32)
    qkv, ab = sh.inputs(rng, 150)
    params, pool = sh.params(rng), sh.pool(rng, 1)
    whole, st_whole = prefill(host, sh, qkv, ab, params, pool, Call([150], [0], [0]))
    parts, st = [], pool
    for lo, hi in zip([0] + cuts, cuts + [150]):
        o, st = prefill(host, sh, qkv[lo:hi], ab[lo:hi], params, st, Call([hi - lo], [0], [lo]))
        parts.append(o)
    got = np.concatenate(parts)
    if all(c % 64 == 0 for c in cuts):
        assert np.array_equal(got, whole) and np.array_equal(st, st_whole)
    else:
        assert_close(bf16_to_f32(got), bf16_to_f32(whole), "gpu_vs_twin_bf16")
        assert_close(st, st_whole, "gpu_vs_twin_fp32")


def test_batch_invariance_and_decode_after_prefill(host, rng):
    sh = Shape(2, 4, 32, 32)
    lens = [19, 111, 1, 7]
    call = Call(lens, [2, 4, 0, 1], [0, 64, 7, 0])
    qkv, ab = sh.inputs(rng, call.n_tokens)
    params, pool = sh.params(rng), sh.pool(rng, 5)
    out, after = prefill(host, sh, qkv, ab, params, pool, call)
    for i, (rows, o) in enumerate(zip(split_rows(np.arange(call.n_tokens), lens),
                                      split_rows(out, lens))):
        alone, st = prefill(host, sh, qkv[rows], ab[rows], params, pool,
                            Call([lens[i]], [call.slots[i]], [call.start[i]]))
        assert np.array_equal(alone, o)
        assert np.array_equal(st[call.slots[i]], after[call.slots[i]])
    # decode: a batch of 4 against each alone, and against the prefill of one more token
    dq, dab = sh.inputs(rng, 4)
    y, st4 = decode(host, sh, dq, dab, params, after, call.slots)
    for i, s in enumerate(call.slots):
        y1, st1 = decode(host, sh, dq[i:i + 1], dab[i:i + 1], params, after, [s])
        assert np.array_equal(y1[0], y[i]) and np.array_equal(st1[s], st4[s])
    rows = split_rows(np.arange(call.n_tokens), lens)[1]
    longer, st_l = prefill(host, sh, np.concatenate([qkv[rows], dq[1:2]]),
                           np.concatenate([ab[rows], dab[1:2]]), params, pool,
                           Call([112], [4], [64]))
    assert_close(bf16_to_f32(y[1]), bf16_to_f32(longer[-1]), "gpu_vs_twin_bf16")
    assert_close(st4[4], st_l[4], "gpu_vs_twin_fp32")


@pytest.mark.parametrize("H,dk,dv", [(3, 16, 32), (2, 128, 64)])
def test_native_step_gives_the_numpy_bits(rng, H, dk, dv):
    """HostBackend's native decode step (gpu_runtime/native_recurrent.py) and the numpy
    formula: the same float32 steps in the same order, the same bits."""
    from metrale.gpu_runtime import native_recurrent
    native = native_recurrent.try_load()
    if native is None:
        pytest.skip("no C++ compiler: the native step cannot be built")
    f = lambda *shape: rng.standard_normal(shape).astype(np.float32)   # noqa: E731
    qn, kn, v, state = f(H, dk) * 0.1, f(H, dk) * 0.1, f(H, dv), f(H, dk, dv)
    g, beta = -np.abs(f(H)), np.abs(f(H)) / 4
    s_np, s_nat = state.copy(), state.copy()
    y_np = gdr.step_f32(qn, kn, v, g, beta, s_np)
    y_nat = gdr.step_f32(qn, kn, v, g, beta, s_nat, native)
    assert np.array_equal(y_np, y_nat) and np.array_equal(s_np, s_nat)


def test_bad_arguments_raise(host):
    def call(Hk=2, Hv=4, dk=32, dv=32, stride=256, ss=4 * 32 * 32, q=16):
        gdr.gdr_decode(host, 0, 16, q, 16, 16, stride, 16, 16, 8, 16, 16, 16, ss, 16, 1, Hk, Hv,
                       dk, dv)
    with pytest.raises(InvalidArgument, match="multiple of n_k_heads"):
        call(Hk=3)
    with pytest.raises(InvalidArgument, match="d_k"):
        call(dk=24)
    with pytest.raises(InvalidArgument, match="d_k"):
        call(dk=256)
    with pytest.raises(InvalidArgument, match="d_v"):
        call(dv=48)
    with pytest.raises(InvalidArgument, match="qkv_stride"):
        call(stride=252)
    with pytest.raises(InvalidArgument, match="slot_stride"):
        call(ss=100)
    with pytest.raises(InvalidArgument, match="q_ptr"):
        call(q=18)


# ---- the kernels ----------------------------------------------------------------------------
_compare = assert_kernel_matches_twin


@pytest.mark.gpu
@pytest.mark.parametrize("lens", RAGGED)
def test_gpu_prefill_matches_twin(device, host, rng, lens):
    sh = Shape(1, 2, 32, 32)
    n = len(lens)
    call = Call(list(lens), [n - i for i in range(n)], [(0, 3, 64, 100, 0)[i] for i in range(n)])
    qkv, ab = sh.inputs(rng, call.n_tokens)
    params, pool = sh.params(rng), sh.pool(rng, n + 1)
    _compare(prefill(device, sh, qkv, ab, params, pool, call),
             prefill(host, sh, qkv, ab, params, pool, call))


@pytest.mark.gpu
@pytest.mark.parametrize("Hk,Hv,dk,dv,n", [(1, 2, 32, 32, 3), (2, 2, 16, 64, 1),
                                           (1, 1, 128, 32, 2), real(16, 16, 128, 128, 4),
                                           real(16, 32, 128, 128, 2)])
def test_gpu_decode_matches_twin(device, host, rng, Hk, Hv, dk, dv, n):
    sh = Shape(Hk, Hv, dk, dv)
    qkv, ab = sh.inputs(rng, n)
    params, pool = sh.params(rng), sh.pool(rng, n + 1)
    slots = [n - i for i in range(n)]
    _compare(decode(device, sh, qkv, ab, params, pool, slots),
             decode(host, sh, qkv, ab, params, pool, slots))


@pytest.mark.gpu
@pytest.mark.parametrize("Hk,Hv,dk,dv,lens", [(2, 4, 64, 32, (70, 5)), (1, 1, 128, 32, (66,)),
                                              (1, 2, 16, 64, (7, 1)),
                                              real(16, 16, 128, 128, (1, 200, 64)),
                                              real(16, 32, 128, 128, (130,))])
def test_gpu_prefill_shapes(device, host, rng, Hk, Hv, dk, dv, lens):
    sh = Shape(Hk, Hv, dk, dv)
    n = len(lens)
    call = Call(list(lens), list(range(n)), [0] + [70] * (n - 1))
    qkv, ab = sh.inputs(rng, call.n_tokens)
    params, pool = sh.params(rng), sh.pool(rng, n)
    _compare(prefill(device, sh, qkv, ab, params, pool, call),
             prefill(host, sh, qkv, ab, params, pool, call))


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["gqa", "wide"])
def test_gpu_matches_hf_golden(device, case):
    check_hf_golden(device, case)


@pytest.mark.gpu
def test_gpu_split_and_batch_invariance(device, rng):
    sh = Shape(1, 2, 32, 32)
    qkv, ab = sh.inputs(rng, 140)
    params, pool = sh.params(rng), sh.pool(rng, 2)
    whole, st_whole = prefill(device, sh, qkv, ab, params, pool, Call([140], [0], [0]))
    a, st = prefill(device, sh, qkv[:64], ab[:64], params, pool, Call([64], [0], [0]))
    b, st = prefill(device, sh, qkv[64:], ab[64:], params, st, Call([76], [0], [64]))
    assert np.array_equal(np.concatenate([a, b]), whole) and np.array_equal(st, st_whole)
    other, _ = sh.inputs(rng, 7)
    both, st2 = prefill(device, sh, np.concatenate([other, qkv]),
                        np.concatenate([ab[:7], ab]), params, pool, Call([7, 140], [1, 0], [3, 0]))
    assert np.array_equal(both[7:], whole) and np.array_equal(st2[0], st_whole[0])
