"""The grouped LoRA GEMMs (ops/lora.py, kernels/lora.cu): the twins against float64 and
against the documented order element by element, rows bit-independent of their neighbours,
rows without an adapter untouched, the launchers' checks; the kernels bit for bit the twin
(emu) at ragged sizes and both entry points."""
from __future__ import annotations

import numpy as np
import pytest

from metrale.errors import InvalidArgument
from metrale.gpu_runtime import kernel_source
from metrale.ops import lora
from metrale.ops.bf16 import bf16_to_f32, f32_to_bf16
from tests.conftest import assert_close
from tests.helpers import Buffers


def rand_bf16(rng, shape, scale=1.0):
    return f32_to_bf16((rng.standard_normal(shape) * scale).astype(np.float32))


class Pool:
    """n_slots adapters of one fused group: A [c, k], B [n, rp], scale [parts] each."""

    def __init__(self, rng, n_slots, k, n, rp, ends):
        self.k, self.n, self.rp, self.ends = k, n, rp, list(ends)
        self.parts = len(self.ends)
        self.c = self.parts * rp
        self.a = rand_bf16(rng, (n_slots, self.c, k), 0.3)
        self.b = rand_bf16(rng, (n_slots, n, rp), 0.3)
        self.scale = (rng.uniform(0.2, 3.0, (n_slots, self.parts))).astype(np.float32)


def run(be, pool, x, y, row_slots, rows_per_tile=1, misalign=False):
    """(t, y after) of shrink + expand over rows with `row_slots` (-1: none)."""
    m = x.shape[0]
    tiles = lora.build_tiles(row_slots, rows_per_tile)
    with Buffers(be) as buf:
        if misalign:   # x and the pools 2 bytes off 16: the 2-byte-load entries
            def put(a):
                return buf.put(np.concatenate([[0], a.ravel()]).astype(a.dtype)).offset(2)
        else:
            put = buf.put
        xp, ap, bp = put(x), put(pool.a), put(pool.b)
        yp, sp = buf.put(y), buf.put(pool.scale)
        tp = buf.put(np.full((m, pool.c), np.nan, np.float32))
        tl = buf.put(tiles if len(tiles) else np.zeros((1, 3), np.int32))
        s = be.default_stream()
        lora.lora_shrink(be, s, tp, xp, ap, pool.c * pool.k, tl, len(tiles), m, pool.k,
                         pool.c, len(pool.a), rows_per_tile)
        lora.lora_expand(be, s, yp, tp, bp, pool.n * pool.rp, sp, tl, len(tiles), m, pool.n,
                         pool.rp, pool.ends, len(pool.a), rows_per_tile)
        return buf.get(tp, (m, pool.c), np.float32), buf.get(yp, y.shape, np.uint16)


def reference(pool, x, y, row_slots):
    """float64 of the same math: y + (x A^T * scale) B^T per row's slot."""
    out = bf16_to_f32(y).astype(np.float64)
    for i, s in enumerate(row_slots):
        if s < 0:
            continue
        t = bf16_to_f32(pool.a[s]).astype(np.float64) @ bf16_to_f32(x[i]).astype(np.float64)
        for p, (j0, j1) in enumerate(zip([0] + pool.ends[:-1], pool.ends)):
            u = t[p * pool.rp:(p + 1) * pool.rp] * pool.scale[s, p]
            out[i, j0:j1] += bf16_to_f32(pool.b[s, j0:j1]).astype(np.float64) @ u
    return out


def setup(rng, m, k, n, rp, ends, n_slots=3):
    pool = Pool(rng, n_slots, k, n, rp, ends)
    return pool, rand_bf16(rng, (m, k)), rand_bf16(rng, (m, n))


def test_entry_points_exist():
    names = set(kernel_source.entry_points(lora.MODULE))
    assert {f"lora_{f}_r{r}_{v}" for f in ("shrink", "expand") for r in (1, 8)
            for v in ("v8", "v1")} <= names


def test_build_tiles():
    t = lora.build_tiles([-1, 2, 2, 2, 0, -1, 0, 0], 2)
    assert t.tolist() == [[1, 2, 2], [3, 1, 2], [4, 1, 0], [6, 2, 0]]
    assert lora.build_tiles([-1, -1], 8).shape == (0, 3)


@pytest.mark.parametrize("k,n,rp,ends", [(64, 48, 16, (32, 40, 48)), (1000, 7, 5, (7,)),
                                         (129, 130, 16, (100, 130)), (2100, 64, 8, (64,))])
def test_twin_matches_float64(host, rng, k, n, rp, ends):
    m = 9
    pool, x, y = setup(rng, m, k, n, rp, ends)
    slots = [0, 1, -1, 2, 2, 0, -1, 1, 0]
    t, got = run(host, pool, x, y, slots, 8)
    ref = reference(pool, x, y, slots)
    assert_close(bf16_to_f32(got), ref, "twin_bf16")
    for i, s in enumerate(slots):
        if s < 0:
            assert np.array_equal(got[i], y[i]), "a row without an adapter is untouched"
            assert np.isnan(t[i]).all(), "... and its t row is never written"
        else:
            want = bf16_to_f32(pool.a[s]).astype(np.float64) @ bf16_to_f32(x[i])
            assert_close(t[i], want, "twin_fp32")


def test_twin_is_the_documented_order(rng):
    """shrink_rows / expand_rows against a scalar loop written from the .cu header."""
    k, c, n, rp = 300, 3, 5, 3
    x, a = rand_bf16(rng, (1, k)), rand_bf16(rng, (c, k))
    xf, af = bf16_to_f32(x[0]), bf16_to_f32(a)
    f = np.float32
    want = []
    for q in range(c):
        lanes = []
        for lane in range(128):
            s = f(0)
            for chunk in range(lane, -(-k // 8), 128):
                for kk in range(chunk * 8, chunk * 8 + 8):
                    s = f(s + f(xf[kk] * af[q, kk])) if kk < k else f(s + f(0))
            lanes.append(s)
        while len(lanes) > 1:
            h = len(lanes) // 2
            lanes = [f(lanes[i] + lanes[i + h]) for i in range(h)]
        want.append(lanes[0])
    t = lora.shrink_rows(x, a)
    assert t.view(np.uint32).tolist() == [np.asarray(want, np.float32).view(np.uint32).tolist()]
    b, y = rand_bf16(rng, (n, rp)), rand_bf16(rng, (1, n))
    scale = np.array([1.7], np.float32)
    got = lora.expand_rows(y, t, b, scale, rp, [n])
    for j in range(n):
        d = f(0)
        for r in range(rp):
            d = f(d + f(f(t[0, r] * scale[0]) * bf16_to_f32(b[j, r])))
        assert got[0, j] == f32_to_bf16(np.array([f(bf16_to_f32(y[0, j]) + d)]))[0]


def test_rows_do_not_depend_on_neighbours_or_tiles(host, rng):
    pool, x, y = setup(rng, 12, 96, 40, 8, (16, 28, 40), n_slots=4)
    mixed = [3, 0, 0, -1, 1, 2, 2, 2, -1, 0, 3, 1]
    _, together = run(host, pool, x, y, mixed, 8)
    _, one_row_tiles = run(host, pool, x, y, mixed, 1)
    assert np.array_equal(together, one_row_tiles)
    for i, s in enumerate(mixed):
        _, alone = run(host, pool, x[i:i + 1], y[i:i + 1], [s], 1)
        assert np.array_equal(alone[0], together[i]), f"row {i}"


def test_no_adapted_row_launches_nothing(host, rng):
    pool, x, y = setup(rng, 3, 32, 16, 8, (16,))
    launches = []
    real = host.launch
    host.launch = lambda *a, **kw: launches.append(a) or real(*a, **kw)
    t, got = run(host, pool, x, y, [-1, -1, -1])
    assert launches == [] and np.array_equal(got, y)


def test_launcher_checks(host):
    with Buffers(host) as buf:
        p = buf.put(np.zeros(64, np.float32))
        with pytest.raises(InvalidArgument, match="part_ends"):
            lora.lora_expand(host, 0, p, p, p, 8, p, p, 1, 1, 16, 8, (10, 8), 1)
        with pytest.raises(InvalidArgument, match="768"):
            lora.lora_expand(host, 0, p, p, p, 8, p, p, 1, 1, 16, 512, (8, 16), 1)
        with pytest.raises(InvalidArgument, match="rows_per_tile"):
            lora.lora_shrink(host, 0, p, p, p, 8, p, 1, 1, 8, 8, 1, rows_per_tile=4)
        with pytest.raises(InvalidArgument, match="x_ptr is NULL"):
            lora.lora_shrink(host, 0, p, 0, p, 8, p, 1, 1, 8, 8, 1)


# ------------------------------------------------------------------------ the kernels
@pytest.mark.gpu
@pytest.mark.parametrize("k,n,rp,ends", [(1, 1, 1, (1,)), (7, 9, 3, (2, 9)), (64, 48, 16, (32, 40, 48)),
                                         (1030, 130, 16, (128, 130)), (136, 200, 24, (200,))])
@pytest.mark.parametrize("rows_per_tile", [1, 8])
def test_kernels_are_the_twin_bit_for_bit(device, host, rng, k, n, rp, ends, rows_per_tile):
    m = 11
    pool, x, y = setup(rng, m, k, n, rp, ends)
    slots = [2, 2, 2, 2, 2, 2, 2, 2, 2, 0, -1]   # a full 8-row tile, a ragged one, none
    t_dev, y_dev = run(device, pool, x, y, slots, rows_per_tile)
    t_host, y_host = run(host, pool, x, y, slots, rows_per_tile)
    assert np.array_equal(t_dev.view(np.uint32), t_host.view(np.uint32))
    assert np.array_equal(y_dev, y_host)


@pytest.mark.gpu
def test_kernels_scalar_loads_and_padding_tiles(device, host, rng):
    pool, x, y = setup(rng, 5, 72, 33, 8, (20, 33))
    slots = [1, -1, 0, 0, 1]
    a = run(device, pool, x, y, slots, 8, misalign=True)
    b = run(host, pool, x, y, slots, 8)
    assert np.array_equal(a[1], b[1])
    # a captured decode graph's padding tiles: slot -1 (and out-of-range) tiles do nothing
    tiles = np.array([[0, 1, 1], [1, 1, -1], [2, 1, 0], [3, 1, 7], [4, 1, 1]], np.int32)
    with Buffers(device) as buf:
        xp, ap, bp = buf.put(x), buf.put(pool.a), buf.put(pool.b)
        yp, sp, tl = buf.put(y), buf.put(pool.scale), buf.put(tiles)
        tp = buf.put(np.zeros((5, pool.c), np.float32))
        lora.lora_shrink(device, 0, tp, xp, ap, pool.c * pool.k, tl, 5, 5, pool.k, pool.c, 3)
        lora.lora_expand(device, 0, yp, tp, bp, pool.n * pool.rp, sp, tl, 5, 5, pool.n,
                         pool.rp, pool.ends, 3)
        got = buf.get(yp, y.shape, np.uint16)
    assert np.array_equal(got[[1, 3]], y[[1, 3]])
    assert np.array_equal(got[[0, 2, 4]], b[1][[0, 2, 4]])


@pytest.mark.parametrize("k,n,rp,ends", [(64, 48, 16, (32, 40, 48)), (1000, 7, 5, (7,)),
                                         (2100, 130, 16, (100, 130))])
def test_native_twin_gives_the_numpy_bits(rng, k, n, rp, ends):
    """HostBackend's native path (gpu_runtime/native_lora.py) and the numpy twin: the same
    float32 operations in the same order, the same bits. (Its lane-major copies of A and B
    are cached until the pool is written: test_lora.py's swap test reloads a slot.)"""
    from metrale.gpu_runtime import HostBackend, native_lora
    if native_lora.try_load() is None:
        pytest.skip("no C++ compiler: the native LoRA GEMMs cannot be built")
    pool, x, y = setup(rng, 13, k, n, rp, ends, n_slots=4)
    slots = [3, 3, 0, -1, 1, 1, 1, 2, 0, -1, 3, 2, 2]
    fast, slow = HostBackend(), HostBackend(native=False)
    for rows in (1, 8):
        t1, y1 = run(fast, pool, x, y, slots, rows)
        t2, y2 = run(slow, pool, x, y, slots, rows)
        assert np.array_equal(y1, y2) and np.array_equal(t1.view(np.uint32), t2.view(np.uint32))


def expand_split(be, pool, y, parts_t, slots, rows_per_tile=1):
    """y after an expand of t given as `splits` partials [splits, m, c] (added in order)."""
    splits, m, c = parts_t.shape
    tiles = lora.build_tiles(slots, rows_per_tile)
    with Buffers(be) as buf:
        yp, bp, sp = buf.put(y), buf.put(pool.b), buf.put(pool.scale)
        tp, tl = buf.put(parts_t), buf.put(tiles)
        lora.lora_expand(be, be.default_stream(), yp, tp, bp, pool.n * pool.rp, sp, tl,
                         len(tiles), m, pool.n, pool.rp, pool.ends, len(pool.a),
                         rows_per_tile, splits=splits, t_split_stride=m * c)
        return buf.get(yp, y.shape, np.uint16)


def test_expand_adds_split_t_in_order(host, rng):
    """A tensor-parallel rank's gathered partials: t = ((t0 + t1) + t2) in float32, then the
    scale; the same bits as one t holding that sum."""
    pool, _, y = setup(rng, 5, 8, 40, 8, (16, 40))
    parts_t = rng.standard_normal((3, 5, pool.c)).astype(np.float32)
    slots = [0, 2, -1, 1, 0]
    got = expand_split(host, pool, y, parts_t, slots)
    summed = ((parts_t[0] + parts_t[1]) + parts_t[2])[None]
    assert np.array_equal(got, expand_split(host, pool, y, summed, slots))
    assert not np.array_equal(got, expand_split(host, pool, y, parts_t[:1], slots))
    with pytest.raises(InvalidArgument, match="t_split_stride"):
        with Buffers(host) as buf:
            p = buf.put(np.zeros(64, np.float32))
            lora.lora_expand(host, 0, p, p, p, 8, p, p, 1, 5, 40, 8, (16, 40), 3, splits=2,
                             t_split_stride=4)


def test_native_split_expand_gives_the_numpy_bits(rng):
    from metrale.gpu_runtime import HostBackend, native_lora
    if native_lora.try_load() is None:
        pytest.skip("no C++ compiler: the native LoRA GEMMs cannot be built")
    pool, _, y = setup(rng, 9, 8, 130, 16, (100, 130))
    parts_t = rng.standard_normal((4, 9, pool.c)).astype(np.float32)
    slots = [2, 2, 0, -1, 1, 1, 1, 0, 2]
    for rows in (1, 8):
        assert np.array_equal(expand_split(HostBackend(), pool, y, parts_t, slots, rows),
                              expand_split(HostBackend(native=False), pool, y, parts_t, slots,
                                           rows))


@pytest.mark.gpu
@pytest.mark.parametrize("rows_per_tile", [1, 8])
def test_kernel_split_expand_is_the_twin(device, host, rng, rows_per_tile):
    pool, _, y = setup(rng, 10, 8, 72, 16, (24, 48, 72))
    parts_t = rng.standard_normal((3, 10, pool.c)).astype(np.float32)
    slots = [1, 1, 1, 0, -1, 2, 2, 0, 0, 0]
    assert np.array_equal(expand_split(device, pool, y, parts_t, slots, rows_per_tile),
                          expand_split(host, pool, y, parts_t, slots, rows_per_tile))
