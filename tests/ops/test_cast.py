"""cast family: BF16 <-> FP32 conversions are bit-exact on every path (vector and tail)."""
import ml_dtypes
import numpy as np
import pytest

from metrale.errors import InvalidArgument
from metrale.gpu_runtime import kernel_source
from metrale.ops import cast
from metrale.ops.bf16 import bf16_to_f32, f32_to_bf16
from tests.conftest import real
from tests.helpers import Buffers

SIZES = [1, 7, 8, 19, 111, 4097, 65536 + 3]


def special_f32(rng, n):
    x = (rng.standard_normal(n) * 10.0 ** rng.integers(-30, 30, n)).astype(np.float32)
    pool = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 1e-40, -1e-40, 3.4e38, -3.4e38,
                     1.00390625, 1.01171875, 65504.0], np.float32)
    k = min(n, pool.size)
    x[:k] = pool[:k]
    return x


def run_bf16_to_f32(backend, bits, offset_elems=0):
    n = bits.size - offset_elems
    with Buffers(backend) as b:
        xp, op = b.put(bits), b.empty((n,), np.float32)
        cast.bf16_to_f32(backend, backend.default_stream(), op, xp.offset(2 * offset_elems), n)
        return b.get(op, (n,), np.float32)


def run_f32_to_bf16(backend, x, offset_elems=0):
    n = x.size - offset_elems
    with Buffers(backend) as b:
        xp, op = b.put(x), b.empty((n,), np.uint16)
        cast.f32_to_bf16(backend, backend.default_stream(), op, xp.offset(4 * offset_elems), n)
        return b.get(op, (n,), np.uint16)


def test_entry_points_exist():
    assert {"bf16_to_f32", "f32_to_bf16"} <= set(kernel_source.entry_points(cast.MODULE))


@pytest.mark.parametrize("n", SIZES)
def test_roundtrip_against_ml_dtypes(host, rng, n):
    x = special_f32(rng, n)
    ref_bits = x.astype(ml_dtypes.bfloat16).view(np.uint16)
    got_bits = run_f32_to_bf16(host, x)
    nan = np.isnan(x)
    assert np.array_equal(got_bits[~nan], ref_bits[~nan])
    assert np.all(np.isnan(bf16_to_f32(got_bits[nan])))
    back = run_bf16_to_f32(host, got_bits)
    ref_back = got_bits.view(ml_dtypes.bfloat16).astype(np.float32)
    assert np.array_equal(back.view(np.uint32)[~nan], ref_back.view(np.uint32)[~nan])
    assert np.all(np.isnan(back[nan]))


def test_native_conversions_equal_numpy_on_every_kind_of_value(rng):
    # ops.bf16 hands every FP32 -> BF16 conversion, and widenings of NATIVE_MIN_ELEMENTS or
    # more, to the native library: it must give numpy's bits for every float32 class (NaN payloads and signs, infinities,
    # subnormals, ties) and every bf16 pattern
    from metrale.gpu_runtime import native
    from metrale.ops import bf16
    nat = native.try_load()
    if nat is None:
        pytest.skip("no C++ compiler: the native library cannot be built")
    u = rng.integers(0, 2**32, 1 << 20, dtype=np.uint64).astype(np.uint32)
    u[:16] = [0x7FC00000, 0xFFC00000, 0x7F800001, 0xFF800001, 0x7FFFFFFF, 0xFFFFFFFF,
              0x7F800000, 0xFF800000, 0, 0x80000000, 1, 0x807FFFFF, 0x3F808000, 0x3F818000,
              0x7F7FFFFF, 0x7F7F8000]
    x = u.view(np.float32)
    for n in (0, 1, 17, bf16.NATIVE_MIN_ELEMENTS - 1, bf16.NATIVE_MIN_ELEMENTS, x.size):
        got = bf16.f32_to_bf16(x[:n])
        assert np.array_equal(got, bf16.f32_to_bf16_numpy(x[:n])), n
        assert np.array_equal(bf16.bf16_to_f32(got).view(np.uint32), got.astype(np.uint32) << 16)
    assert np.array_equal(nat.f32_to_bf16(x, np.empty(x.size, np.uint16)),
                          bf16.f32_to_bf16_numpy(x))
    every = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    widened = nat.bf16_to_f32(every, np.empty(every.size, np.float32))
    assert np.array_equal(widened.view(np.uint32), every.astype(np.uint32) << 16)
    assert np.array_equal(bf16.bf16_to_f32(every).view(np.uint32), widened.view(np.uint32))
    with pytest.raises(ValueError):
        nat.f32_to_bf16(x[::2], np.empty(x.size // 2, np.uint16))   # not contiguous


def test_every_nan_becomes_the_canonical_bf16_nan(host):
    # sign, quiet/signalling and payload bits all vanish, as with cvt.rn.bf16.f32 on sm_80+
    bits = np.array([0x7FC00000, 0xFFC00000, 0x7F800001, 0xFF800001, 0x7FFFFFFF, 0xFFFFFFFF,
                     0x7FA5A5A5], np.uint32)
    got = run_f32_to_bf16(host, bits.view(np.float32))
    assert list(got) == [0x7FFF] * bits.size


def test_round_to_nearest_even_ties(host):
    # 1 + 2^-8 is a tie between 1 and 1 + 2^-7: even mantissa (1.0) wins; 1 + 3*2^-8 -> up.
    x = np.array([1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), 1 + 2**-8 + 2**-20], np.float32)
    got = run_f32_to_bf16(host, x)
    assert list(got) == [0x3F80, 0x3F82, 0xBF80, 0x3F81]


def test_unaligned_pointer_takes_scalar_path(host, rng):
    x = special_f32(rng, 40)
    assert np.array_equal(run_f32_to_bf16(host, x, offset_elems=1), f32_to_bf16(x[1:]))


def test_bad_sizes_raise_before_launch(host):
    with pytest.raises(InvalidArgument, match="n must be"):
        cast.bf16_to_f32(host, 0, 8, 8, 0)
    with pytest.raises(InvalidArgument, match="n must be"):
        cast.f32_to_bf16(host, 0, 8, 8, -3)
    with pytest.raises(InvalidArgument, match="NULL"):
        cast.f32_to_bf16(host, 0, 0, 8, 4)


@pytest.mark.gpu
@pytest.mark.parametrize("n", SIZES + [real(4096 * 128256 // 16)])
@pytest.mark.parametrize("offset", [0, 1])
def test_gpu_matches_twin(device, host, rng, n, offset):
    x = special_f32(rng, n + offset)
    a, h = run_f32_to_bf16(device, x, offset), run_f32_to_bf16(host, x, offset)
    assert np.array_equal(a, h)
    a, h = run_bf16_to_f32(device, h), run_bf16_to_f32(host, h)
    assert np.array_equal(a.view(np.uint32), h.view(np.uint32))
