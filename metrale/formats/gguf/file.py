"""The GGUF container: metadata key/values and tensor directory, read straight from an mmap.

Layout (ggml's docs/gguf.md, versions 2 and 3; little-endian only):

    magic "GGUF" | version u32 | tensor_count u64 | kv_count u64
    kv_count x   key: string | value_type u32 | value
    tensor_count x   name: string | n_dims u32 | ne[n_dims] u64 | ggml_type u32 | offset u64
    padding to `general.alignment` (default 32) | tensor data (each tensor at data + offset)

A string is `len u64 | utf-8 bytes`; an array `item_type u32 | count u64 | items`. Value
types: 0 u8, 1 i8, 2 u16, 3 i16, 4 u32, 5 i32, 6 f32, 7 bool, 8 string, 9 array, 10 u64,
11 i64, 12 f64. `ne[0]` is the innermost (contiguous) dimension, so a tensor's numpy / HF
shape is `ne` reversed.

The `gguf` package's GGUFReader reads the same layout but builds numpy views for every
array item (2.8-5 s for a 49152-token vocabulary here); this parser reads string arrays
into Python lists and numeric arrays with one `np.frombuffer`, and is checked against
GGUFReader field by field in tests/formats/test_gguf.py. Parsed headers are remembered per
file identity (path, size, mtime, inode; the last HEADER_CACHE files), so loading the same
file again in a process skips the parse; their values are shared: read them, never write.
"""
from __future__ import annotations

import mmap
import os
import struct
from collections import OrderedDict
from pathlib import Path
from typing import NamedTuple

import numpy as np

from ...errors import FormatError

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
HEADER_CACHE = 4
_headers: OrderedDict = OrderedDict()   # identity -> (version, fields, types, tensors, data)

# value type -> (struct format, numpy dtype) of the fixed-size scalars
_SCALARS = {0: ("<B", "<u1"), 1: ("<b", "<i1"), 2: ("<H", "<u2"), 3: ("<h", "<i2"),
            4: ("<I", "<u4"), 5: ("<i", "<i4"), 6: ("<f", "<f4"), 7: ("<?", "?"),
            10: ("<Q", "<u8"), 11: ("<q", "<i8"), 12: ("<d", "<f8")}
STRING, ARRAY = 8, 9
FLOAT32 = 6
# Levels of arrays in one metadata value, at most: `_value` recurses once per level, so a
# file nesting a thousand deep would end in a RecursionError. Arrays of arrays are rare in
# real files (two levels at most); 8 is well above them and far below Python's limit.
MAX_ARRAY_DEPTH = 8

# ggml type id -> (name, elements per block, bytes per block): every type of ggml.h, so a
# refusal can name it (tests compare this with gguf.constants.GGML_QUANT_SIZES).
GGML_TYPES = {
    0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20),
    6: ("Q5_0", 32, 22), 7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34), 9: ("Q8_1", 32, 40),
    10: ("Q2_K", 256, 84), 11: ("Q3_K", 256, 110), 12: ("Q4_K", 256, 144),
    13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210), 15: ("Q8_K", 256, 292),
    16: ("IQ2_XXS", 256, 66), 17: ("IQ2_XS", 256, 74), 18: ("IQ3_XXS", 256, 98),
    19: ("IQ1_S", 256, 50), 20: ("IQ4_NL", 32, 18), 21: ("IQ3_S", 256, 110),
    22: ("IQ2_S", 256, 82), 23: ("IQ4_XS", 256, 136), 24: ("I8", 1, 1), 25: ("I16", 1, 2),
    26: ("I32", 1, 4), 27: ("I64", 1, 8), 28: ("F64", 1, 8), 29: ("IQ1_M", 256, 56),
    30: ("BF16", 1, 2), 34: ("TQ1_0", 256, 54), 35: ("TQ2_0", 256, 66),
    39: ("MXFP4", 32, 17),
}

# general.file_type (llama.h's llama_ftype) -> name: the label of a file's dominant tensor
# type (tests compare this with gguf.constants.LlamaFileType)
FILE_TYPES = {
    0: "ALL_F32", 1: "MOSTLY_F16", 2: "MOSTLY_Q4_0", 3: "MOSTLY_Q4_1", 7: "MOSTLY_Q8_0",
    8: "MOSTLY_Q5_0", 9: "MOSTLY_Q5_1", 10: "MOSTLY_Q2_K", 11: "MOSTLY_Q3_K_S",
    12: "MOSTLY_Q3_K_M", 13: "MOSTLY_Q3_K_L", 14: "MOSTLY_Q4_K_S", 15: "MOSTLY_Q4_K_M",
    16: "MOSTLY_Q5_K_S", 17: "MOSTLY_Q5_K_M", 18: "MOSTLY_Q6_K", 19: "MOSTLY_IQ2_XXS",
    20: "MOSTLY_IQ2_XS", 21: "MOSTLY_Q2_K_S", 22: "MOSTLY_IQ3_XS", 23: "MOSTLY_IQ3_XXS",
    24: "MOSTLY_IQ1_S", 25: "MOSTLY_IQ4_NL", 26: "MOSTLY_IQ3_S", 27: "MOSTLY_IQ3_M",
    28: "MOSTLY_IQ2_S", 29: "MOSTLY_IQ2_M", 30: "MOSTLY_IQ4_XS", 31: "MOSTLY_IQ1_M",
    32: "MOSTLY_BF16", 36: "MOSTLY_TQ1_0", 37: "MOSTLY_TQ2_0", 38: "MOSTLY_MXFP4_MOE",
}


def file_type_name(fields: dict) -> str | None:
    """The name of a file's general.file_type (MOSTLY_Q4_K_M, ...), None without one."""
    t = fields.get("general.file_type")
    if t is None:
        return None
    return FILE_TYPES.get(t, f"file type {t!r}") if isinstance(t, int) else repr(t)


class TensorInfo(NamedTuple):
    """One entry of the tensor directory."""

    name: str
    shape: tuple[int, ...]   # numpy order: ne reversed
    ggml_type: int
    offset: int              # absolute, in the file
    nbytes: int

    @property
    def type_name(self) -> str:
        return GGML_TYPES.get(self.ggml_type, (f"type {self.ggml_type}",))[0]


class GGUFFile:
    """A parsed GGUF file: `fields` {key: value}, `field_types` {key: value type, for arrays
    (9, item type)}, `tensors` {name: TensorInfo}, and `raw(name)` (a uint8 view of the
    tensor's bytes in the mmap). Values: int / float / bool / str, lists of str, numpy
    arrays of numbers."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        try:
            with open(self.path, "rb") as f:
                self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
                self.stat = os.fstat(f.fileno())   # of the very file mapped
        except (OSError, ValueError) as e:
            raise FormatError(f"{self.path}: cannot be read ({e})") from None
        self._buf = memoryview(self._mm)
        key = self.identity()
        hit = _headers.get(key)
        if hit is None:
            try:
                self._parse()
            except (struct.error, IndexError, UnicodeDecodeError, ValueError) as e:
                raise FormatError(f"{self.path}: truncated or corrupt GGUF header ({e})") \
                    from None
            for v in self.fields.values():
                if isinstance(v, np.ndarray):
                    v.flags.writeable = False
            hit = (self.version, self.fields, self.field_types, self.tensors,
                   self.data_offset)
            _headers[key] = hit
            while len(_headers) > HEADER_CACHE:
                _headers.popitem(last=False)
        _headers.move_to_end(key)
        self.version, self.fields, self.field_types, self.tensors, self.data_offset = hit

    def _parse(self) -> None:
        b, p = self._buf, 0
        if bytes(b[:4]) != MAGIC:
            raise FormatError(f"{self.path}: not a GGUF file (magic {bytes(b[:4])!r})")
        version, = struct.unpack_from("<I", b, 4)
        if version not in VERSIONS:
            swapped = struct.unpack_from(">I", b, 4)[0]
            what = ("a big-endian GGUF (not supported)" if swapped in VERSIONS
                    else f"GGUF version {version} (supported: 2, 3)")
            raise FormatError(f"{self.path}: {what}")
        self.version = version
        n_tensors, n_kv = struct.unpack_from("<QQ", b, 8)
        p = 24
        self.fields: dict = {}
        self.field_types: dict = {}
        for _ in range(n_kv):
            key, p = self._string(p)
            vtype, = struct.unpack_from("<I", b, p)
            value, p, tname = self._value(vtype, p + 4, key)
            if key in self.fields:
                raise FormatError(f"{self.path}: metadata key {key!r} appears twice")
            self.fields[key], self.field_types[key] = value, tname
        align = self.fields.get("general.alignment", DEFAULT_ALIGNMENT)
        if not isinstance(align, int) or align <= 0 or align & (align - 1):
            raise FormatError(f"{self.path}: general.alignment {align!r} is not a power of 2")
        infos = []
        for _ in range(n_tensors):
            name, p = self._string(p)
            n_dims, = struct.unpack_from("<I", b, p)
            ne = struct.unpack_from(f"<{n_dims}Q", b, p + 4)
            ggml_type, offset = struct.unpack_from("<IQ", b, p + 4 + 8 * n_dims)
            p += 4 + 8 * n_dims + 12
            infos.append((name, tuple(int(x) for x in reversed(ne)), ggml_type, offset))
        data = -(-p // align) * align
        self.data_offset = data
        self.tensors: dict[str, TensorInfo] = {}
        for name, shape, ggml_type, offset in infos:
            if name in self.tensors:
                raise FormatError(f"{self.path}: tensor {name!r} appears twice")
            nbytes = _nbytes(self.path, name, shape, ggml_type)
            start = data + offset
            if offset % align or start + nbytes > len(b):
                raise FormatError(f"{self.path}: tensor {name!r} ({nbytes} bytes at data "
                                  f"offset {offset}) is misaligned or runs past the end "
                                  f"of the file ({len(b)} bytes)")
            self.tensors[name] = TensorInfo(name, shape, ggml_type, start, nbytes)
        self._check_spans(align)

    def _check_spans(self, align: int) -> None:
        """Each tensor's bytes (by its type and shape) fill the space up to the next tensor
        in the data, less the padding to `align` (as llama.cpp's reader requires): a shape
        that does not match the stored blocks would read another tensor's bytes, or leave
        some of its own unread. The last tensor's end is checked against the file's."""
        by_offset = sorted(self.tensors.values(), key=lambda t: t.offset)
        for t, nxt in zip(by_offset, by_offset[1:]):
            span = nxt.offset - t.offset
            if not t.nbytes <= span <= -(-t.nbytes // align) * align:
                raise FormatError(
                    f"{self.path}: tensor {t.name!r} ({t.type_name} {list(t.shape)}) takes "
                    f"{t.nbytes} bytes by its type and shape, but {span} bytes lie between "
                    f"it and the next tensor {nxt.name!r}: its byte count does not match "
                    "its type and shape")

    def _string(self, p: int) -> tuple[str, int]:
        n, = struct.unpack_from("<Q", self._buf, p)
        if p + 8 + n > len(self._buf):
            raise FormatError(f"{self.path}: a string runs past the end of the file")
        return str(self._buf[p + 8:p + 8 + n], "utf-8"), p + 8 + n

    def _value(self, vtype: int, p: int, key: str, depth: int = 0):
        """(value, next position, type tag) of a value of type `vtype` at `p` (of metadata
        key `key`, inside `depth` arrays)."""
        if vtype in _SCALARS:
            fmt = _SCALARS[vtype][0]
            return struct.unpack_from(fmt, self._buf, p)[0], p + struct.calcsize(fmt), vtype
        if vtype == STRING:
            s, p = self._string(p)
            return s, p, vtype
        if vtype != ARRAY:
            raise FormatError(f"{self.path}: unknown metadata value type {vtype}")
        if depth == MAX_ARRAY_DEPTH:
            raise FormatError(f"{self.path}: metadata key {key!r} nests arrays more than "
                              f"{MAX_ARRAY_DEPTH} deep (the limit MAX_ARRAY_DEPTH)")
        itype, count = struct.unpack_from("<IQ", self._buf, p)
        p += 12
        if itype in _SCALARS:
            dt = np.dtype(_SCALARS[itype][1])
            end = p + count * dt.itemsize
            if end > len(self._buf):
                raise FormatError(f"{self.path}: an array runs past the end of the file")
            return np.frombuffer(self._buf[p:end], dt).copy(), end, (ARRAY, itype)
        if itype == STRING:
            out, buf, unpack = [], self._buf, struct.Struct("<Q").unpack_from
            for _ in range(count):
                n, = unpack(buf, p)
                out.append(str(buf[p + 8:p + 8 + n], "utf-8"))
                p += 8 + n
            if p > len(buf):
                raise FormatError(f"{self.path}: a string array runs past the end of the file")
            return out, p, (ARRAY, itype)
        items = []
        for _ in range(count):   # arrays of arrays: rare, read item by item
            v, p, _t = self._value(itype, p, key, depth + 1)
            items.append(v)
        return items, p, (ARRAY, itype)

    def raw(self, name: str) -> np.ndarray:
        """The stored bytes of tensor `name` (a read-only uint8 view of the mmap)."""
        t = self.tensors[name]
        return np.frombuffer(self._buf, np.uint8, t.nbytes, t.offset)

    def close(self) -> None:
        """Release the mmap (views from `raw` must be gone)."""
        self._buf.release()
        self._mm.close()

    def identity(self) -> tuple:
        """What names this file's contents for caches: path, size, mtime, inode."""
        s = self.stat
        return (str(self.path.resolve()), s.st_size, s.st_mtime_ns, s.st_ino)


def _nbytes(path, name: str, shape: tuple[int, ...], ggml_type: int) -> int:
    if ggml_type not in GGML_TYPES:
        raise FormatError(f"{path}: tensor {name!r} has unknown ggml type {ggml_type}")
    tname, block, size = GGML_TYPES[ggml_type]
    n = 1
    for s in shape:
        n *= s
    if shape and shape[-1] % block:
        raise FormatError(f"{path}: tensor {name!r} ({tname}) has rows of {shape[-1]} "
                          f"elements, not a multiple of its block of {block}")
    return n // block * size
