"""HostBackend's native norm / rope / activation routines (native/norm_rope_act.cpp) against
the numpy twins they replace: RMSNorm and RoPE (+ q/k norm, + paged-cache write) bit for bit,
SiLU * up within one BF16 ulp (C's expf vs numpy's SIMD exp); and the fallbacks (overlaps,
bad positions or slots) still give the numpy twin's result or error."""
import numpy as np
import pytest

from metrale.errors import KernelError
from metrale.gpu_runtime import HostBackend
from metrale.ops import activation, rope
from metrale.ops.bf16 import bf16_to_f32, f32_to_bf16
from tests.helpers import Buffers
from tests.ops.test_gated_norm import run_offset
from tests.ops.test_rmsnorm import run_rmsnorm
from tests.ops.test_rope import kv_case, rand_bits, run_rope, run_rope_write_kv


@pytest.fixture(scope="module")
def native():
    be = HostBackend()
    if be.native is None:
        pytest.skip("no C++ compiler: HostBackend runs every twin in numpy")
    assert be.native.row_twins, "numpy's float32 sum order check failed on this machine"
    return be


@pytest.fixture(scope="module")
def numpy_only():
    return HostBackend(native=False)


def calls_native(be, name):
    """How many times the library routine `name` runs during the block (a counting proxy)."""
    class Count:
        n = 0

        def __enter__(self):
            self.orig = getattr(be.native, name)

            def wrapped(*a):
                Count.n += 1
                return self.orig(*a)
            setattr(be.native, name, wrapped)
            return self

        def __exit__(self, *exc):
            delattr(be.native, name)
    return Count()


@pytest.mark.parametrize("hidden", [1, 7, 19, 111, 576, 4097])
@pytest.mark.parametrize("rows", [1, 3, 33])
@pytest.mark.parametrize("mode", ["plain", "residual", "in_place"])
@pytest.mark.parametrize("weight_mode", ["llama", "once", "gemma"])
def test_rmsnorm_same_bits(native, numpy_only, rng, rows, hidden, mode, weight_mode):
    scale = rng.choice([1e-3, 1.0, 40.0])
    x = f32_to_bf16((rng.standard_normal((rows, hidden)) * scale).astype(np.float32))
    w = f32_to_bf16(rng.standard_normal(hidden).astype(np.float32))
    w[::5] = 0x8000   # -0.0: "once" keeps its sign, "gemma" adds 1
    res = f32_to_bf16(rng.standard_normal((rows, hidden)).astype(np.float32)) \
        if mode == "residual" else None
    kw = dict(residual=res, in_place=mode == "in_place", mode=weight_mode)
    with calls_native(native, "rmsnorm") as c:
        got = run_rmsnorm(native, x, w, **kw)
    assert c.n == 1
    want = run_rmsnorm(numpy_only, x, w, **kw)
    assert np.array_equal(got[0], want[0])
    if res is not None:
        assert np.array_equal(got[1], want[1])


@pytest.mark.parametrize("hidden", [1, 7, 19, 111, 1024, 4097])
@pytest.mark.parametrize("rows", [1, 3, 33])
@pytest.mark.parametrize("mode", ["plain", "residual", "in_place"])
@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_rmsnorm_offset_same_bits(native, numpy_only, rng, rows, hidden, mode, offset):
    """gated_norm's zero-centred norm (the hybrids' every layer norm) on the native rows."""
    x = f32_to_bf16((rng.standard_normal((rows, hidden)) * rng.choice([1e-3, 1.0, 40.0]))
                    .astype(np.float32))
    w = f32_to_bf16(rng.standard_normal(hidden).astype(np.float32) * 0.1)
    w[::5] = 0x8000
    res = f32_to_bf16(rng.standard_normal((rows, hidden)).astype(np.float32)) \
        if mode == "residual" else None
    kw = dict(residual=res, in_place=mode == "in_place", offset=offset)
    with calls_native(native, "rmsnorm") as c:
        got = run_offset(native, x, w, **kw)
    assert c.n == 1
    want = run_offset(numpy_only, x, w, **kw)
    assert np.array_equal(got[0], want[0])
    if res is not None:
        assert np.array_equal(got[1], want[1])


def test_rmsnorm_overlapping_rows_fall_back_to_numpy(native, numpy_only, rng):
    """out one row after x: the native routine cannot (it reads a row, then writes one);
    numpy's twin copies x first. Same result either way."""
    rows, hidden = 5, 64
    x = f32_to_bf16(rng.standard_normal((rows + 1, hidden)).astype(np.float32))
    w = f32_to_bf16(rng.standard_normal(hidden).astype(np.float32))
    from metrale.ops import rmsnorm as norm
    outs = []
    for be in (native, numpy_only):
        with Buffers(be) as b:
            p = b.put(x)
            with calls_native(native, "rmsnorm") as c:
                norm.rmsnorm(be, 0, p.offset(hidden * 2), p, b.put(w), rows, hidden, 1e-5)
            outs.append(b.get(p, x.shape, np.uint16))
    assert c.n == 0 and np.array_equal(outs[0], outs[1])


@pytest.mark.parametrize("n_tokens", [1, 7, 111])
@pytest.mark.parametrize("h,kv,d,norm", [(9, 3, 64, False), (4, 2, 128, True),
                                         (3, 3, 32, True), (4, 1, 6, False)])
def test_rope_same_bits(native, numpy_only, rng, n_tokens, h, kv, d, norm):
    table = rope.rope_table(d, 4096, 10000.0, None)
    qkv = rand_bits(rng, (n_tokens, (h + 2 * kv) * d), scale=3.0)
    pos = rng.integers(0, 4096, n_tokens).astype(np.int32)
    qn = rand_bits(rng, d) if norm else None
    kn = rand_bits(rng, d) if norm else None
    with calls_native(native, "rope_write_kv") as c:
        got = run_rope(native, qkv, pos, table, h, kv, d, qn, kn)
    assert c.n == 1
    assert np.array_equal(got, run_rope(numpy_only, qkv, pos, table, h, kv, d, qn, kn))


@pytest.mark.parametrize("n_tokens", [1, 19, 111])
@pytest.mark.parametrize("h,kv,d,norm", [(9, 3, 64, False), (3, 3, 32, True)])
def test_rope_write_kv_same_bits(native, numpy_only, rng, n_tokens, h, kv, d, norm):
    table = rope.rope_table(d, 4096, 10000.0, None)
    qkv, pos, slots, nb = kv_case(rng, n_tokens, h, kv, d, 4)
    if n_tokens > 2:
        slots[1] = slots[2] = max(int(slots[1]), 0)   # a repeated slot: the last token wins
    qn = rand_bits(rng, d) if norm else None
    with calls_native(native, "rope_write_kv") as c:
        got = run_rope_write_kv(native, qkv, pos, table, slots, nb, 4, h, kv, d, qn, qn)
    assert c.n == 1
    want = run_rope_write_kv(numpy_only, qkv, pos, table, slots, nb, 4, h, kv, d, qn, qn)
    for a, b in zip(got, want):
        assert np.array_equal(a, b)


def test_rope_bad_position_or_slot_raises_the_twins_error(native, rng):
    h, kv, d = 2, 1, 8
    table = rope.rope_table(d, 16, 10000.0, None)
    qkv, pos, slots, nb = kv_case(rng, 3, h, kv, d, 4, max_pos=16, pad_every=0)
    with pytest.raises(KernelError, match=r"positions\[1\] = 16 outside the table"):
        run_rope_write_kv(native, qkv, np.array([0, 16, 2], np.int32), table, slots, nb, 4,
                          h, kv, d)
    with pytest.raises(KernelError, match=r"slot_mapping\[2\] = 999 is outside"):
        run_rope_write_kv(native, qkv, pos, table, np.array([0, 1, 999], np.int32), nb, 4,
                          h, kv, d)


def run_act_mul(be, gate_up, act="silu"):
    rows, two_i = gate_up.shape
    with Buffers(be) as b:
        gp, op = b.put(gate_up), b.empty((rows, two_i // 2), np.uint16)
        activation.act_mul(be, 0, op, gp, rows, two_i // 2, act)
        return b.get(op, (rows, two_i // 2), np.uint16)


@pytest.mark.parametrize("intermediate", [1, 7, 19, 111, 1536, 4097])
@pytest.mark.parametrize("rows", [1, 5])
def test_silu_mul_within_one_bf16_ulp(native, numpy_only, rng, rows, intermediate):
    gu = f32_to_bf16((rng.standard_normal((rows, 2 * intermediate)) * 4).astype(np.float32))
    gu[0, :min(4, intermediate)] = f32_to_bf16(np.array([-100, 100, 0, -0.0], np.float32)
                                               [:min(4, intermediate)])
    with calls_native(native, "silu_mul") as c:
        got = run_act_mul(native, gu)
    assert c.n == 1
    want = run_act_mul(numpy_only, gu)
    ulps = np.abs(got.astype(np.int32) - want.astype(np.int32))
    assert ulps.max() <= 1
    assert (ulps > 0).mean() < 0.01          # only values near a rounding boundary
    # and against float64
    g = bf16_to_f32(gu[:, :intermediate]).astype(np.float64)
    ref = g / (1 + np.exp(-g)) * bf16_to_f32(gu[:, intermediate:])
    np.testing.assert_allclose(bf16_to_f32(got), ref, rtol=1e-2, atol=1e-2)


def test_silu_mul_over_exps_whole_range(native, numpy_only):
    """gate over [-110, 95] (e^-g past float32's range both ways, subnormal silu values),
    NaN and infinities, up = 1 and 3: the native exp's overflow, underflow and NaN agree
    with numpy's, every value within one BF16 ulp."""
    g = np.concatenate([np.linspace(-110, 95, 4093, dtype=np.float32),
                        np.array([np.nan, np.inf, -np.inf, 0.0, -0.0], np.float32)])
    gu = f32_to_bf16(np.concatenate([np.stack([g, g]), np.stack([np.ones_like(g),
                                                                 3 * np.ones_like(g)])], 1))
    with calls_native(native, "silu_mul") as c:
        got = run_act_mul(native, gu)
    assert c.n == 1
    want = run_act_mul(numpy_only, gu)
    nan = np.isnan(bf16_to_f32(want))
    assert np.array_equal(np.isnan(bf16_to_f32(got)), nan)
    ulps = np.abs(got[~nan].astype(np.int32) - want[~nan].astype(np.int32))
    assert ulps.max() <= 1


def test_other_activations_stay_in_numpy(native, numpy_only, rng):
    gu = f32_to_bf16(rng.standard_normal((3, 38)).astype(np.float32))
    with calls_native(native, "silu_mul") as c:
        got = run_act_mul(native, gu, "gelu_tanh")
    assert c.n == 0 and np.array_equal(got, run_act_mul(numpy_only, gu, "gelu_tanh"))
