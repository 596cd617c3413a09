"""gated_norm family: the zero-centred RMSNorm (rows and q/k heads, residual add), the gated
RMSNorms of Qwen3-Next / Qwen3.5 (norm, then silu(z)) and Nemotron-H (silu(z), then the group
norm), and the sigmoid output gate; twins against float64, kernels (emu/GPU) against twins."""
import numpy as np
import pytest

from metrale.errors import InvalidArgument
from metrale.gpu_runtime import NULL, kernel_source
from metrale.ops import gated_norm as gn
from metrale.ops.bf16 import bf16_to_f32, f32_to_bf16
from tests.conftest import assert_close
from tests.helpers import Buffers

EPS = 1e-6


def rand_bf16(rng, shape, scale=1.0, shift=0.0):
    return f32_to_bf16((rng.standard_normal(shape) * scale + shift).astype(np.float32))


def f64(bits):
    return bf16_to_f32(bits).astype(np.float64)


def round64(y):
    return bf16_to_f32(f32_to_bf16(np.asarray(y, np.float32)))


def silu64(z):
    return z / (1.0 + np.exp(-z))


def run_offset(backend, x, w, residual=None, in_place=False, offset=1.0):
    rows, hidden = x.shape
    with Buffers(backend) as b:
        xp, wp = b.put(x), b.put(w)
        op = xp if in_place else b.empty(x.shape, np.uint16)
        rp = b.put(residual) if residual is not None else NULL
        gn.rmsnorm_offset(backend, backend.default_stream(), op, xp, wp, rows, hidden, EPS,
                          residual_ptr=rp, offset=offset)
        return (b.get(op, x.shape, np.uint16),
                None if residual is None else b.get(rp, x.shape, np.uint16))


def run_heads(backend, qkv, wq, wk, hq, hk, d):
    n, stride = qkv.shape
    with Buffers(backend) as b:
        p = b.put(qkv)
        gn.rmsnorm_offset_heads(backend, backend.default_stream(), p, b.put(wq), b.put(wk), n,
                                hq, hk, d, stride, EPS)
        return b.get(p, qkv.shape, np.uint16)


def run_gated(backend, x, z, w, group, norm_first, in_place=False):
    n, width = x.shape
    with Buffers(backend) as b:
        xp, zp, wp = b.put(x), b.put(z), b.put(w)
        op = xp if in_place else b.empty(x.shape, np.uint16)
        gn.rmsnorm_gated(backend, backend.default_stream(), op, xp, zp, wp, n, width, group,
                         w.size, z.shape[1], EPS, norm_first)
        return b.get(op, x.shape, np.uint16)


def run_gate(backend, x, g):
    n, width = x.shape
    with Buffers(backend) as b:
        xp = b.put(x)
        gn.sigmoid_gate_mul(backend, backend.default_stream(), xp, b.put(g), n, width,
                            g.shape[1])
        return b.get(xp, x.shape, np.uint16)


def ref_offset(x, w, offset=1.0):
    xf = f64(x)
    return round64(xf / np.sqrt(np.mean(xf * xf, axis=-1, keepdims=True) + EPS) *
                   (offset + f64(w)))


def run_relu2(backend, x):
    with Buffers(backend) as b:
        p = b.put(x)
        gn.relu2(backend, backend.default_stream(), p, x.size)
        return b.get(p, x.shape, np.uint16)


def ref_gated(x, z, w, group, norm_first):
    n, width = x.shape
    xf, zf = f64(x).reshape(n, -1, group), f64(z)[:, :width].reshape(n, -1, group)
    wf = f64(w)
    wf = (np.tile(wf, width // group) if wf.size == group else wf).reshape(-1, group)
    if norm_first:
        normed = round64(round64(xf / np.sqrt(np.mean(xf * xf, -1, keepdims=True) + EPS)) * wf)
        return round64(normed * silu64(zf)).reshape(n, width)
    h = xf * silu64(zf)
    return round64(round64(h / np.sqrt(np.mean(h * h, -1, keepdims=True) + EPS)) * wf) \
        .reshape(n, width)


def test_entry_points_exist():
    assert {"rmsnorm_offset", "rmsnorm_gated", "sigmoid_gate_mul", "relu2"} <= \
        set(kernel_source.entry_points(gn.MODULE))


@pytest.mark.parametrize("rows,hidden", [(1, 8), (7, 19), (5, 256), (3, 1000)])
def test_offset_matches_float64(host, rng, rows, hidden):
    x, w = rand_bf16(rng, (rows, hidden), 2.0), rand_bf16(rng, (hidden,), 0.3)
    out, _ = run_offset(host, x, w)
    assert_close(bf16_to_f32(out), ref_offset(x, w), "twin_bf16")
    # (1 + w), not w: a weight near zero does not zero the output
    assert np.abs(bf16_to_f32(out)).max() > 0.5
    assert np.array_equal(run_offset(host, x, w, in_place=True)[0], out)


def test_offset_zero_is_the_one_rounding_norm_with_w(host, rng):
    """offset 0: Nemotron-H's RMSNorm, bf16(x * inv * w) rounded once."""
    x, w = rand_bf16(rng, (4, 96), 2.0), rand_bf16(rng, (96,), 0.3, 1.0)
    out, _ = run_offset(host, x, w, offset=0.0)
    assert_close(bf16_to_f32(out), ref_offset(x, w, 0.0), "twin_bf16")
    assert not np.array_equal(out, run_offset(host, x, w)[0])
    with pytest.raises(InvalidArgument, match="offset"):
        gn.rmsnorm_offset(host, 0, 8, 8, 8, 1, 16, EPS, offset=0.5)


def test_relu2_matches_float64(host, rng):
    x = rand_bf16(rng, (7, 33), 2.0)
    want = round64(np.maximum(f64(x), 0) ** 2)
    assert np.array_equal(bf16_to_f32(run_relu2(host, x)), want)


def test_offset_fused_residual(host, rng):
    x, res, w = rand_bf16(rng, (6, 96)), rand_bf16(rng, (6, 96), 3.0), rand_bf16(rng, (96,))
    out, new_res = run_offset(host, x, w, residual=res)
    want_res = f32_to_bf16((bf16_to_f32(x) + bf16_to_f32(res)).astype(np.float32))
    assert np.array_equal(new_res, want_res)
    assert np.array_equal(out, run_offset(host, new_res, w)[0])


def test_offset_heads_norms_q_and_k_with_their_weights_and_leaves_v(host, rng):
    n, hq, hk, d = 5, 4, 2, 16
    stride = (hq + 2 * hk) * d + 8   # padding after v: rows are strided
    qkv = rand_bf16(rng, (n, stride), 2.0)
    wq, wk = rand_bf16(rng, (d,), 0.3), rand_bf16(rng, (d,), 0.3)
    out = run_heads(host, qkv, wq, wk, hq, hk, d)
    heads = qkv[:, :(hq + hk) * d].reshape(n, hq + hk, d)
    got = out[:, :(hq + hk) * d].reshape(n, hq + hk, d)
    assert_close(bf16_to_f32(got[:, :hq]), ref_offset(heads[:, :hq], wq), "twin_bf16")
    assert_close(bf16_to_f32(got[:, hq:]), ref_offset(heads[:, hq:], wk), "twin_bf16")
    assert np.array_equal(out[:, (hq + hk) * d:], qkv[:, (hq + hk) * d:])


@pytest.mark.parametrize("norm_first", [True, False])
@pytest.mark.parametrize("n,width,group,per_row", [(1, 32, 32, False), (7, 128, 32, False),
                                                   (3, 96, 24, True), (4, 256, 64, True)])
def test_gated_matches_float64(host, rng, norm_first, n, width, group, per_row):
    x = rand_bf16(rng, (n, width), 2.0)
    z = rand_bf16(rng, (n, width + 40), 2.0)   # z inside wider rows (the in_proj output)
    w = rand_bf16(rng, (width if per_row else group,), 0.5, 1.0)
    got = run_gated(host, x, z, w, group, norm_first)
    assert_close(bf16_to_f32(got), ref_gated(x, z, w, group, norm_first), "twin_bf16")
    assert np.array_equal(run_gated(host, x, z, w, group, norm_first, in_place=True), got)


def test_gated_orders_differ(host, rng):
    """norm-then-gate and gate-then-norm are different functions: a swapped mode fails."""
    x, z = rand_bf16(rng, (4, 64), 2.0), rand_bf16(rng, (4, 64), 2.0)
    w = rand_bf16(rng, (64,), 0.5, 1.0)
    a, b = run_gated(host, x, z, w, 16, True), run_gated(host, x, z, w, 16, False)
    assert np.abs(bf16_to_f32(a) - bf16_to_f32(b)).max() > 0.1


def test_sigmoid_gate_mul_matches_float64(host, rng):
    x, g = rand_bf16(rng, (5, 48), 2.0), rand_bf16(rng, (5, 64), 3.0)
    got = run_gate(host, x, g)
    want = round64(f64(x) * round64(1.0 / (1.0 + np.exp(-f64(g[:, :48])))))
    assert_close(bf16_to_f32(got), want, "twin_bf16")


def test_bad_arguments_raise_before_launch(host):
    s = host.default_stream()
    with pytest.raises(InvalidArgument, match="eps"):
        gn.rmsnorm_offset(host, s, 8, 8, 8, 1, 16, float("nan"))
    with pytest.raises(InvalidArgument, match="stride"):
        gn.rmsnorm_offset_heads(host, s, 8, 8, 8, 2, 4, 2, 16, 64, EPS)
    with pytest.raises(InvalidArgument, match="w_b"):
        gn.rmsnorm_offset_heads(host, s, 8, 8, NULL, 2, 4, 2, 16, 96, EPS)
    with pytest.raises(InvalidArgument, match="multiple of group"):
        gn.rmsnorm_gated(host, s, 8, 8, 8, 8, 2, 100, 32, 32, 100, EPS, True)
    with pytest.raises(InvalidArgument, match="w_len"):
        gn.rmsnorm_gated(host, s, 8, 8, 8, 8, 2, 64, 32, 16, 64, EPS, True)
    with pytest.raises(InvalidArgument, match="z_stride"):
        gn.rmsnorm_gated(host, s, 8, 8, 8, 8, 2, 64, 32, 32, 60, EPS, False)
    with pytest.raises(InvalidArgument, match="g_stride"):
        gn.sigmoid_gate_mul(host, s, 8, 8, 2, 64, 32)
    with pytest.raises(InvalidArgument, match="n_tokens"):
        gn.sigmoid_gate_mul(host, s, 8, 8, 0, 64, 64)


@pytest.mark.gpu
@pytest.mark.parametrize("rows,hidden", [(1, 8), (7, 19), (9, 256), (3, 1000)])
def test_gpu_offset_matches_twin(device, host, rng, rows, hidden):
    x, w = rand_bf16(rng, (rows, hidden), 2.0), rand_bf16(rng, (hidden,), 0.3)
    res = rand_bf16(rng, (rows, hidden), 3.0)
    assert_close(bf16_to_f32(run_offset(device, x, w)[0]), bf16_to_f32(run_offset(host, x, w)[0]),
                 "gpu_vs_twin_bf16")
    a, ra = run_offset(device, x, w, residual=res)
    h, rh = run_offset(host, x, w, residual=res)
    assert np.array_equal(ra, rh)
    assert_close(bf16_to_f32(a), bf16_to_f32(h), "gpu_vs_twin_bf16")


@pytest.mark.gpu
def test_gpu_offset_heads_matches_twin(device, host, rng):
    n, hq, hk, d = 3, 4, 2, 32
    qkv = rand_bf16(rng, (n, (hq + 2 * hk) * d), 2.0)
    wq, wk = rand_bf16(rng, (d,), 0.3), rand_bf16(rng, (d,), 0.3)
    a, h = run_heads(device, qkv, wq, wk, hq, hk, d), run_heads(host, qkv, wq, wk, hq, hk, d)
    assert_close(bf16_to_f32(a), bf16_to_f32(h), "gpu_vs_twin_bf16")
    assert np.array_equal(a[:, (hq + hk) * d:], qkv[:, (hq + hk) * d:])


@pytest.mark.gpu
@pytest.mark.parametrize("norm_first", [True, False])
@pytest.mark.parametrize("n,width,group,per_row", [(5, 128, 32, False), (3, 96, 24, True),
                                                   (2, 512, 128, False)])
def test_gpu_gated_matches_twin(device, host, rng, norm_first, n, width, group, per_row):
    x, z = rand_bf16(rng, (n, width), 2.0), rand_bf16(rng, (n, width + 8), 2.0)
    w = rand_bf16(rng, (width if per_row else group,), 0.5, 1.0)
    assert_close(bf16_to_f32(run_gated(device, x, z, w, group, norm_first)),
                 bf16_to_f32(run_gated(host, x, z, w, group, norm_first)), "gpu_vs_twin_bf16")


@pytest.mark.gpu
def test_gpu_offset_zero_and_relu2_match_twin(device, host, rng):
    x, w = rand_bf16(rng, (5, 200), 2.0), rand_bf16(rng, (200,), 0.3, 1.0)
    assert_close(bf16_to_f32(run_offset(device, x, w, offset=0.0)[0]),
                 bf16_to_f32(run_offset(host, x, w, offset=0.0)[0]), "gpu_vs_twin_bf16")
    y = rand_bf16(rng, (3, 1001), 2.0)
    assert np.array_equal(run_relu2(device, y), run_relu2(host, y))   # one rounding: exact


@pytest.mark.gpu
def test_gpu_sigmoid_gate_matches_twin(device, host, rng):
    x, g = rand_bf16(rng, (4, 300), 2.0), rand_bf16(rng, (4, 310), 3.0)
    assert_close(bf16_to_f32(run_gate(device, x, g)), bf16_to_f32(run_gate(host, x, g)),
                 "gpu_vs_twin_bf16")
