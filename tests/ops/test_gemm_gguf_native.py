"""The native GEMM over GGUF planes (gpu_runtime/native/gemm_gguf.cpp, ops.gemm_gguf's twin by
address): every packed type on every native build (AVX-512 BF16, its float32 FMA steps, the
AVX2 build, the portable float64 one) and thread count gives exactly numpy's bits:
gemm_tc.dot_f32 on ops/gguf_planes.dequant_bf16 of the same planes."""
from __future__ import annotations

import numpy as np
import pytest

from metrale.formats.gguf.packed import split_blocks
from metrale.gpu_runtime import NULL, native
from metrale.gpu_runtime.host import LaunchContext
from metrale.ops import gemm_gguf as G
from metrale.ops import gemm_tc as T
from metrale.ops.bf16 import f32_to_bf16
from metrale.ops.gguf_planes import PACKED, dequant_bf16
from tests.formats.test_gguf_packed import random_blocks
from tests.helpers import GEMM_PATHS, Buffers, gemm_twin_path
from tests.ops.test_gemm_q import twin_host, xs
from tests.ops.test_gemm_tc import bits

TYPES = sorted(PACKED)
IDS = [PACKED[t].name for t in TYPES]
NATIVE = [p for p in GEMM_PATHS if p != "numpy"]


def ks_of(ggml_type: int) -> list[int]:
    """One block, several, and real model widths (576, 896 for 32-blocks; 256-multiples)."""
    return [32, 96, 576, 896] if PACKED[ggml_type].qk == 32 else [256, 768, 1536]


def planes(ggml_type: int, n: int, k: int, seed: int, finite: bool = True):
    return split_blocks(random_blocks(ggml_type, n, k, seed, finite), ggml_type, n, k)


def launch(be, p, x, n: int, out_fp32: bool, ldy: int | None = None) -> np.ndarray:
    """ops.gemm_gguf on backend be over the first n rows of planes p: y [m, n]; with ldy,
    the gap columns of every row must still hold their fill."""
    m = len(x)
    ldy = n if ldy is None else ldy
    dt = np.float32 if out_fp32 else np.uint16
    fill = np.full((m, ldy), 0x5A5A, dt) if not out_fp32 else np.full((m, ldy), -7.25, dt)
    with Buffers(be) as b:
        yp = b.put(fill)
        G.gemm_gguf(be, be.default_stream(), yp, b.put(x), b.put(p.q[:n]),
                    NULL if p.qh is None else b.put(p.qh[:n]), b.put(p.meta[:n]), m, n,
                    x.shape[1], p.ggml_type, ldy=ldy, out_fp32=out_fp32)
        y = b.get(yp, (m, ldy), dt)
    assert np.array_equal(bits(y[:, n:]), bits(fill[:, n:])), "wrote past n"
    return y[:, :n]


def want_of(p, x) -> np.ndarray:
    with np.errstate(invalid="ignore", over="ignore"):   # inf * 0 scales: NaN, as meant
        return T.dot_f32(x, dequant_bf16(p.q, p.qh, p.meta, p.ggml_type, p.k))


@pytest.mark.parametrize("ggml_type", TYPES, ids=IDS)
@pytest.mark.parametrize("path", NATIVE)
def test_every_type_build_thread_count_and_shape_gives_numpys_bits(rng, ggml_type, path):
    """n in 1, 7, 19, 111, m in 1, 3, 8, 17 (decode tiles of every row count's shape and the
    panel path), k from one block to real widths, 1, 2, 3 and 5 threads, ldy > n: every row
    equals numpy's, float32 and BF16 out."""
    with gemm_twin_path(path) as nat:
        be = twin_host(nat)
        try:
            for k in ks_of(ggml_type):
                p = planes(ggml_type, 111, k, k)
                x = xs(rng, 17, k)
                want = want_of(p, x)
                for threads in (1, 2, 3, 5):
                    nat._lib.md_set_threads(threads)
                    for m, n in ((1, 111), (3, 19), (8, 7), (17, 111), (1, 1), (17, 19)):
                        got = launch(be, p, x[:m], n, True, ldy=n + 3)
                        assert np.array_equal(bits(got), bits(want[:m, :n])), (k, threads, m, n)
                    got = launch(be, p, x[:8], 111, False)
                    assert np.array_equal(got, f32_to_bf16(want[:8])), (k, threads)
        finally:
            nat._lib.md_set_threads(native.usable_cpus())


def nonfinite_planes(ggml_type: int, n: int, k: int):
    """Planes with NaN, +-inf and subnormal f16 scales in some blocks (every f16 field of
    the type), finite elsewhere."""
    p = planes(ggml_type, n, k, 7)
    t = PACKED[ggml_type]
    fields = {"Q4_1": [0, 2], "Q5_1": [0, 2], "Q2_K": [16, 18], "Q3_K": [12], "Q4_K": [0, 2],
              "Q5_K": [0, 2], "Q6_K": [16]}.get(t.name, [0])
    meta = p.meta.reshape(n, k // t.qk, t.meta_bytes)
    specials = np.array([0x7C00, 0xFC00, 0x7E00, 0x0001, 0x8003, 0x7C01], np.uint16)
    for r in range(n):
        for i, f in enumerate(fields):
            blk = (3 * r + i) % meta.shape[1]
            meta[r, blk, f:f + 2] = specials[(r + i) % len(specials):][:1].view(np.uint8)
    return p


@pytest.mark.parametrize("ggml_type", TYPES, ids=IDS)
@pytest.mark.parametrize("path", NATIVE)
def test_nan_inf_and_subnormal_scales_give_numpys_bits(rng, ggml_type, path):
    """A NaN or infinite scale makes NaN / inf values (and NaN rows in y); a subnormal f16
    scale is exact: the same bits as numpy on every build, decode and prefill rows."""
    k = 576 if PACKED[ggml_type].qk == 32 else 512
    p = nonfinite_planes(ggml_type, 19, k)
    x = xs(rng, 12, k)
    want = want_of(p, x)
    assert np.isnan(want).any() and np.isfinite(want).any()
    with gemm_twin_path(path) as nat:
        be = twin_host(nat)
        for m in (1, 5, 12):
            got = launch(be, p, x[:m], 19, True)
            assert np.array_equal(bits(got), bits(want[:m])), m


@pytest.mark.parametrize("ggml_type", TYPES, ids=IDS)
def test_strided_rows_twin_takes_the_address_path(rng, ggml_type):
    """gguf_rows_twin (the fused twins' GEMM step) on a strided y view: the native library
    writes it by address, the gap untouched, numpy's bits."""
    k = 256
    p = planes(ggml_type, 9, k, 3)
    x = xs(rng, 2, k)
    want = want_of(p, x)
    with gemm_twin_path("fma") as nat:
        be = twin_host(nat)
        calls = []
        real = nat.gemm_gguf_at
        nat.gemm_gguf_at = lambda *a: calls.append(a) or real(*a)
        try:
            with Buffers(be) as b:
                qp, mp = b.put(p.q), b.put(p.meta)
                hp = NULL if p.qh is None else b.put(p.qh)
                y = np.full((2, 13), -1.0, np.float32)
                ctx = LaunchContext(be, (1, 1, 1), (1, 1, 1), 0)
                G.gguf_rows_twin(ctx, y[:, 2:11], x, qp, hp, mp, ggml_type, 9, k)
        finally:
            del nat.gemm_gguf_at
    assert len(calls) == 1 and calls[0][8] == 13
    assert np.array_equal(bits(y[:, 2:11]), bits(want))
    assert (y[:, :2] == -1).all() and (y[:, 11:] == -1).all()

