"""norm family (module "rmsnorm"): RMSNorm (plain and fused residual add) and LayerNorm."""
import numpy as np
import pytest

from metrale.errors import InvalidArgument
from metrale.gpu_runtime import NULL, kernel_source
from metrale.ops import rmsnorm as norm
from metrale.ops.bf16 import bf16_to_f32, f32_to_bf16, round_bf16
from tests.conftest import assert_close
from tests.helpers import Buffers

EPS = 1e-5


def rand_bf16(rng, shape, scale=1.0, shift=0.0):
    return f32_to_bf16((rng.standard_normal(shape) * scale + shift).astype(np.float32))


def run_rmsnorm(backend, x, w, eps=EPS, residual=None, in_place=False, mode="llama"):
    rows, hidden = x.shape
    with Buffers(backend) as b:
        xp, wp = b.put(x), b.put(w)
        op = xp if in_place else b.empty((rows, hidden), np.uint16)
        rp = b.put(residual) if residual is not None else NULL
        norm.rmsnorm(backend, backend.default_stream(), op, xp, wp, rows, hidden, eps,
                     residual_ptr=rp, weight_mode=mode)
        out = b.get(op, (rows, hidden), np.uint16)
        res = b.get(rp, (rows, hidden), np.uint16) if residual is not None else None
    return out, res


def run_layernorm(backend, x, w, bias, eps=EPS, in_place=False):
    rows, hidden = x.shape
    with Buffers(backend) as b:
        xp, wp, bp = b.put(x), b.put(w), b.put(bias)
        op = xp if in_place else b.empty((rows, hidden), np.uint16)
        norm.layernorm(backend, backend.default_stream(), op, xp, wp, bp, rows, hidden, eps)
        return b.get(op, (rows, hidden), np.uint16)


def ref_rmsnorm(x_bits, w_bits, eps=EPS):
    x = bf16_to_f32(x_bits).astype(np.float64)
    w = bf16_to_f32(w_bits).astype(np.float64)
    y = x / np.sqrt(np.mean(x * x, axis=1, keepdims=True) + eps) * w[None]
    return bf16_to_f32(f32_to_bf16(y.astype(np.float32)))


def ref_rmsnorm_once(x_bits, w_bits, mode, eps=EPS):
    """float64 x * rsqrt(mean(x^2) + eps) * w ("once") or * (1 + w) ("gemma"), one rounding."""
    x = bf16_to_f32(x_bits).astype(np.float64)
    w = bf16_to_f32(w_bits).astype(np.float64)
    y = x / np.sqrt(np.mean(x * x, axis=1, keepdims=True) + eps) * ((1.0 + w) if mode ==
                                                                     "gemma" else w)[None]
    return bf16_to_f32(f32_to_bf16(y.astype(np.float32)))


def ref_layernorm(x_bits, w_bits, b_bits, eps=EPS):
    x = bf16_to_f32(x_bits).astype(np.float64)
    mu = x.mean(axis=1, keepdims=True)
    var = ((x - mu) ** 2).mean(axis=1, keepdims=True)
    y = (x - mu) / np.sqrt(var + eps) * bf16_to_f32(w_bits)[None] + bf16_to_f32(b_bits)[None]
    return bf16_to_f32(f32_to_bf16(y.astype(np.float32)))


def test_entry_points_exist():
    assert {"rmsnorm", "layernorm"} <= set(kernel_source.entry_points(norm.MODULE))


@pytest.mark.parametrize("rows", [1, 7, 19])
@pytest.mark.parametrize("hidden", [1, 7, 19, 111, 4097, 128])
def test_rmsnorm_matches_float64(host, rng, rows, hidden):
    x, w = rand_bf16(rng, (rows, hidden), 2.0), rand_bf16(rng, (hidden,), 0.5, 1.0)
    out, _ = run_rmsnorm(host, x, w)
    assert_close(bf16_to_f32(out), ref_rmsnorm(x, w), "twin_bf16")


def test_rmsnorm_real_size(host, rng):
    x, w = rand_bf16(rng, (64, 4096)), rand_bf16(rng, (4096,), 0.1, 1.0)
    out, _ = run_rmsnorm(host, x, w, eps=1e-6)
    assert_close(bf16_to_f32(out), ref_rmsnorm(x, w, 1e-6), "twin_bf16")


def test_rmsnorm_hf_rounding_order(host, rng):
    """HF LlamaRMSNorm: bf16(weight * bf16(x * rsqrt(var + eps)))."""
    x, w = rand_bf16(rng, (5, 256)), rand_bf16(rng, (256,), 0.3, 1.0)
    out, _ = run_rmsnorm(host, x, w)
    xf = bf16_to_f32(x)
    inv = 1.0 / np.sqrt(np.mean(xf.astype(np.float64) ** 2, axis=1, keepdims=True) + EPS)
    hf = f32_to_bf16(bf16_to_f32(w)[None] * round_bf16((xf * inv).astype(np.float32)))
    # differs from HF only where FP32 rounding of inv flips a BF16 rounding: rare
    assert np.mean(out != hf) < 0.01
    assert_close(bf16_to_f32(out), bf16_to_f32(hf), "twin_bf16")


@pytest.mark.parametrize("hidden", [7, 111, 4096])
def test_rmsnorm_fused_residual(host, rng, hidden):
    rows = 7
    x, res = rand_bf16(rng, (rows, hidden)), rand_bf16(rng, (rows, hidden), 4.0)
    w = rand_bf16(rng, (hidden,), 0.5, 1.0)
    out, new_res = run_rmsnorm(host, x, w, residual=res)
    summed = bf16_to_f32(x).astype(np.float64) + bf16_to_f32(res).astype(np.float64)
    assert np.array_equal(new_res, f32_to_bf16(summed.astype(np.float32)))
    # out is the plain norm of the stored (rounded) residual
    plain, _ = run_rmsnorm(host, new_res, w)
    assert np.array_equal(out, plain)
    assert_close(bf16_to_f32(out), ref_rmsnorm(new_res, w), "twin_bf16")


def test_rmsnorm_in_place(host, rng):
    x, w = rand_bf16(rng, (3, 200)), rand_bf16(rng, (200,))
    ref, _ = run_rmsnorm(host, x, w)
    got, _ = run_rmsnorm(host, x, w, in_place=True)
    assert np.array_equal(got, ref)


@pytest.mark.parametrize("rows", [1, 7, 19])
@pytest.mark.parametrize("hidden", [1, 7, 19, 111, 4097, 384])
def test_layernorm_matches_float64(host, rng, rows, hidden):
    x = rand_bf16(rng, (rows, hidden), 2.0, 3.0)  # a mean far from 0 checks the two passes
    w, bias = rand_bf16(rng, (hidden,), 0.5, 1.0), rand_bf16(rng, (hidden,), 0.5)
    got = run_layernorm(host, x, w, bias)
    assert_close(bf16_to_f32(got), ref_layernorm(x, w, bias), "twin_bf16")
    assert np.array_equal(run_layernorm(host, x, w, bias, in_place=True), got)


@pytest.mark.parametrize("mode", ["once", "gemma"])
@pytest.mark.parametrize("hidden", [1, 7, 111, 128, 4097])
def test_rmsnorm_weight_modes_match_float64(host, rng, mode, hidden):
    """The one-rounding modes (HF GptOssRMSNorm; Gemma's zero-centred (1 + w)), with and
    without the fused residual add; weights far from 1 (Gemma's are centred on 0), so the
    offset moves every output."""
    rows = 7
    x, res = rand_bf16(rng, (rows, hidden), 2.0), rand_bf16(rng, (rows, hidden), 3.0)
    w = rand_bf16(rng, (hidden,), 0.5)
    out, _ = run_rmsnorm(host, x, w, mode=mode)
    assert_close(bf16_to_f32(out), ref_rmsnorm_once(x, w, mode), "twin_bf16")
    out, new_res = run_rmsnorm(host, x, w, residual=res, mode=mode)
    assert_close(bf16_to_f32(out), ref_rmsnorm_once(new_res, w, mode), "twin_bf16")
    if hidden >= 7:   # the modes are different functions of the same weights
        llama, _ = run_rmsnorm(host, x, w)
        assert not np.array_equal(out, llama)


def test_rmsnorm_gemma_mode_rounds_once(host, rng):
    """HF Gemma2RMSNorm: bf16(float32(x * rsqrt(var + eps)) * (1 + w)), no BF16 rounding of
    the normalized row before the weight (Llama's order rounds there)."""
    x, w = rand_bf16(rng, (5, 256)), rand_bf16(rng, (256,), 0.3)
    out, _ = run_rmsnorm(host, x, w, mode="gemma")
    xf = bf16_to_f32(x)
    inv = (1.0 / np.sqrt(np.mean(xf.astype(np.float64) ** 2, axis=1, keepdims=True) + EPS)
           ).astype(np.float32)
    hf = f32_to_bf16((xf * inv) * (np.float32(1.0) + bf16_to_f32(w))[None])
    assert np.mean(out != hf) < 0.01
    assert np.array_equal(run_rmsnorm(host, x, w, mode="gemma", in_place=True)[0], out)


def test_bad_sizes_raise_before_launch(host):
    with pytest.raises(InvalidArgument, match="n_rows"):
        norm.rmsnorm(host, 0, 8, 8, 8, 0, 16, EPS)
    with pytest.raises(InvalidArgument, match="hidden"):
        norm.rmsnorm(host, 0, 8, 8, 8, 1, 0, EPS)
    with pytest.raises(InvalidArgument, match="eps"):
        norm.rmsnorm(host, 0, 8, 8, 8, 1, 16, float("nan"))
    with pytest.raises(InvalidArgument, match="hidden"):
        norm.layernorm(host, 0, 8, 8, 8, 8, 1, -2, EPS)
    with pytest.raises(InvalidArgument, match="NULL"):
        norm.layernorm(host, 0, 8, 8, 8, 0, 1, 16, EPS)
    with pytest.raises(InvalidArgument, match="weight_mode"):
        norm.rmsnorm(host, 0, 8, 8, 8, 1, 16, EPS, weight_mode="offset")


GPU_SHAPES = [(1, 1), (7, 7), (19, 19), (3, 111), (2, 4097), (64, 4096), (17, 3584),
              (9, 5120), (300, 128)]


@pytest.mark.gpu
@pytest.mark.parametrize("rows,hidden", GPU_SHAPES)
def test_gpu_rmsnorm_matches_twin(device, host, rng, rows, hidden):
    x, w = rand_bf16(rng, (rows, hidden)), rand_bf16(rng, (hidden,), 0.5, 1.0)
    res = rand_bf16(rng, (rows, hidden), 3.0)
    a, _ = run_rmsnorm(device, x, w, eps=1e-6)
    h, _ = run_rmsnorm(host, x, w, eps=1e-6)
    assert_close(bf16_to_f32(a), bf16_to_f32(h), "gpu_vs_twin_bf16")
    a, ra = run_rmsnorm(device, x, w, residual=res)
    h, rh = run_rmsnorm(host, x, w, residual=res)
    assert np.array_equal(ra, rh)  # one FP32 add + RNE: bit-exact
    assert_close(bf16_to_f32(a), bf16_to_f32(h), "gpu_vs_twin_bf16")


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["once", "gemma"])
@pytest.mark.parametrize("rows,hidden", [(1, 1), (7, 7), (3, 111), (5, 2304), (9, 640)])
def test_gpu_rmsnorm_weight_modes_match_twin(device, host, rng, mode, rows, hidden):
    x, w = rand_bf16(rng, (rows, hidden)), rand_bf16(rng, (hidden,), 0.5)
    res = rand_bf16(rng, (rows, hidden), 3.0)
    for r in (None, res):
        a, ra = run_rmsnorm(device, x, w, residual=r, mode=mode)
        h, rh = run_rmsnorm(host, x, w, residual=r, mode=mode)
        assert_close(bf16_to_f32(a), bf16_to_f32(h), "gpu_vs_twin_bf16")
        if r is not None:
            assert np.array_equal(ra, rh)


@pytest.mark.gpu
@pytest.mark.parametrize("rows,hidden", GPU_SHAPES + [(30, 384), (30, 1280)])
def test_gpu_layernorm_matches_twin(device, host, rng, rows, hidden):
    x = rand_bf16(rng, (rows, hidden), 2.0, 1.0)
    w, bias = rand_bf16(rng, (hidden,), 0.5, 1.0), rand_bf16(rng, (hidden,), 0.5)
    assert_close(bf16_to_f32(run_layernorm(device, x, w, bias)),
                 bf16_to_f32(run_layernorm(host, x, w, bias)), "gpu_vs_twin_bf16")
