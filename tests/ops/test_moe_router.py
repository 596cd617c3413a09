"""moe_router family: top-k softmax routing (twin against a float64 formula, the tie and
NaN rules, torch.topk's own ties on the reference) and the per-expert row lists; the
kernels against the twins at ragged and real sizes."""
import numpy as np
import pytest

from metrale.errors import InvalidArgument
from metrale.gpu_runtime import kernel_source
from metrale.ops import moe_router as R
from tests.conftest import assert_close, real
from tests.helpers import Buffers
from tests.model.common import FIXTURES


def run_topk(backend, logits, k, renorm):
    n, E = logits.shape
    with Buffers(backend) as b:
        lp, ip, wp = b.put(logits.astype(np.float32)), b.empty((n, k), np.int32), \
            b.empty((n, k), np.float32)
        R.moe_topk_softmax(backend, backend.default_stream(), ip, wp, lp, n, E, k, renorm)
        return b.get(ip, (n, k), np.int32), b.get(wp, (n, k), np.float32)


def run_route(backend, ids, E, block_m):
    n = ids.size
    with Buffers(backend) as b:
        ip = b.put(ids.astype(np.int32).reshape(-1))
        sp, op, tp = b.empty((n,), np.int32), b.empty((E + 1,), np.int32), \
            b.empty((E + 1,), np.int32)
        R.moe_route(backend, backend.default_stream(), sp, op, tp, ip, n, E, block_m)
        return b.get(sp, (n,), np.int32), b.get(op, (E + 1,), np.int32), \
            b.get(tp, (E + 1,), np.int32)


def ref64(logits, k, renorm):
    """float64 softmax, the k largest (ties: lower index), optional renormalisation."""
    l64 = logits.astype(np.float64)
    p = np.exp(l64 - l64.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    ids = np.array([sorted(range(len(r)), key=lambda e: (-r[e], e))[:k] for r in l64])
    w = np.take_along_axis(p, ids, 1)
    return ids, (w / w.sum(1, keepdims=True) if renorm else w)


def router_logits(rng, n, E, scale=2.0):
    return (rng.standard_normal((n, E)) * scale).astype(np.float32)


def test_entry_points_exist():
    assert set(kernel_source.entry_points(R.MODULE)) == {"moe_topk_softmax", "moe_route"}


# ---------------------------------------------------------------------------------------
# CPU: the twins.

SIZES = [(1, 8, 2), (7, 60, 4), (19, 128, 8), (111, 512, 32), (5, 1, 1), (3, 33, 32)]


@pytest.mark.parametrize("renorm", [False, True])
@pytest.mark.parametrize("n,E,k", SIZES)
def test_twin_matches_float64(host, rng, n, E, k, renorm):
    logits = router_logits(rng, n, E)
    ids, w = run_topk(host, logits, k, renorm)
    want_ids, want_w = ref64(logits, k, renorm)
    assert np.array_equal(ids, want_ids)
    assert_close(w, want_w, "twin_fp32")
    if renorm:
        assert_close(w.sum(1), np.ones(n), "twin_fp32")


def test_ties_rank_the_lower_expert_first_and_nan_above_numbers():
    l = np.array([[1.0, 3.0, 3.0, 2.0, 3.0],       # three-way tie at the top
                  [0.0, -0.0, 0.0, -1.0, -1.0],    # -0 == +0: a tie
                  [1.0, np.nan, 5.0, np.nan, 2.0],  # NaN ranks above every number
                  [-np.inf, 0.5, -np.inf, 0.5, 0.25]], np.float32)
    ids, w = R.topk_softmax_f32(l, 3, False)
    assert ids.tolist() == [[1, 2, 4], [0, 1, 2], [1, 3, 2], [1, 3, 4]]
    assert w[0, 0] == w[0, 1] == w[0, 2] and np.isnan(w[2]).all()
    assert np.isfinite(w[3]).all() and w[3, 0] == w[3, 1]


def tie_rows(E):
    """Router rows whose top scores tie: all equal; two experts tied at the top (1 and the
    last); three tied across the k = 2 boundary below a clear first; with E > 35, two tied
    at the top in one lane (experts 1 and 33 of lane 1) and in two lanes (expert 2 of lane
    2, expert 35 of lane 3). Ties go to the lower expert index (torch.topk's order on a
    GPU, see moe_router.cu). Last, a row far below zero (the softmax's max is the row's,
    not 0). E = 1: three single values."""
    if E == 1:   # one expert: every k = 1 pick is it, weight 1 with or without renorm
        return np.array([[0.5], [-3.0], [40.0], [-200.0]], np.float32)
    rng = np.random.default_rng(E)
    rows = [np.full(E, 0.5, np.float32)]
    for _ in range(3 if E < 36 else 5):
        rows.append(rng.uniform(-2.0, 0.0, E).astype(np.float32))
    rows[1][[1, E - 1]] = 3.0
    rows[2][[0]] = 4.0
    rows[2][[2, 3 % E, E - 2]] = 1.0
    if E >= 36:
        rows[4][[33, 1]] = 2.5
        rows[5][[35, 2]] = 2.5
    rows.append(rng.uniform(-200.0, -190.0, E).astype(np.float32))
    return np.stack(rows)


@pytest.mark.parametrize("E", [1, 7, 19, 111])
@pytest.mark.parametrize("k", [1, 2, 3])
def test_top1_and_ties_around_renormalisation(host, E, k):
    """Top-1 and tied top scores with and without norm_topk_prob: ids by the tie rule, the
    weights the float64 formula's (top-1 renormalised is exactly 1)."""
    k = min(k, E)
    logits = tie_rows(E)
    for renorm in (False, True):
        ids, w = run_topk(host, logits, k, renorm)
        want_ids, want_w = ref64(logits, k, renorm)
        assert np.array_equal(ids, want_ids), renorm
        assert_close(w, want_w, "twin_fp32")
        if renorm and k == 1:
            assert (w == 1).all()
    if E > 1:
        assert ids[1, :2].tolist() == [1, E - 1][:k]
        assert ids[2, :2].tolist() == [0, 2][:k]
    if E >= 36:
        assert ids[4, :2].tolist() == [1, 33][:k] and ids[5, :2].tolist() == [2, 35][:k]


def test_softmax_is_the_lane_sum_formula():
    # 40 experts: lane l sums experts l and l + 32, then the butterfly; reproduced exactly
    rng = np.random.default_rng(3)
    l = router_logits(rng, 6, 40, 4.0)
    x = np.exp(l - l.max(1, keepdims=True)).astype(np.float32)
    lanes = np.zeros((6, 32), np.float32)
    lanes[:, :32] = x[:, :32]
    lanes[:, :8] += x[:, 32:]
    while lanes.shape[1] > 1:
        h = lanes.shape[1] // 2
        lanes = lanes[:, :h] + lanes[:, h:]
    assert np.array_equal(R.softmax_f32(l), x / lanes)


def test_twin_rows_are_batch_invariant(rng):
    l = router_logits(rng, 50, 64)
    ids, w = R.topk_softmax_f32(l, 6, True)
    for r in (0, 17, 49):
        i1, w1 = R.topk_softmax_f32(l[r:r + 1], 6, True)
        assert np.array_equal(i1[0], ids[r]) and np.array_equal(w1[0], w[r])


def test_torch_topk_ties_recorded_by_the_fixture_script():
    """torch.topk's picks on rows with tied probabilities (tests/fixtures/moe_topk_ties.npz,
    written by make_fixtures.py on the reference). The top-k VALUES always agree with
    metrale's; the experts agree on every row whose k-th and (k+1)-th probabilities differ
    (a tie inside the top k only reorders equal weights); on rows tied across that
    boundary torch's unstable sort picks by position, metrale by the lower index."""
    with np.load(FIXTURES / "moe_topk_ties.npz") as g:
        cases = [(g[f"logits_{i}"], g[f"ids_{i}"], g[f"values_{i}"], int(g[f"k_{i}"]))
                 for i in range(int(g["count"]))]
    boundary_ties = disagree = 0
    for logits, t_ids, t_vals, k in cases:
        p = R.softmax_f32(logits.astype(np.float32))
        ids, w = R.topk_softmax_f32(logits.astype(np.float32), k, False)
        ps = -np.sort(-p, axis=1)
        assert_close(w, t_vals, "twin_fp32")
        clear = ps[:, k - 1] != ps[:, k] if k < p.shape[1] else np.ones(len(p), bool)
        assert np.array_equal(np.sort(ids[clear], 1), np.sort(t_ids[clear], 1))
        boundary_ties += int((~clear).sum())
        disagree += int((np.sort(ids, 1) != np.sort(t_ids, 1)).any(1).sum())
    assert boundary_ties > 0 and disagree > 0   # the fixture does hold such ties


@pytest.mark.parametrize("n_pairs,E,bm", [(1, 1, 16), (7, 4, 16), (64, 8, 16), (333, 128, 64),
                                          (5000, 512, 128), (16, 60, 16)])
def test_route_twin(rng, n_pairs, E, bm):
    ids = rng.integers(0, E, n_pairs)
    pairs, offsets, tiles = R.route(ids, E, bm)
    assert offsets[0] == 0 and offsets[-1] == n_pairs
    for e in range(E):
        got = pairs[offsets[e]:offsets[e + 1]]
        assert np.array_equal(got, np.flatnonzero(ids == e))
        assert tiles[e + 1] - tiles[e] == -(-len(got) // bm)


def test_bad_arguments_raise_before_launch(host):
    with pytest.raises(InvalidArgument, match="top_k"):
        R.moe_topk_softmax(host, 0, 8, 8, 8, 1, 4, 5, False)
    with pytest.raises(InvalidArgument, match="top_k"):
        R.moe_topk_softmax(host, 0, 8, 8, 8, 1, 64, 33, False)
    with pytest.raises(InvalidArgument, match="num_experts"):
        R.moe_route(host, 0, 8, 8, 8, 8, 4, 513, 16)
    with pytest.raises(InvalidArgument, match="n_tokens"):
        R.moe_topk_softmax(host, 0, 8, 8, 8, 0, 4, 2, False)
    with pytest.raises(InvalidArgument, match="NULL"):
        R.moe_route(host, 0, 0, 8, 8, 8, 4, 8, 16)


# ---------------------------------------------------------------------------------------
# GPU (and the emulator): kernels against twins.

GPU_SIZES = [(1, 8, 2), (7, 60, 4), (19, 128, 8), (111, 37, 5), (4, 512, 32), (2, 1, 1),
             real(2048, 128, 8), real(64, 8, 2)]


@pytest.mark.gpu
@pytest.mark.parametrize("n,E,k", GPU_SIZES)
def test_gpu_topk_matches_twin(device, host, rng, n, E, k):
    logits = router_logits(rng, n, E)
    logits[0, :min(E, 3)] = 1.25          # ties
    for renorm in (False, True):
        ids, w = run_topk(device, logits, k, renorm)
        want_ids, want_w = run_topk(host, logits, k, renorm)
        assert np.array_equal(ids, want_ids), f"n={n} E={E} k={k} renorm={renorm}"
        assert_close(w, want_w, "gpu_vs_twin_fp32")


@pytest.mark.gpu
def test_gpu_topk_nan_inf_and_one_expert_taking_every_token(device, host, rng):
    logits = router_logits(rng, 9, 16)
    logits[:, 3] = 50.0          # expert 3 first for every token
    logits[:, 5] = -np.inf       # expert 5 never
    logits[2, 7] = np.nan
    logits[4] = -np.inf          # a row of -inf: NaN weights, ids by index
    ids, w = run_topk(device, logits, 4, True)
    want_ids, want_w = run_topk(host, logits, 4, True)
    assert np.array_equal(ids, want_ids)
    assert (ids[:, 0] == 3).sum() == 7 and ids[4].tolist() == [0, 1, 2, 3]
    assert ids[2, 0] == 7 and not (ids == 5).any()
    assert np.array_equal(np.isnan(w), np.isnan(want_w))
    ok = ~np.isnan(w)
    assert_close(w[ok], want_w[ok], "gpu_vs_twin_fp32")


@pytest.mark.gpu
@pytest.mark.parametrize("E", [1, 7, 19, 111])
def test_gpu_top1_and_ties_match_twin(device, host, E):
    logits = tie_rows(E)
    for k in sorted({1, min(2, E), min(3, E)}):
        for renorm in (False, True):
            ids, w = run_topk(device, logits, k, renorm)
            want_ids, want_w = run_topk(host, logits, k, renorm)
            assert np.array_equal(ids, want_ids), f"k={k} renorm={renorm}"
            assert np.array_equal(ids, ref64(logits, k, renorm)[0]), f"k={k} renorm={renorm}"
            assert_close(w, want_w, "gpu_vs_twin_fp32")
            if renorm and k == 1:
                assert (w == 1).all()


@pytest.mark.gpu
@pytest.mark.parametrize("n_pairs,E,bm", [(1, 1, 16), (7, 4, 16), (14, 8, 16), (333, 128, 64),
                                          (2000, 512, 128), (40, 60, 16), real(16384, 128, 128)])
def test_gpu_route_matches_twin(device, host, rng, n_pairs, E, bm):
    ids = rng.integers(0, E, n_pairs).astype(np.int32)
    ids[: n_pairs // 2] = 0                     # expert 0 takes half of all pairs
    ids[ids == E - 1] = 0 if E > 1 else ids[ids == E - 1]   # expert E-1 takes none
    got, want = run_route(device, ids, E, bm), run_route(host, ids, E, bm)
    for a, b, what in zip(got, want, ("sorted_pairs", "expert_offsets", "tile_offsets")):
        assert np.array_equal(a, b), f"{what} n_pairs={n_pairs} E={E} bm={bm}"


@pytest.mark.gpu
def test_gpu_route_skips_ids_out_of_range(device, host):
    ids = np.array([2, 9, 0, -1, 2, 1], np.int32)
    pairs, offsets, tiles = run_route(device, ids, 4, 16)
    assert offsets.tolist() == [0, 1, 2, 4, 4] and tiles.tolist() == [0, 1, 2, 3, 3]
    assert pairs[:4].tolist() == [2, 5, 0, 4]
