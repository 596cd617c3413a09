"""elementwise family: in-place bias add and residual add, FP32 math, one BF16 rounding."""
import numpy as np
import pytest

from metrale.errors import InvalidArgument
from metrale.gpu_runtime import kernel_source
from metrale.ops import elementwise
from metrale.ops.bf16 import bf16_to_f32, f32_to_bf16
from tests.conftest import assert_close
from tests.helpers import Buffers


def rand_bf16(rng, shape, scale=1.0):
    return f32_to_bf16((rng.standard_normal(shape) * scale).astype(np.float32))


def run_add_bias(backend, x_bits, bias_bits):
    r, w = x_bits.shape
    with Buffers(backend) as b:
        xp, bp = b.put(x_bits), b.put(bias_bits)
        elementwise.add_bias(backend, backend.default_stream(), xp, bp, r, w)
        return b.get(xp, (r, w), np.uint16)


def run_add_inplace(backend, x_bits, y_bits, offset_elems=0):
    n = x_bits.size - offset_elems
    with Buffers(backend) as b:
        xp, yp = b.put(x_bits), b.put(y_bits)
        elementwise.add_inplace(backend, backend.default_stream(), xp.offset(2 * offset_elems),
                                yp.offset(2 * offset_elems), n)
        return b.get(xp, (x_bits.size,), np.uint16)


def test_entry_points_exist():
    assert {"add_bias", "add_inplace"} <= set(kernel_source.entry_points(elementwise.MODULE))


@pytest.mark.parametrize("rows", [1, 7, 19])
@pytest.mark.parametrize("width", [1, 7, 19, 111, 4097, 4096])
def test_add_bias_matches_float64(host, rng, rows, width):
    x, bias = rand_bf16(rng, (rows, width)), rand_bf16(rng, (width,))
    got = run_add_bias(host, x, bias)
    ref = bf16_to_f32(x).astype(np.float64) + bf16_to_f32(bias).astype(np.float64)[None]
    assert_close(bf16_to_f32(got), bf16_to_f32(f32_to_bf16(ref.astype(np.float32))),
                 "twin_bf16")
    # one rounding of an exact (float32-representable) sum: bit-exact
    assert np.array_equal(got, f32_to_bf16(ref.astype(np.float32)))


@pytest.mark.parametrize("n", [1, 7, 19, 111, 4097, 4096 * 64])
def test_add_inplace_matches_float64(host, rng, n):
    x, y = rand_bf16(rng, (n,)), rand_bf16(rng, (n,), 3.0)
    got = run_add_inplace(host, x, y)
    ref = bf16_to_f32(x).astype(np.float64) + bf16_to_f32(y).astype(np.float64)
    assert_close(bf16_to_f32(got), ref, "twin_bf16")
    assert np.array_equal(got, f32_to_bf16(ref.astype(np.float32)))


def test_add_inplace_aliased_doubles(host, rng):
    x = rand_bf16(rng, (37,))
    with Buffers(host) as b:
        xp = b.put(x)
        elementwise.add_inplace(host, 0, xp, xp, 37)
        got = b.get(xp, (37,), np.uint16)
    assert np.array_equal(got, f32_to_bf16(2 * bf16_to_f32(x)))


def test_add_inplace_unaligned_offset(host, rng):
    x, y = rand_bf16(rng, (50,)), rand_bf16(rng, (50,))
    got = run_add_inplace(host, x, y, offset_elems=3)
    assert np.array_equal(got[:3], x[:3])  # untouched
    assert np.array_equal(got[3:], f32_to_bf16(bf16_to_f32(x[3:]) + bf16_to_f32(y[3:])))


def test_bad_sizes_raise_before_launch(host):
    with pytest.raises(InvalidArgument, match="n_rows"):
        elementwise.add_bias(host, 0, 8, 8, 0, 4)
    with pytest.raises(InvalidArgument, match="width"):
        elementwise.add_bias(host, 0, 8, 8, 4, 0)
    with pytest.raises(InvalidArgument, match="n must be"):
        elementwise.add_inplace(host, 0, 8, 8, 0)
    with pytest.raises(InvalidArgument, match="NULL"):
        elementwise.add_inplace(host, 0, 8, 0, 5)


@pytest.mark.gpu
@pytest.mark.parametrize("rows,width", [(1, 1), (7, 19), (19, 111), (3, 4097), (64, 4096),
                                        (17, 3584), (5, 5120), (8, 14336), (4, 18944)])
def test_gpu_add_bias_matches_twin(device, host, rng, rows, width):
    x, bias = rand_bf16(rng, (rows, width)), rand_bf16(rng, (width,))
    assert np.array_equal(run_add_bias(device, x, bias), run_add_bias(host, x, bias))


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1, 7, 19, 111, 4097, 4096 * 64, 5120 * 33 + 5])
@pytest.mark.parametrize("offset", [0, 1])
def test_gpu_add_inplace_matches_twin(device, host, rng, n, offset):
    x, y = rand_bf16(rng, (n + offset,)), rand_bf16(rng, (n + offset,))
    assert np.array_equal(run_add_inplace(device, x, y, offset), run_add_inplace(host, x, y, offset))


# ---------------------------------------------------------------- scale and soft-cap (issue 40)
def run_scale(backend, x_bits, scale, offset_elems=0):
    n = x_bits.size - offset_elems
    with Buffers(backend) as b:
        xp = b.put(x_bits)
        elementwise.scale_inplace(backend, backend.default_stream(), xp.offset(2 * offset_elems),
                                  scale, n)
        return b.get(xp, (x_bits.size,), np.uint16)


def run_softcap(backend, x, cap, offset_elems=0):
    """x: uint16 BF16 bits or float32 values."""
    fp32 = x.dtype == np.float32
    n = x.size - offset_elems
    with Buffers(backend) as b:
        xp = b.put(x)
        elementwise.softcap_inplace(backend, backend.default_stream(),
                                    xp.offset(x.itemsize * offset_elems), cap, n, fp32)
        return b.get(xp, x.shape, x.dtype)


@pytest.mark.parametrize("n", [1, 7, 111, 4097, 4096])
def test_scale_inplace_matches_float64(host, rng, n):
    """Gemma's embedding normalizer: sqrt(640) as BF16 (25.25) times BF16 rows, one rounding
    of an exact product: bit-exact against float64."""
    x = rand_bf16(rng, (n,))
    s = float(bf16_to_f32(f32_to_bf16(np.array([640 ** 0.5], np.float32)))[0])
    got = run_scale(host, x, s)
    want = f32_to_bf16((bf16_to_f32(x).astype(np.float64) * s).astype(np.float32))
    assert np.array_equal(got, want)


@pytest.mark.parametrize("fp32", [False, True])
@pytest.mark.parametrize("n", [1, 7, 111, 4097])
def test_softcap_inplace_matches_float64(host, rng, n, fp32):
    cap = 30.0
    x = (rng.standard_normal(n) * 40).astype(np.float32)
    x = x if fp32 else f32_to_bf16(x)
    got = run_softcap(host, x, cap)
    xf = (x if fp32 else bf16_to_f32(x)).astype(np.float64)
    want = np.tanh(xf / cap) * cap
    if fp32:
        assert_close(got, want, "twin_fp32")
    else:
        assert_close(bf16_to_f32(got), want, "twin_bf16")
    assert np.all(np.abs(want) <= cap) and np.max(np.abs(xf - want)) > 1.0   # it bends


def test_scale_and_softcap_bad_arguments(host):
    for cap in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(InvalidArgument, match="cap"):
            elementwise.softcap_inplace(host, 0, 64, cap, 16)
    with pytest.raises(InvalidArgument, match="scale"):
        elementwise.scale_inplace(host, 0, 64, float("inf"), 16)
    with pytest.raises(InvalidArgument, match="n"):
        elementwise.scale_inplace(host, 0, 64, 2.0, 0)


@pytest.mark.gpu
@pytest.mark.parametrize("offset", [0, 1])
@pytest.mark.parametrize("n", [1, 7, 111, 4097, 3 * 4096 + 5])
def test_gpu_scale_and_softcap_match_twin(device, host, rng, n, offset):
    x = rand_bf16(rng, (n + offset,), 20.0)
    assert np.array_equal(run_scale(device, x, 48.0, offset), run_scale(host, x, 48.0, offset))
    for arr in (x, (rng.standard_normal(n + offset) * 40).astype(np.float32)):
        g, t = run_softcap(device, arr, 30.0, offset), run_softcap(host, arr, 30.0, offset)
        if arr.dtype == np.float32:
            assert_close(g, t, "gpu_vs_twin_fp32")
        else:
            assert_close(bf16_to_f32(g), bf16_to_f32(t), "gpu_vs_twin_bf16")
