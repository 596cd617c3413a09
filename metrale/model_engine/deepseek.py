"""DeepSeek-V2 / V3 and GLM-4.7-Flash (glm4_moe_lite) decoders on the device: their weights
and their layer sequence (formats/deepseek_config.py has the math; layers.run_decoder hands
an MLA model here).

    residual = embed(ids)
    per layer:  x = input_layernorm(residual)            (layer 0: no add)
                o = mla_attention(x) @ Wo^T              (mla.py)
                x = post_attention_layernorm(residual += o)
                h = the dense MLP (layers < first_k_dense_replace) or the DeepSeek MoE block
                    (moe.moe_mlp with DeepSeek's routing: ops/deepseek_router.py; the shared
                    experts as its ungated shared MLP)
    out = norm(residual += h)
Weights (`DeepseekWeights`, the attributes of DecoderWeights the model reads): per layer
`MlaLayerWeights`; kv_a_proj_with_mqa uploaded whole, its first kv_lora_rank rows (Wc) and
the qk_rope_head_dim rows after them (Wkr) read as two linears; kv_b_proj whole (W_UK and
W_UV are its rows per head, read in place by mla_absorb_q / mla_expand_v); the routers'
e_score_correction_bias as float32, as the router reads it.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import Unsupported
from ..formats.field_table import HF_ACTIVATIONS
from ..formats.layout import expected_tensors
from ..formats.upload import WeightUploader
from ..gpu_runtime.owned import OwnedBuffers
from ..gpu_runtime.types import NULL, DevicePtr
from ..ops import activation, rmsnorm
from .deepseek_fp8 import deepseek_fp8_bytes, split_kv_a, upload_kv_b
from .linear import run_embedding, run_linear, upload_linear
from .memory_plan import held_bytes_of
from .mla import mla_attention
from .moe import moe_mlp
from .moe_weights import MoeLayerWeights, upload_deepseek_moe
from .weights import check_checkpoint


@dataclass
class MlaLayerWeights:
    input_layernorm: DevicePtr
    q_proj: DevicePtr            # [H * qk_head, hidden] or NULL (q_lora_rank set)
    q_a: DevicePtr               # [q_lora_rank, hidden] or NULL
    q_a_norm: DevicePtr          # [q_lora_rank] or NULL
    q_b: DevicePtr               # [H * qk_head, q_lora_rank] or NULL
    kv_a_c: DevicePtr            # [kv_lora_rank, hidden]: rows of kv_a_proj_with_mqa
    kv_a_kr: DevicePtr           # [qk_rope_head_dim, hidden]: the rows after them
    kv_a_norm: DevicePtr         # [kv_lora_rank]
    kv_b: DevicePtr              # [H * (nope + v_head_dim), kv_lora_rank]
    o_proj: DevicePtr            # [hidden, H * v_head_dim]
    post_attention_layernorm: DevicePtr
    gate_up: DevicePtr = NULL    # dense MLP [2 * intermediate, hidden]
    down_proj: DevicePtr = NULL  # [hidden, intermediate]
    moe: MoeLayerWeights | None = None


class DeepseekWeights(OwnedBuffers):
    """Uploads a deepseek_v2 / deepseek_v3 / glm4_moe_lite checkpoint; `free()` returns every
    byte."""

    def __init__(self, backend, source, meta, progress: bool = True) -> None:
        self.backend = backend
        self._owned: list[DevicePtr] = []
        expected = check_checkpoint(source, meta)
        self.nbytes = (sum(held_bytes_of(n, s) for n, s in expected.items())
                       if meta.quantization is None else deepseek_fp8_bytes(meta))
        self.embed_bytes = 2 * meta.vocab_size * meta.hidden_size
        try:
            with WeightUploader(backend, source, self.nbytes, desc=source.description,
                                progress=progress) as up:
                own = lambda name: self._own(up.upload(name))   # noqa: E731
                lin = lambda *ms: upload_linear(self, up, source, meta, list(ms))  # noqa: E731
                self.embed_tokens = own("model.embed_tokens.weight")
                self.layers: list[MlaLayerWeights] = []
                for i in range(meta.num_layers):
                    self.layers.append(self.upload_layer(up, meta, f"model.layers.{i}.",
                                                         bool(meta.moe.sparse_layers[i])))
                self.norm = own("model.norm.weight")
                stored = expected_tensors(meta, source.tensor_names())   # a head of its own
                self.lm_head = (lin("lm_head") if "lm_head.weight" in stored
                                else self.embed_tokens)
        except BaseException:
            self.free()
            raise

    def upload_layer(self, up, meta, p: str, sparse: bool) -> MlaLayerWeights:
        """One decoder block's weights under prefix `p` (`model.layers.{i}.`; the MTP
        layer's too, mtp.py): MLA attention, then the MoE block (`sparse`) or the dense MLP."""
        a = meta.mla
        own = lambda name: self._own(up.upload(name))   # noqa: E731
        lin = lambda *ms: upload_linear(self, up, up.source, meta, list(ms))  # noqa: E731
        s = p + "self_attn."
        # BF16 or FP8 (deepseek_fp8.py: the latent and rope rows two views of one upload)
        kv_a_c, kv_a_kr = split_kv_a(lin(s + "kv_a_proj_with_mqa"), a, meta.hidden_size)
        q = dict(q_proj=NULL, q_a=NULL, q_a_norm=NULL, q_b=NULL)
        if a.q_lora_rank:
            q.update(q_a=lin(s + "q_a_proj"), q_a_norm=own(s + "q_a_layernorm.weight"),
                     q_b=lin(s + "q_b_proj"))
        else:
            q["q_proj"] = lin(s + "q_proj")
        L = MlaLayerWeights(
            input_layernorm=own(p + "input_layernorm.weight"), **q,
            kv_a_c=kv_a_c, kv_a_kr=kv_a_kr, kv_a_norm=own(s + "kv_a_layernorm.weight"),
            kv_b=upload_kv_b(self, up, meta, s + "kv_b_proj"), o_proj=lin(s + "o_proj"),
            post_attention_layernorm=own(p + "post_attention_layernorm.weight"))
        if sparse:
            L.moe = upload_deepseek_moe(self, up, meta, p + "mlp.")
        else:
            L.gate_up = lin(p + "mlp.gate_proj", p + "mlp.up_proj")
            L.down_proj = lin(p + "mlp.down_proj")
        return L


def run_deepseek_decoder(model, stream: int, n: int, *, n_seqs: int, out_ptr: DevicePtr,
                         embeds_uploaded: bool = False, arena=None, lora=None) -> None:
    """layers.run_decoder for an MLA model: final-norm hidden rows [n, hidden] to out_ptr.
    Decode, verify and prefill run the same sequence (the attention's rows find their
    causal prefix through qo_indptr)."""
    if arena is not None and arena is not model._ws:
        raise Unsupported(f"{model._meta.architecture}: the latent KV cache lives in the "
                          "model's paged pool only (no contiguous cache)")
    if lora is not None:
        raise Unsupported(f"{model._meta.architecture}: LoRA adapters are not served on MLA "
                          "models")
    b, ws, m, W = model.backend, model._ws, model._meta, model._weights
    hid, eps = m.hidden_size, m.rms_norm_eps
    if not embeds_uploaded:
        run_embedding(b, stream, ws.residual, W.embed_tokens, ws.token_ids, ws.h_tokens[:n], n,
                      hid, m.vocab_size)
    for i, L in enumerate(W.layers):
        run_mla_block(model, stream, n, i, L, n_seqs, first=i == 0)
    rmsnorm.rmsnorm(b, stream, out_ptr, ws.hidden, W.norm, n, hid, eps,
                    residual_ptr=ws.residual)


def run_mla_block(model, stream: int, n: int, layer: int, L: MlaLayerWeights, n_seqs: int, *,
                  first: bool, cache=None) -> None:
    """One decoder block on the `n` rows of ws.residual (+ ws.hidden, the previous block's
    output, unless `first`): afterwards ws.residual + ws.hidden is its output. `layer` picks
    the rope table (and the latent cache, unless `cache`: the MTP layer's own, mtp.py)."""
    b, ws, m = model.backend, model._ws, model._meta
    hid, inter, eps = m.hidden_size, m.intermediate_size, m.rms_norm_eps
    if first:
        rmsnorm.rmsnorm(b, stream, ws.normed, ws.residual, L.input_layernorm, n, hid, eps)
    else:
        rmsnorm.rmsnorm(b, stream, ws.normed, ws.hidden, L.input_layernorm, n, hid, eps,
                        residual_ptr=ws.residual)
    mla_attention(model, stream, n, layer, L, n_seqs, cache=cache)
    run_linear(b, stream, ws.hidden, ws.mla.o, L.o_proj, n, hid, m.num_heads * m.mla.v_head_dim)
    rmsnorm.rmsnorm(b, stream, ws.normed, ws.hidden, L.post_attention_layernorm, n, hid, eps,
                    residual_ptr=ws.residual)
    if L.moe is not None:
        moe_mlp(model, stream, n, L.moe)
        return
    run_linear(b, stream, ws.gate_up, ws.normed, L.gate_up, n, 2 * inter, hid)
    activation.act_mul(b, stream, ws.act, ws.gate_up, n, inter, HF_ACTIVATIONS[m.hidden_act])
    run_linear(b, stream, ws.hidden, ws.act, L.down_proj, n, hid, inter)
