"""activation family: the fused gated activation act(gate) * up (silu, gelu, gelu_tanh,
relu, quick_gelu) and GELU (erf, tanh, quick)."""
import math

import numpy as np
import pytest

from metrale.errors import InvalidArgument
from metrale.gpu_runtime import kernel_source
from metrale.ops import activation
from metrale.ops.bf16 import bf16_to_f32, f32_to_bf16
from tests.conftest import assert_close
from tests.helpers import Buffers

MODES = ["none", "tanh", "quick"]
ACTS = list(activation.ACTIVATIONS)


def rand_bf16(rng, shape, scale=3.0):
    return f32_to_bf16((rng.standard_normal(shape) * scale).astype(np.float32))


def run_act_mul(backend, gate_up, act="silu"):
    rows, two_i = gate_up.shape
    i = two_i // 2
    with Buffers(backend) as b:
        gp, op = b.put(gate_up), b.empty((rows, i), np.uint16)
        activation.act_mul(backend, backend.default_stream(), op, gp, rows, i, act)
        return b.get(op, (rows, i), np.uint16)


def run_silu_mul(backend, gate_up):
    return run_act_mul(backend, gate_up, "silu")


def ref_act(g, act):
    """float64 act(g), the formulas of transformers' ACT2FN."""
    g = g.astype(np.float64)
    if act == "silu":
        with np.errstate(over="ignore"):
            return g / (1 + np.exp(-g))
    if act == "relu":
        return np.maximum(g, 0.0)
    return ref_gelu(g, {"gelu": "none", "gelu_tanh": "tanh", "quick_gelu": "quick"}[act])


def run_gelu(backend, x, approximate, in_place=False, offset_elems=0):
    n = x.size - offset_elems
    with Buffers(backend) as b:
        xp = b.put(x)
        op = xp if in_place else b.empty((x.size,), np.uint16)
        activation.gelu(backend, backend.default_stream(), op.offset(2 * offset_elems),
                        xp.offset(2 * offset_elems), n, approximate)
        return b.get(op, (x.size,), np.uint16)[offset_elems:]


def ref_gelu(x, approximate):
    x = x.astype(np.float64)
    if approximate == "none":
        return 0.5 * x * (1 + np.vectorize(math.erf)(x / math.sqrt(2)))
    if approximate == "tanh":
        return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))
    return x / (1 + np.exp(-1.702 * x))


def test_entry_points_exist():
    assert {"act_mul", "gelu"} <= set(kernel_source.entry_points(activation.MODULE))


@pytest.mark.parametrize("rows", [1, 7, 19])
@pytest.mark.parametrize("inter", [1, 7, 19, 111, 4097, 1024])
def test_silu_mul_matches_float64(host, rng, rows, inter):
    gu = rand_bf16(rng, (rows, 2 * inter))
    got = run_silu_mul(host, gu)
    g = bf16_to_f32(gu[:, :inter]).astype(np.float64)
    u = bf16_to_f32(gu[:, inter:]).astype(np.float64)
    ref = bf16_to_f32(f32_to_bf16((g / (1 + np.exp(-g)) * u).astype(np.float32)))
    assert_close(bf16_to_f32(got), ref, "twin_bf16")


def test_silu_mul_gate_comes_first(host):
    # gate = 0 -> silu = 0 whatever up is; up = 0 -> 0 whatever gate is
    gu = np.zeros((2, 8), np.float32)
    gu[0, 4:] = 5.0          # row 0: gate 0, up 5 -> 0
    gu[1, :4] = 5.0          # row 1: gate 5, up 0 -> 0
    gu[1, 4:] = 0.0
    got = bf16_to_f32(run_silu_mul(host, f32_to_bf16(gu)))
    assert not got.any()
    gu[1, 4:] = 1.0          # row 1: silu(5) * 1
    got = bf16_to_f32(run_silu_mul(host, f32_to_bf16(gu)))
    assert_close(got[1], np.full(4, 5 / (1 + math.exp(-5))), "twin_bf16")


def test_silu_mul_real_size_and_extremes(host, rng):
    gu = rand_bf16(rng, (4, 2 * 14336))
    gu[0, :8] = f32_to_bf16(np.array([-1e4, 1e4, -100, 100, 0, -0.0, 88, -88], np.float32))
    got = bf16_to_f32(run_silu_mul(host, gu))
    assert np.all(np.isfinite(got))
    g = bf16_to_f32(gu[:, :14336]).astype(np.float64)
    u = bf16_to_f32(gu[:, 14336:]).astype(np.float64)
    with np.errstate(over="ignore"):
        ref = g / (1 + np.exp(-g)) * u
    assert_close(got, bf16_to_f32(f32_to_bf16(ref.astype(np.float32))), "twin_bf16")


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("rows,inter", [(1, 1), (3, 7), (2, 111), (5, 4097), (4, 1024)])
def test_act_mul_matches_float64(host, rng, act, rows, inter):
    gu = rand_bf16(rng, (rows, 2 * inter))
    g = bf16_to_f32(gu[:, :inter]).astype(np.float64)
    u = bf16_to_f32(gu[:, inter:]).astype(np.float64)
    ref = bf16_to_f32(f32_to_bf16((ref_act(g, act) * u).astype(np.float32)))
    assert_close(bf16_to_f32(run_act_mul(host, gu, act)), ref, "twin_bf16", act)


@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
def test_act_mul_twin_rows_in_blocks_equal_rows_alone(host, rng, act):
    # the twin works in blocks of rows (70 rows of 4097: three blocks); a row's bits must
    # not depend on the block it falls in
    gu = rand_bf16(rng, (70, 2 * 4097))
    whole = run_act_mul(host, gu, act)
    for r in (0, 31, 32, 69):
        assert np.array_equal(whole[r:r + 1], run_act_mul(host, gu[r:r + 1], act)), r


def test_act_mul_modes_differ_and_relu_edges(host):
    gu = np.zeros((1, 64), np.float32)
    gu[0, :32] = np.linspace(-4, 4, 32)
    gu[0, 32:] = 1.0
    outs = {a: bf16_to_f32(run_act_mul(host, f32_to_bf16(gu), a)) for a in ACTS}
    for a in ACTS:
        for b in ACTS:
            assert a == b or not np.array_equal(outs[a], outs[b]), (a, b)
    assert not outs["relu"][0, :16].any()          # negative gates -> 0
    gu[0, 0] = np.nan
    assert np.isnan(bf16_to_f32(run_act_mul(host, f32_to_bf16(gu), "relu"))[0, 0])


@pytest.mark.parametrize("approximate", MODES)
@pytest.mark.parametrize("n", [1, 7, 19, 111, 4097, 4096 * 8])
def test_gelu_matches_float64(host, rng, approximate, n):
    x = rand_bf16(rng, (n,))
    got = run_gelu(host, x, approximate)
    ref = bf16_to_f32(f32_to_bf16(ref_gelu(bf16_to_f32(x), approximate).astype(np.float32)))
    assert_close(bf16_to_f32(got), ref, "twin_bf16")


@pytest.mark.parametrize("approximate", MODES)
def test_gelu_in_place_and_unaligned(host, rng, approximate):
    x = rand_bf16(rng, (45,))
    ref = run_gelu(host, x, approximate)
    assert np.array_equal(run_gelu(host, x, approximate, in_place=True), ref)
    assert np.array_equal(run_gelu(host, x, approximate, offset_elems=3), ref[3:])


def test_gelu_modes_differ(host, rng):
    x = f32_to_bf16(np.linspace(-4, 4, 64).astype(np.float32))
    outs = [run_gelu(host, x, m) for m in MODES]
    assert not np.array_equal(outs[0], outs[2])
    assert not np.array_equal(outs[1], outs[2])


def test_bad_arguments_raise_before_launch(host):
    with pytest.raises(InvalidArgument, match="n_rows"):
        activation.act_mul(host, 0, 8, 8, 0, 4)
    with pytest.raises(InvalidArgument, match="intermediate"):
        activation.act_mul(host, 0, 8, 8, 2, 0)
    with pytest.raises(InvalidArgument, match="act must be one of"):
        activation.act_mul(host, 0, 8, 8, 2, 4, "gelu_fast")
    with pytest.raises(InvalidArgument, match="n must be"):
        activation.gelu(host, 0, 8, 8, 0)
    with pytest.raises(InvalidArgument, match="approximate"):
        activation.gelu(host, 0, 8, 8, 4, "erf")
    with pytest.raises(InvalidArgument, match="NULL"):
        activation.gelu(host, 0, 0, 8, 4)


@pytest.mark.gpu
@pytest.mark.parametrize("rows,inter", [(1, 1), (7, 7), (19, 19), (3, 111), (2, 4097),
                                        (64, 14336), (8, 18944), (33, 11008)])
def test_gpu_silu_mul_matches_twin(device, host, rng, rows, inter):
    gu = rand_bf16(rng, (rows, 2 * inter))
    assert_close(bf16_to_f32(run_silu_mul(device, gu)), bf16_to_f32(run_silu_mul(host, gu)),
                 "gpu_vs_twin_bf16")


@pytest.mark.gpu
@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("rows,inter", [(1, 1), (7, 7), (3, 111), (2, 4097), (5, 64)])
def test_gpu_act_mul_matches_twin(device, host, rng, act, rows, inter):
    gu = rand_bf16(rng, (rows, 2 * inter))
    assert_close(bf16_to_f32(run_act_mul(device, gu, act)),
                 bf16_to_f32(run_act_mul(host, gu, act)), "gpu_vs_twin_bf16", act)


@pytest.mark.gpu
@pytest.mark.parametrize("approximate", MODES)
@pytest.mark.parametrize("n", [1, 7, 19, 111, 4097, 1500 * 1536, 257 * 5120])
@pytest.mark.parametrize("offset", [0, 1])
def test_gpu_gelu_matches_twin(device, host, rng, approximate, n, offset):
    x = rand_bf16(rng, (n + offset,))
    assert_close(bf16_to_f32(run_gelu(device, x, approximate, offset_elems=offset)),
                 bf16_to_f32(run_gelu(host, x, approximate, offset_elems=offset)),
                 "gpu_vs_twin_bf16")
