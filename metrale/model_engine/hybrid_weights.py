"""A hybrid linear-attention checkpoint's weights on the device (formats/hybrid_config.py has
the math, formats/hybrid_layout.py the tensors), rearranged at load for the kernels:

- gated DeltaNet: the input projection as two linears, [conv_dim + value_dim, hidden] with
  rows q | k | v | z and [2 * num_v_heads, hidden] with rows b | a (qwen3_next's in_proj_qkvz /
  in_proj_ba are grouped per key head: [q k v z] and [b a] of each group, regrouped here;
  qwen3_5's four projections concatenated; b and a apart because FP8 checkpoints leave
  them BF16 while q|k|v|z are FP8); the conv weight
  [conv_dim, W] (HF's [conv_dim, 1, W]); A_log and dt_bias as FP32 (F32 checkpoint values
  kept exactly); the gated norm's weight [v_head_dim]; out_proj.
- gated attention: q_proj's rows are [q_h | gate_h] per head; q | k | v go to one matrix and
  the gates to another. Partial rotary: the rope kernel rotates pairs (j, j + D/2) of a head;
  the rows of q, k and the q/k norm weights are permuted per head (`rotary_permutation`) so
  the rotary dims' pairs (j, j + R/2) land on pairs (j, j + D/2) with j < R/2 and the pass-
  through dims on pairs whose table row is cos 1, sin 0 (model_engine/hybrid.py builds it).
  q . k is a sum over the same permuted dims of both, so attention is unchanged.
- norms, MLPs (dense gate|up fused, or moe_weights.py's sparse block), embedding, head as for
  the dense decoders.
Every linear is uploaded from (module, rows) parts (`_linear`): BF16, or in an FP8 checkpoint
(formats/hybrid_quant.py) an Fp8Linear kept at its bytes when every part is quantized (rows
taken with their scale rows: scale_row maps each row to its block), else BF16 with the
quantized parts dequantized exactly (linear.py's rule for a split group).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..formats.hybrid_layout import hybrid_tensors
from ..formats.hybrid_quant import hybrid_linear_shapes
from ..formats.quant.fp8 import HostFp8, concat_fp8
from ..formats.quant.layout import dequant_bits
from ..formats.upload import WeightUploader
from ..gpu_runtime.owned import OwnedBuffers
from ..gpu_runtime.types import NULL, DevicePtr
from ..ops.bf16 import bf16_to_f32
from ..ops.gemm_q import fp8_row_bytes
from .linear import Fp8Linear, fp8_bytes, linear_device_bytes
from .moe_weights import MoeLayerWeights, upload_moe_layer


@dataclass
class HybridLayer:
    kind: str                        # "linear_attention" | "full_attention"
    input_norm: DevicePtr            # [hidden], zero-centred (1 + w)
    post_norm: DevicePtr             # [hidden]
    # gated DeltaNet (NULL otherwise)
    in_proj: DevicePtr = NULL        # [proj_width, hidden]: q | k | v | z
    in_proj_ab: DevicePtr = NULL     # [2 * num_v_heads, hidden]: b | a
    conv_w: DevicePtr = NULL         # [conv_dim, W]
    a_log: DevicePtr = NULL          # float32 [num_v_heads]
    dt_bias: DevicePtr = NULL        # float32 [num_v_heads]
    gated_norm: DevicePtr = NULL     # [v_head_dim]
    out_proj: DevicePtr = NULL       # [hidden, value_dim]
    state_index: int = -1            # this layer's index in the state arena
    # gated attention (NULL otherwise)
    qkv: DevicePtr = NULL            # [(H + 2KV) * D, hidden], q and k rows permuted
    gate: DevicePtr = NULL           # [H * D, hidden]: the output gate's rows
    q_norm: DevicePtr = NULL         # [D], permuted
    k_norm: DevicePtr = NULL
    o_proj: DevicePtr = NULL         # [hidden, H * D]
    kv_index: int = -1               # this layer's index in the KV arena
    # MLP
    gate_up: DevicePtr = NULL        # [2 * intermediate, hidden]
    down_proj: DevicePtr = NULL
    moe: MoeLayerWeights | None = None


def proj_width(g) -> int:
    """Columns of the DeltaNet input projection q | k | v | z (a multiple of 16)."""
    return g.conv_dim + g.value_dim


def rotary_permutation(head_dim: int, rotary_dim: int) -> np.ndarray:
    """src [head_dim]: new dim j of a head holds old dim src[j] (module docstring)."""
    D, R = int(head_dim), int(rotary_dim)
    rest = D // 2 - R // 2   # pass-through dims in each half
    return np.concatenate([np.arange(R // 2), np.arange(R, R + rest),
                           np.arange(R // 2, R), np.arange(R + rest, D)])


def hybrid_weight_bytes(meta) -> int:
    """Device bytes HybridWeights holds: BF16 tensors, A_log / dt_bias as FP32, an FP8
    checkpoint's quantized linears at their device bytes (the estimate of the memory plan:
    the loaded weights count what they uploaded, `HybridWeights.nbytes`)."""
    qc, total = meta.quantization, 0
    shapes = hybrid_linear_shapes(meta) if qc is not None else {}
    for name, shape in hybrid_tensors(meta).items():
        module = name[:-len(".weight")]
        if module in shapes and qc.converts(module):
            n, k = shapes[module]
            total += linear_device_bytes(qc, n, k)
            if module.endswith("self_attn.q_proj"):   # its scale grid goes whole with the
                # q rows (qkv) and again with the gate rows (gate): `take_rows`
                total += linear_device_bytes(qc, n, k) - n * (fp8_row_bytes(k) + 4)
            continue
        total += int(np.prod(shape)) * (4 if name.endswith(("A_log", "dt_bias")) else 2)
    return total


def take_rows(h: HostFp8, rows: np.ndarray) -> HostFp8:
    """Rows `rows` of an FP8 linear, each with its scale row (the scales stay whole)."""
    return HostFp8(h.q[rows], h.scales, h.scale_row[rows], h.k, h.block_k)


class HybridWeights(OwnedBuffers):
    """Uploads a hybrid checkpoint; `layers` is a HybridLayer per layer; `free()` returns
    every byte; `nbytes` is what the weights hold on the device."""

    def __init__(self, backend, source, meta, progress: bool = True) -> None:
        self.backend, self._owned = backend, []
        self.nbytes = hybrid_weight_bytes(meta)
        self.embed_bytes = 2 * meta.vocab_size * meta.hidden_size
        self._source, self._meta = source, meta
        self._shapes = hybrid_linear_shapes(meta, source.tensor_names())
        try:
            with WeightUploader(backend, source, self.nbytes, desc=source.description,
                                progress=progress) as up:
                self._up = up
                self.embed_tokens = self._own(up.upload("model.embed_tokens.weight"))
                self.layers = [self._layer(i) for i in range(meta.num_layers)]
                self.norm = self._own(up.upload("model.norm.weight"))
                self.lm_head = self.embed_tokens if meta.tie_word_embeddings else \
                    self._linear([("lm_head", None)])
            self.nbytes = up.bytes_uploaded
        except BaseException:
            self.free()
            raise
        finally:
            self._up = None

    # per layer --------------------------------------------------------------------------
    def _layer(self, i: int) -> HybridLayer:
        m, up, p = self._meta, self._up, f"model.layers.{i}."
        hy = m.hybrid
        L = HybridLayer(kind=hy.layer_types[i],
                        input_norm=self._own(up.upload(p + "input_layernorm.weight")),
                        post_norm=self._own(up.upload(p + "post_attention_layernorm.weight")))
        if L.kind == "linear_attention":
            self._gdn(L, p + "linear_attn.", hy.recurrent_layers.index(i))
        else:
            self._attention(L, p + "self_attn.", hy.attention_layers.index(i))
        L.moe = upload_moe_layer(self, up, m, i)
        if L.moe is None:
            L.gate_up = self._linear([(p + "mlp.gate_proj", None), (p + "mlp.up_proj", None)])
            L.down_proj = self._linear([(p + "mlp.down_proj", None)])
        return L

    def _gdn(self, L: HybridLayer, p: str, index: int) -> None:
        g = self._meta.hybrid.gdn
        if g.fused_projections:   # rows grouped per key head: [q k v z] and [b a]
            r = g.num_v_heads // g.num_k_heads
            width, vz = 2 * g.k_head_dim + 2 * r * g.v_head_dim, r * g.v_head_dim
            base = np.arange(g.num_k_heads)[:, None] * width

            def rows(lo, count):
                return (base + lo + np.arange(count)[None]).reshape(-1)
            dk = g.k_head_dim
            qkvz = np.concatenate([rows(0, dk), rows(dk, dk), rows(2 * dk, vz),
                                   rows(2 * dk + vz, vz)])
            ba = (np.arange(g.num_k_heads)[:, None] * 2 * r + np.arange(2 * r)[None])
            L.in_proj = self._linear([(p + "in_proj_qkvz", qkvz)])
            L.in_proj_ab = self._linear([(p + "in_proj_ba", np.concatenate(
                [ba[:, :r].reshape(-1), ba[:, r:].reshape(-1)]))])
        else:
            L.in_proj = self._linear([(p + "in_proj_qkv", None), (p + "in_proj_z", None)])
            L.in_proj_ab = self._linear([(p + "in_proj_b", None), (p + "in_proj_a", None)])
        L.conv_w = self._own(self._up.upload(p + "conv1d.weight"))   # [C, 1, W] = [C, W]
        L.a_log, L.dt_bias = self._f32(p + "A_log"), self._f32(p + "dt_bias")
        L.gated_norm = self._own(self._up.upload(p + "norm.weight"))
        L.out_proj = self._linear([(p + "out_proj", None)])
        L.state_index = index

    def _attention(self, L: HybridLayer, p: str, index: int) -> None:
        m, src = self._meta, self._source
        H, KV, D = m.num_heads, m.num_kv_heads, m.head_dim
        perm = rotary_permutation(D, m.hybrid.rotary_dim)
        heads = np.arange(H)[:, None] * 2 * D          # q_proj: [q_h | gate_h] per head
        q_rows, gate_rows = (heads + perm[None]).reshape(-1), (heads + D + np.arange(D)).reshape(-1)
        k_rows = (np.arange(KV)[:, None] * D + perm[None]).reshape(-1)
        L.qkv = self._linear([(p + "q_proj", q_rows), (p + "k_proj", k_rows), (p + "v_proj", None)])
        L.gate = self._linear([(p + "q_proj", gate_rows)])
        L.q_norm = self._own(self._up.upload_array(src.read_bf16(p + "q_norm.weight")[perm]))
        L.k_norm = self._own(self._up.upload_array(src.read_bf16(p + "k_norm.weight")[perm]))
        L.o_proj = self._linear([(p + "o_proj", None)])
        L.kv_index = index

    def _linear(self, parts):
        """The linear of `parts` [(module, rows or None)] stacked along n: an Fp8Linear when
        every part is quantized, else a BF16 DevicePtr (module docstring)."""
        qc, src, up = self._meta.quantization, self._source, self._up
        conv = [qc is not None and qc.converts(mod) for mod, _ in parts]
        if all(conv):
            hosts = []
            for mod, rows in parts:
                h = qc.read(src, mod, *self._shapes[mod])
                hosts.append(h if rows is None else take_rows(h, rows))
            h = concat_fp8(hosts)
            ptrs = [self._own(up.upload_bytes(a)) for a in (h.q, h.scales, h.scale_row)]
            return Fp8Linear(*ptrs, h.n, h.k, h.scales.shape[1], h.block_k, fp8_bytes(h))
        bits = []
        for (mod, rows), c in zip(parts, conv):
            w = dequant_bits(qc.read(src, mod, *self._shapes[mod])) if c else \
                np.asarray(src.read_bf16(mod + ".weight"))
            bits.append(w if rows is None else w[rows])
        return self._own(up.upload_array(np.concatenate(bits)))

    def _f32(self, name: str) -> DevicePtr:
        """A per-head parameter as float32: F32 / F16 checkpoint values exactly (F64 rounded
        once), BF16 widened."""
        src = self._source
        if src.tensor_dtype(name) in ("F32", "F16", "F64") and hasattr(src, "read_raw"):
            arr = np.asarray(src.read_raw(name), np.float32)
        else:
            arr = bf16_to_f32(np.asarray(src.read_bf16(name)))
        return self._own(self._up.upload_bytes(np.ascontiguousarray(arr, np.float32)))
