"""dense_attention family: one sequence, dense strided K/V, optional causal mask with offset."""

import numpy as np
import pytest

from metrale.errors import InvalidArgument
from metrale.gpu_runtime import kernel_source
from metrale.ops import dense_attention as da
from metrale.ops.bf16 import bf16_to_f32, f32_to_bf16
from tests.conftest import assert_close
from tests.helpers import Buffers


def rand_bf16(rng, shape, scale=1.0):
    return f32_to_bf16((rng.standard_normal(shape) * scale).astype(np.float32))


def run(backend, q, k, v, H, KV, D, causal, q_offset=0, fused=False, pad=0):
    """q [n_q, q_stride], k/v [n_kv, kv_stride] bf16 rows (or one fused k|v buffer)."""
    n_q, n_kv = q.shape[0], k.shape[0]
    with Buffers(backend) as b:
        qp = b.put(q)
        if fused:  # k and v interleaved per row in one buffer: kv_stride = 2 * row width
            kv = np.concatenate([k, v], axis=1)
            kp = b.put(kv)
            vp = kp.offset(k.shape[1] * 2)
            kv_stride = kv.shape[1]
        else:
            kp, vp = b.put(k), b.put(v)
            kv_stride = k.shape[1]
        op = b.empty((n_q, H * D), np.uint16)
        da.dense_attention(backend, backend.default_stream(), op, qp, kp, vp, n_q, n_kv, H,
                           KV, D, q.shape[1], kv_stride, D ** -0.5, causal, q_offset)
        return b.get(op, (n_q, H * D), np.uint16)


def reference(q, k, v, H, KV, D, causal, q_offset=0):
    n_q, n_kv = q.shape[0], k.shape[0]
    qf = bf16_to_f32(q[:, :H * D]).astype(np.float64).reshape(n_q, H, D)
    kf = bf16_to_f32(k[:, :KV * D]).astype(np.float64).reshape(n_kv, KV, D)
    vf = bf16_to_f32(v[:, :KV * D]).astype(np.float64).reshape(n_kv, KV, D)
    out = np.zeros((n_q, H, D))
    for h in range(H):
        g = h // (H // KV)
        s = qf[:, h] @ kf[:, g].T * D ** -0.5
        if causal:
            mask = np.arange(n_kv)[None, :] > (q_offset + np.arange(n_q))[:, None]
            s[mask] = -np.inf
        p = np.exp(s - s.max(1, keepdims=True))
        out[:, h] = (p / p.sum(1, keepdims=True)) @ vf[:, g]
    return out.reshape(n_q, H * D)


def anti_aligned(rng, n_q, n_kv, H, KV, D, a=32.0):
    """(q, k, v): every query +a, every key -a plus 0..3 BF16 ulps of a: each score lies
    thousands below zero with a spread of a few units (an online max started at 0 instead
    of -inf underflows every exp2)."""
    q = f32_to_bf16(np.full((n_q, H * D), a, np.float32))
    k = f32_to_bf16((-a + a / 128 * rng.integers(0, 4, (n_kv, KV * D))).astype(np.float32))
    return q, k, rand_bf16(rng, (n_kv, KV * D))


def test_entry_points_exist():
    # stamped out by the DENSE_ENTRY macro: found in the preprocessed source
    names = {f"dense_attention_p{p}_v{v}" for p in (1, 2, 4) for v in (8, 2)}
    assert names <= set(kernel_source.entry_points(da.MODULE))


@pytest.mark.parametrize("H,KV,D", [(4, 4, 16), (4, 2, 64), (2, 1, 6), (3, 3, 128),
                                    (2, 2, 256)])
@pytest.mark.parametrize("causal", [False, True])
def test_twin_matches_float64(host, rng, H, KV, D, causal):
    n_q, n_kv = 37, 37
    q, k, v = (rand_bf16(rng, (n, h * D)) for n, h in ((n_q, H), (n_kv, KV), (n_kv, KV)))
    got = run(host, q, k, v, H, KV, D, causal)
    assert_close(bf16_to_f32(got), reference(q, k, v, H, KV, D, causal), "twin_bf16")


def test_strided_rows_and_offset(host, rng):
    """q inside a fused [n, 3d] buffer; causal rows at positions q_offset.. of the cache."""
    H, D, n_kv, n_q, off = 4, 16, 29, 5, 24
    qkv = rand_bf16(rng, (n_q, 3 * H * D))
    k, v = rand_bf16(rng, (n_kv, H * D)), rand_bf16(rng, (n_kv, H * D))
    got = run(host, qkv, k, v, H, H, D, True, q_offset=off, fused=True)
    assert_close(bf16_to_f32(got), reference(qkv, k, v, H, H, D, True, off), "twin_bf16")


def test_rows_do_not_depend_on_n_q(host, rng):
    """A decode step (one row at q_offset) equals that row of the whole-prefix pass."""
    H, D, n = 4, 32, 45
    q, k, v = rand_bf16(rng, (n, H * D)), rand_bf16(rng, (n, H * D)), rand_bf16(rng, (n, H * D))
    full = run(host, q, k, v, H, H, D, True, fused=True)
    for i in (0, 31, 32, 44):
        one = run(host, q[i:i + 1], k, v, H, H, D, True, q_offset=i, fused=True)
        assert np.array_equal(one[0], full[i])
    enc = run(host, q, k, v, H, H, D, False)
    assert np.array_equal(run(host, q[7:9], k, v, H, H, D, False), enc[7:9])


@pytest.mark.parametrize("causal", [False, True])
def test_twin_all_scores_far_below_zero(host, rng, causal):
    H, KV, D, n = 4, 2, 64, 40
    q, k, v = anti_aligned(rng, n, n, H, KV, D)
    want = reference(q, k, v, H, KV, D, causal)
    assert np.abs(want).max() > 0.5
    assert_close(bf16_to_f32(run(host, q, k, v, H, KV, D, causal)), want, "twin_bf16")


def test_bad_arguments_raise(host):
    ok = dict(n_q=4, n_kv=4, num_heads=4, num_kv_heads=2, head_dim=16, q_stride=64,
              kv_stride=32, scale=0.25, causal=False)

    def call(**kw):
        a = {**ok, **kw}
        da.dense_attention(host, 0, 16, 16, 16, 16, a["n_q"], a["n_kv"], a["num_heads"],
                           a["num_kv_heads"], a["head_dim"], a["q_stride"], a["kv_stride"],
                           a["scale"], a["causal"], a.get("q_offset", 0))
    for kw, match in [(dict(n_q=0), "n_q"), (dict(n_kv=0), "n_kv"),
                      (dict(num_kv_heads=3), "num_kv_heads"), (dict(head_dim=15), "head_dim"),
                      (dict(q_stride=32), "q_stride"), (dict(kv_stride=16), "kv_stride"),
                      (dict(scale=0.0), "scale"), (dict(q_offset=-1), "q_offset")]:
        with pytest.raises(InvalidArgument, match=match):
            call(**kw)


@pytest.mark.gpu
@pytest.mark.parametrize("H,KV,D", [(12, 12, 64), (4, 2, 128), (2, 1, 256), (3, 3, 6)])
@pytest.mark.parametrize("causal,n_q,n_kv,off", [(False, 300, 300, 0), (False, 7, 1500, 0),
                                                 (True, 70, 70, 0), (True, 1, 65, 64),
                                                 (True, 4, 40, 36)])
def test_gpu_matches_twin(device, host, rng, H, KV, D, causal, n_q, n_kv, off):
    q, k, v = (rand_bf16(rng, (n, h * D)) for n, h in ((n_q, H), (n_kv, KV), (n_kv, KV)))
    for fused in (False, True):
        g = run(device, q, k, v, H, KV, D, causal, off, fused)
        t = run(host, q, k, v, H, KV, D, causal, off, fused)
        assert_close(bf16_to_f32(g), bf16_to_f32(t), "gpu_vs_twin_bf16", f"fused {fused}")


@pytest.mark.gpu
def test_gpu_rows_do_not_depend_on_n_q(device, rng):
    H, D, n = 4, 64, 80
    q, k, v = rand_bf16(rng, (n, H * D)), rand_bf16(rng, (n, H * D)), rand_bf16(rng, (n, H * D))
    full = run(device, q, k, v, H, H, D, True, fused=True)
    for i in (0, 33, 79):
        one = run(device, q[i:i + 1], k, v, H, H, D, True, q_offset=i, fused=True)
        assert np.array_equal(one[0], full[i])


@pytest.mark.gpu
@pytest.mark.parametrize("H,KV,D", [(4, 2, 64), (3, 3, 6)])
@pytest.mark.parametrize("causal,n_q,n_kv,off", [(False, 7, 65, 0), (True, 19, 19, 0)])
def test_gpu_all_scores_far_below_zero_match_twin(device, host, rng, H, KV, D, causal, n_q,
                                                  n_kv, off):
    """Queries anti-aligned with every key (the causal rows' first sees one key only)."""
    q, k, v = anti_aligned(rng, n_q, n_kv, H, KV, D)
    assert_close(bf16_to_f32(run(device, q, k, v, H, KV, D, causal, off)),
                 bf16_to_f32(run(host, q, k, v, H, KV, D, causal, off)), "gpu_vs_twin_bf16")
