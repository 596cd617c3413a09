"""Nemotron-H on the device (formats/nemotron_config.py has the math): its weights and its
decoder stack, run by HybridModel like the Qwen hybrids' (hybrid_layers.py).

    residual = embed(ids)
    per layer:  x = rmsnorm(residual)                 (bf16(x * inv * w), one rounding;
                                                       layer 0: no add)
                mamba:          proj = x @ in_proj^T  -> z | x B C | dt (| zero padding)
                                xBC = silu(conv1d(x B C) + bias), with its state
                                y = ssd(x, B, C, dt) + D x, with its FP32 state
                                y = rmsnorm_groups(y * silu(z)) * w; h = y @ out_proj^T
                full_attention: q|k|v = x @ Wqkv^T; k, v to the cache (no rotary);
                                h = attention(q, cache) @ Wo^T
                mlp:            h = relu(x @ Wup^T)^2 @ Wdown^T
                residual += h                          (at the next layer's norm)
    out = norm_f(residual += h)
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..formats.upload import WeightUploader
from ..gpu_runtime.owned import OwnedBuffers
from ..gpu_runtime.types import NULL, DevicePtr
from ..ops import causal_conv1d, gated_norm, kv_cache, mamba2_ssd
from ..ops.bf16 import bf16_to_f32
from .linear import run_embedding, run_linear
from .linear_attn import run_recurrent
from .paged_attention import paged_attention

P = "backbone.layers."


@dataclass
class NemotronLayer:
    kind: str                      # "mamba" | "full_attention" | "mlp"
    norm: DevicePtr                # [hidden]
    in_proj: DevicePtr = NULL      # [proj_width, hidden]: z | x B C | dt | pad
    conv_w: DevicePtr = NULL       # [conv_dim, W]
    conv_b: DevicePtr = NULL       # [conv_dim] or NULL
    a_log: DevicePtr = NULL        # float32 [heads]
    dt_bias: DevicePtr = NULL      # float32 [heads]
    d: DevicePtr = NULL            # float32 [heads]
    gated_norm: DevicePtr = NULL   # [inner]
    out_proj: DevicePtr = NULL     # [hidden, inner]
    state_index: int = -1
    qkv: DevicePtr = NULL          # [(H + 2KV) * D, hidden]
    o_proj: DevicePtr = NULL
    kv_index: int = -1
    up: DevicePtr = NULL           # [intermediate, hidden]
    down: DevicePtr = NULL         # [hidden, intermediate]


def mamba_proj_width(mb) -> int:
    """Columns of the padded Mamba2 input projection (a multiple of 8: 16-byte rows)."""
    return -(-mb.proj_dim // 8) * 8


class NemotronWeights(OwnedBuffers):
    """Uploads a Nemotron-H checkpoint (`free()` returns every byte)."""

    def __init__(self, backend, source, meta, nbytes: int, progress: bool = True) -> None:
        self.backend, self._owned, self._source, self._meta = backend, [], source, meta
        self.nbytes, self.embed_bytes = nbytes, 2 * meta.vocab_size * meta.hidden_size
        try:
            with WeightUploader(backend, source, nbytes, desc=source.description,
                                progress=progress) as up:
                self._up = up
                self.embed_tokens = self._own(up.upload("backbone.embeddings.weight"))
                self.layers = [self._layer(i) for i in range(meta.num_layers)]
                self.norm = self._own(up.upload("backbone.norm_f.weight"))
                self.lm_head = self.embed_tokens if meta.tie_word_embeddings else \
                    self._own(up.upload("lm_head.weight"))
        except BaseException:
            self.free()
            raise
        finally:
            self._up = None

    def _layer(self, i: int) -> NemotronLayer:
        m, up, x = self._meta, self._up, f"{P}{i}.mixer."
        hy = m.hybrid
        L = NemotronLayer(hy.layer_types[i], self._own(up.upload(f"{P}{i}.norm.weight")))
        if L.kind == "mamba":
            mb = hy.mamba
            w = np.asarray(self._source.read_bf16(x + "in_proj.weight"))
            pad = np.zeros((mamba_proj_width(mb) - mb.proj_dim, m.hidden_size), np.uint16)
            L.in_proj = self._own(up.upload_array(np.concatenate([w, pad])))
            L.conv_w = self._own(up.upload(x + "conv1d.weight"))   # [C, 1, W] = [C, W]
            L.conv_b = self._own(up.upload(x + "conv1d.bias")) if mb.conv_bias else NULL
            L.a_log, L.dt_bias, L.d = (self._f32(x + k) for k in ("A_log", "dt_bias", "D"))
            L.gated_norm = self._own(up.upload(x + "norm.weight"))
            L.out_proj = self._own(up.upload(x + "out_proj.weight"))
            L.state_index = hy.recurrent_layers.index(i)
        elif L.kind == "full_attention":
            rows = (m.num_heads + 2 * m.num_kv_heads) * m.head_dim
            L.qkv = self._own(self.backend.alloc(rows * m.hidden_size * 2))
            up.upload_into([x + f"{p}_proj.weight" for p in "qkv"], L.qkv)
            L.o_proj = self._own(up.upload(x + "o_proj.weight"))
            L.kv_index = hy.attention_layers.index(i)
        else:
            L.up = self._own(up.upload(x + "up_proj.weight"))
            L.down = self._own(up.upload(x + "down_proj.weight"))
        return L

    def _f32(self, name: str) -> DevicePtr:
        """A per-head parameter as float32 (F32 / F16 values exactly, BF16 widened)."""
        src = self._source
        if src.tensor_dtype(name) in ("F32", "F16", "F64") and hasattr(src, "read_raw"):
            arr = np.asarray(src.read_raw(name), np.float32)
        else:
            arr = bf16_to_f32(np.asarray(src.read_bf16(name)))
        return self._own(self._up.upload_bytes(np.ascontiguousarray(arr, np.float32)))


def nemotron_weight_bytes(meta) -> int:
    """Device bytes NemotronWeights holds: BF16 tensors, FP32 A_log / dt_bias / D, the
    Mamba2 projection's padding rows."""
    from ..formats.hybrid_layout import nemotron_tensors
    total = 0
    for name, shape in nemotron_tensors(meta).items():
        total += int(np.prod(shape)) * (4 if name.endswith(("A_log", "dt_bias", ".D")) else 2)
    mb = meta.hybrid.mamba
    pad = mamba_proj_width(mb) - mb.proj_dim
    return total + 2 * pad * meta.hidden_size * len(meta.hybrid.recurrent_layers)


def run_nemotron_decoder(model, stream: int, n: int, *, decode: bool, n_seqs: int,
                         max_q_len: int, out_ptr, embeds_uploaded: bool = False,
                         arena=None) -> None:
    """All layers over the staged `n` rows (layers.run_decoder's contract)."""
    b, ws, m, W = model.backend, model._ws, model._meta, model._weights
    hid, eps = m.hidden_size, m.rms_norm_eps
    if not embeds_uploaded:
        run_embedding(b, stream, ws.residual, W.embed_tokens, ws.token_ids, ws.h_tokens[:n],
                      n, hid, m.vocab_size)
    for i, L in enumerate(W.layers):
        if i == 0:
            gated_norm.rmsnorm_offset(b, stream, ws.normed, ws.residual, L.norm, n, hid, eps,
                                      offset=0.0)
        else:
            gated_norm.rmsnorm_offset(b, stream, ws.normed, ws.hidden, L.norm, n, hid, eps,
                                      residual_ptr=ws.residual, offset=0.0)
        if L.kind == "mamba":
            mamba_layer(model, stream, L, n, decode)
        elif L.kind == "full_attention":
            plain_attention(model, stream, L, n, decode, n_seqs, max_q_len)
        else:
            inter = m.intermediate_size
            run_linear(b, stream, ws.act, ws.normed, L.up, n, inter, hid)
            gated_norm.relu2(b, stream, ws.act, n * inter)
            run_linear(b, stream, ws.hidden, ws.act, L.down, n, hid, inter)
    gated_norm.rmsnorm_offset(b, stream, out_ptr, ws.hidden, W.norm, n, hid, eps,
                              residual_ptr=ws.residual, offset=0.0)


def mamba_layer(model, stream: int, L, n: int, decode: bool) -> None:
    """ws.hidden[n, hidden] = the Mamba2 mixer of ws.normed (layer weights L)."""
    b, ws, hb, m = model.backend, model._ws, model._hb, model._meta
    mb, arena, step = m.hybrid.mamba, model._arena, model._step
    C, I, PW, hid = mb.conv_dim, mb.inner, hb.proj_width, m.hidden_size
    H, G, N = mb.num_heads, mb.n_groups, mb.d_state
    li = L.state_index
    run_linear(b, stream, hb.proj, ws.normed, L.in_proj, n, PW, hid)
    state, conv = arena.state_base(li), arena.conv_base(li)

    def kernels(row: int, rows: int, slots_ptr, one_step: bool) -> None:
        x_in = hb.proj.offset(2 * (row * PW + I))   # x B C of in_proj's rows
        xbc, y = hb.conv.offset(2 * row * C), hb.core.offset(2 * row * I)
        dt = hb.proj.offset(2 * (row * PW + I + C))
        B, Cm = xbc.offset(2 * I), xbc.offset(2 * (I + G * N))
        if one_step:   # HF's state update does not clamp dt (ops/mamba2_ssd.py)
            causal_conv1d.causal_conv1d_update(b, stream, xbc, C, x_in, PW, L.conv_w, L.conv_b,
                                               conv, arena.conv_stride, slots_ptr, rows, C,
                                               mb.conv_kernel)
            mamba2_ssd.mamba2_step(b, stream, y, xbc, C, B, Cm, C, dt, PW, L.a_log, L.dt_bias,
                                   L.d, 0.0, float("inf"), state, arena.state_stride,
                                   slots_ptr, rows, H, G, mb.head_dim, N)
            return
        causal_conv1d.causal_conv1d_prefill(b, stream, xbc, C, x_in, PW, L.conv_w, L.conv_b,
                                            conv, arena.conv_stride, slots_ptr, ws.qo_indptr,
                                            hb.start_pos, step.n_seqs, step.max_len, C,
                                            mb.conv_kernel)
        mamba2_ssd.mamba2_prefill(b, stream, y, xbc, C, B, Cm, C, dt, PW, L.a_log, L.dt_bias,
                                  L.d, mb.dt_min, mb.dt_max, state, arena.state_stride,
                                  slots_ptr, ws.qo_indptr, hb.start_pos, step.n_seqs, H, G,
                                  mb.head_dim, N, mb.chunk_size)

    run_recurrent(model, stream, li, n, kernels)
    gated_norm.rmsnorm_gated(b, stream, hb.core, hb.core, hb.proj, L.gated_norm, n, I, I // G,
                             I, PW, m.rms_norm_eps, False)
    run_linear(b, stream, ws.hidden, hb.core, L.out_proj, n, hid, I)


def plain_attention(model, stream: int, L, n: int, decode: bool, n_seqs: int,
                    max_q_len: int) -> None:
    """ws.hidden = attention without rotary, norms or gates (layer weights L)."""
    b, ws, m = model.backend, model._ws, model._meta
    H, KV, D, hid = m.num_heads, m.num_kv_heads, m.head_dim, m.hidden_size
    run_linear(b, stream, ws.qkv, ws.normed, L.qkv, n, ws.qkv_dim, hid)
    kc, vc = ws.k_cache(L.kv_index), ws.v_cache(L.kv_index)
    kv_cache.write_kv(b, stream, ws.qkv, kc, vc, ws.slot_mapping, n, H, KV, D)
    paged_attention(model, stream, kc, vc, ws.block_tables, n, decode, n_seqs, max_q_len, H,
                    KV, D)
    run_linear(b, stream, ws.hidden, ws.attn_out, L.o_proj, n, hid, H * D)
