"""A GGUF file's weights kept at their stored bytes on the device (issue 38): which tensors
stay packed, how a fused group's parts are laid out, and the bytes that holds.

Every linear weight (q/k/v/o, gate/up/down), the embedding and a stored lm_head whose type
is a block type of ops/gguf_planes.PACKED stays packed: its planes (formats/gguf/packed.py,
in HF's row order) go to the device as they are, and ops.gemm_gguf / ops.embedding's
embedding_gguf dequantize inside the kernels, to the bits the load-time dequantizer gives.
A fused group (q|k|v, gate|up) is one GgufLinear whose runs of one type each hold their
parts' planes concatenated along n. A group with a part of a float type (F32, F16, BF16;
llama.cpp writes such a mix only when told to) is held as BF16, its packed parts dequantized
at load: the gemm_tc of a BF16 part writes whole rows, not a fused output's columns.
Everything else (norms, biases, float tensors) is BF16 as before.
"""
from __future__ import annotations

import numpy as np

from ..formats import expected_tensors
from ..gpu_runtime.types import NULL
from ..ops.gemm_gguf import GgufW
from .linear import FUSED, GgufLinear

EMBED = "model.embed_tokens.weight"


def keeps_packed(source) -> bool:
    """Whether `source` can hold tensors packed (a GGUF source: formats/gguf/source.py)."""
    return callable(getattr(source, "read_planes", None))


def packed_runs(source, names: list[str]) -> list[tuple[int, list[str]]] | None:
    """The runs of consecutive parts of one ggml type of the fused group `names` (tensor
    names, in n order) as (type, names), or None when the group is held as BF16 (a part of a
    float type, or a source that does not keep tensors packed)."""
    if not keeps_packed(source):
        return None
    types = [source.packed_type(n) for n in names]
    if None in types:
        return None
    runs: list[tuple[int, list[str]]] = []
    for t, name in zip(types, names):
        if runs and runs[-1][0] == t:
            runs[-1][1].append(name)
        else:
            runs.append((t, [name]))
    return runs


def upload_packed(weights, up, source, names: list[str]) -> GgufLinear:
    """The fused group `names` (packed_runs is not None) on the device as a GgufLinear;
    `weights._own` keeps every allocation, `up` counts the bytes."""
    parts, nbytes, k = [], 0, None
    for ggml_type, run in packed_runs(source, names):
        planes = [source.read_planes(n) for n in run]
        k = planes[0].k
        q = weights._own(up.upload_bytes(np.concatenate([p.q for p in planes])))
        qh = (weights._own(up.upload_bytes(np.concatenate([p.qh for p in planes])))
              if planes[0].qh is not None else NULL)
        meta = weights._own(up.upload_bytes(np.concatenate([p.meta for p in planes])))
        n = sum(p.n for p in planes)
        parts.append(GgufW(q, qh, meta, ggml_type, n, k))
        nbytes += sum(p.nbytes for p in planes)
    return GgufLinear(tuple(parts), sum(p.n for p in parts), k, nbytes)


def weight_groups(meta, names) -> list[list[str]]:
    """The tensors DecoderWeights uploads as one linear (fused groups, the embedding, a
    stored lm_head), by tensor name."""
    groups = [[f"model.layers.{i}.{m}.weight" for m in g] for i in range(meta.num_layers)
              for g in FUSED]
    return [g for g in groups + [[EMBED], ["lm_head.weight"]] if all(n in names for n in g)]


def held_bytes(meta, source) -> tuple[int, int]:
    """(all weights, the embedding table) in device bytes when `source`'s block-type
    tensors stay packed: their planes' bytes, every other tensor's BF16 bytes, fused
    groups as upload_packed holds them (the embedding counted once when tied)."""
    expected = expected_tensors(meta, source.tensor_names())

    def bf16(names):
        return sum(2 * int(np.prod(expected[n], dtype=np.int64)) for n in names)

    total, counted, embed = 0, set(), 0
    for g in weight_groups(meta, expected):
        size = sum(source.planes_nbytes(n) for n in g) if packed_runs(source, g) \
            else bf16(g)
        total += size
        embed = size if g == [EMBED] else embed
        counted.update(g)
    return total + bf16(n for n in expected if n not in counted), embed


def held_types(meta, source) -> dict[str, str]:
    """Tensor name -> the type the device holds it in when `source` is loaded packed: its
    stored block type ("Q4_K", ...) or "BF16" (metrale info)."""
    expected = expected_tensors(meta, source.tensor_names())
    out = {n: "BF16" for n in expected}
    for g in weight_groups(meta, expected):
        if packed_runs(source, g):
            out.update((n, source.tensor_dtype(n)) for n in g)
    return out
