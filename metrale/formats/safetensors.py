"""safetensors files: header parsing with full validation, and mmap-backed tensor reads.

Layout: an 8-byte little-endian header length N, N bytes of UTF-8 JSON
`{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}`, then the
data region; offsets are relative to the start of the data region. Nothing here trusts the
file: every offset, size and type is checked before any byte of tensor data is touched, and
every failure is a `FormatError` naming the file (and the tensor when there is one).
"""
from __future__ import annotations

import json
import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import FormatError, Unsupported
from ..ops.bf16 import f32_to_bf16

# safetensors dtype name -> (numpy dtype, bytes per element). The parser accepts every
# dtype the format defines so a checkpoint with an int buffer still opens; `read_bf16`
# converts only the floating ones.
DTYPES: dict[str, tuple[str, int]] = {
    "BF16": ("<u2", 2), "F16": ("<f2", 2), "F32": ("<f4", 4), "F64": ("<f8", 8),
    "I8": ("i1", 1), "U8": ("u1", 1), "I16": ("<i2", 2), "U16": ("<u2", 2),
    "I32": ("<i4", 4), "U32": ("<u4", 4), "I64": ("<i8", 8), "U64": ("<u8", 8),
    "BOOL": ("u1", 1), "F8_E4M3": ("u1", 1), "F8_E5M2": ("u1", 1),
}
FLOAT_DTYPES = ("BF16", "F16", "F32", "F64")
# The reference implementation's limit: a larger header is a corrupt length field, and
# refusing it early avoids allocating gigabytes for a bogus JSON string.
MAX_HEADER_BYTES = 100 * 1024 * 1024
# Elements converted per step when widening F16/F32 sources, to bound temporary memory.
_CONVERT_CHUNK = 1 << 24


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a safetensors file; offsets are absolute file offsets."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start

    @property
    def numel(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) if self.shape else 1


def parse_header(prefix: bytes, file_size: int, source: str = "<bytes>"
                 ) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """Parse and validate a header: `prefix` holds at least the first 8 + N bytes.

    Returns `(tensors by name, __metadata__)`. Raises `FormatError` naming `source` on any
    inconsistency: truncation, length past the end, bad JSON, unknown dtype, bad shape,
    offsets outside the data region or not matching shape x dtype, overlapping tensors.
    """
    if file_size < 8 or len(prefix) < 8:
        raise FormatError(f"{source}: truncated safetensors file ({file_size} bytes; "
                          "the 8-byte header length is missing)")
    (n,) = struct.unpack("<Q", prefix[:8])
    if n > file_size - 8:
        raise FormatError(f"{source}: header length {n} runs past the end of the file "
                          f"({file_size} bytes)")
    if n > MAX_HEADER_BYTES:
        raise FormatError(f"{source}: header length {n} exceeds {MAX_HEADER_BYTES} bytes")
    if len(prefix) < 8 + n:
        raise FormatError(f"{source}: truncated header ({len(prefix) - 8} of {n} bytes)")
    try:
        header = json.loads(bytes(prefix[8:8 + n]).decode("utf-8"),
                            object_pairs_hook=_no_duplicate_keys)
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
        raise FormatError(f"{source}: header is not valid JSON ({type(e).__name__}: "
                          f"{str(e)[:200]})") from None
    if not isinstance(header, dict):
        raise FormatError(f"{source}: header must be a JSON object, got {type(header).__name__}")
    data_start, data_len = 8 + n, file_size - 8 - n
    meta = header.pop("__metadata__", None) or {}
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise FormatError(f"{source}: __metadata__ must map strings to strings")
    tensors = {name: _tensor_info(name, entry, data_start, data_len, source)
               for name, entry in header.items()}
    _check_no_overlap(tensors, source)
    return tensors, meta


def _no_duplicate_keys(pairs):
    keys = [k for k, _ in pairs]
    if len(set(keys)) != len(keys):
        dup = next(k for k in keys if keys.count(k) > 1)
        raise ValueError(f"duplicate key {dup!r}")
    return dict(pairs)


def _tensor_info(name: str, e, data_start: int, data_len: int, source: str) -> TensorInfo:
    where = f"{source}: tensor {name!r}"
    if not isinstance(e, dict):
        raise FormatError(f"{where}: entry must be an object, got {type(e).__name__}")
    dtype, shape, offs = e.get("dtype"), e.get("shape"), e.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise FormatError(f"{where}: unknown dtype {dtype!r} (known: {', '.join(DTYPES)})")
    if not isinstance(shape, list) or not all(_is_uint(d) for d in shape):
        raise FormatError(f"{where}: shape must be a list of non-negative ints, got {shape!r}")
    if not (isinstance(offs, list) and len(offs) == 2 and all(_is_uint(o) for o in offs)):
        raise FormatError(f"{where}: data_offsets must be [begin, end], got {offs!r}")
    begin, end = offs
    if not begin <= end <= data_len:
        raise FormatError(f"{where}: data_offsets [{begin}, {end}] out of range of the data "
                          f"region ({data_len} bytes; truncated file?)")
    numel = 1
    for d in shape:
        numel *= d
    expect = numel * DTYPES[dtype][1]
    if end - begin != expect:
        raise FormatError(f"{where}: data_offsets [{begin}, {end}] hold {end - begin} bytes "
                          f"but shape {shape} x {dtype} needs {expect}")
    return TensorInfo(name, dtype, tuple(shape), data_start + begin, data_start + end)


def _is_uint(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _check_no_overlap(tensors: dict[str, TensorInfo], source: str) -> None:
    spans = sorted((t.start, t.end, t.name) for t in tensors.values() if t.end > t.start)
    for (s0, e0, n0), (s1, e1, n1) in zip(spans, spans[1:]):
        if s1 < e0:
            raise FormatError(f"{source}: tensors {n0!r} and {n1!r} overlap "
                              f"(bytes {s1}..{min(e0, e1)} of the file)")


class SafetensorsFile:
    """A validated, memory-mapped safetensors file. Reads are views of the mapping."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        try:
            with open(self.path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                head = f.read(8)
                n = struct.unpack("<Q", head)[0] if len(head) == 8 else 0
                prefix = head + (f.read(n) if 8 + n <= size and n <= MAX_HEADER_BYTES else b"")
                self.tensors, self.metadata = parse_header(prefix, size, str(self.path))
                # mmap of an empty data region is legal; of a 0-byte file it is not, but
                # parse_header has already refused files shorter than 8 bytes.
                self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except OSError as e:
            raise FormatError(f"{self.path}: cannot read ({e.strerror or e})") from None
        self.size = size

    def close(self) -> None:
        mm, self._mm = getattr(self, "_mm", None), None
        if mm is not None:
            try:
                mm.close()
            except BufferError:  # views still alive: the mapping goes with the last one
                pass

    def __enter__(self) -> "SafetensorsFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def info(self, name: str) -> TensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            raise FormatError(f"{self.path}: no tensor {name!r}") from None

    def raw(self, name: str) -> np.ndarray:
        """The tensor as stored: a read-only, shaped numpy view of the mapping (no copy)."""
        t = self.info(name)
        if self._mm is None:
            raise FormatError(f"{self.path}: file is closed (reading {name!r})")
        arr = np.frombuffer(self._mm, dtype=np.dtype(DTYPES[t.dtype][0]), count=t.numel,
                            offset=t.start)
        return arr.reshape(t.shape)

    def read_bf16(self, name: str) -> np.ndarray:
        """uint16 BF16 bits, shaped. BF16 is a zero-copy mmap view; F16/F32/F64 round (RNE)."""
        t = self.info(name)
        return to_bf16(self.raw(name), t.dtype, f"{self.path}: tensor {name!r}")


def to_bf16(arr: np.ndarray, dtype: str, where: str) -> np.ndarray:
    """Stored values of safetensors `dtype` -> uint16 BF16 bits, round to nearest even.

    F16 -> F32 is exact, so F16 sources round once, like F32 ones. Converts in chunks so a
    large tensor never needs more than its BF16 result plus one chunk of temporaries.
    """
    if dtype == "BF16":
        return arr
    if dtype not in FLOAT_DTYPES:
        raise Unsupported(f"{where}: dtype {dtype} cannot be converted to BF16 "
                          f"(supported: {', '.join(FLOAT_DTYPES)})")
    flat = arr.reshape(-1)
    out = np.empty(flat.size, np.uint16)
    for i in range(0, flat.size, _CONVERT_CHUNK):
        # F64 goes through F32 first (double rounding is possible there, and documented:
        # no F64 checkpoint of a supported model exists).
        out[i:i + _CONVERT_CHUNK] = f32_to_bf16(flat[i:i + _CONVERT_CHUNK].astype(np.float32))
    return out.reshape(arr.shape)
