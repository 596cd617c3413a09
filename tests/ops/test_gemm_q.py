"""The dequantizing tensor-core GEMM (module "gemm_q"): the dequantization against its
formula written out element by element, the twin against float64 and against gemm_tc's
definition on the dequantized bits (every native path, numpy), the kernel against the twin
and bit for bit against gemm_tc on the dequantized weights, batch invariance."""
import numpy as np
import pytest

from metrale.errors import InvalidArgument
from metrale.gpu_runtime import NULL, kernel_source
from metrale.ops import gemm_q as Q
from metrale.ops import gemm_tc as T
from metrale.ops.bf16 import bf16_to_f32, f32_to_bf16
from tests.conftest import assert_close, real
from tests.helpers import GEMM_PATHS, Buffers, gemm_twin_path
from tests.ops.test_gemm_tc import as_f32, bits, run_tc

KINDS = {False: "gpu_vs_twin_bf16", True: "gpu_vs_twin_fp32"}


# ------------------------------------------------------------------------- operands
class Q4:
    """Random packed 4-bit W in the device layout, with garbage in the padding codes."""

    def __init__(self, rng, n, k, group_size=32, act_order=False, garbage=True):
        self.n, self.k, self.group_size = n, k, group_size
        words = Q.q4_row_bytes(k) // 4
        self.q = rng.integers(0, 2**32, size=(n, words), dtype=np.uint64).astype(np.uint32)
        if not garbage:   # padding codes zero (the repacked checkpoints have these)
            codes = ((self.q[:, :, None] >> (4 * np.arange(8, dtype=np.uint32))) & 15)
            codes = codes.reshape(n, -1)
            codes[:, k:] = 0
            self.q = (codes.reshape(n, words, 8).astype(np.uint32)
                      << (4 * np.arange(8, dtype=np.uint32))).sum(-1).astype(np.uint32)
        self.groups = -(-k // group_size)
        # scales of both signs, magnitudes 2^-2 .. 2^2 over 8 sqrt(k) (|y| ~ 1), FP16
        mag = 2.0 ** rng.uniform(-2, 2, size=(n, self.groups)) / (8 * np.sqrt(k))
        s = np.where(rng.random((n, self.groups)) < 0.2, -mag, mag).astype(np.float16)
        self.scales = s.view(np.uint16)
        self.zeros = rng.integers(0, 16, size=(n, self.groups)).astype(np.uint8)
        self.gidx = self.gidx_row = None
        if act_order:   # 3 parts (fused q|k|v), each its own shuffled order of the groups
            self.gidx = np.stack([rng.permutation(np.arange(k) // group_size)
                                  for _ in range(3)]).astype(np.int32)
            self.gidx_row = (np.arange(n) * 3 // n).astype(np.int32)

    def dequant(self):
        return Q.dequant_q4(self.q, self.scales, self.zeros, self.k, self.group_size,
                            self.gidx, self.gidx_row)

    def put(self, b) -> Q.QuantW:
        """Upload into Buffers b: the fused decode GEMMs' operand."""
        g = NULL if self.gidx is None else b.put(self.gidx)
        gr = NULL if self.gidx is None else b.put(self.gidx_row)
        return Q.QuantW("q4", (b.put(self.q), b.put(self.scales), b.put(self.zeros), g, gr),
                        (self.groups, self.group_size), self.n, self.k)

    def launch(self, backend, x, out_fp32=False, rows=None, tile=None):
        m_all = x.shape[0]
        r0, r1 = (0, m_all) if rows is None else rows
        dt = np.float32 if out_fp32 else np.uint16
        with Buffers(backend) as b:
            xp, yp = b.put(x), b.empty((m_all, self.n), dt)
            g = NULL if self.gidx is None else b.put(self.gidx)
            gr = NULL if self.gidx is None else b.put(self.gidx_row)
            Q.gemm_q4(backend, backend.default_stream(),
                      yp.offset(r0 * self.n * np.dtype(dt).itemsize), xp.offset(r0 * self.k * 2),
                      b.put(self.q), b.put(self.scales), b.put(self.zeros), g, gr, r1 - r0,
                      self.n, self.k, self.groups, self.group_size, out_fp32=out_fp32,
                      tile=tile)
            return b.get(yp, (m_all, self.n), dt)[r0:r1]


class F8:
    """Random float8_e4m3fn W (no NaN codes) with block scales; garbage in the padding."""

    def __init__(self, rng, n, k, block=(128, 128), nan=False, garbage=True):
        self.n, self.k = n, k
        self.block_k = block[1]
        kp = Q.fp8_row_bytes(k)
        codes = rng.integers(0, 256, size=(n, kp)).astype(np.uint8)
        if not nan:
            codes[(codes & 0x7F) == 0x7F] -= 1
        if not garbage:
            codes[:, k:] = 0
        self.q = codes
        self.k_blocks = -(-k // self.block_k)
        rows = -(-n // block[0])
        # |code values| ~ 100: scales 2^-2 .. 2^2 over 100 sqrt(k) keep |y| ~ 1
        self.scales = (2.0 ** rng.uniform(-2, 2, size=(rows, self.k_blocks))
                       / (100 * np.sqrt(k))).astype(np.float32)
        self.scale_row = (np.arange(n) // block[0]).astype(np.int32)

    def dequant(self):
        return Q.dequant_fp8(self.q, self.scales, self.scale_row, self.k, self.block_k)

    def put(self, b) -> Q.QuantW:
        return Q.QuantW("fp8", (b.put(self.q), b.put(self.scales), b.put(self.scale_row)),
                        (self.k_blocks, self.block_k), self.n, self.k)

    def launch(self, backend, x, out_fp32=False, rows=None, tile=None):
        m_all = x.shape[0]
        r0, r1 = (0, m_all) if rows is None else rows
        dt = np.float32 if out_fp32 else np.uint16
        with Buffers(backend) as b:
            xp, yp = b.put(x), b.empty((m_all, self.n), dt)
            Q.gemm_fp8(backend, backend.default_stream(),
                       yp.offset(r0 * self.n * np.dtype(dt).itemsize), xp.offset(r0 * self.k * 2),
                       b.put(self.q), b.put(self.scales), b.put(self.scale_row), r1 - r0,
                       self.n, self.k, self.k_blocks, self.block_k, out_fp32=out_fp32,
                       tile=tile)
            return b.get(yp, (m_all, self.n), dt)[r0:r1]


def xs(rng, m, k):
    return f32_to_bf16(rng.standard_normal((m, k), dtype=np.float32))


def w_and_bits(rng, fmt: str, n: int, k: int, make=None):
    """(W, its BF16 bits [n, k]): random BF16 bits for fmt "bf16", else make() (a Q4 / F8)
    and its dequantized bits."""
    if fmt == "bf16":
        w = f32_to_bf16(rng.standard_normal((n, k), dtype=np.float32))
        return w, w
    w = make()
    return w, w.dequant()


def twin_host(nat):
    """A HostBackend whose GEMM twin is `nat` (a gemm_twin_path's library, or None)."""
    from metrale.gpu_runtime import HostBackend
    be = HostBackend(native=False)
    be.native = nat
    return be


def gemm_rows(be, fmt: str, w, wb, x) -> np.ndarray:
    """x @ W^T in float32 through be's GEMM twin: the BF16 GEMM, or W's quantized launch."""
    return T.dot_f32(x, wb, be.native) if fmt == "bf16" else w.launch(be, x, True)


def bf16_rne64(v: float) -> float:
    """A float64 (already a float32 value) rounded to BF16, nearest even, by arithmetic."""
    if v == 0 or not np.isfinite(v):
        return v
    e = np.floor(np.log2(abs(v)))
    ulp = 2.0 ** (e - 7)
    q = v / ulp
    r = np.floor(q)
    if q - r > 0.5 or (q - r == 0.5 and r % 2 == 1):
        r += 1
    return r * ulp


def q4_formula(w: Q4) -> np.ndarray:
    """float64 [n, k]: each element decoded from the packing by its definition."""
    out = np.zeros((w.n, w.k))
    s = w.scales.view(np.float16).astype(np.float64)
    for j in range(w.n):
        for kk in range(w.k):
            code = (int(w.q[j, kk // 8]) >> (4 * (kk % 8))) & 15
            g = kk // w.group_size if w.gidx is None else int(w.gidx[w.gidx_row[j], kk])
            out[j, kk] = bf16_rne64((code - int(w.zeros[j, g])) * s[j, g])
    return out


def fp8_formula(w: F8) -> np.ndarray:
    out = np.zeros((w.n, w.k))
    table = Q.e4m3_table().astype(np.float64)
    for j in range(w.n):
        for kk in range(w.k):
            p = table[w.q[j, kk]] * float(w.scales[w.scale_row[j], kk // w.block_k])
            out[j, kk] = bf16_rne64(float(np.float32(p)))   # FP32 rounding, then BF16
    return out


# ----------------------------------------------------------------------------- CPU
def test_entry_points_exist():
    want = {f"gemm_{f}_{o}_{t}" for f in ("q4", "fp8") for o in ("bf16", "fp32") for t in T.TILES}
    # and the decode entries with fused neighbours (ops/gemm_fused.py)
    want |= {f"gemm_{f}_bf16_16x16_{x}" for f in ("q4", "fp8")
             for x in ("rmsnorm", "actmul_res", "res")}
    assert want == set(kernel_source.entry_points(Q.MODULE))


@pytest.mark.parametrize("n,k,gs,act", [(3, 8, 8, False), (5, 72, 32, False), (4, 96, 32, True),
                                        (2, 256, 128, False)])
def test_q4_dequant_is_the_formula(rng, n, k, gs, act):
    w = Q4(rng, n, k, gs, act)
    assert np.array_equal(bf16_to_f32(w.dequant()).astype(np.float64), q4_formula(w))


@pytest.mark.parametrize("n,k,block", [(3, 19, (128, 128)), (130, 40, (128, 16)),
                                       (5, 300, (1, 128))])
def test_fp8_dequant_is_the_formula(rng, n, k, block):
    w = F8(rng, n, k, block)
    assert np.array_equal(bf16_to_f32(w.dequant()).astype(np.float64), fp8_formula(w))


def test_fp8_nan_codes_give_nan_rows(host, rng):
    w = F8(rng, 4, 32, nan=True)
    w.q[1, 5] = 0x7F
    w.q[2, 7] = 0xFF
    y = w.launch(host, xs(rng, 2, 32), out_fp32=True)
    assert np.isnan(y[:, 1]).all() and np.isnan(y[:, 2]).all()
    assert (w.dequant()[1, 5] == 0x7FFF) and (w.dequant()[2, 7] == 0x7FFF)


@pytest.mark.parametrize("out_fp32", [False, True])
@pytest.mark.parametrize("m,n,k", [(1, 1, 8), (1, 7, 24), (7, 19, 136), (19, 111, 64),
                                   (3, 4097, 64), (9, 33, 4096)])
def test_q4_twin_matches_float64(host, rng, m, n, k, out_fp32):
    w = Q4(rng, n, k, 32 if k % 32 == 0 else 8)
    x = xs(rng, m, k)
    ref = bf16_to_f32(x).astype(np.float64) @ bf16_to_f32(w.dequant()).astype(np.float64).T
    got = w.launch(host, x, out_fp32)
    if out_fp32:
        assert_close(got, ref, "twin_fp32")
    else:
        assert_close(bf16_to_f32(got), bf16_to_f32(f32_to_bf16(ref.astype(np.float32))),
                     "twin_bf16")


@pytest.mark.parametrize("out_fp32", [False, True])
@pytest.mark.parametrize("m,n,k", [(1, 1, 1), (1, 7, 19), (7, 19, 111), (19, 111, 8),
                                   (3, 4097, 64), (9, 33, 4097)])
def test_fp8_twin_matches_float64(host, rng, m, n, k, out_fp32):
    w = F8(rng, n, k, (128, 16) if k < 100 else (128, 128))
    x = xs(rng, m, k)
    ref = bf16_to_f32(x).astype(np.float64) @ bf16_to_f32(w.dequant()).astype(np.float64).T
    got = w.launch(host, x, out_fp32)
    if out_fp32:
        assert_close(got, ref, "twin_fp32")
    else:
        assert_close(bf16_to_f32(got), bf16_to_f32(f32_to_bf16(ref.astype(np.float32))),
                     "twin_bf16")


# k not a multiple of 32 (a partly filled last 32-code block, a k16 step and an 8-chunk
# across k), with uniform (block_k % 64 == 0) and per-position scales: 128 * 3 + 40 = 424
TAIL_F8 = [(1, (128, 128)), (19, (128, 128)), (111, (16, 8)), (424, (128, 128)),
           (424, (1, 16)), (40, (7, 8))]


def nan_padded_f8(rng, n, k, block):
    """F8 whose padding codes (k .. kp - 1) are all NaN (0x7F): a code past k that reaches
    the sum makes its row NaN even against a zero X (finite garbage there would not show)."""
    w = F8(rng, n, k, block)
    w.q[:, k:] = 0x7F
    return w


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("k,block", TAIL_F8)
def test_fp8_twin_never_reads_codes_past_k(rng, k, block, native):
    from metrale.gpu_runtime import HostBackend
    w = nan_padded_f8(rng, 19, k, block)
    x = xs(rng, 3, k)
    ref = bf16_to_f32(x).astype(np.float64) @ bf16_to_f32(w.dequant()).astype(np.float64).T
    got = w.launch(HostBackend(native=native), x, True)
    assert np.isfinite(got).all()
    assert_close(got, ref, "twin_fp32")


@pytest.mark.parametrize("fmt", ["q4", "q4_act", "fp8"])
@pytest.mark.parametrize("m,n,k", [(1, 9, 40), (2, 33, 264), (5, 17, 1000), (12, 40, 4104)])
@pytest.mark.parametrize("path", GEMM_PATHS)
def test_twin_is_gemm_tc_on_the_dequantized_bits(rng, monkeypatch, fmt, m, n, k, path):
    """Every implementation of the twin (native with the dequantization in its tile, every
    build; numpy) gives exactly dot_f32(x, dequant(W))."""
    k8 = k - k % 8
    w = F8(rng, n, k) if fmt == "fp8" else Q4(rng, n, k8, 8 if k8 % 32 else 32, fmt == "q4_act")
    x = xs(rng, m, w.k)
    want = T.dot_f32(x, w.dequant())
    with gemm_twin_path(path) as nat:
        be = twin_host(nat)
        assert np.array_equal(bits(w.launch(be, x, True)), bits(want))
        assert np.array_equal(w.launch(be, x, False), f32_to_bf16(want))


@pytest.mark.parametrize("fmt", ["bf16", "q4", "q4_g8", "fp8"])
@pytest.mark.parametrize("k", [184, 200])
@pytest.mark.parametrize("path", GEMM_PATHS)
def test_every_row_count_and_tile_edge_gives_the_same_bits(rng, fmt, k, path):
    """m = 1..14 (every direct tile of the native AVX2 build, R = 1..8, and the panel
    path's full and leftover row groups), n = 29 (full and single-column tiles), k with a
    partial last block in either lane half (k % 32 = 24, 8): every row equals numpy's."""
    n = 29
    w, wb = w_and_bits(rng, fmt, n, k, {"q4": lambda: Q4(rng, n, k, 32),
                                        "q4_g8": lambda: Q4(rng, n, k, 8),
                                        "fp8": lambda: F8(rng, n, k, (128, 16))}.get(fmt))
    x = xs(rng, 14, k)
    want = T.dot_f32(x, wb)
    with gemm_twin_path(path) as nat:
        be = twin_host(nat)
        for m in range(1, 15):
            assert np.array_equal(bits(gemm_rows(be, fmt, w, wb, x[:m])), bits(want[:m])), m


@pytest.mark.parametrize("case", ["q4_g64", "q4_g128", "q4_act32", "q4_act16", "q4_act8",
                                  "q4_act8_k1600", "q4_act8_k2048", "fp8_128", "fp8_rows12",
                                  "fp8_k64", "fp8_signed"])
@pytest.mark.parametrize("path", GEMM_PATHS)
def test_decode_tables_give_the_same_bits(rng, case, path):
    """Decode (m = 1..8) where the native AVX-512 BF16 build looks W's values up in per-chunk
    tables (native/gemm_quant_dp.h): groups and scale blocks of several 32-blocks, a partial
    last block, FP8 tiles that straddle a scale block's edge (12-row blocks) and others that
    share one, negative scales with +-0 and NaN codes (the sign flip of zeros): every row
    equals numpy's dot_f32 on the dequantized bits. Act-order (30, 59 or 117 groups, three
    parts whose tiles straddle the parts' edges; 200 and 256 groups at k = 1600, 2048): the
    groups' scales and zeros looked up per position."""
    n, k = 45, 936   # 29 full 32-blocks (FP8: a lone block after the pairs) and 8 positions
    if case.startswith("q4_act"):
        gs, _, wide_k = case[6:].partition("_k")
        k = int(wide_k) if wide_k else k
        w = Q4(rng, n, k, int(gs), act_order=True)
        w.zeros[::3] = 16   # GPTQ v1's stored 15 plus its 1
    elif case.startswith("q4"):
        w = Q4(rng, n, k, int(case[4:]))
    else:
        block = {"fp8_128": (128, 128), "fp8_rows12": (12, 128), "fp8_k64": (16, 64),
                 "fp8_signed": (8, 32)}[case]
        w = F8(rng, n, k, block)
        if case == "fp8_signed":
            w.scales[::2] *= -1
            w.q[:, :64:3] &= 0x80   # +0 and -0 codes
            w.q[5, 70], w.q[30, 900] = 0x7F, 0xFF   # two NaN rows
    x = xs(rng, 8, w.k)
    want = T.dot_f32(x, w.dequant())
    with gemm_twin_path(path) as nat:
        be = twin_host(nat)
        for m in range(1, 9):
            got = w.launch(be, x[:m], True)
            assert np.array_equal(bits(got), bits(want[:m])), m
            assert np.array_equal(w.launch(be, x[:m], False), f32_to_bf16(want[:m])), m


@pytest.mark.parametrize("fmt", ["bf16", "q4", "fp8"])
@pytest.mark.parametrize("path", [p for p in GEMM_PATHS if p != "numpy"])
def test_thread_count_never_changes_the_bits(rng, fmt, path):
    """The native GEMM splits W's columns into chunks the threads take in turn (guided:
    their sizes and owners depend on timing): with 1, 2, 3 and 5 threads, decode and
    prefill rows, every row equals numpy's."""
    from metrale.gpu_runtime import native
    n, k = 1000, 1064
    w, wb = w_and_bits(rng, fmt, n, k, {"q4": lambda: Q4(rng, n, k, 128),
                                        "fp8": lambda: F8(rng, n, k)}.get(fmt))
    x = xs(rng, 20, k)
    want = T.dot_f32(x, wb)
    with gemm_twin_path(path) as nat:
        be = twin_host(nat)
        try:
            for threads in (1, 2, 3, 5):
                nat._lib.md_set_threads(threads)
                for m in (1, 5, 20):
                    got = gemm_rows(be, fmt, w, wb, x[:m])
                    assert np.array_equal(bits(got), bits(want[:m])), (threads, m)
        finally:
            nat._lib.md_set_threads(native.usable_cpus())


def test_fp8_scale_rows_out_of_range_are_refused(host, rng):
    """The native GEMM reads scales[scale_row[j]] unchecked: the twin refuses a negative row,
    and a row past the scales' allocation (bounds-checked), before it runs."""
    from metrale.errors import KernelError
    from metrale.gpu_runtime import HostBackend
    x = xs(rng, 1, 256)
    for be in (host, HostBackend(native=False)):   # the native GEMM and numpy's
        w = F8(rng, 40, 256, (16, 128))
        w.scale_row[7] = -1
        with pytest.raises(KernelError, match="negative"):
            w.launch(be, x, True)
        w.scale_row[7] = len(w.scales)   # one row past the end
        with pytest.raises(KernelError, match="past the end"):
            w.launch(be, x, True)


@pytest.mark.parametrize("fmt", ["q4", "fp8"])
def test_twin_is_batch_invariant(host, rng, fmt):
    w = Q4(rng, 45, 4104, 8) if fmt == "q4" else F8(rng, 45, 4104)
    x = xs(rng, 70, w.k)
    full = w.launch(host, x, True)
    for r0, r1 in ((0, 1), (13, 14), (69, 70), (3, 20), (0, 17), (30, 70)):
        assert np.array_equal(bits(w.launch(host, x, True, rows=(r0, r1))), bits(full[r0:r1]))


def test_bad_arguments_raise_before_launch(host):
    args = dict(m=1, n=1, k=8, groups=1, group_size=8)
    with pytest.raises(InvalidArgument, match="multiple of 8"):
        Q.gemm_q4(host, 0, 8, 8, 16, 8, 8, 0, 0, **{**args, "k": 12})
    with pytest.raises(InvalidArgument, match="16-byte aligned"):
        Q.gemm_q4(host, 0, 8, 8, 8, 8, 8, 0, 0, **args)
    with pytest.raises(InvalidArgument, match="group_size"):
        Q.gemm_q4(host, 0, 8, 8, 16, 8, 8, 0, 0, **{**args, "group_size": 12})
    with pytest.raises(InvalidArgument, match="group_size"):
        Q.gemm_q4(host, 0, 8, 8, 16, 8, 8, 0, 0, **{**args, "k": 64, "group_size": 8})
    with pytest.raises(InvalidArgument, match="together"):
        Q.gemm_q4(host, 0, 8, 8, 16, 8, 8, 8, 0, **args)
    with pytest.raises(InvalidArgument, match="block_k"):
        Q.gemm_fp8(host, 0, 8, 8, 16, 8, 8, 1, 1, 19, 2, 8)
    with pytest.raises(InvalidArgument, match="block_k"):
        Q.gemm_fp8(host, 0, 8, 8, 16, 8, 8, 1, 1, 19, 1, 12)
    with pytest.raises(InvalidArgument, match="NULL"):
        Q.gemm_fp8(host, 0, 8, 8, 16, 8, 0, 1, 1, 19, 1, 24)
    with pytest.raises(InvalidArgument, match="tile"):
        Q.gemm_fp8(host, 0, 8, 8, 16, 8, 8, 1, 1, 19, 1, 24, tile="8x8")


# ------------------------------------------------------------- GPU (and the emulator)
# m = 12: the decode tile's second n8 tile of X rows (9-16) with clamped rows in it
RAGGED_Q4 = [(1, 1, 8, 8), (1, 7, 24, 8), (7, 19, 136, 32), (12, 19, 200, 64),
             (19, 111, 64, 32), (1, 4097, 64, 64), (17, 33, 4096, 128), (130, 70, 264, 8)]
RAGGED_F8 = [(1, 1, 1), (1, 7, 19), (7, 19, 111), (12, 19, 200), (19, 111, 8), (1, 4097, 64),
             (17, 33, 4097), (130, 70, 264)]
LLAMA_8B = [real(1, 6144, 4096), real(8, 4096, 4096), real(1, 28672, 4096),
            real(1, 4096, 14336), real(64, 28672, 4096), real(300, 6144, 4096),
            real(2048, 4096, 14336)]


def check_every_tile(device, host, w, x, label):
    """Every tile, both outputs: within the table's bound of the twin, and bit for bit the
    device's own gemm_tc run on the dequantized weights (garbage in the padding codes)."""
    wd = w.dequant()
    for out_fp32 in (False, True):
        want = w.launch(host, x, out_fp32)
        for tile in T.TILES:
            got = w.launch(device, x, out_fp32, tile=tile)
            assert_close(as_f32(got), as_f32(want), KINDS[out_fp32], f"{label} tile={tile}")
            same = run_tc(device, x, wd, out_fp32, tile=tile)
            assert np.array_equal(bits(got), bits(same)), f"{label} tile={tile}"


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k,gs", RAGGED_Q4)
def test_gpu_q4_matches_twin_and_gemm_tc_bits(device, host, rng, m, n, k, gs):
    for act in (False, True):
        check_every_tile(device, host, Q4(rng, n, k, gs, act_order=act), xs(rng, m, k),
                         f"m={m} n={n} k={k} act={act}")


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k", RAGGED_F8)
def test_gpu_fp8_matches_twin_and_gemm_tc_bits(device, host, rng, m, n, k):
    for block in ((128, 128), (1, 16), (7, 8)):
        check_every_tile(device, host, F8(rng, n, k, block), xs(rng, m, k),
                         f"m={m} n={n} k={k} block={block}")


@pytest.mark.gpu
@pytest.mark.parametrize("k,block", TAIL_F8)
def test_gpu_fp8_decode_tile_stops_at_k(device, host, rng, k, block):
    """The decode tile (16x16) with NaN codes past k: 1 and 12 X rows (one and two n8
    tiles), the twin's values and gemm_tc's bits on the dequantized weights."""
    w = nan_padded_f8(rng, 19, k, block)
    wd = w.dequant()
    for m in (1, 12):
        x = xs(rng, m, k)
        for out_fp32 in (False, True):
            got = w.launch(device, x, out_fp32, tile="16x16")
            assert not np.isnan(as_f32(got)).any(), f"m={m} out_fp32={out_fp32}"
            assert_close(as_f32(got), as_f32(w.launch(host, x, out_fp32)), KINDS[out_fp32])
            assert np.array_equal(bits(got), bits(run_tc(device, x, wd, out_fp32, tile="16x16")))


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k", LLAMA_8B)
def test_gpu_matches_twin_llama_shapes(device, host, rng, m, n, k):
    for w in (Q4(rng, n, k, 128), F8(rng, n, k)):
        x = xs(rng, m, k)
        assert_close(bf16_to_f32(w.launch(device, x)), bf16_to_f32(w.launch(host, x)),
                     KINDS[False], f"{type(w).__name__} m={m} n={n} k={k}")


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["q4", "fp8"])
def test_gpu_batch_invariance_across_m_and_tiles(device, rng, fmt):
    """Row i alone equals row i inside m = 2..70 (default tile, crossing 16/17 and 64/65)
    and inside every tile at several offsets."""
    w = Q4(rng, 37, 264, 8, act_order=True) if fmt == "q4" else F8(rng, 37, 269, (16, 16))
    x = xs(rng, 70, w.k)
    solo = {i: w.launch(device, x, True, rows=(i, i + 1))[0] for i in (0, 15, 16, 17, 64, 69)}
    for r0, r1, tile in ((0, 17, None), (0, 65, None), (0, 70, None), (15, 17, "16x16"),
                         (1, 65, "64x32"), (0, 70, "128x128"), (16, 69, "16x16")):
        part = w.launch(device, x, True, rows=(r0, r1), tile=tile)
        for i, want in solo.items():
            if r0 <= i < r1:
                assert np.array_equal(bits(part[i - r0]), bits(want)), (i, r0, r1, tile)
