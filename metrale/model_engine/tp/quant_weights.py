"""The quantized linears of a tensor-parallel rank (sharded_weights.py asks here for every
linear the config quantizes): each part read and repacked as on one device
(formats/quant/), cut to the rank's slice (quant_shard.py) and uploaded packed as the
Q4Linear / Fp8Linear the layer passes run, so a rank holds only its slice's bytes. A fused
group the config splits (some parts quantized, some not) goes up as BF16, each quantized
part dequantized by ops.gemm_q's formula, as linear.py does on one device."""
from __future__ import annotations

import numpy as np

from ...formats.quant.fp8 import HostFp8, concat_fp8
from ...formats.quant.int4 import concat_q4
from ...formats.quant.layout import dequant_bits, linear_shapes
from ..linear import Fp8Linear, Q4Linear, fp8_bytes, q4_bytes
from ...gpu_runtime.types import NULL
from . import quant_shard


def check_row_parallel(meta, plan, where: str) -> None:
    """Every rank's input-column slice of o_proj / down_proj (the experts' and the shared
    expert's too) that the config quantizes, as the format allows it (Unsupported naming
    the tensor before anything is read)."""
    qc = meta.quantization
    shapes = linear_shapes(meta)
    D = meta.head_dim
    moe = meta.moe
    down = f".{moe.expert_proj[2]}" if moe is not None else None
    for name, (_, k) in shapes.items():
        if name.endswith("self_attn.o_proj"):
            per = plan.num_heads * D
        elif name.endswith("mlp.down_proj"):
            per = plan.intermediate
        elif plan.expert_parallel:   # every expert and the shared one whole on its rank
            continue
        elif name.endswith("shared_expert.down_proj"):
            per = plan.shared_intermediate
        elif down is not None and ".experts." in name and name.endswith(down):
            per = plan.expert_intermediate
        else:
            continue
        if qc.converts(name):
            for r in range(plan.size):
                quant_shard.check_columns(qc, name, k, r * per, (r + 1) * per, where)


def quantized(meta, module: str) -> bool:
    qc = meta.quantization
    return qc is not None and qc.converts(module)


def upload_rows(w, meta, parts, pad_to=None):
    """Rows [a, b) of each (module, (a, b)) fused along n, as `w` (ShardedDecoderWeights)
    uploads them: a Q4Linear / Fp8Linear, or BF16 bits (a group the config splits)."""
    qc, src = meta.quantization, w._source
    shapes = linear_shapes(meta, src.tensor_names())
    hosts = []
    for m, (a, b) in parts:
        n, k = shapes[m]
        hosts.append(quant_shard.rows(qc.read(src, m, n, k), a, b, pad_to)
                     if qc.converts(m) else None)
    if not all(h is not None for h in hosts):
        bits = [dequant_bits(h) if h is not None else w._read(m + ".weight")[a:b]
                for (m, (a, b)), h in zip(parts, hosts)]
        return w._upload(np.concatenate(bits))
    return _linear(w, hosts)


def upload_columns(w, meta, module: str, span):
    """Columns [a, b) of a quantized [n, k] linear: the rank's slice of a row-parallel
    layer, kept quantized."""
    qc, src = meta.quantization, w._source
    n, k = linear_shapes(meta, src.tensor_names())[module]
    return _linear(w, [quant_shard.columns(qc.read(src, module, n, k), *span)])


def _linear(w, hosts):
    up = w._up
    n, k = sum(h.n for h in hosts), hosts[0].k
    if isinstance(hosts[0], HostFp8):
        h = concat_fp8(hosts)
        ptrs = [w._own(up.upload_bytes(a)) for a in (h.q, h.scales, h.scale_row)]
        w.held += fp8_bytes(h)
        return Fp8Linear(*ptrs, n, k, h.scales.shape[1], h.block_k, fp8_bytes(h))
    if any(p.gidx is not None for p in hosts):   # act-order in some part: a table each
        for p in hosts:
            if p.gidx is None:
                p.gidx = (np.arange(p.k) // p.group_size).astype(np.int32)[None]
                p.gidx_row = np.zeros(p.n, np.int32)
    h = concat_q4(hosts)
    ptrs = [w._own(up.upload_bytes(a)) for a in (h.q, h.scales, h.zeros)]
    g = gr = NULL
    if h.gidx is not None:
        g, gr = w._own(up.upload_bytes(h.gidx)), w._own(up.upload_bytes(h.gidx_row))
    w.held += q4_bytes(h)
    return Q4Linear(*ptrs, g, gr, n, k, h.scales.shape[1], h.group_size, q4_bytes(h))
