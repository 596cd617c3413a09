"""mamba2_ssd family: Mamba2's chunked scan (prefill) and state update (decode), against a
float64 recurrence, HF's torch reference (committed goldens), split and batch invariance, and
the kernels against the twins."""
import math
from pathlib import Path

import numpy as np
import pytest

from metrale.errors import InvalidArgument
from metrale.gpu_runtime import kernel_source
from metrale.ops import mamba2_ssd as m2
from metrale.ops.bf16 import bf16_to_f32
from tests.conftest import assert_close, real
from tests.helpers import Buffers
from tests.ops.recurrent_batch import (RAGGED, Call, assert_kernel_matches_twin, assert_rel_max,
                                      rand_bf16, split_rows)

GOLDEN = Path(__file__).resolve().parents[1] / "fixtures" / "linear_attn" / "mamba2_ssd.npz"
NO_LIMIT = (0.0, math.inf)


class Shape:
    """x | B | C rows (the conv output) of stride `stride`, dt rows of n_heads + pad."""

    def __init__(self, H, G, P, N, chunk=64, pad=8):
        self.H, self.G, self.P, self.N, self.chunk = H, G, P, N, chunk
        self.stride = H * P + 2 * G * N + pad
        self.dt_stride = H + 3

    def inputs(self, rng, n):
        xbc = rand_bf16(rng, (n, self.stride))
        xbc[:, self.H * self.P:] = rand_bf16(rng, (n, self.stride - self.H * self.P), 0.5)
        return xbc, rand_bf16(rng, (n, self.dt_stride))

    def params(self, rng):
        a_log = np.log(np.linspace(0.5, 8.0, self.H)).astype(np.float32)
        return (a_log, (rng.standard_normal(self.H) * 0.5 - 1).astype(np.float32),
                rng.standard_normal(self.H).astype(np.float32))

    def split(self, xbc, dt):
        """float32 x [n, H, P], B, C [n, G, N], dt_raw [n, H]."""
        n, H, G, P, N = xbc.shape[0], self.H, self.G, self.P, self.N
        f = bf16_to_f32(xbc)
        o = H * P
        return (f[:, :o].reshape(n, H, P), f[:, o:o + G * N].reshape(n, G, N),
                f[:, o + G * N:o + 2 * G * N].reshape(n, G, N), bf16_to_f32(dt[:, :H]))

    def pool(self, rng, n_slots, scale=0.3):
        return (rng.standard_normal((n_slots, self.H, self.P, self.N)) * scale).astype(np.float32)


def _launch(be, sh, xbc, dt, params, pool, slots, call=None, limits=NO_LIMIT):
    T = xbc.shape[0]
    a_log, dt_bias, D = params
    with Buffers(be) as buf:
        xp, dtp = buf.put(xbc), buf.put(dt)
        bp = xp.offset(2 * sh.H * sh.P)
        cp = bp.offset(2 * sh.G * sh.N)
        op = buf.put(np.zeros((T, sh.H, sh.P), np.uint16))
        alp, dbp, dp, pp = buf.put(a_log), buf.put(dt_bias), buf.put(D), buf.put(pool)
        ss = sh.H * sh.P * sh.N
        common = (op, xp, sh.stride, bp, cp, sh.stride, dtp, sh.dt_stride, alp, dbp, dp,
                  *limits, pp, ss)
        if call is None:
            sp = buf.put(np.asarray(slots, np.int32))
            m2.mamba2_step(be, be.default_stream(), *common, sp, len(slots), sh.H, sh.G, sh.P,
                           sh.N)
        else:
            cu, sp, st = call.upload(buf)
            m2.mamba2_prefill(be, be.default_stream(), *common, sp, cu, st, len(call.lens), sh.H,
                              sh.G, sh.P, sh.N, sh.chunk)
        return buf.get(op, (T, sh.H, sh.P), np.uint16), buf.get(pp, pool.shape, np.float32)


def prefill(be, sh, xbc, dt, params, pool, call, limits=NO_LIMIT):
    return _launch(be, sh, xbc, dt, params, pool, None, call, limits)


def step(be, sh, xbc, dt, params, pool, slots, limits=NO_LIMIT):
    return _launch(be, sh, xbc, dt, params, pool, slots, None, limits)


def reference(x, B, C, dt_raw, a_log, dt_bias, D, s0, limits=NO_LIMIT):
    """float64 token-by-token recurrence of one sequence -> (y [n, H, P], state)."""
    x, B, C, dt_raw = (np.asarray(v, np.float64) for v in (x, B, C, dt_raw))
    H, G = x.shape[1], B.shape[1]
    grp = np.arange(H) // (H // G)
    v = dt_raw + dt_bias
    dt = np.clip(np.where(v > 20, v, np.log1p(np.exp(np.minimum(v, 20)))), *limits)
    A = -np.exp(np.float64(a_log))
    S = np.array(s0, np.float64)
    y = np.empty(x.shape)
    for t in range(x.shape[0]):
        S = np.exp(dt[t] * A)[:, None, None] * S + \
            x[t][:, :, None] * (dt[t][:, None] * B[t][grp])[:, None, :]
        y[t] = np.einsum("hpn,hn->hp", S, C[t][grp]) + D[:, None] * x[t]
    return y, S


def check_against_reference(sh, xbc, dt, params, before, after, out, call, limits=NO_LIMIT):
    x, B, C, dtr = sh.split(xbc, dt)
    for i, (rows, o) in enumerate(zip(split_rows(np.arange(call.n_tokens), call.lens),
                                      split_rows(out, call.lens))):
        s = call.slots[i]
        s0 = before[s] if call.start[i] else np.zeros_like(before[s])
        ry, rs = reference(x[rows], B[rows], C[rows], dtr[rows], *params, s0, limits)
        assert_close(bf16_to_f32(o), ry, "twin_bf16", f"sequence {i}")
        assert_rel_max(o, ry, after[s], rs, f"sequence {i}")


def test_entry_points_exist():
    names = {f"mamba2_prefill_n{n}" for n in m2.D_STATES} | {"mamba2_step"}
    assert names <= set(kernel_source.entry_points(m2.MODULE))


def test_chunk_grid_is_absolute():
    assert m2.chunk_bounds(0, 300, 128) == [(0, 128), (128, 256), (256, 300)]
    assert m2.chunk_bounds(250, 10, 256) == [(0, 6), (6, 10)]


@pytest.mark.parametrize("lens", RAGGED)
@pytest.mark.parametrize("limits", [NO_LIMIT, (0.05, 0.4)])
def test_twin_prefill_matches_float64(host, rng, lens, limits):
    sh = Shape(4, 2, 32, 32, chunk=16)
    n = len(lens)
    call = Call(list(lens), [n - i for i in range(n)], [(0, 3, 16, 100, 0)[i] for i in range(n)])
    xbc, dt = sh.inputs(rng, call.n_tokens)
    params, pool = sh.params(rng), sh.pool(rng, n + 1)
    out, after = prefill(host, sh, xbc, dt, params, pool, call, limits)
    check_against_reference(sh, xbc, dt, params, pool, after, out, call, limits)
    assert np.array_equal(after[0], pool[0])


def test_twin_step_matches_float64(host, rng):
    sh = Shape(4, 1, 8, 64)
    xbc, dt = sh.inputs(rng, 3)
    params, pool = sh.params(rng), sh.pool(rng, 4)
    out, after = step(host, sh, xbc, dt, params, pool, [3, 0, 2])
    check_against_reference(sh, xbc, dt, params, pool, after, out, Call([1, 1, 1], [3, 0, 2],
                                                                        [1, 1, 1]))


def check_hf_golden(be, case):
    """Ragged chunked scans (some from an initial state) and one step per sequence against
    HF's mamba2_chunk_scan / mamba2_selective_state_update (float32)."""
    z = np.load(GOLDEN)
    G_ = {k.split("/", 1)[1]: z[k] for k in z.files if k.startswith(case + "/")}
    T, H, P = G_["x"].shape
    G, N = G_["B"].shape[1:]
    sh = Shape(H, G, P, N, chunk=int(G_["chunk"]), pad=0)
    sh.dt_stride = H
    xbc = np.concatenate([G_["x"].reshape(T, -1), G_["B"].reshape(T, -1),
                          G_["C"].reshape(T, -1)], axis=1)
    params = (G_["a_log"].astype(np.float32), G_["dt_bias"].astype(np.float32),
              G_["D"].astype(np.float32))
    limits = tuple(float(v) for v in G_["dt_limit"])
    n = len(G_["lens"])
    call = Call(G_["lens"].tolist(), list(range(n)), [3 if f else 0 for f in G_["init"]])
    out, after = prefill(be, sh, xbc, G_["dt"], params, G_["s0"].astype(np.float32), call,
                         limits)
    assert_close(bf16_to_f32(out), G_["out"], "twin_bf16")
    assert_rel_max(out, G_["out"], after, G_["final"], "prefill:")
    dxbc = np.concatenate([G_["dec_x"].reshape(n, -1), G_["dec_B"].reshape(n, -1),
                           G_["dec_C"].reshape(n, -1)], axis=1)
    out, after = step(be, sh, dxbc, G_["dec_dt"], params, G_["final"].copy(), list(range(n)))
    assert_close(bf16_to_f32(out), G_["dec_out"], "twin_bf16")
    assert_rel_max(out, G_["dec_out"], after, G_["dec_state"], "step:")


@pytest.mark.parametrize("case", ["groups", "limits"])
def test_twin_matches_hf_golden(host, case):
    check_hf_golden(host, case)


@pytest.mark.parametrize("cuts", [[32], [32, 96], [10, 40]])
def test_split_prefill(host, rng, cuts):
    """Calls split at multiples of chunk_size give the one-call bits; others agree closely."""
    sh = Shape(2, 1, 32, 32, chunk=32)
    xbc, dt = sh.inputs(rng, 111)
    params, pool = sh.params(rng), sh.pool(rng, 1)
    whole, st_whole = prefill(host, sh, xbc, dt, params, pool, Call([111], [0], [0]))
    parts, st = [], pool
    for lo, hi in zip([0] + cuts, cuts + [111]):
        o, st = prefill(host, sh, xbc[lo:hi], dt[lo:hi], params, st, Call([hi - lo], [0], [lo]))
        parts.append(o)
    got = np.concatenate(parts)
    if all(c % 32 == 0 for c in cuts):
        assert np.array_equal(got, whole) and np.array_equal(st, st_whole)
    else:
        assert_rel_max(got, whole, st, st_whole)


def test_batch_invariance_and_step_after_prefill(host, rng):
    sh = Shape(4, 2, 32, 32, chunk=16)
    lens = [19, 111, 1, 7]
    call = Call(lens, [2, 4, 0, 1], [0, 16, 7, 0])
    xbc, dt = sh.inputs(rng, call.n_tokens)
    params, pool = sh.params(rng), sh.pool(rng, 5)
    out, after = prefill(host, sh, xbc, dt, params, pool, call)
    for i, (rows, o) in enumerate(zip(split_rows(np.arange(call.n_tokens), lens),
                                      split_rows(out, lens))):
        alone, st = prefill(host, sh, xbc[rows], dt[rows], params, pool,
                            Call([lens[i]], [call.slots[i]], [call.start[i]]))
        assert np.array_equal(alone, o)
        assert np.array_equal(st[call.slots[i]], after[call.slots[i]])
    dx, ddt = sh.inputs(rng, 4)
    y, st4 = step(host, sh, dx, ddt, params, after, call.slots)
    for i, s in enumerate(call.slots):
        y1, st1 = step(host, sh, dx[i:i + 1], ddt[i:i + 1], params, after, [s])
        assert np.array_equal(y1[0], y[i]) and np.array_equal(st1[s], st4[s])
    rows = split_rows(np.arange(call.n_tokens), lens)[1]
    longer, st_l = prefill(host, sh, np.concatenate([xbc[rows], dx[1:2]]),
                           np.concatenate([dt[rows], ddt[1:2]]), params, pool,
                           Call([112], [4], [16]))
    assert_rel_max(y[1:2], longer[-1:], st4[4], st_l[4])


@pytest.mark.parametrize("H,P,N", [(3, 8, 32), (2, 64, 256)])
def test_native_step_gives_the_numpy_bits(rng, H, P, N):
    """HostBackend's native decode step and the numpy formula: the same bits."""
    from metrale.gpu_runtime import native_recurrent
    native = native_recurrent.try_load()
    if native is None:
        pytest.skip("no C++ compiler: the native step cannot be built")
    f = lambda *shape: rng.standard_normal(shape).astype(np.float32)   # noqa: E731
    x, B, C, state = f(H, P), f(H, N), f(H, N), f(H, P, N)
    dt, A, D = np.abs(f(H)) / 4, -np.abs(f(H)), f(H)
    s_np, s_nat = state.copy(), state.copy()
    y_np = m2.step_f32(x, B, C, dt, A, D, s_np)
    y_nat = m2.step_f32(x, B, C, dt, A, D, s_nat, native)
    assert np.array_equal(y_np, y_nat) and np.array_equal(s_np, s_nat)


def test_bad_arguments_raise(host):
    def call(H=4, G=2, P=32, N=32, xs=256, ss=4 * 32 * 32, lim=NO_LIMIT, chunk=64, x=16):
        m2.mamba2_prefill(host, 0, 16, x, xs, 16, 16, xs, 16, 4, 16, 16, 16, *lim, 16, ss, 16,
                          16, 16, 1, H, G, P, N, chunk)
    with pytest.raises(InvalidArgument, match="multiple of n_groups"):
        call(G=3)
    with pytest.raises(InvalidArgument, match="d_state"):
        call(N=48)
    with pytest.raises(InvalidArgument, match="head_dim"):
        call(P=24)
    with pytest.raises(InvalidArgument, match="x_stride"):
        call(xs=252)
    with pytest.raises(InvalidArgument, match="slot_stride"):
        call(ss=100)
    with pytest.raises(InvalidArgument, match="dt limits"):
        call(lim=(0.5, 0.1))
    with pytest.raises(InvalidArgument, match="chunk_size"):
        call(chunk=300)
    with pytest.raises(InvalidArgument, match="x_ptr"):
        call(x=18)


# ---- the kernels ----------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("lens", RAGGED)
def test_gpu_prefill_matches_twin(device, host, rng, lens):
    sh = Shape(4, 2, 32, 32, chunk=16)
    n = len(lens)
    call = Call(list(lens), [n - i for i in range(n)], [(0, 3, 16, 100, 0)[i] for i in range(n)])
    xbc, dt = sh.inputs(rng, call.n_tokens)
    params, pool = sh.params(rng), sh.pool(rng, n + 1)
    assert_kernel_matches_twin(prefill(device, sh, xbc, dt, params, pool, call, (0.01, 2.0)),
                               prefill(host, sh, xbc, dt, params, pool, call, (0.01, 2.0)))


@pytest.mark.gpu
@pytest.mark.parametrize("H,G,P,N,chunk,lens", [
    (2, 1, 32, 64, 128, (130, 7)), (2, 2, 32, 128, 64, (70,)), (1, 1, 16, 256, 256, (19, 5)),
    real(128, 8, 64, 128, 128, (300, 1)),      # Nemotron-H-8B's mixer
    real(128, 1, 64, 256, 256, (270,))])       # Granite-4.0-H's (d_state 256, one group)
def test_gpu_prefill_shapes(device, host, rng, H, G, P, N, chunk, lens):
    sh = Shape(H, G, P, N, chunk=chunk)
    n = len(lens)
    call = Call(list(lens), list(range(n)), [0] + [chunk - 2] * (n - 1))
    xbc, dt = sh.inputs(rng, call.n_tokens)
    params, pool = sh.params(rng), sh.pool(rng, n)
    assert_kernel_matches_twin(prefill(device, sh, xbc, dt, params, pool, call),
                               prefill(host, sh, xbc, dt, params, pool, call))


@pytest.mark.gpu
@pytest.mark.parametrize("H,G,P,N,n", [(4, 2, 8, 32, 3), (2, 1, 12, 64, 2), (2, 2, 4, 256, 1),
                                       (1, 1, 32, 128, 2), real(128, 8, 64, 128, 4),
                                       real(128, 1, 64, 256, 2)])
def test_gpu_step_matches_twin(device, host, rng, H, G, P, N, n):
    sh = Shape(H, G, P, N)
    xbc, dt = sh.inputs(rng, n)
    params, pool = sh.params(rng), sh.pool(rng, n + 1)
    slots = [n - i for i in range(n)]
    for lim in (NO_LIMIT, (0.05, 0.3)):
        assert_kernel_matches_twin(step(device, sh, xbc, dt, params, pool, slots, lim),
                                   step(host, sh, xbc, dt, params, pool, slots, lim))


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["groups", "limits"])
def test_gpu_matches_hf_golden(device, case):
    check_hf_golden(device, case)


@pytest.mark.gpu
def test_gpu_split_and_batch_invariance(device, rng):
    sh = Shape(2, 1, 32, 32, chunk=32)
    xbc, dt = sh.inputs(rng, 100)
    params, pool = sh.params(rng), sh.pool(rng, 2)
    whole, st_whole = prefill(device, sh, xbc, dt, params, pool, Call([100], [0], [0]))
    a, st = prefill(device, sh, xbc[:64], dt[:64], params, pool, Call([64], [0], [0]))
    b, st = prefill(device, sh, xbc[64:], dt[64:], params, st, Call([36], [0], [64]))
    assert np.array_equal(np.concatenate([a, b]), whole) and np.array_equal(st, st_whole)
    other, odt = sh.inputs(rng, 7)
    both, st2 = prefill(device, sh, np.concatenate([other, xbc]), np.concatenate([odt, dt]),
                        params, pool, Call([7, 100], [1, 0], [3, 0]))
    assert np.array_equal(both[7:], whole) and np.array_equal(st2[0], st_whole[0])
