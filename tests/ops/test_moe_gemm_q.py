"""moe_gemm_q family: the grouped expert GEMM over 4-bit (GPTQ / AWQ, act-order included)
and FP8 experts, dequantized in the tile. The twin against float64; the twin bit for bit
the BF16 grouped GEMM (moe_gemm) on the dequantized experts, on the native CPU path and in
numpy; each row bit for bit gemm_q's row of that token against its expert, whatever the
tile or the other tokens (batch invariance); the kernel against the twin at every tile."""
import numpy as np
import pytest

from metrale.errors import InvalidArgument
from metrale.gpu_runtime import NULL, kernel_source
from metrale.ops import moe_gemm as G, moe_gemm_q as MQ
from metrale.ops.bf16 import bf16_to_f32, f32_to_bf16
from metrale.ops.moe_router import route
from tests.conftest import assert_close
from tests.helpers import Buffers
from tests.ops.test_gemm_q import F8, Q4, twin_host, xs
from tests.ops.test_moe_gemm import run_moe, routing

KINDS = {False: "gpu_vs_twin_bf16", True: "gpu_vs_twin_fp32"}


class Experts:
    """E random quantized experts of one format (test_gemm_q's Q4 / F8 each), stacked in
    moe_gemm_q's layout: act-order tables and FP8 scale rows numbered globally."""

    def __init__(self, rng, fmt, E, n, k):
        self.fmt, self.E, self.n, self.k = fmt, E, n, k
        if fmt == "fp8":
            self.ws = [F8(rng, n, k, block=(16, 32)) for _ in range(E)]
            offs = np.cumsum([0] + [len(w.scales) for w in self.ws[:-1]])
            self.arrays = (np.stack([w.q for w in self.ws]),
                           np.concatenate([w.scales for w in self.ws]),
                           np.stack([w.scale_row + o for w, o in zip(self.ws, offs)])
                           .astype(np.int32))
            self.scalars = (self.ws[0].k_blocks, self.ws[0].block_k)
            return
        act = fmt == "q4_act"
        self.ws = [Q4(rng, n, k, group_size=16, act_order=act, garbage=False)
                   for _ in range(E)]
        g = gr = None
        if act:
            g = np.concatenate([w.gidx for w in self.ws])
            gr = np.stack([w.gidx_row + 3 * e for e, w in enumerate(self.ws)])
        self.arrays = (np.stack([w.q for w in self.ws]), np.stack([w.scales for w in self.ws]),
                       np.stack([w.zeros for w in self.ws]), g, gr)
        self.scalars = (self.ws[0].groups, self.ws[0].group_size)

    def dequant(self) -> np.ndarray:
        """BF16 bits [E, n, k]: each expert by gemm_q's dequantization."""
        return np.stack([w.dequant() for w in self.ws])

    def run(self, backend, x, ids, row_div, out_fp32=False, tile=None):
        t = G.TILES[tile] if tile else G.pick_tile(ids.size, self.E)
        pairs, offsets, tiles = route(ids.reshape(-1), self.E, t.bm)
        dt = np.float32 if out_fp32 else np.uint16
        with Buffers(backend) as b:
            yp = b.empty((ids.size, self.n), dt)
            w = [NULL if a is None else b.put(a) for a in self.arrays]
            gemm = MQ.moe_gemm_fp8 if self.fmt == "fp8" else MQ.moe_gemm_q4
            gemm(backend, backend.default_stream(), yp, b.put(x), *w, b.put(pairs),
                 b.put(offsets), b.put(tiles), ids.size, self.E, self.n, self.k, row_div,
                 *self.scalars, out_fp32=out_fp32, tile=t.name)
            return b.get(yp, (ids.size, self.n), dt)


FMTS = ["q4", "q4_act", "fp8"]


def test_entry_points_exist():
    want = {f"moe_gemm_{f}_{o}_{t}" for f in ("q4", "fp8") for o in ("bf16", "fp32")
            for t in G.TILES}
    assert want == set(kernel_source.entry_points(MQ.MODULE))


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("out_fp32", [False, True])
def test_twin_matches_float64(host, rng, fmt, out_fp32):
    E, n, k, top_k, tokens = 5, 24, 96, 2, 9
    ex = Experts(rng, fmt, E, n, k)
    x, ids = xs(rng, tokens, k), routing(rng, tokens, E, top_k)
    y = ex.run(host, x, ids, top_k, out_fp32)
    w64 = bf16_to_f32(ex.dequant()).astype(np.float64)[ids.reshape(-1)]
    x64 = bf16_to_f32(x).astype(np.float64)[np.arange(ids.size) // top_k]
    ref = np.einsum("pk,pnk->pn", x64, w64)
    if out_fp32:
        assert_close(y, ref, "twin_fp32")
    else:
        assert_close(bf16_to_f32(y), bf16_to_f32(f32_to_bf16(ref.astype(np.float32))),
                     "twin_bf16")


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("out_fp32", [False, True])
def test_twin_is_the_bf16_grouped_gemm_of_the_dequantized_experts(rng, fmt, out_fp32,
                                                                   native):
    """Bit for bit moe_gemm on dequant(W): the native CPU path (dequantization inside its
    tile) and numpy, for the gate_up gather (row_div = top_k) and the down one (1)."""
    from metrale.gpu_runtime import HostBackend
    be = HostBackend() if native else twin_host(None)
    if native and be.native is None:
        pytest.skip("no C++ compiler: no native CPU path")
    E, n, k, top_k = 6, 40, 136, 3
    ex = Experts(rng, fmt, E, n, k)
    x = xs(rng, 11, k)
    ids = routing(rng, 11, E, top_k, hot=1, cold=4)
    for row_div, xr in ((top_k, x), (1, np.repeat(x, top_k, axis=0))):
        got = ex.run(be, xr, ids, row_div, out_fp32)
        want = run_moe(be, xr, ex.dequant(), ids, row_div, out_fp32)
        assert np.array_equal(got, want), (fmt, row_div)


@pytest.mark.parametrize("fmt", FMTS)
def test_a_token_s_bits_do_not_depend_on_who_shares_its_expert(host, rng, fmt):
    """Token 0's rows alone, and inside batches that route other tokens to its experts
    (every tile): the same bits (and gemm_q's row of it against each expert)."""
    E, n, k, top_k = 4, 32, 64, 2
    ex = Experts(rng, fmt, E, n, k)
    x = xs(rng, 17, k)
    ids = routing(rng, 17, E, top_k, hot=2)
    solo = ex.run(host, x[:1], ids[:1], top_k, True)
    for tile in G.TILES:
        assert np.array_equal(ex.run(host, x, ids, top_k, True, tile)[:top_k], solo), tile
    for s, e in enumerate(ids[0]):
        alone = ex.ws[e].launch(host, x[:1], True)[0]
        assert np.array_equal(solo[s], alone), (s, e)


def test_bad_arguments_are_refused_before_launch(host):
    with pytest.raises(InvalidArgument, match="multiple of 8"):   # k % 8 for 4-bit
        MQ.moe_gemm_q4(host, 0, 64, 64, 64, 64, 64, NULL, NULL, 64, 64, 64, 4, 2, 8, 12, 1,
                       1, 16)
    with pytest.raises(InvalidArgument, match="q_ptr"):           # q not 16-byte aligned
        MQ.moe_gemm_fp8(host, 0, 64, 64, 72, 64, 64, 64, 64, 64, 4, 2, 8, 64, 1, 2, 32)
    with pytest.raises(InvalidArgument, match="k_blocks"):
        MQ.moe_gemm_fp8(host, 0, 64, 64, 64, 64, 64, 64, 64, 64, 4, 2, 8, 64, 1, 3, 32)
    with pytest.raises(InvalidArgument, match="num_experts"):
        MQ.moe_gemm_fp8(host, 0, 64, 64, 64, 64, 64, 64, 64, 64, 4, 0, 8, 64, 1, 2, 32)
    with pytest.raises(InvalidArgument, match="tile"):
        MQ.moe_gemm_fp8(host, 0, 64, 64, 64, 64, 64, 64, 64, 64, 4, 2, 8, 64, 1, 2, 32,
                        tile="32x32")


# ------------------------------------------------------------------------------------ GPU
@pytest.mark.gpu
@pytest.mark.parametrize("tile", list(G.TILES))
@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("out_fp32", [False, True])
def test_gpu_matches_twin_and_the_bf16_kernel(device, host, rng, tile, fmt, out_fp32):
    """The kernel against the twin, and bit for bit the BF16 grouped GEMM kernel on the
    dequantized experts at every tile (odd n and k past a tile edge; an expert nobody
    chose)."""
    E, n, k, top_k = 5, 40, 200, 2
    ex = Experts(rng, fmt, E, n, k)
    x = xs(rng, 21, k)
    ids = routing(rng, 21, E, top_k, cold=3)
    g = ex.run(device, x, ids, top_k, out_fp32, tile)
    t = ex.run(host, x, ids, top_k, out_fp32, tile)
    if out_fp32:
        assert_close(g, t, KINDS[True])
    else:
        assert_close(bf16_to_f32(g), bf16_to_f32(t), KINDS[False])
    bf16 = run_moe(device, x, ex.dequant(), ids, top_k, out_fp32, tile)
    assert np.array_equal(g.view(np.uint32) if out_fp32 else g,
                          bf16.view(np.uint32) if out_fp32 else bf16)
