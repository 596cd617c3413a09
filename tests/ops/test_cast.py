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
