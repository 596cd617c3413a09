"""attention_mla family (ops/attention_mla.py): the absorbed MLA decode over a paged latent cache
against a float64 formula, against the decompressed attention (keys and values expanded
per head from the latent, as transformers' DeepseekV3Attention runs it), split-K over
several 256-token pieces, batch invariance, and bad arguments."""
import numpy as np
import pytest

from metrale.errors import InvalidArgument
from metrale.ops import attention_mla as M
from metrale.ops.bf16 import bf16_to_f32, f32_to_bf16
from tests.conftest import assert_close, rel_max_error
from tests.helpers import Buffers


def bf(x):
    return bf16_to_f32(f32_to_bf16(np.asarray(x, np.float32)))


def make_case(rng, lens, H=4, R=64, rope=16, bs=16):
    """Per row a sequence of lens[r] latent rows in shuffled blocks; absorbed queries."""
    D = R + rope
    blocks_per = [-(-L // bs) for L in lens]
    nblocks = sum(blocks_per)
    perm = rng.permutation(nblocks)
    mb = max(blocks_per)
    tables = np.full((len(lens), mb), -1, np.int32)
    cache = bf(rng.standard_normal((nblocks, bs, D)))
    o = 0
    for r, k in enumerate(blocks_per):
        tables[r, :k] = perm[o:o + k]
        o += k
    q = bf(rng.standard_normal((len(lens), H, D)) * 0.3)
    return q, cache, tables, np.asarray(lens, np.int32), mb


def run(backend, q, cache, tables, lens, scale, R, rope, bs, mb):
    n, H, D = q.shape
    msp = M.mla_max_splits(mb * bs)
    with Buffers(backend) as b:
        qp, cp = b.put(f32_to_bf16(q)), b.put(f32_to_bf16(cache))
        tp, lp = b.put(tables), b.put(lens)
        op = b.empty((n, H, R), np.uint16)
        wp = b.empty((M.mla_workspace_bytes(n, H, R, msp),), np.uint8)
        M.attention_mla(backend, backend.default_stream(), op, qp, cp, tp, lp, n, H, R, rope, bs,
                     mb, scale, wp, msp)
        return bf16_to_f32(b.get(op, (n, H, R), np.uint16))


def ref64(q, cache, tables, lens, scale, R, bs):
    out = []
    for r in range(len(lens)):
        pos = np.arange(lens[r])
        rows = cache[tables[r][pos // bs], pos % bs].astype(np.float64)     # [L, D]
        s = q[r].astype(np.float64) @ rows.T * scale                         # [H, L]
        p = np.exp(s - s.max(1, keepdims=True))
        p /= p.sum(1, keepdims=True)
        out.append(p @ rows[:, :R])
    return np.stack(out)


@pytest.mark.parametrize("lens", [[1], [7, 33], [300, 5, 513]])
def test_twin_against_float64(host, rng, lens):
    R, rope, bs = 64, 16, 16
    q, cache, tables, L, mb = make_case(rng, lens, R=R, rope=rope, bs=bs)
    got = run(host, q, cache, tables, L, 0.11, R, rope, bs, mb)
    assert_close(got, ref64(q, cache, tables, L, 0.11, R, bs), "twin_bf16")


def test_absorbed_equals_decompressed(host, rng):
    """o_h from the latent (W_UK folded into q, W_UV after) = HF's expanded attention."""
    H, R, rope, nope, vd, bs = 4, 64, 16, 24, 32, 16
    L = 70
    c = bf(rng.standard_normal((L, R)))                 # normalized latents
    kr = bf(rng.standard_normal((L, rope)))             # roped shared key
    w_uk = bf(rng.standard_normal((H, nope, R)) * 0.2)  # kv_b_proj rows of W_UK per head
    w_uv = bf(rng.standard_normal((H, vd, R)) * 0.2)
    q_nope = bf(rng.standard_normal((1, H, nope)))
    q_rope = bf(rng.standard_normal((1, H, rope)))
    scale = (nope + rope) ** -0.5
    # decompressed, float64: k_h = [c W_UK_h^T | kr], v_h = c W_UV_h^T
    k = np.concatenate([np.einsum("lr,hdr->hld", c, w_uk),
                        np.broadcast_to(kr, (H, L, rope))], -1).astype(np.float64)
    v = np.einsum("lr,hdr->hld", c, w_uv).astype(np.float64)
    qf = np.concatenate([q_nope[0], q_rope[0]], -1).astype(np.float64)
    s = np.einsum("hd,hld->hl", qf, k) * scale
    p = np.exp(s - s.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    want = np.einsum("hl,hld->hd", p, v)
    # absorbed through the kernel's twin over a paged cache
    cache = np.zeros((-(-L // bs), bs, R + rope), np.float32)
    cache.reshape(-1, R + rope)[:L] = np.concatenate([c, kr], 1)
    tables = np.arange(cache.shape[0], dtype=np.int32)[None, ::-1].copy()
    cache = cache[::-1].copy()                         # blocks stored in reverse
    qa = bf(M.absorb_query(q_nope, q_rope, w_uk))
    lat = run(host, qa, cache, tables, np.array([L], np.int32), scale, R, rope, bs,
              tables.shape[1])
    got = np.einsum("hr,hdr->hd", lat[0], w_uv)
    assert rel_max_error(got, want) < 2e-2


def test_batch_invariance(host, rng):
    R, rope, bs = 64, 16, 16
    q, cache, tables, L, mb = make_case(rng, [290, 17, 64], R=R, rope=rope, bs=bs)
    both = run(host, q, cache, tables, L, 0.2, R, rope, bs, mb)
    for r in range(3):
        one = run(host, q[r:r + 1], cache, tables[r:r + 1], L[r:r + 1], 0.2, R, rope, bs, mb)
        assert np.array_equal(one[0], both[r])


def test_bad_arguments(host):
    with pytest.raises(InvalidArgument, match="kv_lora_rank"):
        M.attention_mla(host, 0, 8, 8, 8, 8, 8, 1, 1, 1000, 64, 16, 1, 0.1, 8, 1)
    with pytest.raises(InvalidArgument, match="scale"):
        M.attention_mla(host, 0, 8, 8, 8, 8, 8, 1, 1, 64, 16, 16, 1, float("nan"), 8, 1)
    with pytest.raises(InvalidArgument, match="max_kv_len"):
        M.mla_max_splits(0)


def test_entry_points_exist():
    from metrale.gpu_runtime import kernel_source
    assert set(kernel_source.entry_points(M.MODULE)) == {"attention_mla_split",
                                                         "attention_mla_combine"}


@pytest.mark.gpu
@pytest.mark.parametrize("lens, H", [([1, 40], 3), ([300, 9], 10), ([513], 16)])
def test_gpu_matches_twin(device, host, lens, H):
    rng = np.random.default_rng(7)
    R, rope, bs = 64, 16, 16
    q, cache, tables, L, mb = make_case(rng, lens, H=H, R=R, rope=rope, bs=bs)
    got = run(device, q, cache, tables, L, 0.13, R, rope, bs, mb)
    want = run(host, q, cache, tables, L, 0.13, R, rope, bs, mb)
    assert_close(got, want, "gpu_vs_twin_bf16")
