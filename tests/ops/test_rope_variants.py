"""rope family, the options of issue 40: a partial rotary embedding (Phi-3/4's
`partial_rotary_factor`: only the first R dims of each head rotate, the rest pass through)
and Gemma 3's q/k norm, whose weight applies as (1 + w); the twin against float64, the kernel
(emu / CUDA) against the twin, `rope_write_kv` against apply_rope + write_kv."""
import numpy as np
import pytest

from metrale.errors import InvalidArgument
from metrale.gpu_runtime import NULL
from metrale.ops import kv_cache, rope
from metrale.ops.bf16 import bf16_to_f32, f32_to_bf16
from tests.conftest import assert_close
from tests.helpers import Buffers


def rand_bits(rng, shape, scale=1.0):
    return f32_to_bf16((rng.standard_normal(shape) * scale).astype(np.float32))


def run(backend, qkv, pos, table, h, kv, d, rd, qn=None, kn=None, gemma=False, slots=None,
        num_slots=0, fused=True):
    """qkv after apply_rope (slots None), or (qkv, k_cache, v_cache) after rope_write_kv
    (or apply_rope + write_kv when not `fused`)."""
    n = qkv.shape[0]
    with Buffers(backend) as b:
        qp, pp = b.put(qkv), b.put(np.asarray(pos, np.int32))
        tp = b.put(np.ascontiguousarray(table, np.float32))
        qnp = b.put(qn) if qn is not None else NULL
        knp = b.put(kn) if kn is not None else NULL
        s = backend.default_stream()
        if slots is None:
            rope.apply_rope(backend, s, qp, pp, tp, n, h, kv, d, table.shape[0], qnp, knp,
                            1e-6, rotary_dim=rd, gemma_norm=gemma)
            return b.get(qp, qkv.shape, np.uint16)
        shape = (num_slots, kv * d)
        kp, vp = b.put(np.zeros(shape, np.uint16)), b.put(np.zeros(shape, np.uint16))
        sp = b.put(np.asarray(slots, np.int32))
        if fused:
            rope.rope_write_kv(backend, s, qp, pp, tp, kp, vp, sp, n, h, kv, d, table.shape[0],
                               qnp, knp, 1e-6, rotary_dim=rd, gemma_norm=gemma)
        else:
            rope.apply_rope(backend, s, qp, pp, tp, n, h, kv, d, table.shape[0], qnp, knp,
                            1e-6, rotary_dim=rd, gemma_norm=gemma)
            kv_cache.write_kv(backend, s, qp, kp, vp, sp, n, h, kv, d)
        return (b.get(qp, qkv.shape, np.uint16), b.get(kp, shape, np.uint16),
                b.get(vp, shape, np.uint16))


def ref(qkv, pos, table, h, kv, d, rd, qn=None, kn=None, gemma=False, eps=1e-6):
    """float64: the q/k norm over the whole head (weight 1 + w for Gemma), rounded to BF16
    once; then the first rd dims rotated as pairs (j, j + rd/2), the rest passed through."""
    n = qkv.shape[0]
    x = bf16_to_f32(qkv).astype(np.float64).reshape(n, h + 2 * kv, d)
    out = x.copy()
    for t in range(n):
        c = table[pos[t], :rd // 2].astype(np.float64)
        s = table[pos[t], rd // 2:].astype(np.float64)
        for head in range(h + kv):
            v = x[t, head].copy()
            w = qn if head < h else kn
            if w is not None:
                wf = bf16_to_f32(w).astype(np.float64) + (1.0 if gemma else 0.0)
                v = v / np.sqrt(np.mean(v * v) + eps) * wf
                v = bf16_to_f32(f32_to_bf16(v.astype(np.float32))).astype(np.float64)
            x1, x2 = v[:rd // 2], v[rd // 2:rd]
            out[t, head] = np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s, v[rd:]])
    return out.reshape(n, -1)


CASES = [  # (h, kv, d, rd): Phi-4-mini's 0.75 of 128, odd pass-through counts, d = rd
    (4, 2, 128, 96), (3, 1, 64, 32), (2, 2, 32, 2), (4, 2, 6, 4), (2, 1, 256, 64),
    (4, 2, 64, 64)]


@pytest.mark.parametrize("norm", [None, "qwen3", "gemma"])
@pytest.mark.parametrize("h,kv,d,rd", CASES)
def test_twin_matches_float64(host, rng, h, kv, d, rd, norm):
    n = 9
    table = rope.rope_table(rd, 512, 10000.0, None)
    qkv = rand_bits(rng, (n, (h + 2 * kv) * d), 2.0)
    pos = rng.integers(0, 512, n).astype(np.int32)
    qn = kn = None
    if norm:   # Gemma's weights sit around 0 (the 1 is added), Qwen3's around 1
        center = 0.0 if norm == "gemma" else 1.0
        qn = f32_to_bf16((center + 0.5 * rng.standard_normal(d)).astype(np.float32))
        kn = f32_to_bf16((center + 0.5 * rng.standard_normal(d)).astype(np.float32))
    gemma = norm == "gemma"
    got = run(host, qkv, pos, table, h, kv, d, rd, qn, kn, gemma)
    assert_close(bf16_to_f32(got), ref(qkv, pos, table, h, kv, d, rd, qn, kn, gemma),
                 "twin_bf16")
    assert np.array_equal(got[:, (h + kv) * d:], qkv[:, (h + kv) * d:])   # v untouched
    if norm is None and rd < d:   # the passed dims are the input's bits
        x, y = qkv.reshape(n, -1, d), got.reshape(n, -1, d)
        assert np.array_equal(x[:, :h + kv, rd:], y[:, :h + kv, rd:])


def test_gemma_norm_adds_one_to_the_weight(host, rng):
    """gemma_norm with w is the plain q/k norm with 1 + w (exact in BF16 for these w)."""
    h, kv, d = 2, 1, 32
    table = rope.rope_table(d, 64, 10000.0, None)
    qkv = rand_bits(rng, (5, (h + 2 * kv) * d), 2.0)
    pos = np.arange(5, dtype=np.int32)
    w = f32_to_bf16(rng.choice([-0.5, -0.25, 0.0, 0.25, 0.5], d).astype(np.float32))
    w1 = f32_to_bf16(bf16_to_f32(w) + np.float32(1.0))
    a = run(host, qkv, pos, table, h, kv, d, d, w, w, gemma=True)
    b = run(host, qkv, pos, table, h, kv, d, d, w1, w1, gemma=False)
    assert np.array_equal(a, b)
    assert not np.array_equal(a, run(host, qkv, pos, table, h, kv, d, d, w, w))


def test_bad_rotary_dim_raises_before_launch(host):
    for rd in (0, 3, 66, -2):
        with pytest.raises(InvalidArgument, match="rotary_dim"):
            rope.apply_rope(host, 0, 64, 64, 64, 4, 4, 2, 64, 16, rotary_dim=rd)
        with pytest.raises(InvalidArgument, match="rotary_dim"):
            rope.rope_write_kv(host, 0, 64, 64, 64, 256, 256, 64, 4, 4, 2, 64, 16,
                               rotary_dim=rd)


@pytest.mark.parametrize("norm", [None, "gemma"])
def test_rope_write_kv_caches_the_rotated_k(host, rng, norm):
    h, kv, d, rd = 4, 2, 64, 48
    table = rope.rope_table(rd, 256, 10000.0, None)
    n, slots = 6, np.array([3, -1, 0, 5, 7, 1], np.int32)
    qkv = rand_bits(rng, (n, (h + 2 * kv) * d), 2.0)
    pos = rng.integers(0, 256, n).astype(np.int32)
    w = f32_to_bf16((0.5 * rng.standard_normal(d)).astype(np.float32)) if norm else None
    got, kc, vc = run(host, qkv, pos, table, h, kv, d, rd, w, w, norm == "gemma",
                      slots=slots, num_slots=8)
    assert_close(bf16_to_f32(got), ref(qkv, pos, table, h, kv, d, rd, w, w, norm == "gemma"),
                 "twin_bf16")
    for t, s in enumerate(slots):
        if s >= 0:
            assert np.array_equal(kc[s], got[t, h * d:(h + kv) * d])
            assert np.array_equal(vc[s], qkv[t, (h + kv) * d:])


@pytest.mark.gpu
@pytest.mark.parametrize("norm", [None, "qwen3", "gemma"])
@pytest.mark.parametrize("n,h,kv,d,rd", [(1, 32, 8, 128, 96), (19, 24, 8, 128, 96),
                                         (7, 4, 1, 6, 4), (5, 2, 2, 256, 64),
                                         (9, 8, 4, 256, 256), (3, 4, 2, 64, 2)])
def test_gpu_matches_twin(device, host, rng, n, h, kv, d, rd, norm):
    table = rope.rope_table(rd, 4096, 10000.0, None)
    qkv = rand_bits(rng, (n, (h + 2 * kv) * d), 2.0)
    pos = rng.integers(0, 4096, n).astype(np.int32)
    qn = kn = None
    if norm:
        center = 0.0 if norm == "gemma" else 1.0
        qn = f32_to_bf16((center + 0.5 * rng.standard_normal(d)).astype(np.float32))
        kn = f32_to_bf16((center + 0.5 * rng.standard_normal(d)).astype(np.float32))
    gemma = norm == "gemma"
    g = run(device, qkv, pos, table, h, kv, d, rd, qn, kn, gemma)
    t = run(host, qkv, pos, table, h, kv, d, rd, qn, kn, gemma)
    assert_close(bf16_to_f32(g), bf16_to_f32(t), "gpu_vs_twin_bf16")
    slots = rng.permutation(2 * n)[:n].astype(np.int32)
    fused = run(device, qkv, pos, table, h, kv, d, rd, qn, kn, gemma, slots, 2 * n)
    apart = run(device, qkv, pos, table, h, kv, d, rd, qn, kn, gemma, slots, 2 * n,
                fused=False)
    for a, b in zip(fused, apart):
        assert np.array_equal(a, b)
