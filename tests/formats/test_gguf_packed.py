"""GGUF tensors kept at their bytes: the block -> plane split (formats/gguf/packed.py) is
lossless both ways, and the planes' dequantization (ops/gguf_planes.py, the formula of every
GGUF kernel) gives the load-time dequantizer's bits for every type it has, and llama.cpp's
own reference (`gguf.quants`) for every packed type, against a float64 formula too."""
from __future__ import annotations

import numpy as np
import pytest

from metrale.formats.gguf.packed import join_blocks, split_blocks
from metrale.formats.gguf.quants import BLOCK_DEQUANT, dequantize_bf16
from metrale.ops.bf16 import f32_to_bf16
from metrale.ops.gguf_planes import PACKED, dequant_bf16, dequant_f32, plane_bytes

TYPES = sorted(PACKED)


def random_blocks(ggml_type: int, n: int, k: int, seed: int, finite: bool = True):
    """Random stored bytes of a [n, k] tensor; with `finite`, every f16 scale field a
    finite value of moderate size (llama.cpp's reference widens through float32 too)."""
    t = PACKED[ggml_type]
    rng = np.random.default_rng([seed, ggml_type])
    b = rng.integers(0, 256, (n * k // t.qk, t.block_bytes), dtype=np.uint8)
    if finite:
        at = {"Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q8_0": [0],
              "IQ4_NL": [0], "Q2_K": [80, 82], "Q3_K": [108], "Q4_K": [0, 2], "Q5_K": [0, 2],
              "Q6_K": [208], "IQ4_XS": [0]}[t.name]
        for a in at:   # |x| in [2^-8, 2^4), either sign
            v = (rng.uniform(-8, 4, len(b)) * 1.0)
            h = (np.sign(rng.standard_normal(len(b))) * 2.0 ** v).astype(np.float16)
            b[:, a:a + 2] = h.view(np.uint8).reshape(-1, 2)
    return b.reshape(-1)


@pytest.mark.parametrize("ggml_type", TYPES, ids=[PACKED[t].name for t in TYPES])
@pytest.mark.parametrize("n,k", [(1, 256), (3, 512), (7, 1024)])
def test_split_and_join_are_inverse_and_keep_the_bytes(ggml_type, n, k):
    raw = random_blocks(ggml_type, n, k, 0, finite=False)
    p = split_blocks(raw, ggml_type, n, k)
    q_row, qh_row, meta_row = plane_bytes(ggml_type, k)
    assert p.q.shape == (n, q_row) and p.meta.shape == (n, meta_row)
    assert (p.qh is None) == (qh_row == 0) and (p.qh is None or p.qh.shape == (n, qh_row))
    assert p.nbytes == raw.nbytes   # k multiple of 256: no row padding
    assert np.array_equal(join_blocks(p), raw)


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
@pytest.mark.parametrize("k", [1, 5, 64, 111, 2048])
def test_pack_bits_is_unpack_bits_inverse_at_ragged_widths(bits, k):
    """Fields at bit (e * bits) % 8 of byte (e * bits) // 8, zero padding past k."""
    from metrale.ops.gguf_planes import pack_bits, unpack_bits
    f = np.random.default_rng([bits, k]).integers(0, 1 << bits, (3, k), dtype=np.uint8)
    row = -(-k * bits // 8 // 16) * 16 + 16
    p = pack_bits(f, bits, row)
    assert np.array_equal(unpack_bits(p, bits, k), f)
    e = np.arange(k)
    want = np.zeros((3, row), np.int64)
    np.add.at(want, (slice(None), e * bits // 8), f.astype(np.int64) << (e * bits % 8))
    assert np.array_equal(p, want.astype(np.uint8))


@pytest.mark.parametrize("ggml_type", [t for t in TYPES if t in BLOCK_DEQUANT],
                         ids=[PACKED[t].name for t in TYPES if t in BLOCK_DEQUANT])
def test_planes_give_the_load_time_bits(ggml_type):
    """Every type the loader dequantizes: the same bits from the planes, NaN and infinite
    scales included (random bytes)."""
    n, k = 5, 512
    raw = random_blocks(ggml_type, n, k, 1, finite=False)
    p = split_blocks(raw, ggml_type, n, k)
    want = dequantize_bf16(raw, ggml_type, (n, k), native=False)
    assert np.array_equal(dequant_bf16(p.q, p.qh, p.meta, ggml_type, k), want)


def ggml_reference(raw: np.ndarray, ggml_type: int, n: int, k: int) -> np.ndarray:
    from gguf import GGMLQuantizationType, quants
    return quants.dequantize(raw.reshape(n, -1), GGMLQuantizationType(ggml_type)) \
        .reshape(n, k).astype(np.float32)


@pytest.mark.parametrize("ggml_type", TYPES, ids=[PACKED[t].name for t in TYPES])
def test_planes_match_llama_cpps_reference(ggml_type):
    """llama.cpp's numpy reference (gguf-py) on the same blocks, value for value."""
    n, k = 4, 512
    raw = random_blocks(ggml_type, n, k, 2)
    p = split_blocks(raw, ggml_type, n, k)
    ours = dequant_f32(p.q, p.qh, p.meta, ggml_type, k)
    assert np.array_equal(ours, ggml_reference(raw, ggml_type, n, k))
    assert np.array_equal(dequant_bf16(p.q, p.qh, p.meta, ggml_type, k), f32_to_bf16(ours))


def float64_formula(p, ggml_type: int) -> np.ndarray:
    """The docstring's formula in float64, element by element from the planes' bits."""
    from metrale.ops.gguf_planes import KVALUES, k4_scales, q3k_scales, unpack_bits
    t = PACKED[ggml_type]
    lo = unpack_bits(p.q, t.low_bits, p.k).astype(np.int64)
    hi = unpack_bits(p.qh, t.high_bits, p.k).astype(np.int64) if t.high_bits else 0 * lo
    out = np.zeros((p.n, p.k))
    meta = p.meta.reshape(p.n, -1, t.meta_bytes)

    def f16(row, b, at):
        return float(meta[row, b, at:at + 2].copy().view("<f2")[0])
    for r in range(p.n):
        for e in range(p.k):
            b, i = divmod(e, t.qk)
            j = i // t.sub
            name, mn = t.name, 0.0
            c = float(lo[r, e])
            if name == "Q4_0":
                s, c = f16(r, b, 0), c - 8
            elif name in ("Q4_1", "Q5_1"):
                s, mn, c = f16(r, b, 0), f16(r, b, 2), c + 16 * hi[r, e]
            elif name == "Q5_0":
                s, c = f16(r, b, 0), c + 16 * hi[r, e] - 16
            elif name == "Q8_0":
                s, c = f16(r, b, 0), float(np.int8(np.uint8(lo[r, e])))
            elif name == "IQ4_NL":
                s, c = f16(r, b, 0), float(KVALUES[lo[r, e]])
            elif name == "Q2_K":
                sc = int(meta[r, b, j])
                s, mn = f16(r, b, 16) * (sc & 15), -f16(r, b, 18) * (sc >> 4)
            elif name == "Q3_K":
                sc = int(q3k_scales(meta[r, b, 0:12])[j])
                s, c = f16(r, b, 12) * (sc - 32), c - (0 if hi[r, e] else 4)
            elif name in ("Q4_K", "Q5_K"):
                sc, m6 = k4_scales(meta[r, b, 4:16])
                s, mn = f16(r, b, 0) * int(sc[j]), -f16(r, b, 2) * int(m6[j])
                c += 16 * hi[r, e]
            elif name == "Q6_K":
                s = f16(r, b, 16) * int(meta[r, b, j:j + 1].view(np.int8)[0])
                c = c + 16 * hi[r, e] - 32
            elif name == "IQ4_XS":
                sh = int(meta[r, b, 2:4].copy().view("<u2")[0])
                ls = ((int(meta[r, b, 4 + j // 2]) >> (4 * (j % 2))) & 15) | \
                    (((sh >> (2 * j)) & 3) << 4)
                s, c = f16(r, b, 0) * (ls - 32), float(KVALUES[lo[r, e]])
            out[r, e] = s * c + mn
    return out


@pytest.mark.parametrize("ggml_type", TYPES, ids=[PACKED[t].name for t in TYPES])
def test_planes_are_the_float64_formula_rounded_once(ggml_type):
    n, k = 2, 256
    raw = random_blocks(ggml_type, n, k, 3)
    p = split_blocks(raw, ggml_type, n, k)
    exact = float64_formula(p, ggml_type)
    assert np.array_equal(dequant_f32(p.q, p.qh, p.meta, ggml_type, k),
                          exact.astype(np.float32))
