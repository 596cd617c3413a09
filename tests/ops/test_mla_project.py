"""mla_project family (ops/mla_project.py): the rope + latent cache write, the query
absorption and the value expansion against float64 formulas (HF's rope conventions: V2's
complex pairs, V3's interleaved and half-split rotations), and the prefill form of
attention_mla (rows found through qo_indptr) equal to per-row decode."""
import numpy as np
import pytest

from metrale.ops import attention_mla as M
from metrale.ops import mla_project as P
from metrale.ops.bf16 import bf16_to_f32, f32_to_bf16
from tests.conftest import assert_close
from tests.helpers import Buffers


def bf(x):
    return bf16_to_f32(f32_to_bf16(np.asarray(x, np.float32)))


def table(mp, rope, theta=10000.0):
    inv = 1.0 / theta ** (np.arange(0, rope, 2) / rope)
    ang = np.arange(mp)[:, None] * inv[None]
    return np.concatenate([np.cos(ang), np.sin(ang)], 1).astype(np.float32)


def rope64(x, pos, tab, adjacent):
    """HF: V2's view_as_complex(x pairs) * e^{i theta} / V3's rotate_half on the halves."""
    h = x.shape[-1] // 2
    cos = tab[pos, :h].astype(np.float64)
    sin = tab[pos, h:].astype(np.float64)
    x = x.astype(np.float64)
    if adjacent:
        z = (x[..., 0::2] + 1j * x[..., 1::2]) * np.exp(1j * np.arctan2(sin, cos))[:, None] \
            * np.hypot(cos, sin)[:, None]
        out = np.empty_like(x)
        out[..., 0::2], out[..., 1::2] = z.real, z.imag
        return out
    a, b = x[..., :h], x[..., h:]
    c, s = cos[:, None], sin[:, None]
    return np.concatenate([a * c - b * s, b * c + a * s], -1)


@pytest.mark.parametrize("adjacent", [True, False])
def test_rope_cache_against_float64(host, rng, adjacent):
    n, H, dn, dr, R, mp = 5, 3, 8, 8, 32, 64
    q = bf(rng.standard_normal((n, H, dn + dr)))
    c = bf(rng.standard_normal((n, R)))
    kr = bf(rng.standard_normal((n, dr)))
    pos = np.array([0, 3, 17, 40, 63], np.int32)
    slots = np.array([4, 0, -1, 7, 2], np.int32)
    tab = table(mp, dr)
    with Buffers(host) as b:
        qp, cp, kp = b.put(f32_to_bf16(q)), b.put(f32_to_bf16(c)), b.put(f32_to_bf16(kr))
        cache0 = np.zeros((8, R + dr), np.uint16)
        pp, tp, sp, cachep = b.put(pos), b.put(tab), b.put(slots), b.put(cache0)
        P.mla_rope_cache(host, 0, qp, cp, kp, pp, tp, cachep, sp, n, H, dn, dr, R, mp, adjacent)
        q_out = bf16_to_f32(b.get(qp, (n, H, dn + dr), np.uint16))
        cache = bf16_to_f32(b.get(cachep, (8, R + dr), np.uint16))
    assert np.array_equal(q_out[..., :dn], q[..., :dn])
    assert_close(q_out[..., dn:], rope64(q[..., dn:], pos, tab, adjacent), "twin_bf16")
    k = rope64(kr[:, None], pos, tab, adjacent)[:, 0]
    for t, s in enumerate(slots):
        if s >= 0:
            assert np.array_equal(cache[s, :R], c[t])
            assert_close(cache[s, R:], k[t], "twin_bf16")
    assert not cache[[1, 3, 5, 6]].any()    # slot -1 writes nothing


def test_absorb_and_expand_against_float64(host, rng):
    n, H, dn, dr, dv, R = 4, 3, 16, 8, 12, 32
    q = bf(rng.standard_normal((n, H, dn + dr)))
    kvb = bf(rng.standard_normal((H * (dn + dv), R)) * 0.2)
    lat = bf(rng.standard_normal((n, H, R)))
    w = kvb.reshape(H, dn + dv, R).astype(np.float64)
    with Buffers(host) as b:
        qp, kp, lp = b.put(f32_to_bf16(q)), b.put(f32_to_bf16(kvb)), b.put(f32_to_bf16(lat))
        qa, o = b.empty((n, H, R + dr), np.uint16), b.empty((n, H, dv), np.uint16)
        P.mla_absorb_q(host, 0, qa, qp, kp, n, H, dn, dr, dv, R)
        P.mla_expand_v(host, 0, o, lp, kp, n, H, dn, dv, R)
        qa = bf16_to_f32(b.get(qa, (n, H, R + dr), np.uint16))
        o = bf16_to_f32(b.get(o, (n, H, dv), np.uint16))
    assert_close(qa[..., :R], np.einsum("nhd,hdr->nhr", q[..., :dn], w[:, :dn]), "twin_bf16")
    assert np.array_equal(qa[..., R:], q[..., dn:])
    assert_close(o, np.einsum("nhr,hvr->nhv", lat, w[:, dn:]), "twin_bf16")


def test_prefill_rows_equal_decode_rows(host, rng):
    """Query rows of two sequences through qo_indptr (causal, in two launches of rows) give
    the bits of each position decoded alone."""
    H, R, dr, bs = 2, 32, 8, 4
    lens = np.array([9, 6], np.int32)                 # cache lengths after the chunk
    q_rows = [5, 3]                                   # the chunk's query rows per sequence
    tables = np.array([[0, 1, 2], [3, 4, -1]], np.int32)
    cache = bf(rng.standard_normal((5, bs, R + dr)))
    n = sum(q_rows)
    qa = bf(rng.standard_normal((n, H, R + dr)))
    indptr = np.array([0, 5, 8], np.int32)
    msp = M.mla_max_splits(12)
    with Buffers(host) as b:
        cp, tp, lp, ip = b.put(f32_to_bf16(cache)), b.put(tables), b.put(lens), b.put(indptr)
        qp = b.put(f32_to_bf16(qa))
        out = b.empty((n, H, R), np.uint16)
        ws = b.empty((M.mla_workspace_bytes(4, H, R, msp),), np.uint8)
        for r0 in (0, 4):                             # chunks of 4 rows
            rows = min(4, n - r0)
            M.attention_mla(host, 0, out.offset(r0 * H * R * 2), qp.offset(r0 * H * (R + dr) * 2),
                         cp, tp, lp, rows, H, R, dr, bs, 3, 0.3, ws, msp, qo_indptr_ptr=ip,
                         n_seqs=2, row_base=r0)
        got = b.get(out, (n, H, R), np.uint16)
        for g in range(n):
            s = 0 if g < 5 else 1
            L = int(lens[s] - (indptr[s + 1] - 1 - g))
            one_len = b.put(np.array([L], np.int32))
            one_tab = b.put(tables[s:s + 1])
            o1 = b.empty((1, H, R), np.uint16)
            M.attention_mla(host, 0, o1, qp.offset(g * H * (R + dr) * 2), cp, one_tab, one_len, 1,
                         H, R, dr, bs, 3, 0.3, ws, msp)
            assert np.array_equal(b.get(o1, (1, H, R), np.uint16)[0], got[g]), f"row {g}"


def test_entry_points_exist():
    from metrale.gpu_runtime import kernel_source
    assert set(kernel_source.entry_points(P.MODULE)) == {"mla_rope_cache", "mla_absorb_q",
                                                         "mla_expand_v"}


def _project_all(backend, q, c, kr, pos, tab, slots, kvb, lat, dims, adjacent):
    n, H, dn, dr, dv, R, mp = dims
    with Buffers(backend) as b:
        qp, cp, kp = b.put(f32_to_bf16(q)), b.put(f32_to_bf16(c)), b.put(f32_to_bf16(kr))
        pp, tp, sp = b.put(pos), b.put(tab), b.put(slots)
        cachep = b.put(np.zeros((n + 2, R + dr), np.uint16))
        wp, lp = b.put(f32_to_bf16(kvb)), b.put(f32_to_bf16(lat))
        qa, o = b.empty((n, H, R + dr), np.uint16), b.empty((n, H, dv), np.uint16)
        P.mla_rope_cache(backend, 0, qp, cp, kp, pp, tp, cachep, sp, n, H, dn, dr, R, mp,
                         adjacent)
        P.mla_absorb_q(backend, 0, qa, qp, wp, n, H, dn, dr, dv, R)
        P.mla_expand_v(backend, 0, o, lp, wp, n, H, dn, dv, R)
        return [bf16_to_f32(b.get(p, shape, np.uint16)) for p, shape in (
            (qp, (n, H, dn + dr)), (cachep, (n + 2, R + dr)), (qa, (n, H, R + dr)),
            (o, (n, H, dv)))]


@pytest.mark.gpu
@pytest.mark.parametrize("adjacent", [True, False])
@pytest.mark.parametrize("dims", [(3, 2, 16, 8, 12, 32, 40), (5, 5, 40, 16, 24, 64, 64)])
def test_gpu_matches_twin(device, host, adjacent, dims):
    rng = np.random.default_rng(11)
    n, H, dn, dr, dv, R, mp = dims
    q = bf(rng.standard_normal((n, H, dn + dr)))
    c = bf(rng.standard_normal((n, R)))
    kr = bf(rng.standard_normal((n, dr)))
    pos = rng.integers(0, mp, n).astype(np.int32)
    slots = np.arange(n, dtype=np.int32)[::-1].copy()
    slots[0] = -1
    kvb = bf(rng.standard_normal((H * (dn + dv), R)) * 0.2)
    lat = bf(rng.standard_normal((n, H, R)))
    args = (q, c, kr, pos, table(mp, dr), slots, kvb, lat, dims, adjacent)
    got, want = _project_all(device, *args), _project_all(host, *args)
    assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1])  # rope: exact
    for g, w in zip(got[2:], want[2:]):
        assert_close(g, w, "gpu_vs_twin_bf16")


@pytest.mark.gpu
def test_gpu_prefill_rows_match_twin(device, host):
    rng = np.random.default_rng(12)
    H, R, dr, bs = 9, 32, 8, 4
    lens, indptr = np.array([300, 6], np.int32), np.array([0, 5, 8], np.int32)
    tables = np.stack([np.arange(75), np.r_[75, 76, np.full(73, -1)]]).astype(np.int32)
    cache = bf(rng.standard_normal((77, bs, R + dr)))
    qa = bf(rng.standard_normal((8, H, R + dr)))
    msp = M.mla_max_splits(300)

    def go(backend):
        with Buffers(backend) as b:
            cp, tp, lp, ip = b.put(f32_to_bf16(cache)), b.put(tables), b.put(lens), \
                b.put(indptr)
            qp, out = b.put(f32_to_bf16(qa)), b.empty((8, H, R), np.uint16)
            ws = b.empty((M.mla_workspace_bytes(8, H, R, msp),), np.uint8)
            M.attention_mla(backend, 0, out, qp, cp, tp, lp, 8, H, R, dr, bs, 75, 0.2, ws, msp,
                         qo_indptr_ptr=ip, n_seqs=2, row_base=0)
            return bf16_to_f32(b.get(out, (8, H, R), np.uint16))
    assert_close(go(device), go(host), "gpu_vs_twin_bf16")
