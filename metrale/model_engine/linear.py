"""Quantized linear layers on the device and their dispatch: what DecoderWeights holds for a
(fused) linear, and the one call layers.py makes for every linear.

A linear is either a DevicePtr (BF16 W [n, k], ops.gemm_tc), a quantized linear holding
the packed data + scales (+ zeros, act-order tables) of formats/quant_*.py's device layout
(ops.gemm_q), or a GGUF linear kept at its stored bytes (GgufLinear: ops.gemm_gguf's planes;
uploaded by gguf_weights.py). Fused q|k|v and gate|up stay fused when every part is
quantized; a group whose parts the config splits (some quantized, some not) is uploaded as
BF16, each quantized part dequantized by ops.gemm_q's own formula: the same bits the
dequantizing kernel would feed its MMAs, so the model computes the same values either way.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

from ..formats.quant.layout import dequant_bits, linear_shapes
from ..formats.quant.fp8 import HostFp8, concat_fp8
from ..formats.quant.int4 import HostQ4, concat_q4
from ..gpu_runtime.types import NULL, DevicePtr
from ..ops import embedding, gemm_q, gemm_tc
from ..ops.gemm_gguf import GgufW
from ..ops.gguf_planes import dequant_bf16, plane_bytes


@dataclass
class Q4Linear:
    """4-bit W [n, k] on the device (ops.gemm_q.gemm_q4's arguments)."""
    q: DevicePtr
    scales: DevicePtr
    zeros: DevicePtr
    gidx: DevicePtr          # NULL unless act-order
    gidx_row: DevicePtr
    n: int
    k: int
    groups: int
    group_size: int
    nbytes: int

    @cached_property
    def operand(self) -> gemm_q.QuantW:
        """This W as gemm_q's launchers and the fused decode GEMMs take it (built once)."""
        return gemm_q.QuantW("q4", (self.q, self.scales, self.zeros, self.gidx, self.gidx_row),
                             (self.groups, self.group_size), self.n, self.k)

    def run(self, backend, stream, y_ptr, x_ptr, m: int, out_fp32: bool = False) -> None:
        self.operand.run(backend, stream, y_ptr, x_ptr, m, out_fp32)


@dataclass
class Fp8Linear:
    """float8_e4m3fn W [n, k] on the device (ops.gemm_q.gemm_fp8's arguments)."""
    q: DevicePtr
    scales: DevicePtr
    scale_row: DevicePtr
    n: int
    k: int
    k_blocks: int
    block_k: int
    nbytes: int

    @cached_property
    def operand(self) -> gemm_q.QuantW:
        """This W as gemm_q's launchers and the fused decode GEMMs take it (built once)."""
        return gemm_q.QuantW("fp8", (self.q, self.scales, self.scale_row),
                             (self.k_blocks, self.block_k), self.n, self.k)

    def run(self, backend, stream, y_ptr, x_ptr, m: int, out_fp32: bool = False) -> None:
        self.operand.run(backend, stream, y_ptr, x_ptr, m, out_fp32)


@dataclass
class GgufLinear:
    """GGUF W [n, k] kept at its stored bytes (ops.gemm_gguf): the planes of each run of one
    ggml type along n, in order (one run, or a fused q|k|v / gate|up whose parts differ in
    type: Q4_K_M files hold attn_v Q6_K beside Q4_K), each run written into its own
    columns of Y (ldy = n): the columns the same W dequantized at load would give."""
    parts: tuple[GgufW, ...]
    n: int
    k: int
    nbytes: int

    def run(self, backend, stream, y_ptr, x_ptr, m: int, out_fp32: bool = False) -> None:
        col = 0
        for p in self.parts:
            p.run(backend, stream, DevicePtr(y_ptr).offset(col * (4 if out_fp32 else 2)),
                  x_ptr, m, out_fp32, ldy=self.n)
            col += p.n

    def host_rows(self, backend, ids) -> np.ndarray:
        """uint16 BF16 bits [len(ids), k] of rows `ids` of a one-run W (an embedding
        table): its planes' rows copied from the device and dequantized (dequant_bf16,
        the bits embedding_gguf and the load-time dequantizer give)."""
        (p,) = self.parts
        planes = []
        for ptr, row in zip((p.q, p.qh, p.meta), plane_bytes(p.ggml_type, p.k)):
            out = np.empty((len(ids), row), np.uint8)
            for i, t in enumerate(ids):
                if row:
                    backend.copy_d2h(DevicePtr(ptr).offset(int(t) * row), out[i])
            planes.append(out if row else None)
        return dequant_bf16(*planes, p.ggml_type, p.k)


def run_embedding(backend, stream: int, out_ptr, table, ids_ptr, ids, n: int, hidden: int,
                  vocab: int) -> None:
    """out[n, hidden] bf16 = rows `ids` (int32 [n] at ids_ptr; `ids` the same on the host)
    of the embedding table: BF16 (a DevicePtr) or a GgufLinear kept packed (its rows
    dequantized on lookup: the bits of the table dequantized at load)."""
    if isinstance(table, GgufLinear):
        (p,) = table.parts
        embedding.embedding_gguf(backend, stream, out_ptr, ids_ptr, p.q, p.qh, p.meta, n,
                                 hidden, vocab, p.ggml_type, ids)
    else:
        embedding.embedding(backend, stream, out_ptr, table, ids_ptr, n, hidden, vocab)


def fused_operand(w):
    """W for ops/gemm_fused.py: a BF16 DevicePtr as it is, a quantized linear's QuantW."""
    return w.operand if isinstance(w, (Q4Linear, Fp8Linear)) else w


def run_linear(backend, stream: int, y_ptr, x_ptr, w, m: int, n: int, k: int,
               out_fp32: bool = False) -> None:
    """y[m, n] = x[m, k] @ W[n, k]^T with the batch-invariant tensor-core GEMM of W's kind:
    BF16 (a DevicePtr) or quantized / GGUF (dequantized in the kernel's tile, the same k
    order)."""
    if isinstance(w, (Q4Linear, Fp8Linear, GgufLinear)):
        if (w.n, w.k) != (n, k):
            raise ValueError(f"linear of shape [{w.n}, {w.k}] used as [{n}, {k}]")
        w.run(backend, stream, y_ptr, x_ptr, m, out_fp32)
    else:
        gemm_tc.gemm_tc(backend, stream, y_ptr, x_ptr, w, m, n, k, out_fp32=out_fp32)


def upload_linear(weights, up, source, meta, modules: list[str]):
    """Upload the linear `modules` (HF names, fused along n in this order) -> a DevicePtr
    (BF16) or a Q4Linear / Fp8Linear; `weights._own` / `_alloc` keep every allocation."""
    qc = meta.quantization
    if qc is None:   # BF16 (shapes checked against the layout, which names Phi-3's fused
        # qkv_proj / gate_up_proj too; the quantized layouts below do not)
        dims = [tuple(source.tensor_shape(m + ".weight")) for m in modules]
    else:
        dims = [linear_shapes(meta, source.tensor_names())[m] for m in modules]
    n, k = sum(d[0] for d in dims), dims[0][1]
    quantized = [qc is not None and qc.converts(m) for m in modules]
    if not any(quantized):
        if len(modules) == 1:
            return weights._own(up.upload(modules[0] + ".weight"))
        ptr = weights._alloc(n * k * 2)
        up.upload_into([m + ".weight" for m in modules], ptr)
        return ptr
    hosts = [qc.read(source, m, d[0], d[1]) if q else None
             for m, d, q in zip(modules, dims, quantized)]
    if not all(quantized):   # a group the config splits: BF16, dequantized exactly
        bits = [dequant_bits(h) if h is not None else np.asarray(source.read_bf16(m + ".weight"))
                for m, h in zip(modules, hosts)]
        return weights._own(up.upload_array(np.concatenate(bits)))
    if isinstance(hosts[0], HostQ4):
        h = concat_q4(hosts)
        ptrs = [weights._own(up.upload_bytes(a)) for a in (h.q, h.scales, h.zeros)]
        g = gr = NULL
        if h.gidx is not None:
            g, gr = weights._own(up.upload_bytes(h.gidx)), weights._own(up.upload_bytes(h.gidx_row))
        return Q4Linear(*ptrs, g, gr, n, k, h.scales.shape[1], h.group_size,
                        q4_bytes(h))
    h = concat_fp8(hosts)
    ptrs = [weights._own(up.upload_bytes(a)) for a in (h.q, h.scales, h.scale_row)]
    return Fp8Linear(*ptrs, n, k, h.scales.shape[1], h.block_k, fp8_bytes(h))


def q4_bytes(h: HostQ4) -> int:
    extra = 0 if h.gidx is None else h.gidx.nbytes + h.gidx_row.nbytes
    return h.q.nbytes + h.scales.nbytes + h.zeros.nbytes + extra


def fp8_bytes(h: HostFp8) -> int:
    return h.q.nbytes + h.scales.nbytes + h.scale_row.nbytes


# The fused groups DecoderWeights uploads (weights.py), by module suffix.
FUSED = (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("self_attn.o_proj",),
         ("mlp.gate_proj", "mlp.up_proj"), ("mlp.down_proj",))


def quantized_weight_bytes(meta) -> int:
    """Device bytes of a quantized decoder's weights: BF16 for everything but the linears
    the config quantizes (their packed data, scales and zeros as uploaded; act-order
    tables counted at their worst, one per part), fused groups as weights.py fuses them."""
    from ..formats.layout import expected_tensors
    qc = meta.quantization
    shapes = linear_shapes(meta)
    total = sum(2 * int(np.prod(s)) for name, s in expected_tensors(meta).items()
                if name.rsplit(".", 1)[0] not in shapes or not name.endswith(".weight"))
    groups = [[f"model.layers.{i}.{m}" for m in g] for i in range(meta.num_layers)
              for g in FUSED if f"model.layers.{i}.{g[0]}" in shapes]
    grouped = {m for g in groups for m in g}
    # the rest one by one: the output head, a MoE block's expert linears (the bytes of
    # experts fused gate|up are those of the parts)
    groups += [[m] for m in shapes if m not in grouped]
    for g in groups:
        dims = [shapes[m] for m in g]
        if not all(qc.converts(m) for m in g):
            total += sum(2 * n * k for n, k in dims)
            continue
        for n, k in dims:
            total += linear_device_bytes(qc, n, k)
    return total


def linear_device_bytes(qc, n: int, k: int) -> int:
    """Bytes one quantized [n, k] linear takes on the device (act-order tables excluded:
    act-order adds 4 (k + n) bytes a part)."""
    if qc.kind == "int4":
        g = qc.groups(k)
        return n * gemm_q.q4_row_bytes(k) + n * g * 3 + (4 * (k + n) if qc.desc_act else 0)
    rows = {"block": -(-n // qc.block[0]) if qc.block else 1, "channel": n,
            "tensor": 1}[qc.strategy]
    kb = -(-k // qc.block[1]) if qc.strategy == "block" else 1
    return n * gemm_q.fp8_row_bytes(k) + rows * kb * 4 + n * 4
