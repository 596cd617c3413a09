"""The GEMM over GGUF weights kept at their bytes (modules "gemm_gguf" and "gemm_gguf_k"):
the launcher's checks and twin on the CPU; on the device (the emulator) every type, tile and
output bit for bit gemm_tc's GEMM on ops/gguf_planes.dequant_bf16's weights (so the
dequantized values are the planes' bits, the sign of zero aside: an identity X shows those
values directly), within the table's bound of the twin (whose summation order differs:
gemm_tc.py's dot_f32), Y rows ldy apart with the columns past n untouched, batch invariance
across m, row offsets and tiles, and NaN / infinite scales."""
import numpy as np
import pytest

from metrale.errors import InvalidArgument
from metrale.formats.gguf.packed import Planes, split_blocks
from metrale.gpu_runtime import NULL, kernel_source
from metrale.ops import gemm_gguf as G
from metrale.ops import gemm_tc as T
from metrale.ops.bf16 import bf16_to_f32, f32_to_bf16
from metrale.ops.gguf_planes import PACKED, dequant_bf16, dequant_f32
from tests.conftest import assert_close, real
from tests.helpers import Buffers
from tests.ops.test_gemm_tc import as_f32, bits, run_tc

TYPES = sorted(PACKED)
NAMES = [PACKED[t].name for t in TYPES]
BY_NAME = {PACKED[t].name: t for t in TYPES}
KINDS = {False: "gpu_vs_twin_bf16", True: "gpu_vs_twin_fp32"}
# byte offsets of each block's f16 scale fields (d, and dmin / m where the type has one)
SCALE_AT = {"Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q8_0": [0],
            "IQ4_NL": [0], "Q2_K": [16 + 64, 16 + 66], "Q3_K": [108], "Q4_K": [0, 2],
            "Q5_K": [0, 2], "Q6_K": [208], "IQ4_XS": [0]}
SENTINEL = {np.uint16: 0x7BAD, np.float32: -1234.5}
RAGGED = (1, 7, 19, 111)


# ------------------------------------------------------------------------- operands
def random_blocks(rng, ggml_type: int, n: int, k: int) -> np.ndarray:
    """Random stored blocks [n * k / QK, block_bytes] of W [n, k] whose f16 scale fields
    are finite, of either sign, scaled by one power of two so that |W| ~ 1 / sqrt(k)
    (x @ W^T of unit-normal x near 1: the twin comparison's tolerance is absolute too)."""
    t = PACKED[ggml_type]
    b = rng.integers(0, 256, (n * k // t.qk, t.block_bytes), dtype=np.uint8)

    def set_scales(e: int) -> None:
        for a in SCALE_AT[t.name]:
            h = np.sign(rng.standard_normal(len(b))) * 2.0 ** rng.uniform(-1, 1, len(b))
            b[:, a:a + 2] = (h * 2.0 ** e).astype(np.float16).view(np.uint8).reshape(-1, 2)
    set_scales(0)
    p = split_blocks(b.reshape(-1), ggml_type, n, k)
    rms = float(np.sqrt(np.mean(dequant_f32(p.q, p.qh, p.meta, ggml_type, k) ** 2.0)))
    set_scales(int(np.round(-np.log2(rms * np.sqrt(k)))))
    return b


def random_planes(rng, ggml_type: int, n: int, k: int) -> Planes:
    return split_blocks(random_blocks(rng, ggml_type, n, k).reshape(-1), ggml_type, n, k)


def xs(rng, m, k):
    return f32_to_bf16(rng.standard_normal((m, k), dtype=np.float32))


def wbits(p: Planes) -> np.ndarray:
    return dequant_bf16(p.q, p.qh, p.meta, p.ggml_type, p.k)


def launch(backend, p: Planes, x, out_fp32=False, tile=None, ldy=None, rows=None):
    """Y [rows, ldy] (every column: the ones past n hold SENTINEL unless written) of X's
    rows `rows` (pointers offset into the full buffers) against W's planes."""
    m_all, k = x.shape
    ldy = p.n if ldy is None else ldy
    r0, r1 = (0, m_all) if rows is None else rows
    dt = np.float32 if out_fp32 else np.uint16
    with Buffers(backend) as b:
        xp = b.put(x)
        yp = b.put(np.full((m_all, ldy), SENTINEL[dt], dt))
        qh = NULL if p.qh is None else b.put(p.qh)
        G.gemm_gguf(backend, backend.default_stream(),
                    yp.offset(r0 * ldy * np.dtype(dt).itemsize), xp.offset(r0 * k * 2),
                    b.put(p.q), qh, b.put(p.meta), r1 - r0, p.n, k, p.ggml_type, ldy=ldy,
                    out_fp32=out_fp32, tile=tile)
        return b.get(yp, (m_all, ldy), dt)[r0:r1]


def ragged_launches(tile: str, few: bool = False):
    """(m, n) pairs of a tile's launches: m = 1..16 for the decode tile (n cycling through
    RAGGED), every RAGGED pair for the others; `few` (a real hidden size: emulator time):
    two of each, the largest row and column counts among them."""
    if tile == "16x16":
        return [(1, 111), (16, 19)] if few else [(m, RAGGED[m % 4]) for m in range(1, 17)]
    return [(7, 111), (111, 19)] if few else [(m, n) for m in RAGGED for n in RAGGED]


# ----------------------------------------------------------------------------- CPU
def test_entry_points_exist():
    for module in (G.MODULE, G.MODULE_K):
        want = {G.kernel_name(t, f, tile) for t in TYPES if G.module_of(t) == module
                for f in (False, True) for tile in T.TILES}
        assert set(kernel_source.entry_points(module)) == want, module


def test_plane_alignment_is_each_blocks_natural_alignment():
    want = {"Q4_0": (16, 1, 2), "Q4_1": (16, 1, 4), "Q5_0": (16, 4, 2), "Q5_1": (16, 4, 4),
            "Q8_0": (16, 1, 2), "IQ4_NL": (16, 1, 2), "Q2_K": (16, 1, 4), "Q3_K": (16, 16, 2),
            "Q4_K": (16, 1, 16), "Q5_K": (16, 16, 16), "Q6_K": (16, 16, 2),
            "IQ4_XS": (16, 1, 8)}
    assert {PACKED[t].name: G.plane_alignment(t) for t in TYPES} == want


def test_bad_arguments_raise_before_launch(host):
    q4k, q5k, q4_0 = BY_NAME["Q4_K"], BY_NAME["Q5_K"], BY_NAME["Q4_0"]
    ok = dict(m=1, n=1, k=256)
    with pytest.raises(InvalidArgument, match="meta_ptr .* 16-byte aligned"):
        G.gemm_gguf(host, 0, 64, 64, 64, NULL, 72, ggml_type=q4k, **ok)
    with pytest.raises(InvalidArgument, match="q_ptr .* 16-byte aligned"):
        G.gemm_gguf(host, 0, 64, 64, 72, NULL, 64, ggml_type=q4k, **ok)
    with pytest.raises(InvalidArgument, match="qh_ptr .* 16-byte aligned"):
        G.gemm_gguf(host, 0, 64, 64, 64, 72, 64, ggml_type=q5k, **ok)
    with pytest.raises(InvalidArgument, match="needs a qh plane"):
        G.gemm_gguf(host, 0, 64, 64, 64, NULL, 64, ggml_type=q5k, **ok)
    with pytest.raises(InvalidArgument, match="no qh plane"):
        G.gemm_gguf(host, 0, 64, 64, 64, 64, 64, ggml_type=q4k, **ok)
    with pytest.raises(InvalidArgument, match="multiple of Q4_K's block of 256"):
        G.gemm_gguf(host, 0, 64, 64, 64, NULL, 64, 1, 1, 224, q4k)
    with pytest.raises(InvalidArgument, match="meta_ptr .* 2-byte aligned"):
        G.gemm_gguf(host, 0, 64, 64, 64, NULL, 65, 1, 1, 32, q4_0)
    with pytest.raises(InvalidArgument, match="ldy = 3 is less than n = 4"):
        G.gemm_gguf(host, 0, 64, 64, 64, NULL, 64, 1, 4, 32, q4_0, ldy=3)
    with pytest.raises(InvalidArgument, match="not kept packed"):
        G.gemm_gguf(host, 0, 64, 64, 64, NULL, 64, 1, 4, 32, 1)


@pytest.mark.parametrize("ggml_type", TYPES, ids=NAMES)
def test_twin_is_gemm_tc_on_the_planes_bits(host, rng, ggml_type):
    """The twin: dot_f32 of x and dequant_bf16(W), bit for bit, within the float64 formula's
    bound, Y rows ldy apart (the columns past n untouched)."""
    qk = PACKED[ggml_type].qk
    n, k, m = 19, 3 * qk, 7
    p, x = random_planes(rng, ggml_type, n, k), xs(rng, m, k)
    want = T.dot_f32(x, wbits(p))
    ref = bf16_to_f32(x).astype(np.float64) @ bf16_to_f32(wbits(p)).astype(np.float64).T
    for out_fp32 in (False, True):
        y = launch(host, p, x, out_fp32, ldy=n + 3)
        assert (y[:, n:] == SENTINEL[y.dtype.type]).all()
        got = y[:, :n]
        assert np.array_equal(bits(got), bits(want if out_fp32 else f32_to_bf16(want)))
        if out_fp32:
            assert_close(got, ref, "twin_fp32")


# ------------------------------------------------------------- GPU (and the emulator)
def check_tiles(device, host, p: Planes, x, label: str, few: bool = False) -> None:
    """Every tile and output over its ragged (m, n) launches (W's first n rows, X's first m):
    gemm_tc's bits on the dequantized W (one launch of all rows: gemm_tc is batch- and
    tile-invariant), within the table's bound of the twin."""
    w = wbits(p)
    for out_fp32 in (False, True):
        same = run_tc(device, x, w, out_fp32)
        twin = launch(host, p, x, out_fp32)
        for tile in T.TILES:
            for m, n in ragged_launches(tile, few):
                if n > p.n or m > len(x):
                    continue
                sub = Planes(p.q[:n], None if p.qh is None else p.qh[:n], p.meta[:n],
                             p.ggml_type, n, p.k)
                got = launch(device, sub, x[:m], out_fp32, tile=tile)
                where = f"{label} out_fp32={out_fp32} tile={tile} m={m} n={n}"
                assert np.array_equal(bits(got), bits(same[:m, :n])), where
                assert_close(as_f32(got), as_f32(twin[:m, :n]), KINDS[out_fp32], where)


def one_several_real(ggml_type: int) -> list[int]:
    """k = one block, several blocks, a real hidden size (576 / 896 for 32-element blocks;
    the K-quants' 256-multiples: 1536 = 6 blocks)."""
    return [32, 7 * 32, 576] if PACKED[ggml_type].qk == 32 else [256, 3 * 256, 1536]


@pytest.mark.gpu
@pytest.mark.parametrize("ggml_type", TYPES, ids=NAMES)
@pytest.mark.parametrize("kind", ["one_block", "several_blocks", "hidden"])
def test_gpu_every_tile_is_gemm_tc_on_the_planes_bits(device, host, rng, ggml_type, kind):
    k = one_several_real(ggml_type)[["one_block", "several_blocks", "hidden"].index(kind)]
    p = random_planes(rng, ggml_type, max(RAGGED), k)
    check_tiles(device, host, p, xs(rng, max(RAGGED), k), f"{PACKED[ggml_type].name} k={k}",
                few=kind == "hidden")


@pytest.mark.gpu
@pytest.mark.parametrize("ggml_type", TYPES, ids=NAMES)
def test_gpu_identity_x_gives_the_planes_values(device, rng, ggml_type):
    """X = rows of the identity: Y = W^T in FP32, each element exactly dequant_bf16's
    value (a -0 weight sums to +0 from the +0 accumulator), every tile."""
    qk = PACKED[ggml_type].qk
    n, k = 19, 2 * qk
    p = random_planes(rng, ggml_type, n, k)
    want = bf16_to_f32(wbits(p)).T + np.float32(0)     # -0 -> +0
    eye = f32_to_bf16(np.eye(k, dtype=np.float32))
    for tile in ("64x32", "128x128"):
        got = launch(device, p, eye, True, tile=tile)
        assert np.array_equal(bits(got), bits(want)), tile
    for r0 in range(0, k, 16):   # the decode tile: 16 identity rows at a time
        got = launch(device, p, eye[r0:r0 + 16], True, tile="16x16")
        assert np.array_equal(bits(got), bits(want[r0:r0 + 16])), r0


@pytest.mark.gpu
@pytest.mark.parametrize("ggml_type", TYPES, ids=NAMES)
def test_gpu_y_rows_are_ldy_apart(device, rng, ggml_type):
    """ldy > n, odd and even (pair stores on and off): the first n columns as with ldy = n,
    the others keep their sentinel, every tile and output."""
    qk = PACKED[ggml_type].qk
    n, k, m = 19, 2 * qk, 7
    p, x = random_planes(rng, ggml_type, n, k), xs(rng, m, k)
    for out_fp32 in (False, True):
        for tile in T.TILES:
            dense = launch(device, p, x, out_fp32, tile=tile)
            for ldy in (n + 1, n + 8):
                y = launch(device, p, x, out_fp32, tile=tile, ldy=ldy)
                assert np.array_equal(bits(y[:, :n]), bits(dense)), (tile, ldy)
                assert (y[:, n:] == SENTINEL[y.dtype.type]).all(), (tile, ldy)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["Q4_0", "Q5_1", "Q3_K", "Q4_K", "Q6_K", "IQ4_XS"])
def test_gpu_batch_invariance_across_m_offsets_and_tiles(device, rng, name):
    """Row i alone equals row i inside m = 2..70 (the default tile, crossing 16/17 and
    64/65) and inside every tile at row offsets (X and Y pointers moved by whole rows)."""
    ggml_type = BY_NAME[name]
    k = 2 * PACKED[ggml_type].qk
    p, x = random_planes(rng, ggml_type, 37, k), xs(rng, 70, k)
    solo = {i: launch(device, p, x, True, rows=(i, i + 1))[0] for i in (0, 15, 16, 17, 64, 69)}
    for r0, r1, tile in ((0, 17, None), (0, 65, None), (0, 70, None), (15, 17, "16x16"),
                         (1, 65, "64x32"), (0, 70, "128x128"), (16, 69, "16x16")):
        part = launch(device, p, x, True, rows=(r0, r1), tile=tile)
        for i, want in solo.items():
            if r0 <= i < r1:
                assert np.array_equal(bits(part[i - r0]), bits(want)), (i, r0, r1, tile)


@pytest.mark.gpu
@pytest.mark.parametrize("ggml_type", TYPES, ids=NAMES)
def test_gpu_nan_and_infinite_scales(device, host, rng, ggml_type):
    """Blocks whose d (or dmin / m) is +-inf or NaN, and d = -0: the NaN and infinite rows of
    the twin and gemm_tc's bits on the dequantized W, every tile and output."""
    t = PACKED[ggml_type]
    n, k, m = 19, 2 * t.qk, 12
    b = random_blocks(rng, ggml_type, n, k)
    specials = np.array([np.inf, -np.inf, np.nan, -0.0], np.float16).view(np.uint8)
    for i, a in enumerate(SCALE_AT[t.name]):   # blocks 3i .. 3i + 3 of rows 0, 1, ...
        for s in range(4):
            blk = (3 * i + 5 * s) % len(b)
            b[blk, a:a + 2] = specials[2 * s:2 * s + 2]
    p = split_blocks(b.reshape(-1), ggml_type, n, k)
    with np.errstate(invalid="ignore"):   # gguf_planes.sub_scales' inf * 0 scales
        w = wbits(p)
    assert ((w & 0x7FFF) > 0x7F80).any()   # some NaN weights
    x = xs(rng, m, k)
    for out_fp32 in (False, True):
        same = run_tc(device, x, w, out_fp32)
        with np.errstate(invalid="ignore"):
            twin = launch(host, p, x, out_fp32)
        for tile in T.TILES:
            got = launch(device, p, x, out_fp32, tile=tile)
            assert np.array_equal(bits(got), bits(same)), (out_fp32, tile)
            assert_close(as_f32(got), as_f32(twin), KINDS[out_fp32], f"{out_fp32} {tile}")


# an 8B model's linears (Llama 3.1 8B: q|k|v 6144, o 4096, gate|up 28672, down k 14336)
LLAMA_8B = [real(1, 6144, 4096), real(8, 4096, 4096), real(1, 28672, 4096),
            real(1, 4096, 14336), real(64, 28672, 4096), real(300, 6144, 4096),
            real(2048, 4096, 14336)]


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["Q4_K", "Q6_K", "Q8_0", "Q4_0"])
@pytest.mark.parametrize("m,n,k", LLAMA_8B)
def test_gpu_matches_twin_llama_shapes(device, host, rng, name, m, n, k):
    p, x = random_planes(rng, BY_NAME[name], n, k), xs(rng, m, k)
    assert_close(bf16_to_f32(launch(device, p, x)), bf16_to_f32(launch(host, p, x)),
                 KINDS[False], f"{name} m={m} n={n} k={k}")
