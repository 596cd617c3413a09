"""GGUF files written for the packed-weight tests (gguf-py's writer, tests/formats/gguf_util.py):
a committed fixture's metadata and tokenizer with its 2-D tensors stored in chosen ggml types
(one type per tensor: mixed fused groups, a tied embedding in a K-quant), optionally widened
to rows of 256 (hidden 256, heads x head_dim 256) so that every K-quant and IQ4_XS fits.

A tensor's values: the fixture's own weights where the shape is unchanged (the file's row
order, as stored) and random normal ones where it is widened, quantized by gguf-py's
`quants.quantize` for the types it writes (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, F16); the other
block types (K-quants, IQ4_NL, IQ4_XS) get valid random blocks: random code and scale bytes,
their f16 block scales finite and sized so that the weights are about 0.05."""
from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import quants

from metrale.formats.gguf.file import GGUFFile
from metrale.formats.gguf.quants import dequantize_bf16
from metrale.ops.bf16 import bf16_to_f32
from metrale.ops.gguf_planes import PACKED
from tests.formats.gguf_util import GGUF_FIXTURES, rewrite

TYPE = {t.name: i for i, t in PACKED.items()} | {"F32": 0, "F16": 1}
QUANTIZED_BY_GGUF_PY = {"Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "F16"}
# byte offsets of a block's f16 scale fields, and the largest |sub-scale * code| a block's
# integer fields reach per unit of its f16 scale (for the random blocks' magnitudes)
SCALES = {"IQ4_NL": ([0], 127), "Q2_K": ([80, 82], 45), "Q3_K": ([108], 128),
          "Q4_K": ([0, 2], 945), "Q5_K": ([0, 2], 1953), "Q6_K": ([208], 4096),
          "IQ4_XS": ([0], 4064)}


def random_blocks(type_name: str, n: int, k: int, rng) -> np.ndarray:
    """Valid random blocks [n, k / QK * block_bytes] of a block type gguf-py cannot write."""
    t = PACKED[TYPE[type_name]]
    b = rng.integers(0, 256, (n * k // t.qk, t.block_bytes), dtype=np.uint8)
    at, reach = SCALES[type_name]
    for a in at:
        d = (0.05 / reach * rng.uniform(0.5, 1.5, len(b))).astype(np.float16)
        b[:, a:a + 2] = d.view(np.uint8).reshape(-1, 2)
    return b.reshape(n, -1)


def stored(values: np.ndarray, type_name: str, rng):
    """(array, type) for rewrite's add_tensors: float32 values of an F32 tensor, else its
    stored bytes [rows, row bytes] of `type_name`."""
    if type_name == "F32":
        return values.astype(np.float32)
    if type_name in QUANTIZED_BY_GGUF_PY:
        q = quants.quantize(values.astype(np.float32), T[type_name])
        return np.ascontiguousarray(q).view(np.uint8).reshape(values.shape[0], -1), \
            T[type_name]
    return random_blocks(type_name, *values.shape, rng), T[type_name]


def _shape(name: str, dims: dict) -> tuple[int, ...]:
    """The numpy shape of GGUF tensor `name` at `dims` (V, H, I, Q = heads * D, KV = kv
    heads * D, D)."""
    V, H, I, Q, KV, D = (dims[x] for x in ("V", "H", "I", "Q", "KV", "D"))
    part = name.split(".")[-2] if name.startswith("blk.") else name.split(".")[0]
    bias = name.endswith(".bias")
    shapes = {"token_embd": (V, H), "output": (V, H), "output_norm": (H,),
              "attn_norm": (H,), "ffn_norm": (H,), "attn_q": (Q, H), "attn_k": (KV, H),
              "attn_v": (KV, H), "attn_output": (H, Q), "ffn_gate": (I, H), "ffn_up": (I, H),
              "ffn_down": (H, I), "attn_q_norm": (D,), "attn_k_norm": (D,)}
    s = shapes[part]
    return s[:1] if bias else s


def write_model(dst: Path, base: str, types, *, wide: bool = False, tied: bool | None = None,
                seed: int = 0) -> Path:
    """Write fixture `base` (tests/fixtures/gguf/) to `dst` with each 2-D tensor in
    `types(gguf_name)` (a type name; 1-D tensors stay F32). `wide`: hidden 256,
    intermediate 512, head_dim 256 / heads (random weights). `tied`: drop output.weight (True) or
    add one (False); None keeps the fixture's choice."""
    g = GGUFFile(GGUF_FIXTURES / f"{base}.gguf")
    arch = g.fields["general.architecture"]
    heads = g.fields[f"{arch}.attention.head_count"]
    kv = g.fields[f"{arch}.attention.head_count_kv"]
    V, H0 = g.tensors["token_embd.weight"].shape
    D0 = g.tensors["blk.0.attn_k.weight"].shape[0] // kv
    I0 = g.tensors["blk.0.ffn_gate.weight"].shape[0]
    H, I, D = (256, 512, 256 // heads) if wide else (H0, I0, D0)   # wide: q rows 256
    dims = dict(V=V, H=H, I=I, Q=heads * D, KV=kv * D, D=D)
    keys = {}
    if wide:
        keys = {f"{arch}.embedding_length": H, f"{arch}.feed_forward_length": I,
                f"{arch}.rope.dimension_count": D}
        if f"{arch}.attention.key_length" in g.fields:
            keys |= {f"{arch}.attention.key_length": D, f"{arch}.attention.value_length": D}
    names = list(g.tensors)
    if tied is True:
        names = [n for n in names if n != "output.weight"]
    elif tied is False and "output.weight" not in names:
        names.append("output.weight")
    rng = np.random.default_rng(seed)
    add = {}
    for name in names:
        shape = _shape(name, dims)
        info = g.tensors.get(name)
        if info is not None and info.shape == shape:   # the fixture's values, as stored
            values = bf16_to_f32(dequantize_bf16(np.array(g.raw(name)), info.ggml_type, shape))
        elif len(shape) == 1:
            values = 1 + 0.1 * rng.standard_normal(shape)
        else:
            values = 0.05 * rng.standard_normal(shape)
        add[name] = stored(values, "F32" if len(shape) == 1 else types(name), rng)
    g.close()
    return rewrite(GGUF_FIXTURES / f"{base}.gguf", dst, keys, drop_tensors=list(g.tensors),
                   add_tensors=add)


def one_type(type_name: str):
    """Every 2-D tensor in `type_name`."""
    return lambda name: type_name


def by_part(**parts):
    """Types by tensor part (attn_q, ffn_down, token_embd, output, ...)."""
    def pick(name):
        part = name.split(".")[-2] if name.startswith("blk.") else name.split(".")[0]
        return parts[part]
    return pick
