"""HostBackend's converted-weight cache: every way an allocation can be written drops its
conversions (a stale conversion served gives a wrong GEMM here), the budget, pinning by
views handed out; and the GEMM twin's native and numpy paths agreeing bit for bit."""
import gc

import numpy as np
import pytest

from metrale.gpu_runtime import HostBackend, native
from metrale.gpu_runtime.views import device_array
from metrale.ops import elementwise, embedding
from metrale.ops import gemm_tc as T
from metrale.ops.bf16 import f32_to_bf16
from tests.conftest import emu_available
from tests.helpers import GEMM_PATHS, gemm_twin_path

K = 64


def _bf16(a) -> np.ndarray:
    return f32_to_bf16(np.asarray(a, np.float32))


# x row and two weight matrices: with W_BENIGN (ones) element 0 is 1, with W_CANCEL the
# products are 2^60 (t=0), 2^-10 (t=2) and -2^60 (t=32), element 0 is 2^-10: a stale
# float64 copy of W_BENIGN served for W_CANCEL changes the result.
X = np.zeros((1, K), np.float32)
X[0, [0, 2, 32]] = [2.0**30, 1.0, -(2.0**30)]
W_BENIGN = np.ones((3, K), np.float32)
W_CANCEL = np.ones((3, K), np.float32)
W_CANCEL[0] = 0.0
W_CANCEL[0, [0, 2, 32]] = [2.0**30, 2.0**-10, 2.0**30]
WANT_CANCEL = T.dot_f32(_bf16(X), _bf16(W_CANCEL))


def test_the_example_tells_stale_from_fresh():
    assert WANT_CANCEL[0, 0] == 2.0**-10
    assert not np.array_equal(T.dot_f32(_bf16(X), _bf16(W_BENIGN)), WANT_CANCEL)


def _gemm(be, x_ptr, w_ptr, y_ptr, m=1):
    T.gemm_tc(be, 0, y_ptr, x_ptr, w_ptr, m, 3, K, out_fp32=True)
    y = np.empty((m, 3), np.float32)
    be.copy_d2h(y_ptr, y)
    return y


def _h2d(be, w, _):
    be.copy_h2d(_bf16(W_CANCEL), w)


def _h2d_async_in_a_graph(be, w, _):
    src = _bf16(W_CANCEL)
    be.begin_capture(0)
    be.copy_h2d_async(src, w, 0)
    g = be.end_capture(0)
    be.launch_graph(g, 0)


def _d2d(be, w, _):
    src = be.alloc(3 * K * 2)
    be.copy_h2d(_bf16(W_CANCEL), src)
    be.copy_d2d(src, w, 3 * K * 2)
    be.free(src)


def _memset_then_h2d_rows(be, w, _):
    be.memset(w, 0, 3 * K * 2)   # zeros, then the rest row by row through an offset
    be.copy_h2d(_bf16(W_CANCEL)[0], w)
    be.copy_h2d(_bf16(W_CANCEL)[1:], w.offset(K * 2))
    return "memset"


def _twin_writes(be, w, _):
    # a kernel (the embedding lookup's twin) writes the weights: rows 0, 1, 2 of a table
    table, ids = be.alloc(3 * K * 2), be.alloc(3 * 4)
    be.copy_h2d(_bf16(W_CANCEL), table)
    be.copy_h2d(np.arange(3, dtype=np.int32), ids)
    embedding.embedding(be, 0, w, table, ids, 3, K, 3)
    be.free(table)
    be.free(ids)


def _view_written_later(be, w, gemm):
    # a writable view handed out before the GEMM, written after it
    arr = device_array(w, (3, K), np.uint16, be)
    gemm()
    arr[:] = _bf16(W_CANCEL)
    del arr


def _free_and_realloc(be, w, _):
    # the caller re-uploads into whatever address the next alloc gives
    return "realloc"


WRITES = [_h2d, _h2d_async_in_a_graph, _d2d, _memset_then_h2d_rows, _twin_writes,
          _view_written_later, _free_and_realloc]


# The numpy path of the twin caches W widened to float64 (the native library converts
# nothing: it widens in registers).
@pytest.mark.parametrize("m", [1, 20])
@pytest.mark.parametrize("write", WRITES, ids=[f.__name__ for f in WRITES])
def test_a_write_to_the_weights_drops_their_conversions(m, write):
    be = HostBackend(native=False)
    x = be.alloc(m * K * 2)
    be.copy_h2d(np.repeat(_bf16(X), m, axis=0), x)
    y = be.alloc(m * 3 * 4)
    w = be.alloc(3 * K * 2)
    be.copy_h2d(_bf16(W_BENIGN), w)
    benign = _gemm(be, x, w, y, m)        # fills the cache from W_BENIGN
    assert be.convert_cache.used_bytes > 0 and be.convert_cache.misses >= 1
    if write is _free_and_realloc:
        be.free(w)
        w = be.alloc(3 * K * 2)
        be.copy_h2d(_bf16(W_CANCEL), w)
    else:
        write(be, w, lambda: _gemm(be, x, w, y, m))
    got = _gemm(be, x, w, y, m)
    assert np.array_equal(got, np.repeat(WANT_CANCEL, m, axis=0)), (got, benign)
    for p in (x, y, w):
        be.free(p)


def test_the_cache_is_used_while_nothing_writes():
    be = HostBackend(native=False)
    x, y, w = be.alloc(20 * K * 2), be.alloc(20 * 3 * 4), be.alloc(3 * K * 2)
    be.copy_h2d(np.repeat(_bf16(X), 20, axis=0), x)
    be.copy_h2d(_bf16(W_CANCEL), w)
    first = _gemm(be, x, w, y, 20)
    misses = be.convert_cache.misses
    # reads of the weights (a twin's read-only view, a copy out) keep the conversions
    be.copy_d2h(w, np.empty(3 * K, np.uint16))
    again = _gemm(be, x, w, y, 20)
    assert np.array_equal(first, again)
    assert be.convert_cache.misses == misses and be.convert_cache.hits == 1


def test_a_view_handed_out_pins_its_allocation_until_it_is_gone():
    be = HostBackend(native=False)
    x, y, w = be.alloc(20 * K * 2), be.alloc(20 * 3 * 4), be.alloc(3 * K * 2)
    be.copy_h2d(np.repeat(_bf16(X), 20, axis=0), x)
    be.copy_h2d(_bf16(W_CANCEL), w)
    arr = device_array(w, (3, K), np.uint16, be)
    rows = arr[1:]            # derived views keep the pin too
    del arr
    gc.collect()
    _gemm(be, x, w, y, 20)
    assert be.convert_cache.stats()["pinned"] == 1 and be.convert_cache.refused >= 1
    rows[:] = _bf16(W_BENIGN[1:])
    del rows
    gc.collect()
    assert be.convert_cache.stats()["pinned"] == 0
    want = T.dot_f32(np.repeat(_bf16(X), 20, axis=0),
                              np.concatenate([_bf16(W_CANCEL[:1]), _bf16(W_BENIGN[1:])]))
    assert np.array_equal(_gemm(be, x, w, y, 20), want)


def test_read_views_are_read_only(host):
    p = host.alloc(16)
    v = host.read(p, 4, np.float32)
    with pytest.raises(ValueError):
        v[0] = 1.0
    host.free(p)


@pytest.mark.parametrize("budget", [0, 40_000, None])
def test_budget_caches_what_fits_and_converts_the_rest(rng, budget):
    """Conversions are cached while they fit the budget, the rest converted per call; the
    bits are the same whatever is cached."""
    x = f32_to_bf16(rng.standard_normal((24, 300)).astype(np.float32))
    ws = [f32_to_bf16((rng.standard_normal((n, 300)) / 17).astype(np.float32))
          for n in (40, 70, 2000)]           # 102 KB, 179 KB and 5.1 MB as float64
    ref = HostBackend(native=False, convert_cache_bytes=0)
    be = HostBackend(native=False, convert_cache_bytes=budget)
    outs = {}
    for name, b in (("ref", ref), ("be", be)):
        xp = b.alloc(x.nbytes)
        b.copy_h2d(x, xp)
        for i, w in enumerate(ws):
            wp, yp = b.alloc(w.nbytes), b.alloc(24 * w.shape[0] * 4)
            b.copy_h2d(w, wp)
            for _ in range(2):
                T.gemm_tc(b, 0, yp, xp, wp, 24, w.shape[0], 300, out_fp32=True)
            out = np.empty((24, w.shape[0]), np.float32)
            b.copy_d2h(yp, out)
            outs[name, i] = out
    for i in range(3):
        assert np.array_equal(outs["ref", i].view(np.uint32), outs["be", i].view(np.uint32))
    st = be.convert_cache.stats()
    cached = {0: 0, 40_000: 0, None: 3}[budget]
    assert st["allocations"] == cached and st["refused"] == 6 - 2 * cached
    assert st["used_bytes"] == (0 if budget is not None else 8 * 320 * 2110)
    assert ref.convert_cache.stats()["used_bytes"] == 0


@pytest.mark.parametrize("path", [p for p in GEMM_PATHS if p != "numpy"])
def test_native_and_numpy_give_the_same_bits(rng, path):
    """The native library (each of its paths) and numpy compute the same formula: the same
    bits everywhere, where the order decides every rounding (values 2^-60 .. 2^60, products
    down in the float32 subnormals, where the flush decides), with NaN, Inf, -0,
    subnormals, every k from 1 to 300 (every tail of a 32-position block), a few long rows, and row counts the native GEMM splits into row
    blocks (the last one small enough for its direct path); both output types."""
    specials = np.array([0x7F80, 0xFF80, 0x7FC1, 0x0001, 0x8000, 0x807F], np.uint16)
    shapes = [tuple(int(v) for v in rng.integers(1, (40, 70, 300))) for _ in range(150)]
    shapes += [(1, 1, k) for k in range(1, 40)] + [(9, 5, 4864), (3, 17, 4104), (2, 3, 9000),
                                                   (250, 7, 4864), (200, 5, 9000)]
    for trial, (m, n, k) in enumerate(shapes):
        scale = (2.0 ** rng.integers(-60, 60, (1, k)) if trial % 3 == 0 else
                 2.0 ** -66 if trial % 3 == 1 and trial % 2 else 1.0)   # tiny products
        x = f32_to_bf16((rng.standard_normal((m, k)) * scale).astype(np.float32))
        w = f32_to_bf16((rng.standard_normal((n, k)) * scale).astype(np.float32))
        if trial % 5 == 0:
            x.flat[rng.integers(0, x.size, 3)] = rng.choice(specials, 3)
            w.flat[rng.integers(0, w.size, 3)] = rng.choice(specials, 3)
        a = T.dot_f32(x, w)
        with gemm_twin_path(path) as nat:
            b = T.dot_f32(x, w, nat)
            y16 = nat.gemm(x, w, np.empty((m, n), np.uint16))
        assert np.array_equal(a.view(np.uint32), b.view(np.uint32)), (trial, m, n, k)
        assert np.array_equal(y16, f32_to_bf16(a)), (trial, m, n, k)


@pytest.mark.skipif(not emu_available(), reason="no C++ compiler")
def test_an_emulated_kernel_writing_the_weights_drops_their_conversions():
    from metrale.gpu_runtime.emu import EmuBackend
    be = EmuBackend()
    w, delta = be.alloc(3 * K * 2), be.alloc(3 * K * 2)
    be.copy_h2d(_bf16(W_BENIGN), w)
    be.copy_h2d(_bf16(W_BENIGN), delta)

    def stats():
        return be.converted(w, 3 * K * 2, "test.sum", lambda: be.read(w, 3 * K, np.uint16)
                            .astype(np.int64).sum(), 8)
    before = stats()
    assert stats() == before and be.convert_cache.hits == 1
    elementwise.add_inplace(be, 0, w, delta, 3 * K)   # the compiled kernel writes w
    assert stats() == _bf16(2 * W_BENIGN).astype(np.int64).sum() != before
    be.free(w)
    be.free(delta)
