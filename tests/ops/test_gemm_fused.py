"""The decode GEMMs with rmsnorm (+ the qkv bias) / act_mul / the residual add fused in
(ops/gemm_fused.py):
twin against a float64 formula, twin and kernel bit for bit against the unfused sequence
they replace (what lets the model fuse decode and not prefill), kernel against twin, and
the argument checks."""
import numpy as np
import pytest

from metrale.errors import InvalidArgument
from metrale.gpu_runtime import kernel_source
from metrale.ops import activation, elementwise, gemm_fused as F, gemm_q, gemm_tc, rmsnorm
from metrale.ops.bf16 import bf16_to_f32, f32_to_bf16
from metrale.ops.gemm_q import QuantW
from tests.conftest import assert_close, real
from tests.helpers import Buffers

EPS = 1e-5
RAGGED = [(1, 1, 1), (1, 7, 19), (7, 19, 111), (16, 33, 264), (19, 111, 8), (1, 4097, 64),
          (3, 40, 4097)]


def bf16(rng, shape, scale=1.0):
    return f32_to_bf16((rng.standard_normal(shape) * scale).astype(np.float32))


def operands(rng, m, n, k):
    return dict(x=bf16(rng, (m, k), 2.0), w=bf16(rng, (n, k), k ** -0.5),
                nw=bf16(rng, (k,), 0.5), gate_up=bf16(rng, (m, 2 * k), 2.0),
                res=bf16(rng, (m, n), 4.0), bias=bf16(rng, (n,), 1.0))


def put_w(b, d, wq):
    """W on the device: d["w"] (BF16 bits) as a pointer, or the quantized wq (test_gemm_q's
    Q4 / F8) as a gemm_q.QuantW."""
    return b.put(d["w"]) if wq is None else wq.put(b)


def gemm(backend, s, y, x, w, m, n, k):
    """The unfused GEMM of W's kind (gemm_tc, or gemm_q's launcher for a QuantW)."""
    if isinstance(w, QuantW):
        w.run(backend, s, y, x, m)
    else:
        gemm_tc.gemm_tc(backend, s, y, x, w, m, n, k)


def fused(backend, kind, d, m, n, k, act=None, x_byte_offset=0, wq=None):
    """The fused launch; returns its output (y, or the updated residual)."""
    s = backend.default_stream()
    with Buffers(backend) as b:
        wp = put_w(b, d, wq)
        if kind.startswith("rmsnorm"):
            raw = np.zeros(d["x"].size + x_byte_offset // 2, np.uint16)
            raw[x_byte_offset // 2:] = d["x"].reshape(-1)
            xp = b.put(raw).offset(x_byte_offset)
            yp = b.empty((m, n), np.uint16)
            bias = b.put(d["bias"]) if kind == "rmsnorm_bias" else None
            F.gemm_rmsnorm(backend, s, yp, xp, wp, b.put(d["nw"]), m, n, k, EPS, bias_ptr=bias)
            return b.get(yp, (m, n), np.uint16)
        rp = b.put(d["res"])
        if kind == "actmul":
            F.gemm_actmul_residual(backend, s, rp, b.put(d["gate_up"]), wp, m, n, k, act)
        else:
            F.gemm_residual(backend, s, rp, b.put(d["x"]), wp, m, n, k)
        return b.get(rp, (m, n), np.uint16)


def unfused(backend, kind, d, m, n, k, act=None, wq=None):
    """The launches the fused one replaces, as the model ran them before."""
    s = backend.default_stream()
    with Buffers(backend) as b:
        wp = put_w(b, d, wq)
        if kind.startswith("rmsnorm"):
            normed, yp = b.empty((m, k), np.uint16), b.empty((m, n), np.uint16)
            rmsnorm.rmsnorm(backend, s, normed, b.put(d["x"]), b.put(d["nw"]), m, k, EPS)
            gemm(backend, s, yp, normed, wp, m, n, k)
            if kind == "rmsnorm_bias":
                elementwise.add_bias(backend, s, yp, b.put(d["bias"]), m, n)
            return b.get(yp, (m, n), np.uint16)
        if kind == "actmul":
            xp = b.empty((m, k), np.uint16)
            activation.act_mul(backend, s, xp, b.put(d["gate_up"]), m, k, act)
        else:
            xp = b.put(d["x"])
        hidden, rp = b.empty((m, n), np.uint16), b.put(d["res"])
        gemm(backend, s, hidden, xp, wp, m, n, k)
        # the residual add of the next rmsnorm (its normalized output is not compared)
        rmsnorm.rmsnorm(backend, s, b.empty((m, n), np.uint16), hidden,
                        b.put(np.ones(n, np.uint16) * 0x3F80), m, n, EPS, residual_ptr=rp)
        return b.get(rp, (m, n), np.uint16)


def ref64(kind, d, k, act=None):
    """float64 formula, BF16 roundings where the kernels store."""
    w = bf16_to_f32(d["w"]).astype(np.float64)
    if kind.startswith("rmsnorm"):
        x = bf16_to_f32(d["x"]).astype(np.float64)
        inv = 1.0 / np.sqrt((x * x).mean(axis=1, keepdims=True) + EPS)
        a = bf16_to_f32(f32_to_bf16((bf16_to_f32(f32_to_bf16((x * inv).astype(np.float32)))
                                     * bf16_to_f32(d["nw"])).astype(np.float32)))
        y = a.astype(np.float64) @ w.T
        if kind == "rmsnorm_bias":
            y = bf16_to_f32(f32_to_bf16(y.astype(np.float32))) + bf16_to_f32(d["bias"])
        return y
    if kind == "actmul":
        gu = bf16_to_f32(d["gate_up"]).astype(np.float64)
        g, u = gu[:, :k], gu[:, k:]
        a = {"silu": g / (1 + np.exp(-g)), "relu": np.maximum(g, 0)}[act] * u
        x = bf16_to_f32(f32_to_bf16(a.astype(np.float32))).astype(np.float64)
    else:
        x = bf16_to_f32(d["x"]).astype(np.float64)
    y = bf16_to_f32(f32_to_bf16((x @ w.T).astype(np.float32))).astype(np.float64)
    return bf16_to_f32(d["res"]).astype(np.float64) + y


CASES = [("rmsnorm", None), ("rmsnorm_bias", None), ("actmul", "silu"), ("actmul", "relu"),
         ("residual", None)]


def test_entry_points_exist():
    names = set(kernel_source.entry_points(gemm_tc.MODULE))
    assert {"gemm_tc_bf16_16x16_rmsnorm", "gemm_tc_bf16_16x16_actmul_res",
            "gemm_tc_bf16_16x16_res"} <= names


@pytest.mark.parametrize("kind,act", CASES)
@pytest.mark.parametrize("m,n,k", RAGGED)
def test_twin_matches_float64(host, rng, kind, act, m, n, k):
    d = operands(rng, m, n, k)
    got = bf16_to_f32(fused(host, kind, d, m, n, k, act))
    assert_close(got, ref64(kind, d, k, act).astype(np.float32), "twin_bf16",
                 f"{kind} m={m} n={n} k={k}")


@pytest.mark.parametrize("kind,act", CASES)
@pytest.mark.parametrize("m,n,k", [(1, 7, 19), (7, 19, 111), (19, 111, 8), (3, 40, 4097)])
def test_twin_equals_the_unfused_twins(host, rng, kind, act, m, n, k):
    d = operands(rng, m, n, k)
    assert np.array_equal(fused(host, kind, d, m, n, k, act), unfused(host, kind, d, m, n, k, act))


@pytest.mark.parametrize("kind,act", CASES)
def test_native_and_numpy_twins_same_bits(rng, kind, act):
    """HostBackend's native rows (norm, silu, the residual add) against numpy alone: the
    same bits (silu: the act_mul twins' own one-ulp exp difference aside, so relu here)."""
    from metrale.gpu_runtime import HostBackend
    nat, np_only = HostBackend(), HostBackend(native=False)
    if nat.native is None or not nat.native.row_twins:
        pytest.skip("no native row twins here")
    if act == "silu":
        act = "relu"
    for m, n, k in ((1, 7, 19), (5, 33, 264)):
        d = operands(rng, m, n, k)
        d["res"][0, :3] = [0x7F80, 0xFF80, 0x7FC0]   # +inf, -inf, NaN in the residual
        assert np.array_equal(fused(nat, kind, d, m, n, k, act),
                              fused(np_only, kind, d, m, n, k, act)), f"{kind} {m} {n} {k}"


def test_bad_arguments_raise_before_launch(host):
    s = host.default_stream()
    with Buffers(host) as b:
        x, w, y = b.empty((2, 64), np.uint16), b.empty((8, 64), np.uint16), \
            b.empty((2, 8), np.uint16)
        with pytest.raises(InvalidArgument, match="must not overlap"):
            F.gemm_rmsnorm(host, s, x, x, w, w, 2, 8, 64, EPS)
        with pytest.raises(InvalidArgument, match="eps"):
            F.gemm_rmsnorm(host, s, y, x, w, w, 2, 8, 64, float("nan"))
        with pytest.raises(InvalidArgument, match="act"):
            F.gemm_actmul_residual(host, s, y, x, w, 2, 8, 32, "swish")
        with pytest.raises(InvalidArgument, match="gate_up"):
            F.gemm_actmul_residual(host, s, x, x, w, 2, 8, 32, "silu")
        with pytest.raises(InvalidArgument, match="must not overlap"):
            F.gemm_residual(host, s, x, x, w, 2, 8, 64)
        with pytest.raises(InvalidArgument, match="k"):
            F.gemm_residual(host, s, y, x, w, 2, 8, 0)


# ---------------------------------------------------------------------------------------
# GPU (and the emulator)

@pytest.mark.gpu
@pytest.mark.parametrize("kind,act", CASES)
@pytest.mark.parametrize("m,n,k", RAGGED + [real(1, 6144, 4096), real(1, 4096, 14336)])
def test_gpu_fused_equals_unfused_and_matches_twin(device, host, rng, kind, act, m, n, k):
    d = operands(rng, m, n, k)
    got = fused(device, kind, d, m, n, k, act)
    assert np.array_equal(got, unfused(device, kind, d, m, n, k, act)), \
        f"{kind} m={m} n={n} k={k}: the fused kernel's bits differ from the unfused launches"
    assert_close(bf16_to_f32(got), bf16_to_f32(fused(host, kind, d, m, n, k, act)),
                 "gpu_vs_twin_bf16", f"{kind} m={m} n={n} k={k}")


@pytest.mark.gpu
@pytest.mark.parametrize("k,offset", [(264, 2), (19, 0)])
def test_gpu_rmsnorm_scalar_path_same_bits(device, rng, k, offset):
    # x 2 bytes past 16-byte alignment, or k % 8 != 0: the element-wise fill and norm order
    d = operands(rng, 5, 21, k)
    want = unfused(device, "rmsnorm", d, 5, 21, k)
    assert np.array_equal(fused(device, "rmsnorm", d, 5, 21, k, x_byte_offset=offset), want)


# ---------------------------------------------------------------------------------------
# Quantized W (kernels/gemm_q.cu's fused entries, the one-warp decode tile)

def quant_w(rng, fmt, n, k):
    from tests.ops.test_gemm_q import F8, Q4
    k8 = k - k % 8
    if fmt == "fp8":
        return F8(rng, n, k, (16, 16)), k
    return Q4(rng, n, k8, 8 if k8 % 32 else 32, act_order=fmt == "q4_act"), k8


QUANT = ["q4", "q4_act", "fp8"]
QUANT_SIZES = [(1, 7, 24), (7, 19, 111), (12, 33, 264), (19, 40, 136)]


def test_quant_entry_points_exist():
    names = set(kernel_source.entry_points(gemm_q.MODULE))
    assert {f"gemm_{f}_bf16_16x16_{x}" for f in ("q4", "fp8")
            for x in ("rmsnorm", "actmul_res", "res")} <= names


@pytest.mark.parametrize("fmt", QUANT)
@pytest.mark.parametrize("kind,act", CASES)
@pytest.mark.parametrize("m,n,k", QUANT_SIZES)
def test_quant_twin_equals_unfused_and_float64(host, rng, fmt, kind, act, m, n, k):
    wq, k = quant_w(rng, fmt, n, k)
    d = operands(rng, m, n, k)
    got = fused(host, kind, d, m, n, k, act, wq=wq)
    assert np.array_equal(got, unfused(host, kind, d, m, n, k, act, wq=wq))
    d["w"] = wq.dequant()   # the formula on the dequantized weights
    assert_close(bf16_to_f32(got), ref64(kind, d, k, act).astype(np.float32), "twin_bf16",
                 f"{fmt} {kind} m={m} n={n} k={k}")


def test_quant_bad_arguments_raise_before_launch(host, rng):
    s = host.default_stream()
    wq, _ = quant_w(rng, "q4", 8, 64)
    with Buffers(host) as b:
        x, y, w = b.empty((2, 64), np.uint16), b.empty((2, 8), np.uint16), wq.put(b)
        with pytest.raises(InvalidArgument, match=r"shape \[8, 64\] used as \[8, 32\]"):
            F.gemm_residual(host, s, y, x, w, 2, 8, 32)
        bad = QuantW("q4", w.ptrs, (w.scalars[0], 12), 8, 64)
        with pytest.raises(InvalidArgument, match="group_size"):
            F.gemm_rmsnorm(host, s, y, x, bad, x, 2, 8, 64, EPS)
        with pytest.raises(InvalidArgument, match="format"):
            F.gemm_residual(host, s, y, x, QuantW("q3", w.ptrs, w.scalars, 8, 64), 2, 8, 64)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", QUANT)
@pytest.mark.parametrize("kind,act", CASES)
@pytest.mark.parametrize("m,n,k", QUANT_SIZES + [real(1, 6144, 4096), real(1, 4096, 14336)])
def test_gpu_quant_fused_equals_unfused_and_twin(device, host, rng, fmt, kind, act, m, n, k):
    wq, k = quant_w(rng, fmt, n, k)
    d = operands(rng, m, n, k)
    got = fused(device, kind, d, m, n, k, act, wq=wq)
    assert np.array_equal(got, unfused(device, kind, d, m, n, k, act, wq=wq)), \
        f"{fmt} {kind} m={m} n={n} k={k}: the fused kernel's bits differ from the unfused"
    assert_close(bf16_to_f32(got), bf16_to_f32(fused(host, kind, d, m, n, k, act, wq=wq)),
                 "gpu_vs_twin_bf16", f"{fmt} {kind} m={m} n={n} k={k}")
