"""GGUF block formats: metrale's dequantizers (numpy and native) against a float64
implementation written element by element from ggml's layouts (ggml-common.h, quoted in
formats/gguf/quants.py), and against the `gguf` package's own dequantizer."""
from __future__ import annotations

import numpy as np
import pytest

from metrale.errors import Unsupported
from metrale.formats.gguf.file import GGML_TYPES
from metrale.formats.gguf.quants import (SUPPORTED, dequantize_bf16, dequantize_f32)
from metrale.gpu_runtime import native
from metrale.ops.bf16 import f32_to_bf16_numpy

BLOCK_TYPES = {"Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q5_1": 7, "Q8_0": 8, "Q4_K": 12,
               "Q5_K": 13, "Q6_K": 14}
# byte offsets of the f16 fields (d, m / dmin) of each block
HALVES = {2: (0,), 3: (0, 2), 6: (0,), 7: (0, 2), 8: (0,), 12: (0, 2), 13: (0, 2), 14: (208,)}


def f16(b: np.ndarray, at: int) -> float:
    return float(b[at:at + 2].view("<f2")[0])


def ref_block(t: int, b: np.ndarray) -> list[float]:
    """float64 values of one block of type t (b: its bytes), element by element."""
    out = []
    if t in (2, 3, 6, 7):                      # Q4_0 Q4_1 Q5_0 Q5_1
        has_min, high = t in (3, 7), t in (6, 7)
        d = f16(b, 0)
        m = f16(b, 2) if has_min else 0.0
        p = 4 if has_min else 2
        qh = int.from_bytes(bytes(b[p:p + 4]), "little") if high else 0
        qs = b[p + 4:] if high else b[p:]
        for i in range(32):
            q = int(qs[i] & 15) if i < 16 else int(qs[i - 16] >> 4)
            q += ((qh >> i) & 1) * 16
            if has_min:
                out.append(d * q + m)
            else:
                out.append(d * (q - (16 if high else 8)))
    elif t == 8:                               # Q8_0
        d = f16(b, 0)
        out = [d * int(v) for v in b[2:34].view(np.int8)]
    elif t in (12, 13):                        # Q4_K Q5_K
        d, dmin, s = f16(b, 0), f16(b, 2), [int(x) for x in b[4:16]]
        qh, qs = (b[16:48], b[48:176]) if t == 13 else (None, b[16:144])
        for i in range(256):
            j, l = i // 32, i % 32             # sub-block, position in it
            c = j // 2                         # 64-element chunk
            byte = int(qs[32 * c + l])
            q = byte & 15 if j % 2 == 0 else byte >> 4
            if qh is not None:
                q += ((int(qh[l]) >> j) & 1) * 16
            if j < 4:
                sc, mn = s[j] & 63, s[j + 4] & 63
            else:
                sc = (s[j + 4] & 15) | ((s[j - 4] >> 6) << 4)
                mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4)
            out.append(d * sc * q - dmin * mn)
    elif t == 14:                              # Q6_K
        ql, qh, sc, d = b[0:128], b[128:192], b[192:208].view(np.int8), f16(b, 208)
        for i in range(256):
            h, r = i // 128, i % 128
            k, l = r // 32, r % 32             # quarter, position
            low = int(ql[64 * h + l + (32 if k in (1, 3) else 0)])
            low = low & 15 if k < 2 else low >> 4
            q = low | (((int(qh[32 * h + l]) >> (2 * k)) & 3) << 4)
            out.append(d * int(sc[i // 16]) * (q - 32))
    return out


def ref_bf16(t: int, raw: np.ndarray) -> np.ndarray:
    size = GGML_TYPES[t][2]
    vals = [v for blk in raw.reshape(-1, size) for v in ref_block(t, blk)]
    # the exact value (float64 holds it) rounded once to float32, then to BF16
    return f32_to_bf16_numpy(np.array(vals, np.float64).astype(np.float32))


def random_blocks(t: int, n: int, seed: int, specials: bool = False) -> np.ndarray:
    """n random blocks of type t; the f16 scale fields are finite (a mix of signs and
    magnitudes, subnormals included), or also inf / NaN with `specials`."""
    rng = np.random.default_rng(seed)
    size = GGML_TYPES[t][2]
    raw = rng.integers(0, 256, (n, size), dtype=np.uint8)
    for at in HALVES[t]:
        h = (rng.standard_normal(n) * 10.0 ** rng.integers(-7, 2, n)).astype(np.float16)
        h[::17] = np.float16(3e-6)             # a subnormal half
        if specials:
            h[1::5] = np.float16(np.inf)
            h[2::5] = np.float16(np.nan)
        raw[:, at:at + 2] = h.view(np.uint8).reshape(n, 2)
    return raw.reshape(-1)


@pytest.mark.parametrize("name", list(BLOCK_TYPES))
@pytest.mark.parametrize("specials", [False, True])
def test_block_formats_against_float64(name, specials):
    t = BLOCK_TYPES[name]
    qk = GGML_TYPES[t][1]
    nb = 40 if qk == 32 else 12
    raw = random_blocks(t, nb, seed=t + 100 * specials, specials=specials)
    want = ref_bf16(t, raw)
    got = dequantize_bf16(raw, t, (nb * qk,), native=False)
    assert np.array_equal(got, want), f"{name}: numpy dequantizer differs from float64"
    if native.try_load() is not None:
        got_native = dequantize_bf16(raw, t, (nb * qk,), native=True)
        assert np.array_equal(got_native, want), f"{name}: native dequantizer differs"


@pytest.mark.parametrize("name", list(BLOCK_TYPES))
def test_float32_values_equal_the_gguf_package(name):
    """The float32 values (before BF16) are the gguf package's, bit for bit."""
    quants = pytest.importorskip("gguf.quants")
    t = BLOCK_TYPES[name]
    qk, size = GGML_TYPES[t][1:]
    raw = random_blocks(t, 24 if qk == 32 else 6, seed=7 * t)
    ours = dequantize_f32(raw, t, raw.size // size * qk)
    theirs = quants.dequantize(raw.reshape(1, -1), t).reshape(-1)
    assert np.array_equal(ours.view(np.uint32), theirs.astype(np.float32).view(np.uint32))


@pytest.mark.parametrize("t, dtype", [(0, "<f4"), (1, "<f2")])
@pytest.mark.parametrize("use_native", [False, True])
def test_plain_float_types_round_to_nearest_even(t, dtype, use_native):
    if use_native and native.try_load() is None:
        pytest.skip("no native library on this machine")
    rng = np.random.default_rng(t)
    x = (rng.standard_normal(1000) * 10.0 ** rng.integers(-6, 4, 1000)).astype(dtype)
    x[:4] = np.array([np.inf, -np.inf, np.nan, 0.0], dtype)
    raw = x.view(np.uint8)
    want = f32_to_bf16_numpy(x.astype(np.float32))
    assert np.array_equal(dequantize_bf16(raw, t, (10, 100), native=use_native),
                          want.reshape(10, 100))


def test_bf16_is_copied_bit_for_bit():
    bits = np.random.default_rng(0).integers(0, 1 << 16, 64, dtype=np.uint16)
    assert np.array_equal(dequantize_bf16(bits.view(np.uint8), 30, (8, 8)),
                          bits.reshape(8, 8))


def test_chunks_split_at_block_boundaries(monkeypatch):
    """The numpy path's chunking (whole blocks per step) gives the one-shot result."""
    from metrale.formats.gguf import quants as gguf_quants
    raw = random_blocks(12, 9, seed=3)
    whole = dequantize_bf16(raw, 12, (9 * 256,), native=False)
    monkeypatch.setattr(gguf_quants, "_CHUNK_ELEMENTS", 512)
    assert np.array_equal(dequantize_bf16(raw, 12, (9 * 256,), native=False), whole)


def test_other_types_are_refused_by_name():
    for t, (name, _, _) in GGML_TYPES.items():
        if t in SUPPORTED:
            continue
        with pytest.raises(Unsupported, match=name):
            dequantize_bf16(np.zeros(GGML_TYPES[t][2], np.uint8), t, (GGML_TYPES[t][1],))


def test_wrong_byte_count_is_an_error():
    with pytest.raises(ValueError, match="take 68 bytes"):
        dequantize_bf16(np.zeros(34, np.uint8), 8, (64,))


def test_type_table_matches_the_gguf_package():
    constants = pytest.importorskip("gguf.constants")
    theirs = {int(t): (t.name, *constants.GGML_QUANT_SIZES[t])
              for t in constants.GGMLQuantizationType if t in constants.GGML_QUANT_SIZES}
    for t, entry in GGML_TYPES.items():
        assert theirs[t] == entry, t


def test_file_type_table_matches_the_gguf_package():
    constants = pytest.importorskip("gguf.constants")
    from metrale.formats.gguf.file import FILE_TYPES
    theirs = {int(t): t.name for t in constants.LlamaFileType}
    for t, name in FILE_TYPES.items():
        assert theirs[t] == name, t


@pytest.mark.parametrize("name", ["Q4_1", "Q6_K"])
def test_native_threads_split_large_tensors_exactly(name):
    """From 1M elements the native loop splits blocks over threads: same bits as numpy."""
    if native.try_load() is None:
        pytest.skip("no native library on this machine")
    t = BLOCK_TYPES[name]
    qk = GGML_TYPES[t][1]
    nb = (1 << 20) // qk + 3                      # ragged: not a multiple of the threads
    raw = random_blocks(t, nb, seed=11)
    assert np.array_equal(dequantize_bf16(raw, t, (nb * qk,), native=True),
                          dequantize_bf16(raw, t, (nb * qk,), native=False))


# Q2_K, Q3_K, IQ4_NL, IQ4_XS: dequantized at load through the device's planes (quants.py)
PLANE_TYPES = {"Q2_K": 10, "Q3_K": 11, "IQ4_NL": 20, "IQ4_XS": 23}


@pytest.mark.parametrize("name", list(PLANE_TYPES))
@pytest.mark.parametrize("use_native", [None, False])
def test_plane_types_dequantize_at_load_as_the_gguf_package(name, use_native):
    """The load-time dequantizer (native library's choice or numpy) gives gguf-py's float32
    values rounded once to BF16, in chunks as in one go (they were refused before)."""
    quants = pytest.importorskip("gguf.quants")
    from tests.formats.test_gguf_packed import random_blocks as finite_blocks
    t = PLANE_TYPES[name]
    n, k = 3, 4 * 256
    raw = finite_blocks(t, n, k, 9)
    theirs = quants.dequantize(raw.reshape(n, -1), t).astype(np.float32)
    assert np.array_equal(dequantize_f32(raw, t, n * k).reshape(n, k).view(np.uint32),
                          theirs.view(np.uint32))
    got = dequantize_bf16(raw, t, (n, k), native=use_native)
    assert np.array_equal(got, f32_to_bf16_numpy(theirs))
