"""Decoder-only weights on the device, fused for fewer launches.

Per layer: q/k/v projections concatenated into one `[(H + 2*KV) * D, hidden]` matrix (and
their biases into one vector), gate/up into one `[2 * intermediate, hidden]` matrix. HF key
names are read as they are in the checkpoint; every tensor's presence and shape is checked
before the first byte is uploaded, and a failed load frees everything it allocated.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..formats import check_tensors, expected_tensors
from ..formats.quant.checkpoint import check_quantized
from ..formats.quant.mxfp4_check import check_mxfp4
from ..formats.upload import WeightUploader
from ..gpu_runtime.owned import OwnedBuffers
from ..gpu_runtime.types import NULL, DevicePtr
from .gguf_weights import EMBED, held_bytes, packed_runs, upload_packed
from .linear import upload_linear
from .memory_plan import held_bytes_of, weight_bytes
from .moe_weights import MoeLayerWeights, upload_moe_layer


@dataclass
class LayerWeights:
    # the linears (qkv, o_proj, gate_up, down_proj) are BF16 DevicePtrs or, in a quantized
    # checkpoint, linear.py's Q4Linear / Fp8Linear, in a GGUF kept packed its GgufLinear
    # (run through linear.run_linear)
    input_layernorm: DevicePtr        # [hidden]
    qkv: DevicePtr                    # [(H + 2KV) * D, hidden]
    qkv_bias: DevicePtr               # [(H + 2KV) * D] or NULL
    q_norm: DevicePtr                 # [D] or NULL (qwen3)
    k_norm: DevicePtr                 # [D] or NULL
    o_proj: DevicePtr                 # [hidden, H * D]
    o_bias: DevicePtr                 # [hidden] or NULL (llama / qwen3 attention_bias)
    post_attention_layernorm: DevicePtr  # [hidden]
    gate_up: DevicePtr                # [2 * intermediate, hidden]
    gate_up_bias: DevicePtr           # [2 * intermediate] or NULL (llama mlp_bias)
    down_proj: DevicePtr              # [hidden, intermediate]
    down_bias: DevicePtr              # [hidden] or NULL
    moe: MoeLayerWeights | None = None  # a mixture-of-experts block instead of the MLP
    # Gemma's MLP norms (the attention's output norm is then post_attention_layernorm)
    pre_feedforward_layernorm: DevicePtr = NULL    # [hidden] or NULL
    post_feedforward_layernorm: DevicePtr = NULL   # [hidden] or NULL
    sinks: DevicePtr = NULL           # fp32 [num_heads] or NULL (gpt-oss attention sinks)

    @property
    def pre_mlp_norm(self) -> DevicePtr:
        """The norm the MLP reads: Gemma's pre_feedforward_layernorm, else (Llama's block)
        post_attention_layernorm."""
        if not self.pre_feedforward_layernorm.is_null():
            return self.pre_feedforward_layernorm
        return self.post_attention_layernorm


def check_checkpoint(source, meta) -> dict[str, tuple[int, ...]]:
    """Check every tensor of a decoder checkpoint (presence, shape, dtype) against its
    metadata; returns the float tensors (name -> shape) uploaded as BF16. FormatError
    naming the file and the tensor."""
    if meta.moe is not None and meta.moe.oss is not None and meta.moe.oss.mxfp4:
        expected = expected_tensors(meta, source.tensor_names())
        check_mxfp4(source, expected)   # gpt-oss's packed experts
        return expected
    if meta.quantization is None:
        expected = expected_tensors(meta, source.tensor_names())
        check_tensors(source, expected)
        return expected
    return check_quantized(source, meta)   # quantized linears: formats/quant/


class DecoderWeights(OwnedBuffers):
    """Uploads a decoder checkpoint (MoE blocks: moe_weights.py); `free()` returns every
    byte. `packed`: a GGUF source's block-type tensors stay at their stored bytes
    (gguf_weights.py); `nbytes` is what the weights hold on the device, `embed_bytes` the
    embedding table's part of it."""

    def __init__(self, backend, source, meta, progress: bool = True,
                 packed: bool = False) -> None:
        self.backend = backend
        self._owned: list[DevicePtr] = []
        expected = check_checkpoint(source, meta)
        self.nbytes = (sum(held_bytes_of(n, s) for n, s in expected.items())
                       if meta.quantization is None else weight_bytes(meta))
        self.embed_bytes = 2 * meta.vocab_size * meta.hidden_size
        if packed:
            self.nbytes, self.embed_bytes = held_bytes(meta, source)

        def lin(*modules):
            names = [m + ".weight" for m in modules]
            if packed and packed_runs(source, names) is not None:
                return upload_packed(self, up, source, names)
            return upload_linear(self, up, source, meta, list(modules))
        H, KV, D, hid = meta.num_heads, meta.num_kv_heads, meta.head_dim, meta.hidden_size
        qkv_rows = (H + 2 * KV) * D
        try:
            with WeightUploader(backend, source, self.nbytes, desc=source.description,
                                progress=progress) as up:
                self.embed_tokens = (upload_packed(self, up, source, [EMBED])
                                     if packed and packed_runs(source, [EMBED]) else
                                     self._own(up.upload(EMBED)))
                self.layers: list[LayerWeights] = []
                var = meta.variant
                for i in range(meta.num_layers):
                    p = f"model.layers.{i}."
                    att = p + "self_attn."
                    qkv = (lin(att + "qkv_proj") if var.fused_projections else
                           lin(*[att + f"{x}_proj" for x in "qkv"]))
                    bias = NULL
                    if meta.attention_bias:
                        bias = self._alloc(qkv_rows * 2)
                        up.upload_into([att + f"{x}_proj.bias" for x in "qkv"], bias)
                    moe = upload_moe_layer(self, up, meta, i)   # None: a dense MLP
                    gate_up = NULL if moe is not None else (
                        lin(p + "mlp.gate_up_proj") if var.fused_projections else
                        lin(p + "mlp.gate_proj", p + "mlp.up_proj"))
                    gate_up_bias = down_bias = NULL
                    if meta.mlp_bias:
                        gate_up_bias = self._alloc(2 * meta.intermediate_size * 2)
                        up.upload_into([p + "mlp.gate_proj.bias", p + "mlp.up_proj.bias"],
                                       gate_up_bias)
                        down_bias = self._own(up.upload(p + "mlp.down_proj.bias"))
                    self.layers.append(LayerWeights(
                        input_layernorm=self._own(up.upload(p + "input_layernorm.weight")),
                        qkv=qkv,
                        qkv_bias=bias,
                        q_norm=self._own(up.upload(att + "q_norm.weight")) if meta.qk_norm else NULL,
                        k_norm=self._own(up.upload(att + "k_norm.weight")) if meta.qk_norm else NULL,
                        o_proj=lin(att + "o_proj"),
                        o_bias=(self._own(up.upload(att + "o_proj.bias")) if meta.o_proj_bias
                                else NULL),
                        post_attention_layernorm=self._own(
                            up.upload(p + "post_attention_layernorm.weight")),
                        gate_up=gate_up, gate_up_bias=gate_up_bias,
                        down_proj=lin(p + "mlp.down_proj") if moe is None else NULL,
                        down_bias=down_bias, moe=moe,
                        **self._variant_tensors(up, meta, p),
                    ))
                self.norm = self._own(up.upload("model.norm.weight"))
                # tied: the embedding, unless the checkpoint stores a head (layout.py)
                self.lm_head = (lin("lm_head") if "lm_head.weight" in expected_tensors(
                    meta, source.tensor_names()) else self.embed_tokens)
        except BaseException:
            self.free()
            raise

    def _variant_tensors(self, up, meta, p: str) -> dict:
        """The LayerWeights fields of a family's extra tensors (Gemma's MLP norms, gpt-oss's
        sinks, uploaded as FP32: the attention kernels read them so)."""
        var, out = meta.variant, {}
        if var.sandwich_norms:
            for name in ("pre_feedforward_layernorm", "post_feedforward_layernorm"):
                out[name] = self._own(up.upload(p + name + ".weight"))
        if var.attention_sinks:
            bits = up.source.read_bf16(p + "self_attn.sinks")
            f32 = np.ascontiguousarray(bits.astype(np.uint32) << 16).view(np.float32)
            out["sinks"] = self._alloc(f32.nbytes)
            self.backend.copy_h2d(f32, out["sinks"])
        return out
