"""The batch-invariant tensor-core GEMM (module "gemm_tc"): twin against float64 and its
16-lane definition (native VDPBF16PS and FMA paths, numpy), kernel against twin at ragged and real sizes, and bit-exact batch invariance across
every m and every tile configuration."""
import numpy as np
import pytest

from metrale.errors import DeviceError, InvalidArgument
from metrale.gpu_runtime import kernel_source, native
from metrale.gpu_runtime.cxx import compiler
from metrale.ops import gemm_tc as T
from metrale.ops.bf16 import bf16_to_f32, f32_to_bf16
from tests.conftest import assert_close, real
from tests.helpers import GEMM_PATHS, Buffers, gemm_twin_path
from tests.ops.test_gemm import operands, ref64

KINDS = {False: "gpu_vs_twin_bf16", True: "gpu_vs_twin_fp32"}


def run_tc(backend, x, w, out_fp32=False, rows=None, tile=None, x_byte_offset=0):
    """y for the rows `rows` of x (pointers offset into the full buffers), optionally with
    x placed `x_byte_offset` bytes past an aligned address (the unaligned path)."""
    m_all, k = x.shape
    n = w.shape[0]
    r0, r1 = (0, m_all) if rows is None else rows
    dt = np.float32 if out_fp32 else np.uint16
    with Buffers(backend) as b:
        raw = np.zeros(x.size + x_byte_offset // 2, np.uint16)
        raw[x_byte_offset // 2:] = x.reshape(-1)
        xp = b.put(raw).offset(x_byte_offset)
        wp, yp = b.put(w), b.empty((m_all, n), dt)
        T.gemm_tc(backend, backend.default_stream(),
                  yp.offset(r0 * n * np.dtype(dt).itemsize), xp.offset(r0 * k * 2), wp,
                  r1 - r0, n, k, out_fp32=out_fp32, tile=tile)
        return b.get(yp, (m_all, n), dt)[r0:r1]


def bits(a):
    return a.view(np.uint32) if a.dtype == np.float32 else a


def as_f32(y):
    return y if y.dtype == np.float32 else bf16_to_f32(y)


def lanes_f32(x, w):
    """The twin's definition written out position by position (small shapes only): BF16
    subnormals count as 0; block b = t // 32, lane l = (t % 32) // 2, each block's odd
    position of a lane before its even one, each step f32(lane + exact product) flushed to
    0 when tiny after rounding to 24 bits with an unbounded exponent; padding adds nothing;
    then the lane tree (flushed alike), + 0, the canonical NaN."""
    def daz(b):
        return bf16_to_f32(np.where((b & 0x7F80) == 0, 0, b)).astype(np.float64)

    def step(lane, prod):
        # float64 holds the product exactly and, when the two are near enough to matter,
        # the sum: its float32 rounding is the one rounding of an FMA
        s = lane + prod
        mant, exp = np.frexp(s)
        tiny = np.abs(np.ldexp(np.round(mant * 2.0**24) / 2.0**24, exp)) < 2.0**-126
        return np.where(tiny, 0.0, s).astype(np.float32)

    def flush(a):
        return np.where(np.abs(a) < 2.0**-126, np.float32(0.0), a)

    xf, wf = daz(x), daz(w)
    k = x.shape[1]
    lanes = [np.zeros((len(x), len(w)), np.float32) for _ in range(16)]
    with np.errstate(over="ignore", invalid="ignore"):
        for b in range(-(-k // 32)):
            for parity in (1, 0):
                for lane in range(16):
                    t = 32 * b + 2 * lane + parity
                    if t < k:
                        lanes[lane] = step(lanes[lane], np.outer(xf[:, t], wf[:, t]))
        for half in (8, 4, 2, 1):
            lanes = [flush(lanes[i] + lanes[i + half]) for i in range(half)]
    y = lanes[0] + np.float32(0.0)
    y[np.isnan(y)] = np.uint32(0x7FC00000).view(np.float32)
    return y


def test_entry_points_exist():
    # The plain GEMMs, one per output dtype and tile, plus ops/gemm_fused.py's decode entries.
    want = {f"gemm_tc_{o}_{t}" for o in ("bf16", "fp32") for t in T.TILES}
    want |= {f"gemm_tc_bf16_16x16_{f}" for f in ("rmsnorm", "actmul_res", "res")}
    assert want == set(kernel_source.entry_points(T.MODULE))


# ---------------------------------------------------------------------------------------
# CPU: the twin.

@pytest.mark.parametrize("out_fp32", [False, True])
@pytest.mark.parametrize("m,n,k", [(1, 1, 1), (1, 7, 19), (7, 19, 111), (19, 111, 8),
                                   (3, 4097, 64), (9, 33, 4097), (130, 40, 256)])
def test_twin_matches_float64(host, rng, m, n, k, out_fp32):
    x, w = operands(rng, m, n, k)
    got = run_tc(host, x, w, out_fp32)
    ref = ref64(x, w)
    if out_fp32:
        assert got.dtype == np.float32
        assert_close(got, ref, "twin_fp32")
    else:
        assert_close(bf16_to_f32(got), bf16_to_f32(f32_to_bf16(ref.astype(np.float32))),
                     "twin_bf16")


@pytest.mark.parametrize("m,n,k", [(5, 9, 37), (17, 6, 300), (2, 3, 1000), (12, 40, 6000)])
@pytest.mark.parametrize("path", GEMM_PATHS)
def test_twin_is_the_16_lane_float32_sum(rng, m, n, k, path):
    x, w = operands(rng, m, n, k)
    with gemm_twin_path(path) as nat:
        assert np.array_equal(bits(T.dot_f32(x, w, nat)), bits(lanes_f32(x, w)))


@pytest.mark.parametrize("path", GEMM_PATHS)
def test_twin_result_is_a_function_of_the_two_rows(path):
    # products 2^60 (t=0), 2^-10 (t=2), -2^60 (t=32): 2^-10 by the twin's order (t=0 and
    # t=32 share lane 0, t=2 is lane 1), 0 by a sequential one; alone or inside a 5 x 7
    # block the same
    xr, wr = np.zeros((1, 64), np.float32), np.zeros((1, 64), np.float32)
    xr[0, [0, 2, 32]] = [2.0**30, 1.0, -(2.0**30)]
    wr[0, [0, 2, 32]] = [2.0**30, 2.0**-10, 2.0**30]
    x, w = f32_to_bf16(xr), f32_to_bf16(wr)
    with gemm_twin_path(path) as nat:
        alone = T.dot_f32(x, w, nat)
        inside = T.dot_f32(np.repeat(x, 5, axis=0), np.repeat(w, 7, axis=0), nat)
        # an exactly cancelling row is +0, as the kernel's accumulator gives
        z = T.dot_f32(f32_to_bf16(np.array([[1.0, 1.0, -2.0]], np.float32)),
                      f32_to_bf16(np.array([[1.0, 1.0, 1.0]], np.float32)), nat)
    assert alone[0, 0] == 2.0**-10
    assert np.array_equal(bits(inside), bits(np.broadcast_to(alone, (5, 7))))
    assert z[0, 0] == 0.0 and not np.signbit(z[0, 0])


@pytest.mark.parametrize("path", GEMM_PATHS)
def test_twin_handles_zeros_subnormals_and_wide_rows(rng, path):
    # rows: all zero; BF16 subnormals with normals; values spanning 2^-60 .. 2^60; products
    # in the float32 subnormals; ordinary values
    x = np.zeros((5, 40), np.uint16)
    x[1, :20] = rng.integers(1, 0x80, 20)                                  # subnormals
    x[1, 20:] = f32_to_bf16(rng.standard_normal(20).astype(np.float32))
    x[2] = f32_to_bf16((rng.standard_normal(40) * 2.0 ** rng.integers(-60, 60, 40))
                       .astype(np.float32))
    x[3] = f32_to_bf16((rng.standard_normal(40) * 2.0**-66).astype(np.float32))
    x[4] = f32_to_bf16(rng.standard_normal(40).astype(np.float32))
    w = np.concatenate([x, f32_to_bf16(rng.standard_normal((5, 40)).astype(np.float32))])
    with gemm_twin_path(path) as nat:
        y = T.dot_f32(x, w, nat)
    assert np.array_equal(bits(y), bits(lanes_f32(x, w)))
    assert not np.signbit(y[0]).any() and not y[0].any()
    # row 3 with itself: products near 2^-132, every step's sum subnormal, so flushed
    assert y[3, 3] == 0.0


@pytest.mark.parametrize("path", GEMM_PATHS)
def test_twin_flushes_by_the_rounded_value_at_2_to_the_minus_126(path):
    # lane 0: 2^-126 (t=1) then a product -d (t=0). Exact sum 2^-126 - d: d = 2^-151 is
    # the tie that rounds (24 bits, unbounded exponent) up to 2^-126, kept; d = 1.25 *
    # 2^-151 rounds below 2^-126, flushed to 0, although rounding it into float32's
    # subnormals would give 2^-126; d = 2^-150 flushed; d = 2^-152 kept.
    cases = [(2.0**-151, 2.0**-126), (1.25 * 2.0**-151, 0.0), (2.0**-150, 0.0),
             (2.0**-152, 2.0**-126)]
    x = f32_to_bf16(np.array([[2.0**-76, 2.0**-63]], np.float32))
    w = f32_to_bf16(np.array([[-d * 2.0**76, 2.0**-63] for d, _ in cases], np.float32))
    with gemm_twin_path(path) as nat:
        y = T.dot_f32(x, w, nat)
    assert np.array_equal(y[0], [want for _, want in cases])
    assert np.array_equal(bits(y), bits(lanes_f32(x, w)))


@pytest.mark.parametrize("path", GEMM_PATHS)
def test_twin_keeps_nan_and_inf(path):
    x = f32_to_bf16(np.array([[np.inf, 1.0], [np.nan, 0.0], [1.0, 2.0]], np.float32))
    w = f32_to_bf16(np.array([[1.0, 1.0], [-1.0, 3.0]], np.float32))
    with gemm_twin_path(path) as nat:
        y = T.dot_f32(x, w, nat)
    assert y[0, 0] == np.inf and y[0, 1] == -np.inf
    assert np.isnan(y[1]).all() and np.array_equal(y[2], [3.0, 5.0])


def test_native_library_builds_wherever_there_is_a_compiler():
    """A missing source or header in the installed package would otherwise pass unseen:
    HostBackend falls back to numpy (same bits, much slower) and these tests skip."""
    try:
        compiler()
    except DeviceError:
        pytest.skip("no C++ compiler")
    assert native.load() is native.try_load() is not None


def test_native_library_builds_for_this_cpu():
    """load() falls back to the generic build when the -march=native one fails (a compiler
    without the flag), which would also hide a source that compiles only without this
    CPU's instruction sets (the AVX-512 BF16 paths): the tuned build must compile."""
    try:
        compiler()
    except DeviceError:
        pytest.skip("no C++ compiler")
    native._build(native.TUNE)


def test_native_library_checks_its_dot_product_instruction():
    """Where the library has the VDPBF16PS path, the load-time check ran it against the
    formula and it is used only when no lane differed; set_dp(False) falls back to FMAs."""
    nat = native.try_load()
    if nat is None:
        pytest.skip("no C++ compiler: the native GEMM twin cannot be built")
    if nat.dp_mismatches < 0:
        assert not nat.uses_dp and not nat.set_dp(True)
        return
    assert nat.uses_dp == (nat.dp_mismatches == 0)
    assert nat.kind == ("vdpbf16ps" if nat.uses_dp else "fma")
    assert not nat.set_dp(False) and nat.kind == "fma" and not nat.uses_dp
    assert nat.set_dp(True) == (nat.dp_mismatches == 0)


def test_the_portable_build_runs_the_float64_step():
    with gemm_twin_path("portable") as lib:
        assert lib.kind == "float64" and not lib.uses_dp and lib.dp_mismatches == -1


@pytest.mark.parametrize("out_fp32", [False, True])
def test_twin_is_batch_invariant(host, rng, out_fp32):
    x, w = operands(rng, 70, 45, 4104)
    full = run_tc(host, x, w, out_fp32)
    for r0, r1 in ((0, 1), (13, 14), (69, 70), (3, 20), (0, 17), (30, 70)):
        part = run_tc(host, x, w, out_fp32, rows=(r0, r1))
        assert np.array_equal(bits(part), bits(full[r0:r1])), (r0, r1)


def test_fp32_output_rounds_to_the_bf16_output(host, rng):
    x, w = operands(rng, 6, 50, 300)
    assert np.array_equal(f32_to_bf16(run_tc(host, x, w, True)), run_tc(host, x, w))


def test_pick_tile_switch_points():
    pick = lambda m, n: T.pick_tile(m, n).name  # noqa: E731
    assert [pick(m, 4096) for m in (1, 16, 17, 64, 65, 2048)] == \
        ["16x16", "16x16", "64x32", "64x32", "64x32", "128x128"]
    assert pick(256, 128 * 64) == "128x128" and pick(256, 128 * 63) == "64x32"
    assert pick(1, 65535 * 16) == "16x16" and pick(1, 65535 * 16 + 1) == "128x128"


def test_bad_arguments_raise_before_launch(host):
    for args, name in (((0, 4, 4), "m"), ((4, 0, 4), "n"), ((4, 4, -1), "k")):
        with pytest.raises(InvalidArgument, match=f"{name} must be"):
            T.gemm_tc(host, 0, 8, 8, 8, *args)
    with pytest.raises(InvalidArgument, match="NULL"):
        T.gemm_tc(host, 0, 8, 0, 8, 1, 1, 1)
    with pytest.raises(InvalidArgument, match="tile"):
        T.gemm_tc(host, 0, 8, 8, 8, 1, 1, 1, tile="32x32")
    with pytest.raises(InvalidArgument, match="grid.y"):
        T.gemm_tc(host, 0, 8, 8, 8, 1, 65535 * 16 + 1, 8, tile="16x16")


# ---------------------------------------------------------------------------------------
# GPU (and the emulator): the kernel against the twin, every tile, both output types.

RAGGED = [(1, 1, 1), (1, 7, 19), (7, 19, 111), (19, 111, 8), (1, 4097, 64), (17, 33, 4097),
          (111, 19, 136), (130, 70, 264)]
LLAMA_8B = [  # (m, n, k): qkv, o, gate_up, down at decode / verify / prefill row counts
    real(1, 6144, 4096), real(8, 4096, 4096), real(64, 28672, 4096), real(64, 4096, 14336),
    real(300, 6144, 4096), real(2048, 4096, 4096), real(2048, 4096, 14336)]


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k", RAGGED)
def test_gpu_matches_twin_every_tile(device, host, rng, m, n, k):
    x, w = operands(rng, m, n, k)
    for out_fp32 in (False, True):
        want = run_tc(host, x, w, out_fp32)
        for tile in T.TILES:
            got = run_tc(device, x, w, out_fp32, tile=tile)
            assert_close(as_f32(got), as_f32(want), KINDS[out_fp32],
                         f"m={m} n={n} k={k} tile={tile} fp32={out_fp32}")


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k", LLAMA_8B)
def test_gpu_matches_twin_llama_shapes(device, host, rng, m, n, k):
    x, w = operands(rng, m, n, k)
    got, want = run_tc(device, x, w), run_tc(host, x, w)
    assert_close(bf16_to_f32(got), bf16_to_f32(want), KINDS[False], f"m={m} n={n} k={k}")


@pytest.mark.gpu
@pytest.mark.parametrize("m", [real(1), real(8), real(64)])
def test_gpu_lm_head_fp32(device, host, rng, m):
    x, w = operands(rng, m, 128256, 4096)
    assert_close(run_tc(device, x, w, True), run_tc(host, x, w, True), KINDS[True])


@pytest.mark.gpu
@pytest.mark.parametrize("k,offset", [(264, 2), (64, 8), (19, 0)])
def test_gpu_unaligned_and_ragged_k_take_the_scalar_path(device, host, rng, k, offset):
    # x 2 or 8 bytes past 16-byte alignment (k % 8 == 0), or k % 8 != 0: the scalar fill
    x, w = operands(rng, 21, 37, k)
    for out_fp32 in (False, True):
        want = run_tc(host, x, w, out_fp32)
        for tile in T.TILES:
            got = run_tc(device, x, w, out_fp32, tile=tile, x_byte_offset=offset)
            assert np.array_equal(bits(got), bits(run_tc(device, x, w, out_fp32, tile=tile))), \
                f"k={k} offset={offset} tile={tile}: scalar and vector paths differ"
            assert_close(as_f32(got), as_f32(want), KINDS[out_fp32])


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", [(37, 264), (19, 19), real(4096, 4096), real(4096, 14336)])
def test_gpu_batch_invariance_across_m_and_tiles(device, rng, n, k):
    """Row i alone (m = 1) equals row i inside every m = 2..130 (small shapes; a subset at
    real ones), with the default tile (crossing its switch points 16/17 and 64/65) and with
    every tile forced at several row offsets; FP32 output rounds to the BF16 output."""
    x, w = operands(rng, 130, n, k)
    small = n * k < 1 << 16
    rows = range(130) if small else (0, 15, 16, 64, 129)
    solo = {i: run_tc(device, x, w, True, rows=(i, i + 1))[0] for i in rows}
    solo_bf16 = {i: run_tc(device, x, w, False, rows=(i, i + 1))[0] for i in (0, 16, 129)}
    for i in solo_bf16:
        assert np.array_equal(f32_to_bf16(solo[i]), solo_bf16[i])

    def check(r0, r1, tile):
        part = run_tc(device, x, w, True, rows=(r0, r1), tile=tile)
        for i in solo:
            if r0 <= i < r1:
                assert np.array_equal(bits(part[i - r0]), bits(solo[i])), \
                    f"row {i} in rows [{r0}, {r1}) tile {tile} differs from m = 1"
    for m in (range(2, 131) if small else (2, 16, 17, 64, 65, 128, 130)):
        check(0, m, None)
    for r0, r1 in ((0, 17), (0, 65), (0, 130), (15, 17), (1, 65), (64, 130), (16, 129)):
        for tile in T.TILES:
            check(r0, r1, tile)
    part = run_tc(device, x, w, False, rows=(0, 130))
    for i in solo_bf16:
        assert np.array_equal(part[i], solo_bf16[i])
