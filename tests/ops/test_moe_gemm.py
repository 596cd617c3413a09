"""moe_gemm family: the grouped tensor-core GEMM over routed experts. Twin against float64;
the kernel against the twin at every tile; every row bit-identical to gemm_tc of that row
against its expert's weight (on the device too), whatever the tile, the batch or which
other tokens chose the same expert."""
import numpy as np
import pytest

from metrale.errors import InvalidArgument
from metrale.gpu_runtime import kernel_source
from metrale.ops import gemm_tc, moe_gemm as G
from metrale.ops.bf16 import bf16_to_f32, f32_to_bf16
from metrale.ops.moe_router import route
from tests.conftest import assert_close, real
from tests.helpers import Buffers
from tests.ops.test_gemm import rand_bf16

KINDS = {False: "gpu_vs_twin_bf16", True: "gpu_vs_twin_fp32"}


def operands(rng, tokens, E, n, k):
    return rand_bf16(rng, (tokens, k)), rand_bf16(rng, (E, n, k), 1.0 / np.sqrt(k))


def routing(rng, tokens, E, top_k, hot=None, cold=None):
    """ids [tokens, top_k], distinct per token; `hot` in every token's list, `cold` in none."""
    ids = np.empty((tokens, top_k), np.int64)
    for t in range(tokens):
        pool = [e for e in range(E) if e not in (hot, cold)]
        pick = list(rng.choice(pool, top_k - (hot is not None), replace=False))
        if hot is not None:
            pick.insert(int(rng.integers(0, top_k)), hot)
        ids[t] = pick
    return ids


def run_moe(backend, x, w, ids, row_div, out_fp32=False, tile=None):
    """y [n_pairs, n] of the grouped GEMM over the routing `ids` (flat pairs); x rows are
    read as x[pair // row_div]."""
    E, n, k = w.shape
    n_pairs = ids.size
    t = G.TILES[tile] if tile else G.pick_tile(n_pairs, E)
    pairs, offsets, tiles = route(ids.reshape(-1), E, t.bm)
    dt = np.float32 if out_fp32 else np.uint16
    with Buffers(backend) as b:
        yp = b.empty((n_pairs, n), dt)
        G.moe_gemm(backend, backend.default_stream(), yp, b.put(x), b.put(w), b.put(pairs),
                   b.put(offsets), b.put(tiles), n_pairs, E, n, k, row_div, out_fp32, t.name)
        return b.get(yp, (n_pairs, n), dt)


def run_tc(backend, x, w, out_fp32):
    m, k = x.shape
    dt = np.float32 if out_fp32 else np.uint16
    with Buffers(backend) as b:
        yp = b.empty((m, w.shape[0]), dt)
        gemm_tc.gemm_tc(backend, backend.default_stream(), yp, b.put(x), b.put(w), m,
                        w.shape[0], k, out_fp32)
        return b.get(yp, (m, w.shape[0]), dt)


def bits(a):
    return a.view(np.uint32) if a.dtype == np.float32 else a


def as_f32(y):
    return y if y.dtype == np.float32 else bf16_to_f32(y)


def ref64(x, w, ids, row_div):
    flat = ids.reshape(-1)
    xs = bf16_to_f32(x).astype(np.float64)[np.arange(flat.size) // row_div]
    ws = bf16_to_f32(w).astype(np.float64)[flat]
    return np.einsum("pk,pnk->pn", xs, ws)


def test_entry_points_exist():
    want = {f"moe_gemm_{q}{o}_{t}" for q in ("", "mxfp4_") for o in ("bf16", "fp32")
            for t in G.TILES}   # mxfp4_: gpt-oss's packed experts (test_moe_options.py)
    assert want == set(kernel_source.entry_points(G.MODULE))


# ---------------------------------------------------------------------------------------
# CPU: the twin.

CASES = [  # (tokens, E, top_k, n, k)
    (1, 8, 2, 19, 111), (7, 4, 2, 33, 64), (19, 60, 4, 7, 136), (5, 1, 1, 40, 8),
    (40, 16, 8, 24, 200)]


@pytest.mark.parametrize("out_fp32", [False, True])
@pytest.mark.parametrize("tokens,E,top_k,n,k", CASES)
def test_twin_matches_float64(host, rng, tokens, E, top_k, n, k, out_fp32):
    x, w = operands(rng, tokens, E, n, k)
    ids = routing(rng, tokens, E, top_k)
    y = run_moe(host, x, w, ids, top_k, out_fp32)
    ref = ref64(x, w, ids, top_k)
    if out_fp32:
        assert_close(y, ref, "twin_fp32")
    else:
        assert_close(bf16_to_f32(y), bf16_to_f32(f32_to_bf16(ref.astype(np.float32))),
                     "twin_bf16")


@pytest.mark.parametrize("out_fp32", [False, True])
def test_twin_rows_are_gemm_tc_rows(host, rng, out_fp32):
    """Row p is gemm_tc of x[p // row_div] against W[e], bit for bit, for the gather of the
    gate_up GEMM (row_div = top_k) and of the down GEMM (row_div = 1)."""
    x, w = operands(rng, 11, 6, 30, 72)
    ids = routing(rng, 11, 6, 3, hot=2, cold=4)
    for row_div, xs in ((3, x), (1, np.repeat(x, 3, axis=0))):
        y = run_moe(host, xs, w, ids, row_div, out_fp32)
        for p, e in enumerate(ids.reshape(-1)):
            solo = run_tc(host, xs[p // row_div][None], w[e], out_fp32)[0]
            assert np.array_equal(bits(y[p]), bits(solo)), (row_div, p)


def test_pick_tile_and_grid_bound():
    pick = lambda pairs, E: G.pick_tile(pairs, E).name  # noqa: E731
    assert pick(8, 128) == pick(512, 128) == pick(128, 8) == "16x16"  # decode
    assert pick(1024, 16) == "64x32" and pick(16384, 128) == pick(4096, 8) == "128x128"
    rng = np.random.default_rng(0)
    for n_pairs, E, bm in ((1, 1, 16), (8, 128, 16), (100, 3, 64), (4097, 128, 128)):
        bound = G.max_tiles(n_pairs, E, bm)
        for _ in range(20):   # any routing needs at most `bound` tiles
            ids = rng.integers(0, rng.integers(1, E + 1), n_pairs)
            assert route(ids, E, bm)[2][-1] <= bound
    # tight: every expert hit once more than a multiple of bm
    assert route(np.arange(3 * 17) % 3, 3, 16)[2][-1] == G.max_tiles(51, 3, 16) == 6


def test_bad_arguments_raise_before_launch(host):
    args = (8, 8, 8, 8, 8, 8)
    with pytest.raises(InvalidArgument, match="num_experts"):
        G.moe_gemm(host, 0, *args, 4, 600, 4, 4, 1)
    with pytest.raises(InvalidArgument, match="tile"):
        G.moe_gemm(host, 0, *args, 4, 4, 4, 4, 1, tile="32x32")
    with pytest.raises(InvalidArgument, match="row_div"):
        G.moe_gemm(host, 0, *args, 4, 4, 4, 4, 0)
    with pytest.raises(InvalidArgument, match="NULL"):
        G.moe_gemm(host, 0, 8, 8, 8, 0, 8, 8, 4, 4, 4, 4, 1)


# ---------------------------------------------------------------------------------------
# GPU (and the emulator): the kernel against the twin and against gemm_tc.

GPU_CASES = [  # (tokens, E, top_k, n, k): ragged; k % 8 != 0 takes the scalar fill
    (1, 8, 2, 19, 111), (7, 4, 2, 33, 64), (19, 6, 3, 17, 136), (3, 1, 1, 9, 8),
    (24, 5, 2, 40, 72)]
QWEN3_30B = [  # (tokens, E, top_k, n, k): gate_up and down at decode / prefill sizes
    real(1, 128, 8, 1536, 2048), real(64, 128, 8, 2048, 768), real(512, 128, 8, 1536, 2048)]


@pytest.mark.gpu
@pytest.mark.parametrize("tokens,E,top_k,n,k", GPU_CASES)
def test_gpu_matches_twin_every_tile(device, host, rng, tokens, E, top_k, n, k):
    x, w = operands(rng, tokens, E, n, k)
    ids = routing(rng, tokens, E, top_k, hot=0, cold=E - 1 if E > top_k else None)
    for out_fp32 in (False, True):
        want = run_moe(host, x, w, ids, top_k, out_fp32)
        for tile in G.TILES:
            got = run_moe(device, x, w, ids, top_k, out_fp32, tile)
            assert_close(as_f32(got), as_f32(want), KINDS[out_fp32],
                         f"tokens={tokens} E={E} n={n} k={k} tile={tile} fp32={out_fp32}")


@pytest.mark.gpu
@pytest.mark.parametrize("tokens,E,top_k,n,k", QWEN3_30B)
def test_gpu_matches_twin_real_shapes(device, host, rng, tokens, E, top_k, n, k):
    x, w = operands(rng, tokens, E, n, k)
    ids = routing(rng, tokens, E, top_k)
    got, want = run_moe(device, x, w, ids, top_k), run_moe(host, x, w, ids, top_k)
    assert_close(bf16_to_f32(got), bf16_to_f32(want), KINDS[False])


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", [(24, 136), (13, 37)])
def test_gpu_rows_equal_gemm_tc_and_do_not_depend_on_the_batch(device, rng, n, k):
    """On the device: every row of every tile equals gemm_tc of that row against its
    expert (alone, m = 1); a token routed alone, inside a batch where one expert takes
    every token and another none, and inside a batch routed otherwise, gives the same
    bits."""
    E, top_k = 5, 2
    x, w = operands(rng, 20, E, n, k)
    ids = routing(rng, 20, E, top_k, hot=1, cold=3)
    solo = {(t, s): run_tc(device, x[t][None], w[ids[t, s]], True)[0]
            for t in (0, 7, 19) for s in range(top_k)}
    for tile in G.TILES:
        y = run_moe(device, x, w, ids, top_k, True, tile).reshape(20, top_k, n)
        for (t, s), want in solo.items():
            assert np.array_equal(bits(y[t, s]), bits(want)), (tile, t, s)
    for t in (0, 7, 19):   # the token alone, and with every other token's routing changed
        alone = run_moe(device, x[t][None], w, ids[t][None], top_k, True).reshape(top_k, n)
        other = ids.copy()
        other[np.arange(20) != t] = routing(rng, 19, E, top_k)
        mixed = run_moe(device, x, w, other, top_k, True).reshape(20, top_k, n)
        for s in range(top_k):
            assert np.array_equal(bits(alone[s]), bits(solo[(t, s)]))
            assert np.array_equal(bits(mixed[t, s]), bits(solo[(t, s)]))
    bf = run_moe(device, x, w, ids, top_k, False).reshape(20, top_k, n)
    assert np.array_equal(bf[7, 1], f32_to_bf16(solo[(7, 1)]))


@pytest.mark.gpu
def test_gpu_unaligned_x_takes_the_scalar_path(device, host, rng):
    E, top_k, n, k = 4, 2, 21, 64
    x, w = operands(rng, 6, E, n, k)
    ids = routing(rng, 6, E, top_k)
    pairs, offsets, tiles = route(ids.reshape(-1), E, 16)
    with Buffers(device) as b:
        raw = np.zeros(x.size + 1, np.uint16)
        raw[1:] = x.reshape(-1)
        xp = b.put(raw).offset(2)            # 2 bytes past 16-byte alignment
        yp = b.empty((12, n), np.float32)
        G.moe_gemm(device, device.default_stream(), yp, xp, b.put(w), b.put(pairs),
                   b.put(offsets), b.put(tiles), 12, E, n, k, top_k, True, "16x16")
        got = b.get(yp, (12, n), np.float32)
    assert np.array_equal(bits(got), bits(run_moe(device, x, w, ids, top_k, True, "16x16")))
    assert_close(got, run_moe(host, x, w, ids, top_k, True), KINDS[True])
