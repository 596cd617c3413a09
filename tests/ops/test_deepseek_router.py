"""deepseek_router family (ops/deepseek_router.py): V3's sigmoid + correction-bias grouped
top-k and V2's softmax group-limited greedy against a float64 formula written from
transformers' DeepseekV3TopkRouter / DeepseekV2TopkRouter, the bias choosing but not
weighing, the group limit, ties by the lower index, and bad arguments."""
import numpy as np
import pytest

from metrale.errors import InvalidArgument
from metrale.ops import deepseek_router as DR
from tests.conftest import assert_close
from tests.helpers import Buffers


def run(backend, logits, k, ng, tg, mode, renorm, scale, bias=None):
    n, E = logits.shape
    with Buffers(backend) as b:
        lp = b.put(logits.astype(np.float32))
        bp = b.put(bias.astype(np.float32)) if bias is not None else 0
        ip, wp = b.empty((n, k), np.int32), b.empty((n, k), np.float32)
        DR.moe_topk_grouped(backend, 0, ip, wp, lp, n, E, k, ng, tg, mode, renorm, scale, bp)
        return b.get(ip, (n, k), np.int32), b.get(wp, (n, k), np.float32)


def ref64(logits, k, ng, tg, mode, renorm, scale, bias=None):
    """One token at a time, python sorts: larger first, ties by lower index."""
    ids, ws = [], []
    for l in logits.astype(np.float64):
        E = len(l)
        G = E // ng
        if mode == 1:
            s = 1 / (1 + np.exp(-l))
            c = s + (0 if bias is None else bias.astype(np.float64))
            gs = [sum(sorted(c[g * G:(g + 1) * G], reverse=True)[:2]) for g in range(ng)]
        else:
            s = np.exp(l - l.max())
            s /= s.sum()
            c = s
            gs = [max(c[g * G:(g + 1) * G]) for g in range(ng)]
        groups = sorted(range(ng), key=lambda g: (-gs[g], g))[:tg]
        allowed = [e for e in range(E) if e // G in groups]
        chosen = sorted(allowed, key=lambda e: (-c[e], e))[:k]
        w = s[chosen]
        if renorm:
            w = w / (w.sum() + 1e-20)
        ids.append(chosen)
        ws.append(w * scale)
    return np.array(ids), np.array(ws)


@pytest.mark.parametrize("E, k, ng, tg", [(8, 2, 4, 2), (64, 6, 8, 3), (256, 8, 8, 4),
                                          (16, 4, 1, 1)])
def test_v3_against_float64(host, rng, E, k, ng, tg):
    logits = (rng.standard_normal((37, E)) * 2).astype(np.float32)
    bias = (rng.standard_normal(E) * 0.2).astype(np.float32)
    ids, w = run(host, logits, k, ng, tg, 1, True, 2.5, bias)
    rid, rw = ref64(logits, k, ng, tg, 1, True, 2.5, bias)
    assert np.array_equal(ids, rid)
    assert_close(w, rw, "twin_fp32")


@pytest.mark.parametrize("E, k, ng, tg", [(8, 2, 2, 1), (64, 6, 1, 1), (160, 6, 8, 3)])
def test_v2_against_float64(host, rng, E, k, ng, tg):
    logits = (rng.standard_normal((29, E)) * 2).astype(np.float32)
    ids, w = run(host, logits, k, ng, tg, 0, False, 1.5)
    rid, rw = ref64(logits, k, ng, tg, 0, False, 1.5)
    assert np.array_equal(ids, rid)
    assert_close(w, rw, "twin_fp32")


def test_bias_chooses_but_does_not_weigh(host):
    logits = np.array([[2.0, 1.0, 0.0, -1.0]], np.float32)
    bias = np.array([0.0, 0.0, 0.0, 5.0], np.float32)
    ids, w = run(host, logits, 2, 1, 1, 1, False, 1.0, bias)
    assert ids.tolist() == [[3, 0]]                     # expert 3 chosen through the bias
    s = 1 / (1 + np.exp(-logits[0].astype(np.float64)))
    assert_close(w[0], s[[3, 0]], "twin_fp32")          # weighed by its own sigmoid


def test_group_limit_changes_the_choice(host):
    # the two best experts (0, 2) sit in different groups; one group of two is kept
    logits = np.array([[3.0, -3.0, 2.9, 2.5]], np.float32)
    ids, _ = run(host, logits, 2, 2, 1, 0, False, 1.0)
    assert ids.tolist() == [[0, 1]]     # V2: group 0's best (3.0) wins, expert 1 comes along
    ids, _ = run(host, logits, 2, 2, 1, 1, False, 1.0)
    assert ids.tolist() == [[2, 3]]     # V3: group 1's top-two sum (1.87 > 1.0) wins
    ids, _ = run(host, logits, 2, 1, 1, 0, False, 1.0)
    assert ids.tolist() == [[0, 2]]     # no limit


def test_ties_go_to_the_lower_index(host):
    logits = np.zeros((3, 8), np.float32)
    logits[1, [5, 6]] = 1.0
    for mode in (0, 1):
        ids, _ = run(host, logits, 3, 4, 2, mode, mode == 1, 1.0)
        # groups 2 and 3 win; among experts 4 and 7 (equal) the lower index
        assert ids[0].tolist() == [0, 1, 2] and ids[1].tolist() == [5, 6, 4]


def test_bad_arguments(host):
    with pytest.raises(InvalidArgument, match="n_group"):
        DR.moe_topk_grouped(host, 0, 8, 8, 8, 1, 10, 2, 4, 2, 1, True, 1.0)
    with pytest.raises(InvalidArgument, match="top_k"):
        DR.moe_topk_grouped(host, 0, 8, 8, 8, 1, 8, 5, 4, 2, 1, True, 1.0)
    with pytest.raises(InvalidArgument, match="mode"):
        DR.moe_topk_grouped(host, 0, 8, 8, 8, 1, 8, 1, 8, 1, 1, True, 1.0)


def test_entry_points_exist():
    from metrale.gpu_runtime import kernel_source
    assert set(kernel_source.entry_points(DR.MODULE)) == {"moe_topk_grouped"}


@pytest.mark.gpu
@pytest.mark.parametrize("E, k, ng, tg, mode", [(8, 2, 4, 2, 1), (64, 6, 8, 3, 1),
                                                (256, 8, 8, 4, 1), (8, 2, 2, 1, 0),
                                                (160, 6, 8, 3, 0), (64, 6, 1, 1, 0)])
def test_gpu_matches_twin(device, host, E, k, ng, tg, mode):
    rng = np.random.default_rng(E + k)
    logits = (rng.standard_normal((13, E)) * 2).astype(np.float32)
    logits[3] = 0.5                                   # a row of ties
    bias = (rng.standard_normal(E) * 0.2).astype(np.float32) if mode else None
    args = (logits, k, ng, tg, mode, mode == 1, 2.5, bias)
    (gi, gw), (hi, hw) = run(device, *args), run(host, *args)
    assert np.array_equal(gi, hi)
    assert_close(gw, hw, "gpu_vs_twin_fp32")
