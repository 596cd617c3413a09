"""safetensors header validation, mmap reads and F16/F32 -> BF16 conversion."""
from __future__ import annotations

import struct

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from metrale import FormatError, MetraleError, Unsupported
from metrale.formats import SafetensorsFile, parse_header, to_bf16
from metrale.formats.safetensors import DTYPES
from metrale.ops.bf16 import bf16_to_f32

from .st_util import st_bytes, tensors_bytes

SIZES = (1, 7, 19, 111)  # ragged on purpose: no tensor ends on an aligned boundary


def _write(tmp_path, data: bytes, name="m.safetensors"):
    p = tmp_path / name
    p.write_bytes(data)
    return p


def _parse(data: bytes):
    return parse_header(data, len(data), "x.safetensors")


def test_ragged_tensors_roundtrip(tmp_path, rng):
    arrays = {f"t{n}": rng.integers(0, 1 << 16, size=n).astype(np.uint16) for n in SIZES}
    arrays["m"] = rng.integers(0, 1 << 16, size=(7, 19)).astype(np.uint16)
    p = _write(tmp_path, tensors_bytes({k: ("BF16", v) for k, v in arrays.items()}))
    with SafetensorsFile(p) as f:
        assert set(f.tensors) == set(arrays)
        for k, v in arrays.items():
            got = f.read_bf16(k)
            assert got.dtype == np.uint16 and got.shape == v.shape
            np.testing.assert_array_equal(got, v)
            assert not got.flags.writeable  # a view of the read-only mapping, no copy


def test_reference_writer_output_parses(tmp_path, rng):
    from safetensors.numpy import save_file
    arrays = {f"t{n}": rng.standard_normal(n).astype(np.float32) for n in SIZES}
    save_file(arrays, str(tmp_path / "r.safetensors"), metadata={"format": "pt"})
    with SafetensorsFile(tmp_path / "r.safetensors") as f:
        assert f.metadata == {"format": "pt"}
        for k, v in arrays.items():
            np.testing.assert_array_equal(f.raw(k), v)


def test_f32_to_bf16_round_nearest_even(tmp_path):
    # 1 + 2^-8 is exactly half a BF16 ulp above 1.0 -> ties to even (1.0);
    # 1 + 3*2^-8 is a tie between 1+2^-7 (odd) and 1+2^-6 (even) -> 1+2^-6;
    # 1 + 2^-8 + 2^-20 is above the tie -> rounds up.
    vals = np.array([1 + 2**-8, 1 + 3 * 2**-8, 1 + 2**-8 + 2**-20, -2.5, 0.0, np.inf, np.nan],
                    np.float32)
    p = _write(tmp_path, tensors_bytes({"a": ("F32", vals)}))
    with SafetensorsFile(p) as f:
        got = bf16_to_f32(f.read_bf16("a"))
    np.testing.assert_array_equal(got[:6], [1.0, 1 + 2**-6, 1 + 2**-7, -2.5, 0.0, np.inf])
    assert np.isnan(got[6])


def test_f16_to_bf16_rounds_once(tmp_path):
    # F16 1 + 2^-8 + 2^-10 is exact in F16; BF16 has 7 mantissa bits -> rounds up to 1+2^-7.
    vals = np.array([1 + 2**-8, 1 + 2**-8 + 2**-10, 65504.0, -0.0, 2**-24], np.float16)
    p = _write(tmp_path, tensors_bytes({"h": ("F16", vals.reshape(1, 5))}))
    with SafetensorsFile(p) as f:
        bits = f.read_bf16("h")
    assert bits.shape == (1, 5)
    np.testing.assert_array_equal(bf16_to_f32(bits)[0],
                                  [1.0, 1 + 2**-7, 65536.0, -0.0, np.float32(2**-24)])


def test_conversion_matches_reference_on_random(rng):
    x = (rng.standard_normal(1001) * 10.0).astype(np.float32)
    bits = to_bf16(x, "F32", "t")
    # reference: pick the nearer of the two BF16 neighbours, ties to even mantissa
    u = x.view(np.uint32)
    lo = (u >> 16).astype(np.uint16)
    rem = u & 0xFFFF
    up = (rem > 0x8000) | ((rem == 0x8000) & (lo & 1 == 1))
    np.testing.assert_array_equal(bits, lo + up.astype(np.uint16))


def test_int_tensor_cannot_become_bf16(tmp_path):
    p = _write(tmp_path, tensors_bytes({"i": ("I32", np.arange(3))}))
    with SafetensorsFile(p) as f:
        with pytest.raises(Unsupported, match="'i'.*I32"):
            f.read_bf16("i")


def test_empty_tensor_and_empty_file_header(tmp_path):
    p = _write(tmp_path, st_bytes({"e": {"dtype": "F32", "shape": [0, 3], "data_offsets": [0, 0]}}))
    with SafetensorsFile(p) as f:
        assert f.read_bf16("e").shape == (0, 3)


# -- errors: each names the file, and the tensor where there is one -----------------
def test_truncated_file(tmp_path):
    p = _write(tmp_path, b"\x10\x00\x00")
    with pytest.raises(FormatError, match=r"m\.safetensors.*truncated"):
        SafetensorsFile(p)


def test_truncated_data_region(tmp_path):
    good = tensors_bytes({"w": ("F32", np.ones(19, np.float32))})
    p = _write(tmp_path, good[:-5])
    with pytest.raises(FormatError, match=r"m\.safetensors.*'w'.*out of range.*truncated"):
        SafetensorsFile(p)


def test_header_length_beyond_file(tmp_path):
    p = _write(tmp_path, struct.pack("<Q", 1000) + b"{}")
    with pytest.raises(FormatError, match=r"m\.safetensors.*header length 1000.*past the end"):
        SafetensorsFile(p)


def test_huge_header_length(tmp_path):
    p = _write(tmp_path, struct.pack("<Q", 2**63) + b"{}")
    with pytest.raises(FormatError, match="header length"):
        SafetensorsFile(p)


@pytest.mark.parametrize("header", [b"{not json", b"\xff\xfe{}", b"[1, 2]", b'"s"',
                                    b'{"a": 1, "a": 2}'])
def test_header_not_json_object(tmp_path, header):
    p = _write(tmp_path, struct.pack("<Q", len(header)) + header)
    with pytest.raises(FormatError, match=r"m\.safetensors"):
        SafetensorsFile(p)


def test_unknown_dtype(tmp_path):
    p = _write(tmp_path, st_bytes({"w": {"dtype": "F17", "shape": [1], "data_offsets": [0, 2]}},
                                  b"\0\0"))
    with pytest.raises(FormatError, match=r"m\.safetensors: tensor 'w': unknown dtype 'F17'"):
        SafetensorsFile(p)


@pytest.mark.parametrize("entry, msg", [
    ({"dtype": "F32", "shape": [2], "data_offsets": [0, 12]}, "out of range"),
    ({"dtype": "F32", "shape": [2], "data_offsets": [4, 0]}, "out of range"),
    ({"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}, "needs 8"),
    ({"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}, "shape"),
    ({"dtype": "F32", "shape": [1.0], "data_offsets": [0, 4]}, "shape"),
    ({"dtype": "F32", "shape": [True], "data_offsets": [0, 4]}, "shape"),
    ({"dtype": "F32", "shape": [1], "data_offsets": [0]}, "data_offsets"),
    ({"dtype": "F32", "shape": [1]}, "data_offsets"),
    ([1, 2], "entry must be an object"),
])
def test_bad_offsets_and_shapes(tmp_path, entry, msg):
    p = _write(tmp_path, st_bytes({"w": entry}, b"\0" * 8))
    with pytest.raises(FormatError, match=rf"m\.safetensors: tensor 'w'.*{msg}"):
        SafetensorsFile(p)


def test_overlapping_tensors(tmp_path):
    hdr = {"a": {"dtype": "BF16", "shape": [7], "data_offsets": [0, 14]},
           "b": {"dtype": "BF16", "shape": [1], "data_offsets": [12, 14]}}
    p = _write(tmp_path, st_bytes(hdr, b"\0" * 14))
    with pytest.raises(FormatError, match=r"m\.safetensors: tensors 'a' and 'b' overlap"):
        SafetensorsFile(p)


def test_bad_metadata(tmp_path):
    p = _write(tmp_path, st_bytes({"__metadata__": {"k": 1}}))
    with pytest.raises(FormatError, match="__metadata__"):
        SafetensorsFile(p)


def test_missing_tensor_name(tmp_path):
    p = _write(tmp_path, tensors_bytes({"a": ("BF16", np.zeros(1))}))
    with SafetensorsFile(p) as f, pytest.raises(FormatError, match=r"m\.safetensors.*'zz'"):
        f.read_bf16("zz")


# -- fuzz: any bytes give a MetraleError or a valid parse, never another exception ------
def _check_valid(tensors, size):
    for t in tensors.values():
        assert 8 <= t.start <= t.end <= size
        assert t.nbytes == t.numel * DTYPES[t.dtype][1]


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=200))
def test_fuzz_random_bytes(data):
    try:
        tensors, _ = _parse(data)
    except MetraleError:
        return
    _check_valid(tensors, len(data))


_json_leaf = st.one_of(st.none(), st.booleans(), st.integers(-5, 300), st.floats(allow_nan=True),
                       st.text(max_size=6), st.sampled_from(["BF16", "F16", "F32", "I8", "X"]))
_json = st.recursive(_json_leaf, lambda c: st.one_of(st.lists(c, max_size=4),
                                                     st.dictionaries(st.text(max_size=5), c,
                                                                     max_size=4)),
                     max_leaves=20)
_entry = st.fixed_dictionaries({"dtype": st.sampled_from(["BF16", "F16", "F32", "F64", "Q4"]),
                                "shape": st.lists(st.integers(-1, 5), max_size=3),
                                "data_offsets": st.lists(st.integers(-2, 80), min_size=0,
                                                         max_size=3)})


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(st.text(max_size=4), st.one_of(_entry, _json), max_size=5),
       st.integers(0, 80), st.integers(0, 40))
def test_fuzz_structured_headers(header, data_len, cut):
    raw = st_bytes(header, b"\0" * data_len)
    for data in (raw, raw[:max(0, len(raw) - cut)]):
        try:
            tensors, _ = _parse(data)
        except MetraleError:
            continue
        _check_valid(tensors, len(data))


def test_deeply_nested_json_is_a_format_error():
    deep = b"[" * 100000 + b"]" * 100000
    data = struct.pack("<Q", len(deep)) + deep
    with pytest.raises(FormatError):
        _parse(data)
