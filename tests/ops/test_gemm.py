"""gemm (cuBLAS / its twin) and the batch-invariant gemv kernel (module "gemv")."""
import numpy as np
import pytest

from metrale.errors import InvalidArgument
from metrale.gpu_runtime import kernel_source
from metrale.ops import gemm as G
from metrale.ops.bf16 import bf16_to_f32, f32_to_bf16
from tests.conftest import assert_close, real
from tests.helpers import Buffers


def rand_bf16(rng, shape, scale=1.0):
    return f32_to_bf16((rng.standard_normal(shape, dtype=np.float32) * np.float32(scale)))


def operands(rng, m, n, k):
    # scales keep |y| ~ 1 so the absolute part of the tolerances is meaningful
    return rand_bf16(rng, (m, k)), rand_bf16(rng, (n, k), 1.0 / np.sqrt(k))


def run_gemv(backend, x, w, out_fp32=False, rows=None):
    """y for the rows `rows` (a slice of x's rows, launched with x/y pointers offset)."""
    m_all, k = x.shape
    n = w.shape[0]
    r0, r1 = (0, m_all) if rows is None else rows
    dt = np.float32 if out_fp32 else np.uint16
    with Buffers(backend) as b:
        xp, wp = b.put(x), b.put(w)
        yp = b.empty((m_all, n), dt)
        G.gemv(backend, backend.default_stream(), yp.offset(r0 * n * np.dtype(dt).itemsize),
               xp.offset(r0 * k * 2), wp, r1 - r0, n, k, out_fp32=out_fp32)
        return b.get(yp, (m_all, n), dt)[r0:r1]


def run_gemm(backend, x, w):
    m, k = x.shape
    n = w.shape[0]
    with Buffers(backend) as b:
        xp, wp, yp = b.put(x), b.put(w), b.empty((m, n), np.uint16)
        G.gemm(backend, backend.default_stream(), yp, xp, wp, m, n, k)
        return b.get(yp, (m, n), np.uint16)


def ref64(x, w):
    return bf16_to_f32(x).astype(np.float64) @ bf16_to_f32(w).astype(np.float64).T


def as_f32(y):
    return y if y.dtype == np.float32 else bf16_to_f32(y)


def test_entry_points_exist():
    assert {"gemv_bf16", "gemv_fp32"} <= set(kernel_source.entry_points(G.MODULE))


@pytest.mark.parametrize("m,n,k", [(1, 1, 1), (1, 7, 19), (7, 19, 111), (19, 111, 8),
                                   (3, 4097, 64), (9, 33, 4097), (2, 5, 4096)])
def test_gemm_matches_float64(host, rng, m, n, k):
    x, w = operands(rng, m, n, k)
    got = run_gemm(host, x, w)
    assert_close(bf16_to_f32(got), bf16_to_f32(f32_to_bf16(ref64(x, w).astype(np.float32))),
                 "twin_bf16")


@pytest.mark.parametrize("out_fp32", [False, True])
@pytest.mark.parametrize("m,n,k", [(1, 1, 1), (1, 7, 19), (7, 19, 111), (19, 111, 8),
                                   (3, 4097, 64), (9, 33, 4097), (8, 16, 256), (17, 40, 24)])
def test_gemv_matches_float64(host, rng, m, n, k, out_fp32):
    x, w = operands(rng, m, n, k)
    got = run_gemv(host, x, w, out_fp32)
    ref = ref64(x, w)
    if out_fp32:
        assert got.dtype == np.float32
        assert_close(got, ref, "twin_fp32")
    else:
        assert_close(bf16_to_f32(got), bf16_to_f32(f32_to_bf16(ref.astype(np.float32))),
                     "twin_bf16")


def test_gemv_real_size_m1(host, rng):
    x, w = operands(rng, 1, 4096, 4096)
    ref = ref64(x, w)
    assert_close(run_gemv(host, x, w, out_fp32=True), ref, "twin_fp32")
    assert_close(bf16_to_f32(run_gemv(host, x, w)),
                 bf16_to_f32(f32_to_bf16(ref.astype(np.float32))), "twin_bf16")


def check_batch_invariance(backend, x, w, out_fp32):
    """Row i alone (m=1) must equal row i inside m=7 and inside m=64 bit for bit."""
    full = run_gemv(backend, x, w, out_fp32)                 # m = 64 (8 row tiles)
    first7 = run_gemv(backend, x, w, out_fp32, rows=(0, 7))  # m = 7
    mid7 = run_gemv(backend, x, w, out_fp32, rows=(13, 20))  # m = 7, crossing a tile edge
    bits = (lambda a: a.view(np.uint32)) if out_fp32 else (lambda a: a)
    assert np.array_equal(bits(first7), bits(full[:7]))
    assert np.array_equal(bits(mid7), bits(full[13:20]))
    for i in (0, 3, 6, 13, 15, 16, 19, 40, 63):
        single = run_gemv(backend, x, w, out_fp32, rows=(i, i + 1))
        assert np.array_equal(bits(single[0]), bits(full[i])), f"row {i} differs at m=1"


@pytest.mark.parametrize("out_fp32", [False, True])
@pytest.mark.parametrize("n,k", [(37, 256), (19, 19), (64, 4096), (5, 4104)])
def test_gemv_batch_invariance(host, rng, n, k, out_fp32):
    x, w = operands(rng, 64, n, k)
    check_batch_invariance(host, x, w, out_fp32)


@pytest.mark.parametrize("m,n,k", [(1, 64, 4096), (8, 100, 512), (64, 37, 1000)])
def test_gemm_and_gemv_agree(host, rng, m, n, k):
    # Same products, different FP32 summation order (one matmul vs per-row products): a
    # BF16 result may cross one rounding boundary, the case gpu_vs_twin_bf16 describes.
    x, w = operands(rng, m, n, k)
    assert_close(bf16_to_f32(run_gemm(host, x, w)), bf16_to_f32(run_gemv(host, x, w)),
                 "gpu_vs_twin_bf16")


def test_gemv_fp32_widens_to_bf16_result(host, rng):
    x, w = operands(rng, 5, 50, 300)
    y32 = run_gemv(host, x, w, out_fp32=True)
    assert np.array_equal(f32_to_bf16(y32), run_gemv(host, x, w))


def test_bad_sizes_raise_before_launch(host):
    for fn in (G.gemm, G.gemv):
        for args, name in (((0, 4, 4), "m"), ((4, 0, 4), "n"), ((4, 4, -1), "k")):
            with pytest.raises(InvalidArgument, match=f"{name} must be"):
                fn(host, 0, 8, 8, 8, *args)
        with pytest.raises(InvalidArgument, match="NULL"):
            fn(host, 0, 8, 0, 8, 1, 1, 1)
    with pytest.raises(InvalidArgument, match="grid.y"):
        G.gemv(host, 0, 8, 8, 8, 1, 65535 * 16 + 1, 8)


# ---------------------------------------------------------------------------------------
# GPU: kernel against twin at real sizes, and batch invariance of the kernel itself.

GPU_SHAPES = [  # (n, k)
    (1, 1), (7, 19), (111, 4097), (4097, 64), (37, 256), (19, 1000),
    real(4096, 4096), real(6144, 4096), real(28672, 4096), real(4096, 14336),  # Llama-3-8B
    real(3584, 3584), real(37888, 3584), real(3584, 18944),                    # Qwen2-7B
    real(5120, 5120), real(5120, 13824),                                       # 13B-class
]


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 8, 64])
@pytest.mark.parametrize("n,k", GPU_SHAPES)
def test_gpu_gemv_matches_twin(device, host, rng, m, n, k):
    x, w = operands(rng, m, n, k)
    for out_fp32 in (False, True):
        a, h = run_gemv(device, x, w, out_fp32), run_gemv(host, x, w, out_fp32)
        kind = "gpu_vs_twin_fp32" if out_fp32 else "gpu_vs_twin_bf16"
        assert_close(as_f32(a), as_f32(h), kind, f"m={m} n={n} k={k} fp32={out_fp32}")


@pytest.mark.gpu
@pytest.mark.real_size
@pytest.mark.parametrize("m", [1, 8, 64])
def test_gpu_gemv_lm_head(device, host, rng, m):
    n, k = 128256, 4096
    x, w = operands(rng, m, n, k)
    for out_fp32 in (True, False):
        a, h = run_gemv(device, x, w, out_fp32), run_gemv(host, x, w, out_fp32)
        kind = "gpu_vs_twin_fp32" if out_fp32 else "gpu_vs_twin_bf16"
        assert_close(as_f32(a), as_f32(h), kind, f"lm_head m={m} fp32={out_fp32}")


@pytest.mark.gpu
@pytest.mark.parametrize("out_fp32", [False, True])
@pytest.mark.parametrize("n,k", [(37, 256), (19, 19), (129, 4104), real(4096, 4096),
                                 real(4096, 14336), real(128256, 4096)])
def test_gpu_gemv_batch_invariance(device, rng, n, k, out_fp32):
    x, w = operands(rng, 64, n, k)
    check_batch_invariance(device, x, w, out_fp32)


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k", [real(1, 4096, 4096), real(8, 14336, 4096),
                                   real(64, 4096, 14336), (7, 19, 111), (33, 70, 256),
                                   real(300, 4096, 4096)])
def test_gpu_gemm_matches_twin(device, host, rng, m, n, k):
    x, w = operands(rng, m, n, k)
    assert_close(bf16_to_f32(run_gemm(device, x, w)), bf16_to_f32(run_gemm(host, x, w)),
                 "gpu_vs_twin_bf16")
