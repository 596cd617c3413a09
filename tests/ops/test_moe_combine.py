"""moe_combine family: the weighted sum of a token's expert outputs in its top-k slot
order (plus the gated shared expert); twin against float64 and its float32 formula; the
kernel against the twin."""
import numpy as np
import pytest

from metrale.gpu_runtime import kernel_source
from metrale.gpu_runtime.types import NULL
from metrale.ops import moe_combine as C
from metrale.ops.bf16 import bf16_to_f32, f32_to_bf16
from tests.conftest import assert_close, real
from tests.helpers import Buffers


def inputs(rng, n, k, h, shared=False, gate=False):
    y = rng.standard_normal((n * k, h)).astype(np.float32)
    w = rng.random((n, k)).astype(np.float32)
    s = rng.standard_normal((n, h)).astype(np.float32) if shared else None
    g = (rng.standard_normal(n) * 3).astype(np.float32) if gate else None
    return y, w, s, g


def run(backend, y, w, s=None, g=None, out_offset=0, out_fp32=False):
    n, k = w.shape
    h = y.shape[1]
    dt = np.float32 if out_fp32 else np.uint16
    with Buffers(backend) as b:
        op = b.empty((n * h + out_offset,), dt)
        C.moe_combine(backend, backend.default_stream(),
                      op.offset(np.dtype(dt).itemsize * out_offset), b.put(y),
                      b.put(w), n, h, k, NULL if s is None else b.put(s),
                      NULL if g is None else b.put(g), out_fp32=out_fp32)
        return b.get(op, (n * h + out_offset,), dt)[out_offset:].reshape(n, h)


def ref64(y, w, s=None, g=None):
    n, k = w.shape
    out = np.einsum("nk,nkh->nh", w.astype(np.float64), y.reshape(n, k, -1).astype(np.float64))
    if s is not None:
        gate = 1.0 if g is None else 1.0 / (1.0 + np.exp(-g.astype(np.float64)))[:, None]
        out = out + gate * s
    return out


def test_entry_points_exist():
    assert set(kernel_source.entry_points(C.MODULE)) == {"moe_combine", "moe_combine_f32"}


@pytest.mark.parametrize("shared,gate", [(False, False), (True, True)])
def test_twin_f32_is_the_sum_before_its_rounding(host, rng, shared, gate):
    """moe_combine_f32 stores the float32 sum moe_combine rounds: the same formula, in
    slot order; its BF16 rounding is moe_combine's output."""
    y, w, s, g = inputs(rng, 7, 3, 24, shared, gate)
    got = run(host, y, w, s, g, out_fp32=True)
    want = C.combine_f32(y.reshape(7, 3, 24), w, s, g)
    assert got.dtype == np.float32 and np.array_equal(got, want)
    assert np.array_equal(f32_to_bf16(got), run(host, y, w, s, g))


SIZES = [(1, 1, 8), (7, 2, 19), (19, 8, 64), (3, 4, 4097)]


@pytest.mark.parametrize("shared,gate", [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize("n,k,h", SIZES)
def test_twin_matches_float64(host, rng, n, k, h, shared, gate):
    y, w, s, g = inputs(rng, n, k, h, shared, gate)
    got = bf16_to_f32(run(host, y, w, s, g))
    assert_close(got, bf16_to_f32(f32_to_bf16(ref64(y, w, s, g).astype(np.float32))),
                 "twin_bf16")


def test_twin_sums_in_slot_order_in_float32():
    # 2^24 + 1 + 1 - 2^24: slot order gives 0 (each +1 lost to rounding), so the result is
    # not any other order's 2
    y = np.array([[2.0**24], [1.0], [1.0], [-(2.0**24)]], np.float32)
    w = np.ones((1, 4), np.float32)
    assert C.combine_f32(y.reshape(1, 4, 1), w)[0, 0] == 0.0
    assert C.combine_f32(y[[1, 2, 0, 3]].reshape(1, 4, 1), w)[0, 0] == 2.0


def test_twin_rows_are_batch_invariant(host, rng):
    y, w, s, g = inputs(rng, 12, 3, 40, True, True)
    full = run(host, y, w, s, g)
    one = run(host, y[15:18], w[5:6], s[5:6], g[5:6])
    assert np.array_equal(full[5], one[0])


@pytest.mark.gpu
@pytest.mark.parametrize("n,k,h", SIZES + [(5, 3, 20), real(64, 8, 2048), real(2048, 2, 4096)])
def test_gpu_matches_twin(device, host, rng, n, k, h):
    for shared, gate in ((False, False), (True, False), (True, True)):
        y, w, s, g = inputs(rng, n, k, h, shared, gate)
        got, want = run(device, y, w, s, g), run(host, y, w, s, g)
        assert_close(bf16_to_f32(got), bf16_to_f32(want), "gpu_vs_twin_bf16",
                     f"n={n} k={k} h={h} shared={shared} gate={gate}")
        if device.name == "emu" and not gate:
            # IEEE float32 steps on both sides (no expf): the same bits
            assert np.array_equal(got, want)
        got, want = run(device, y, w, s, g, out_fp32=True), run(host, y, w, s, g, out_fp32=True)
        assert_close(got, want, "gpu_vs_twin_fp32", f"fp32 n={n} k={k} h={h} gate={gate}")
        if device.name == "emu" and not gate:
            assert np.array_equal(got, want)


@pytest.mark.gpu
def test_gpu_unaligned_output_takes_the_scalar_path(device, rng):
    y, w, s, g = inputs(rng, 4, 2, 64, True, True)
    assert np.array_equal(run(device, y, w, s, g, out_offset=1), run(device, y, w, s, g))
    assert np.array_equal(run(device, y, w, s, g, out_offset=1, out_fp32=True),
                          run(device, y, w, s, g, out_fp32=True))
