"""Whisper's encoder and decoder as launch sequences over raw pointers.

Encoder (one window of F mel frames, T = (F - 1) // 2 + 1 positions), pre-norm blocks:
    x = gelu(conv2(gelu(conv1(mel)))) + positions[:T]        (conv1d, time-major rows)
    per layer: x += out_proj(attn(qkv(ln1(x))))                (dense_attention, no mask)
               x += fc2(gelu(fc1(ln2(x))))
    out = layer_norm(x)
The batch-invariant tensor-core GEMM (`gemm_tc`) for every linear, `add_bias` after each.

Decoder rows [start, start + n) of a token prefix against one encoded window:
    x = embed(ids) + dec_positions[start + i]
    per layer: q = q_proj(ln1(x)); k|v rows -> self KV buffer rows start.. (one GEMM)
               x += out_proj(causal dense_attention(q, KV[:start + n], q_offset=start))
               x += out_proj(dense_attention(xq_proj(lnx(x)), cross K|V of the window))
               x += fc2(gelu(fc1(ln2(x))))
    logits(last row) = layer_norm(x_last) @ lm_head^T  (FP32)
The decoder uses the batch-invariant GEMM for every linear and row-invariant kernels
elsewhere, so a row's values never depend on how many rows were run with it: a cached
decode step is bit-identical to recomputing the whole prefix.
"""
from __future__ import annotations

import numpy as np

from ..gpu_runtime.owned import OwnedBuffers
from ..gpu_runtime.types import DevicePtr
from ..ops import activation, dense_attention, elementwise, embedding, gemm_tc, rmsnorm
from ..ops.bf16 import f32_to_bf16
from ..ops.conv1d import conv1d

GELU_MODES = {"gelu": "none", "gelu_new": "tanh", "gelu_pytorch_tanh": "tanh",
              "gelu_fast": "tanh", "quick_gelu": "quick"}


class Workspace(OwnedBuffers):
    """Activation buffers, allocated once at load: encoder rows sized by the encoder's
    maximum window, decoder rows by max_target_positions."""

    def __init__(self, backend, w, n_mels: int, vocab: int) -> None:
        self.backend = backend
        self._owned: list[DevicePtr] = []
        d, Te, Td = w.d_model, w.max_source_positions, w.max_target_positions
        F = 2 * Te
        try:
            a = self._alloc
            self.mel = a(F * n_mels * 2)          # [F, n_mels] time-major
            self.conv1 = a(F * d * 2)             # [F, d]
            self.ex = a(Te * d * 2)               # [Te, d] encoder residual stream
            self.en = a(Te * d * 2)               # normed
            self.eqkv = a(Te * 3 * d * 2)         # [Te, 3d]
            self.eattn = a(Te * d * 2)
            self.ehid = a(Te * d * 2)
            self.effn = a(Te * w.encoder_ffn_dim * 2)
            self.enc_in = a(Te * d * 2)           # encoded states uploaded for cross K/V
            self.tok = a(Td * 4)
            self.pos = a(Td * 4)
            self.dx = a(Td * d * 2)
            self.dn = a(Td * d * 2)
            self.dq = a(Td * d * 2)
            self.dattn = a(Td * d * 2)
            self.dhid = a(Td * d * 2)
            self.dffn = a(Td * w.decoder_ffn_dim * 2)
            self.logits = a(vocab * 4)            # FP32 row of the last position
        except BaseException:
            self.free()
            raise


def _linear(b, s, fn, y, x, w, bias, m, n, k) -> None:
    fn(b, s, y, x, w, m, n, k)
    elementwise.add_bias(b, s, y, bias, m, n)


def run_encoder(model, stream: int, frames: int) -> int:
    """Mel rows already in ws.mel ([frames, n_mels] bf16); final states -> ws.en. Returns T."""
    b, ws, W, w = model.backend, model._ws, model._weights, model._w
    d, H, ffn, eps = w.d_model, w.encoder_attention_heads, w.encoder_ffn_dim, w.layer_norm_eps
    D = d // H
    conv1d(b, stream, ws.conv1, ws.mel, W.conv1, W.conv1_b, model._n_mels, d, frames, 3, 1, 1,
           True)
    T = (frames - 1) // 2 + 1
    conv1d(b, stream, ws.ex, ws.conv1, W.conv2, W.conv2_b, d, d, frames, 3, 2, 1, True)
    elementwise.add_inplace(b, stream, ws.ex, W.enc_positions, T * d)
    mm = gemm_tc.gemm_tc
    for L in W.enc_layers:
        rmsnorm.layernorm(b, stream, ws.en, ws.ex, L.ln1_w, L.ln1_b, T, d, eps)
        _linear(b, stream, mm, ws.eqkv, ws.en, L.qkv, L.qkv_b, T, 3 * d, d)
        dense_attention.dense_attention(b, stream, ws.eattn, ws.eqkv, ws.eqkv.offset(2 * d),
                                        ws.eqkv.offset(4 * d), T, T, H, H, D, 3 * d, 3 * d,
                                        D ** -0.5, False)
        _linear(b, stream, mm, ws.ehid, ws.eattn, L.o, L.o_b, T, d, d)
        elementwise.add_inplace(b, stream, ws.ex, ws.ehid, T * d)
        rmsnorm.layernorm(b, stream, ws.en, ws.ex, L.ln2_w, L.ln2_b, T, d, eps)
        _linear(b, stream, mm, ws.effn, ws.en, L.fc1, L.fc1_b, T, ffn, d)
        activation.gelu(b, stream, ws.effn, ws.effn, T * ffn, model._gelu)
        _linear(b, stream, mm, ws.ehid, ws.effn, L.fc2, L.fc2_b, T, d, ffn)
        elementwise.add_inplace(b, stream, ws.ex, ws.ehid, T * d)
    rmsnorm.layernorm(b, stream, ws.en, ws.ex, W.enc_ln_w, W.enc_ln_b, T, d, eps)
    return T


def cross_kv(model, stream: int, n_enc: int, out: DevicePtr) -> None:
    """Cross-attention K|V of every decoder layer from the states in ws.enc_in:
    out [layers, n_enc, 2d] bf16 (computed once per encoded window)."""
    b, ws, W, w = model.backend, model._ws, model._weights, model._w
    d = w.d_model
    for i, L in enumerate(W.dec_layers):
        dst = out.offset(i * n_enc * 2 * d * 2)
        _linear(b, stream, gemm_tc.gemm_tc, dst, ws.enc_in, L.xkv, L.xkv_b, n_enc, 2 * d, d)


def run_decoder(model, stream: int, start: int, n: int, entry) -> None:
    """Decoder rows [start, start + n) (ids/positions already in ws.tok / ws.pos); writes
    their K|V into entry.self_kv and the last row's FP32 logits into ws.logits."""
    b, ws, W, w = model.backend, model._ws, model._weights, model._w
    d, H, ffn, eps = w.d_model, w.decoder_attention_heads, w.decoder_ffn_dim, w.layer_norm_eps
    D, Td, V = d // H, w.max_target_positions, model._meta.vocab_size
    lin = gemm_tc.gemm_tc
    scale = D ** -0.5
    embedding.embedding(b, stream, ws.dx, W.embed_in, ws.tok, n, d, V)
    embedding.embedding(b, stream, ws.dhid, W.dec_positions, ws.pos, n, d, Td)
    elementwise.add_inplace(b, stream, ws.dx, ws.dhid, n * d)
    for i, L in enumerate(W.dec_layers):
        kv = entry.self_kv.offset(i * Td * 2 * d * 2)
        rmsnorm.layernorm(b, stream, ws.dn, ws.dx, L.ln1_w, L.ln1_b, n, d, eps)
        _linear(b, stream, lin, ws.dq, ws.dn, L.q, L.q_b, n, d, d)
        _linear(b, stream, lin, kv.offset(start * 2 * d * 2), ws.dn, L.kv, L.kv_b, n, 2 * d, d)
        dense_attention.dense_attention(b, stream, ws.dattn, ws.dq, kv, kv.offset(2 * d),
                                        n, start + n, H, H, D, d, 2 * d, scale, True, start)
        _linear(b, stream, lin, ws.dhid, ws.dattn, L.o, L.o_b, n, d, d)
        elementwise.add_inplace(b, stream, ws.dx, ws.dhid, n * d)

        xkv = entry.cross_kv.offset(i * entry.n_enc * 2 * d * 2)
        rmsnorm.layernorm(b, stream, ws.dn, ws.dx, L.lnx_w, L.lnx_b, n, d, eps)
        _linear(b, stream, lin, ws.dq, ws.dn, L.xq, L.xq_b, n, d, d)
        dense_attention.dense_attention(b, stream, ws.dattn, ws.dq, xkv, xkv.offset(2 * d),
                                        n, entry.n_enc, H, H, D, d, 2 * d, scale, False)
        _linear(b, stream, lin, ws.dhid, ws.dattn, L.xo, L.xo_b, n, d, d)
        elementwise.add_inplace(b, stream, ws.dx, ws.dhid, n * d)

        rmsnorm.layernorm(b, stream, ws.dn, ws.dx, L.ln2_w, L.ln2_b, n, d, eps)
        _linear(b, stream, lin, ws.dffn, ws.dn, L.fc1, L.fc1_b, n, ffn, d)
        activation.gelu(b, stream, ws.dffn, ws.dffn, n * ffn, model._gelu)
        _linear(b, stream, lin, ws.dhid, ws.dffn, L.fc2, L.fc2_b, n, d, ffn)
        elementwise.add_inplace(b, stream, ws.dx, ws.dhid, n * d)
    last = (n - 1) * d * 2
    rmsnorm.layernorm(b, stream, ws.dn, ws.dx.offset(last), W.dec_ln_w, W.dec_ln_b, 1, d, eps)
    gemm_tc.gemm_tc(b, stream, ws.logits, ws.dn, W.lm_head, 1, V, d, out_fp32=True)


def upload_rows(backend, stream: int, rows_f32: np.ndarray, dst: DevicePtr) -> None:
    """float32 host rows -> bf16 device buffer (the tensor API's input states)."""
    backend.copy_h2d(np.ascontiguousarray(f32_to_bf16(rows_f32)), dst)


__all__ = ["Workspace", "run_encoder", "run_decoder", "cross_kv", "upload_rows", "GELU_MODES"]
