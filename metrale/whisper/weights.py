"""Whisper weights on the device, fused for fewer launches.

Encoder layers: q/k/v concatenated into one `[3d, d]` matrix with one `[3d]` bias (Whisper's
k_proj has no bias: zeros there). Decoder layers: q alone (`[d, d]`), k/v fused (`[2d, d]`,
bias `[0 | v_bias]`) so their rows land straight in a `[n, 2d]` KV buffer; the same for the
cross-attention (encoder_attn). Conv stem weights are permuted to the conv1d kernel's
tap-major `[c_out, k, c_in]`. `proj_out` is the decoder embedding unless the checkpoint
unties it. Every tensor's presence and shape is checked before the first byte is uploaded;
a failed load frees everything it allocated.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..formats import check_tensors, expected_tensors
from ..formats.upload import WeightUploader
from ..gpu_runtime.owned import OwnedBuffers
from ..gpu_runtime.types import DevicePtr
from ..ops.conv1d import hf_weight_to_tap_major


@dataclass
class EncoderLayer:
    ln1_w: DevicePtr
    ln1_b: DevicePtr
    qkv: DevicePtr       # [3d, d]
    qkv_b: DevicePtr     # [3d] (k part zero)
    o: DevicePtr         # [d, d]
    o_b: DevicePtr
    ln2_w: DevicePtr
    ln2_b: DevicePtr
    fc1: DevicePtr       # [ffn, d]
    fc1_b: DevicePtr
    fc2: DevicePtr       # [d, ffn]
    fc2_b: DevicePtr


@dataclass
class DecoderLayer:
    ln1_w: DevicePtr
    ln1_b: DevicePtr
    q: DevicePtr         # self-attention [d, d]
    q_b: DevicePtr
    kv: DevicePtr        # [2d, d]
    kv_b: DevicePtr      # [2d] (k part zero)
    o: DevicePtr
    o_b: DevicePtr
    lnx_w: DevicePtr     # encoder_attn_layer_norm
    lnx_b: DevicePtr
    xq: DevicePtr        # cross-attention q [d, d]
    xq_b: DevicePtr
    xkv: DevicePtr       # cross-attention k|v [2d, d] (applied to the encoder states)
    xkv_b: DevicePtr
    xo: DevicePtr
    xo_b: DevicePtr
    ln2_w: DevicePtr
    ln2_b: DevicePtr
    fc1: DevicePtr
    fc1_b: DevicePtr
    fc2: DevicePtr
    fc2_b: DevicePtr


class WhisperWeights(OwnedBuffers):
    """Uploads a WhisperForConditionalGeneration checkpoint; `free()` returns every byte."""

    def __init__(self, backend, source, meta, progress: bool = True) -> None:
        self.backend = backend
        self._owned: list[DevicePtr] = []
        self._source = source
        expected = expected_tensors(meta, source.tensor_names())
        check_tensors(source, expected)
        w = meta.whisper
        d = w.d_model
        self.n_mels = int(source.tensor_shape("model.encoder.conv1.weight")[1])
        nbytes = sum(2 * math.prod(s) for s in expected.values())
        try:
            with WeightUploader(backend, source, nbytes, desc=source.description,
                                progress=progress) as up:
                self._up = up
                self.conv1 = self._array(hf_weight_to_tap_major(
                    source.read_bf16("model.encoder.conv1.weight")))
                self.conv1_b = self._tensor("model.encoder.conv1.bias")
                self.conv2 = self._array(hf_weight_to_tap_major(
                    source.read_bf16("model.encoder.conv2.weight")))
                self.conv2_b = self._tensor("model.encoder.conv2.bias")
                self.enc_positions = self._tensor("model.encoder.embed_positions.weight")
                self.enc_layers = [self._enc_layer(f"model.encoder.layers.{i}.", d)
                                   for i in range(w.encoder_layers)]
                self.enc_ln_w = self._tensor("model.encoder.layer_norm.weight")
                self.enc_ln_b = self._tensor("model.encoder.layer_norm.bias")
                self.embed_tokens = self._tensor("model.decoder.embed_tokens.weight")
                # scale_embedding is not applied, as in transformers: WhisperDecoder sets
                # embed_scale = sqrt(d_model) but its forward never multiplies by it
                self.embed_in = self.embed_tokens
                self.dec_positions = self._tensor("model.decoder.embed_positions.weight")
                self.dec_layers = [self._dec_layer(f"model.decoder.layers.{i}.", d)
                                   for i in range(w.decoder_layers)]
                self.dec_ln_w = self._tensor("model.decoder.layer_norm.weight")
                self.dec_ln_b = self._tensor("model.decoder.layer_norm.bias")
                # tied: the embedding, unless the checkpoint stores a head (layout.py)
                self.lm_head = (self._tensor("proj_out.weight") if "proj_out.weight" in expected
                                else self.embed_tokens)
                self._up = None
        except BaseException:
            self.free()
            raise

    # ------------------------------------------------------------------ layers
    def _enc_layer(self, p: str, d: int) -> EncoderLayer:
        a = p + "self_attn."
        return EncoderLayer(
            ln1_w=self._tensor(p + "self_attn_layer_norm.weight"),
            ln1_b=self._tensor(p + "self_attn_layer_norm.bias"),
            qkv=self._fused([a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"]),
            qkv_b=self._bias([a + "q_proj.bias", None, a + "v_proj.bias"], d),
            o=self._tensor(a + "out_proj.weight"), o_b=self._tensor(a + "out_proj.bias"),
            ln2_w=self._tensor(p + "final_layer_norm.weight"),
            ln2_b=self._tensor(p + "final_layer_norm.bias"),
            fc1=self._tensor(p + "fc1.weight"), fc1_b=self._tensor(p + "fc1.bias"),
            fc2=self._tensor(p + "fc2.weight"), fc2_b=self._tensor(p + "fc2.bias"))

    def _dec_layer(self, p: str, d: int) -> DecoderLayer:
        a, x = p + "self_attn.", p + "encoder_attn."
        return DecoderLayer(
            ln1_w=self._tensor(p + "self_attn_layer_norm.weight"),
            ln1_b=self._tensor(p + "self_attn_layer_norm.bias"),
            q=self._tensor(a + "q_proj.weight"), q_b=self._tensor(a + "q_proj.bias"),
            kv=self._fused([a + "k_proj.weight", a + "v_proj.weight"]),
            kv_b=self._bias([None, a + "v_proj.bias"], d),
            o=self._tensor(a + "out_proj.weight"), o_b=self._tensor(a + "out_proj.bias"),
            lnx_w=self._tensor(p + "encoder_attn_layer_norm.weight"),
            lnx_b=self._tensor(p + "encoder_attn_layer_norm.bias"),
            xq=self._tensor(x + "q_proj.weight"), xq_b=self._tensor(x + "q_proj.bias"),
            xkv=self._fused([x + "k_proj.weight", x + "v_proj.weight"]),
            xkv_b=self._bias([None, x + "v_proj.bias"], d),
            xo=self._tensor(x + "out_proj.weight"), xo_b=self._tensor(x + "out_proj.bias"),
            ln2_w=self._tensor(p + "final_layer_norm.weight"),
            ln2_b=self._tensor(p + "final_layer_norm.bias"),
            fc1=self._tensor(p + "fc1.weight"), fc1_b=self._tensor(p + "fc1.bias"),
            fc2=self._tensor(p + "fc2.weight"), fc2_b=self._tensor(p + "fc2.bias"))

    # ------------------------------------------------------------------ helpers
    def _tensor(self, name: str) -> DevicePtr:
        return self._own(self._up.upload(name))

    def _array(self, bits: np.ndarray) -> DevicePtr:
        return self._own(self._up.upload_array(np.ascontiguousarray(bits, np.uint16)))

    def _fused(self, names: list[str]) -> DevicePtr:
        rows = sum(int(self._source.tensor_shape(n)[0]) for n in names)
        cols = int(self._source.tensor_shape(names[0])[1])
        ptr = self._own(self.backend.alloc(rows * cols * 2))
        self._up.upload_into(names, ptr)
        return ptr

    def _bias(self, names: list, d: int) -> DevicePtr:
        """Concatenated biases; None is a [d] block of zeros (a projection without bias)."""
        parts = [np.zeros(d, np.uint16) if n is None else self._source.read_bf16(n)
                 for n in names]
        return self._array(np.concatenate(parts))
