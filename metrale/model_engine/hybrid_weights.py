"""A hybrid linear-attention checkpoint's weights on the device (formats/hybrid_config.py has
the math, formats/hybrid_layout.py the tensors), rearranged at load for the kernels:

- gated DeltaNet: one input projection [proj_width, hidden] with rows q | k | v | z | b | a
  (qwen3_next's in_proj_qkvz / in_proj_ba are grouped per key head: [q k v z] and [b a] of
  each group, regrouped here; qwen3_5's four projections concatenated), zero rows padding
  proj_width to a multiple of 8 (16-byte rows for the conv's vector path); the conv weight
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
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..formats.hybrid_layout import hybrid_tensors
from ..formats.upload import WeightUploader
from ..gpu_runtime.types import NULL, DevicePtr
from ..ops.bf16 import bf16_to_f32
from .moe_weights import MoeLayerWeights, upload_moe_layer


@dataclass
class HybridLayer:
    kind: str                        # "linear_attention" | "full_attention"
    input_norm: DevicePtr            # [hidden], zero-centred (1 + w)
    post_norm: DevicePtr             # [hidden]
    # gated DeltaNet (NULL otherwise)
    in_proj: DevicePtr = NULL        # [proj_width, hidden]: q | k | v | z | b | a | pad
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
    """Columns of the fused DeltaNet input projection, padded to a multiple of 8."""
    return -(-g.proj_dim // 8) * 8


def rotary_permutation(head_dim: int, rotary_dim: int) -> np.ndarray:
    """src [head_dim]: new dim j of a head holds old dim src[j] (module docstring)."""
    D, R = int(head_dim), int(rotary_dim)
    rest = D // 2 - R // 2   # pass-through dims in each half
    return np.concatenate([np.arange(R // 2), np.arange(R, R + rest),
                           np.arange(R // 2, R), np.arange(R + rest, D)])


def hybrid_weight_bytes(meta) -> int:
    """Device bytes HybridWeights holds: every tensor as BF16, A_log / dt_bias as FP32, the
    DeltaNet projection's padding rows."""
    total = 0
    for name, shape in hybrid_tensors(meta).items():
        n = int(np.prod(shape))
        total += n * (4 if name.endswith(("A_log", "dt_bias")) else 2)
    g = meta.hybrid.gdn
    if g is not None:
        pad = proj_width(g) - g.proj_dim
        total += 2 * pad * meta.hidden_size * len(meta.hybrid.recurrent_layers)
    return total


class HybridWeights:
    """Uploads a hybrid checkpoint; `layers` is a HybridLayer per layer; `free()` returns
    every byte; `nbytes` is what the weights hold on the device."""

    def __init__(self, backend, source, meta, progress: bool = True) -> None:
        self.backend, self._owned = backend, []
        self.nbytes = hybrid_weight_bytes(meta)
        self.embed_bytes = 2 * meta.vocab_size * meta.hidden_size
        self._source, self._meta = source, meta
        try:
            with WeightUploader(backend, source, self.nbytes, desc=source.description,
                                progress=progress) as up:
                self._up = up
                self.embed_tokens = self._own(up.upload("model.embed_tokens.weight"))
                self.layers = [self._layer(i) for i in range(meta.num_layers)]
                self.norm = self._own(up.upload("model.norm.weight"))
                self.lm_head = self.embed_tokens if meta.tie_word_embeddings else \
                    self._own(up.upload("lm_head.weight"))
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
            L.gate_up = self._alloc(2 * m.intermediate_size * m.hidden_size * 2)
            up.upload_into([p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"], L.gate_up)
            L.down_proj = self._own(up.upload(p + "mlp.down_proj.weight"))
        return L

    def _gdn(self, L: HybridLayer, p: str, index: int) -> None:
        g, hid, src = self._meta.hybrid.gdn, self._meta.hidden_size, self._source
        if g.fused_projections:   # rows grouped per key head: [q k v z] and [b a]
            r = g.num_v_heads // g.num_k_heads
            qkvz = src.read_bf16(p + "in_proj_qkvz.weight").reshape(g.num_k_heads, -1, hid)
            cut = np.cumsum([g.k_head_dim, g.k_head_dim, r * g.v_head_dim])
            q, k, v, z = (a.reshape(-1, hid) for a in np.split(qkvz, cut, axis=1))
            ba = src.read_bf16(p + "in_proj_ba.weight").reshape(g.num_k_heads, 2 * r, hid)
            b, a = ba[:, :r].reshape(-1, hid), ba[:, r:].reshape(-1, hid)
            parts = [q, k, v, z, b, a]
        else:
            parts = [src.read_bf16(p + f"in_proj_{x}.weight") for x in ("qkv", "z", "b", "a")]
        pad = np.zeros((proj_width(g) - g.proj_dim, hid), np.uint16)
        L.in_proj = self._own(self._up.upload_array(np.concatenate(parts + [pad])))
        L.conv_w = self._own(self._up.upload(p + "conv1d.weight"))   # [C, 1, W] = [C, W]
        L.a_log, L.dt_bias = self._f32(p + "A_log"), self._f32(p + "dt_bias")
        L.gated_norm = self._own(self._up.upload(p + "norm.weight"))
        L.out_proj = self._own(self._up.upload(p + "out_proj.weight"))
        L.state_index = index

    def _attention(self, L: HybridLayer, p: str, index: int) -> None:
        m, src = self._meta, self._source
        H, KV, D, hid = m.num_heads, m.num_kv_heads, m.head_dim, m.hidden_size
        perm = rotary_permutation(D, m.hybrid.rotary_dim)
        qg = src.read_bf16(p + "q_proj.weight").reshape(H, 2, D, hid)   # [q_h | gate_h]
        q = qg[:, 0][:, perm].reshape(H * D, hid)
        k = src.read_bf16(p + "k_proj.weight").reshape(KV, D, hid)[:, perm].reshape(-1, hid)
        v = src.read_bf16(p + "v_proj.weight")
        L.qkv = self._own(self._up.upload_array(np.concatenate([q, k, v])))
        L.gate = self._own(self._up.upload_array(qg[:, 1].reshape(H * D, hid)))
        L.q_norm = self._own(self._up.upload_array(src.read_bf16(p + "q_norm.weight")[perm]))
        L.k_norm = self._own(self._up.upload_array(src.read_bf16(p + "k_norm.weight")[perm]))
        L.o_proj = self._own(self._up.upload(p + "o_proj.weight"))
        L.kv_index = index

    def _f32(self, name: str) -> DevicePtr:
        """A per-head parameter as float32: F32 / F16 checkpoint values exactly (F64 rounded
        once), BF16 widened."""
        src = self._source
        if src.tensor_dtype(name) in ("F32", "F16", "F64") and hasattr(src, "read_raw"):
            arr = np.asarray(src.read_raw(name), np.float32)
        else:
            arr = bf16_to_f32(np.asarray(src.read_bf16(name)))
        return self._own(self._up.upload_bytes(np.ascontiguousarray(arr, np.float32)))

    # ownership (moe_weights.upload_moe_layer allocates through these) -------------------
    def _alloc(self, nbytes: int) -> DevicePtr:
        return self._own(self.backend.alloc(nbytes))

    def _own(self, ptr: DevicePtr) -> DevicePtr:
        self._owned.append(ptr)
        return ptr

    def free(self) -> None:
        for p in self._owned:
            self.backend.free(p)
        self._owned.clear()
