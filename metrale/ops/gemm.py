"""Matrix products in the nn.Linear layout, Y[m, n] = X[m, k] @ W[n, k]^T, BF16 in, FP32
accumulation.

* `gemm` — cuBLAS through `backend.gemm_bf16` (prefill, large m). Not capturable in a CUDA
  graph through CuPy. `gemm_twin` is HostBackend.gemm_bf16's numpy implementation.
* `gemv` — the project's own memory-bound kernel (kernels/gemv.cu, module "gemv") for
  decode (small m), capturable. BATCH-INVARIANT: y[i, j] is computed with the same
  reduction order whatever m is (see the .cu header). `out_fp32=True` writes float32 Y
  (FP32 logits) instead of BF16. Its twin is batch-invariant too: every row is its own
  float32 matrix-vector product over the same fixed column chunks of W, never one matmul
  whose blocking could depend on m.
"""
from __future__ import annotations

import numpy as np

from ..errors import InvalidArgument
from ..gpu_runtime.types import DevicePtr
from .bf16 import bf16_to_f32, f32_to_bf16
from .checks import check_ptrs, check_sizes
from ..gpu_runtime import twins as _twin_table
from .registry import twin

MODULE = "gemv"
GEMV_THREADS = 256
GEMV_ROWS = 8           # rows of x per CTA (grid.x tiles m)
GEMV_COLS_PER_CTA = 16  # 8 warps x 2 columns (grid.y tiles n)
_MAX_GRID_Y = 65535
# Twin working set: W is widened to float32 in chunks of about this many elements. The chunk
# height depends only on k, so it is the same for every m (batch invariance).
_CHUNK_ELEMS = 1 << 24


def _check(what: str, m: int, n: int, k: int, **ptrs) -> None:
    check_sizes(what, m=m, n=n, k=k)
    check_ptrs(what, **ptrs)


def gemm(backend, stream: int, y_ptr, x_ptr, w_ptr, m: int, n: int, k: int) -> None:
    """Y[m, n] = X[m, k] @ W[n, k]^T, BF16 in/out, FP32 accumulation (cuBLAS on CUDA)."""
    _check("gemm", m, n, k, y_ptr=y_ptr, x_ptr=x_ptr, w_ptr=w_ptr)
    if not backend.has_gemm():
        # No cuBLAS library on this machine: the GEMV kernel computes the same product
        # (memory-bound, so slow for long prompts, but correct).
        gemv(backend, stream, y_ptr, x_ptr, w_ptr, m, n, k)
        return
    backend.gemm_bf16(int(m), int(n), int(k), DevicePtr(x_ptr), DevicePtr(w_ptr),
                      DevicePtr(y_ptr), stream)


def gemm_twin(backend, m, n, k, x_ptr, w_ptr, y_ptr) -> None:
    """HostBackend.gemm_bf16: float64 matmul (W widened in column chunks), BF16 store.

    float64 makes each row's result independent of m in practice: BLAS may block a
    matmul differently for different m, but those differences sit ~1e-16 below the value
    and almost never survive the rounding to BF16. So a prompt chunked differently (a
    scheduler's chunked prefill vs one whole prefill) gives the same cache on the host.
    """
    m, n, k = int(m), int(n), int(k)
    x = bf16_to_f32(backend.read(x_ptr, m * k, np.uint16)).reshape(m, k).astype(np.float64)
    w = backend.read(w_ptr, n * k, np.uint16).reshape(n, k)
    y = np.empty((m, n), np.float32)
    step = max(1, _CHUNK_ELEMS // k)
    for j0 in range(0, n, step):
        y[:, j0:j0 + step] = x @ bf16_to_f32(w[j0:j0 + step]).astype(np.float64).T
    backend.view(y_ptr, m * n, np.uint16).reshape(m, n)[:] = f32_to_bf16(y)


_twin_table.register("cublas", "gemm_bf16", gemm_twin)


def gemv(backend, stream: int, y_ptr, x_ptr, w_ptr, m: int, n: int, k: int,
         out_fp32: bool = False) -> None:
    """Y[m, n] = X[m, k] @ W[n, k]^T with the batch-invariant GEMV kernel.

    x: [m, k] bf16; w: [n, k] bf16; y: [m, n] bf16, or float32 when out_fp32. Any k >= 1
    (128-bit loads when k % 8 == 0 and x, w are 16-byte aligned); n <= 65535 * 16.
    """
    _check("gemv", m, n, k, y_ptr=y_ptr, x_ptr=x_ptr, w_ptr=w_ptr)
    grid_y = -(-int(n) // GEMV_COLS_PER_CTA)
    if grid_y > _MAX_GRID_Y:
        raise InvalidArgument(f"gemv: n = {n} exceeds {_MAX_GRID_Y * GEMV_COLS_PER_CTA} "
                              "(grid.y limit)")
    grid = (-(-int(m) // GEMV_ROWS), grid_y)
    func = "gemv_fp32" if out_fp32 else "gemv_bf16"
    backend.launch(backend.kernel(MODULE, func), grid, (GEMV_THREADS,), 0, stream,
                   (DevicePtr(y_ptr), DevicePtr(x_ptr), DevicePtr(w_ptr), np.int32(m),
                    np.int32(n), np.int32(k)))


def gemv_rows_f32(x: np.ndarray, w_bits: np.ndarray) -> np.ndarray:
    """Batch-invariant float32 reference: x [m, k] float32, w_bits [n, k] uint16 -> [m, n].

    Each output row is computed on its own as `W_chunk @ x_row` (a fresh contiguous copy of
    the row), over column chunks whose height depends only on k.
    """
    m, k = x.shape
    n = w_bits.shape[0]
    y = np.empty((m, n), np.float32)
    step = max(1, _CHUNK_ELEMS // k)
    rows = [np.array(x[i], dtype=np.float32, copy=True) for i in range(m)]
    for j0 in range(0, n, step):
        wf = bf16_to_f32(w_bits[j0:j0 + step])
        for i in range(m):
            y[i, j0:j0 + step] = wf @ rows[i]
    return y


def _gemv_twin(ctx, y_ptr, x_ptr, w_ptr, m, n, k, out_dtype) -> None:
    m, n, k = int(m), int(n), int(k)
    x = bf16_to_f32(ctx.read(x_ptr, m * k, np.uint16)).reshape(m, k)
    w = ctx.read(w_ptr, n * k, np.uint16).reshape(n, k)
    y = gemv_rows_f32(x, w)
    if out_dtype == np.float32:
        ctx.view(y_ptr, m * n, np.float32).reshape(m, n)[:] = y
    else:
        ctx.view(y_ptr, m * n, np.uint16).reshape(m, n)[:] = f32_to_bf16(y)


@twin(MODULE, "gemv_bf16")
def gemv_bf16_twin(ctx, y_ptr, x_ptr, w_ptr, m, n, k) -> None:
    _gemv_twin(ctx, y_ptr, x_ptr, w_ptr, m, n, k, np.uint16)


@twin(MODULE, "gemv_fp32")
def gemv_fp32_twin(ctx, y_ptr, x_ptr, w_ptr, m, n, k) -> None:
    _gemv_twin(ctx, y_ptr, x_ptr, w_ptr, m, n, k, np.float32)
