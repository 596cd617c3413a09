"""A rank's slice of a quantized linear (model_engine/tp/quant_shard.py), no MPI needed: it
dequantizes to exactly that slice of the dequantized whole (ops.gemm_q's formula, the
values the GEMM multiplies), for FP8 block scales cut inside a 128 x 128 block along rows
and along columns, per-channel FP8, 4-bit groups with and without act-order; a split that
cuts a 4-bit group is refused naming the tensor and the group size."""
import numpy as np
import pytest

from metrale.errors import Unsupported
from metrale.formats.quant.fp8 import HostFp8
from metrale.formats.quant.int4 import HostQ4
from metrale.formats.quant.layout import dequant_bits
from metrale.model_engine.tp import quant_shard as S
from tests.ops.test_gemm_q import F8, Q4


def host_fp8(rng, n, k, block):
    w = F8(rng, n, k, block=block, garbage=False)
    return HostFp8(w.q, w.scales, w.scale_row, k, w.block_k)


def host_q4(rng, n, k, gs, act):
    w = Q4(rng, n, k, group_size=gs, act_order=act, garbage=False)
    return HostQ4(w.q, w.scales, w.zeros, w.gidx, w.gidx_row, k, gs)


@pytest.mark.parametrize("a,b", [(0, 192), (192, 384), (64, 200), (136, 272), (0, 8)])
def test_fp8_block_rows_inside_a_128_block(rng, a, b):
    """E.g. 8 KV heads of 128 rows over 16 ranks: 64 rows each, two ranks per block."""
    h = host_fp8(rng, 384, 288, (128, 128))
    s = S.rows(h, a, b)
    assert np.array_equal(dequant_bits(s), dequant_bits(h)[a:b])
    assert len(s.scales) == (b - 1) // 128 - a // 128 + 1   # only its blocks' scales


@pytest.mark.parametrize("block", [(128, 128), (64, 32), (1, 16)])
@pytest.mark.parametrize("a,b", [(0, 136), (136, 272), (64, 200), (8, 16), (256, 272)])
def test_fp8_columns_start_anywhere_on_8(rng, block, a, b):
    h = host_fp8(rng, 40, 272, block)
    s = S.columns(h, a, b)
    assert s.block_k % 8 == 0 and s.scales.shape[1] == -(-(b - a) // s.block_k)
    assert np.array_equal(dequant_bits(s), dequant_bits(h)[:, a:b])


def test_fp8_per_channel_columns_and_padded_rows(rng):
    w = F8(rng, 24, 100, block=(1, 128), garbage=False)   # one scale per row
    h = HostFp8(w.q, w.scales[:, :1].copy(), w.scale_row, 100, 128)
    assert np.array_equal(dequant_bits(S.columns(h, 48, 100)), dequant_bits(h)[:, 48:100])
    padded = S.rows(h, 16, 24, pad_to=12)
    d = dequant_bits(padded)
    assert np.array_equal(d[:8], dequant_bits(h)[16:24]) and not d[8:].any()


@pytest.mark.parametrize("act", [False, True])
@pytest.mark.parametrize("a,b", [(0, 96), (96, 192), (32, 64)])
def test_q4_rows_and_whole_group_columns(rng, act, a, b):
    h = host_q4(rng, 48, 192, 32, act)
    assert np.array_equal(dequant_bits(S.rows(h, 8, 40)), dequant_bits(h)[8:40])
    assert np.array_equal(dequant_bits(S.columns(h, a, b)), dequant_bits(h)[:, a:b])


def test_a_split_that_cuts_a_group_is_refused_by_name():
    from metrale.formats.quant.int4 import Int4Config
    qc = Int4Config("gptq", 64, False, False, True, (), None, "config.json")
    S.check_columns(qc, "model.layers.0.mlp.down_proj", 192, 0, 128, "x")   # whole groups
    with pytest.raises(Unsupported, match=r"model.layers.0.mlp.down_proj.*group_size 64"):
        S.check_columns(qc, "model.layers.0.mlp.down_proj", 192, 96, 192, "x")
    act = Int4Config("gptq", 64, True, False, True, (), None, "config.json")
    S.check_columns(act, "model.layers.0.mlp.down_proj", 192, 96, 192, "x")   # g_idx: kept


def test_fp8_columns_off_the_8_grid_are_refused_by_name():
    from metrale.formats.quant.fp8 import Fp8Config
    qc = Fp8Config("fp8", "block", (64, 32), None, (), "config.json")
    S.check_columns(qc, "o", 200, 104, 200, "x")
    with pytest.raises(Unsupported, match="tensor model.layers.1.mlp.down_proj.*start at 100"):
        S.check_columns(qc, "model.layers.1.mlp.down_proj", 200, 100, 200, "x")
