"""The tensors of a quantized decoder checkpoint, derived from its metadata and config:
which linears are quantized, what each holds, and a repacked linear's BF16 values."""
from __future__ import annotations

import numpy as np

from ...errors import Unsupported
from . import int4 as quant_int4
from ..layout import expected_tensors
from ..moe_config import expert_linear_shapes

# The linear modules of a decoder layer, as HF names them (n, k from the metadata).
LAYER_LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                 "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
# Tensors only a quantized linear has: found on a module the config leaves in BF16, they
# are refused (a quantized module the config does not describe).
QUANT_SUFFIXES = ("qweight", "qzeros", "scales", "g_idx", "weight_scale_inv", "weight_scale",
                  "input_scale", "activation_scale", "weight_zero_point",
                  "weight_shape_original")


def linear_shapes(meta, names=None) -> dict[str, tuple[int, int]]:
    """HF module name -> (out_features n, in_features k) of every linear the model runs
    (the output head when the checkpoint has one of its own)."""
    if getattr(meta, "hybrid", None) is not None:   # the hybrid families' linears
        from ..hybrid_quant import hybrid_linear_shapes
        return hybrid_linear_shapes(meta, names)
    if getattr(meta, "mla", None) is not None:   # DeepSeek: every 2-D weight but the
        # embedding and the routers (HF's router is no nn.Linear: never converted)
        return {n[:-len(".weight")]: tuple(s) for n, s in expected_tensors(meta, names).items()
                if n.endswith(".weight") and len(s) == 2 and "embed" not in n
                and not n.endswith("mlp.gate.weight")}
    h, d = meta.hidden_size, meta.head_dim
    q, kv, inter = meta.num_heads * d, meta.num_kv_heads * d, meta.intermediate_size
    dims = {"self_attn.q_proj": (q, h), "self_attn.k_proj": (kv, h),
            "self_attn.v_proj": (kv, h), "self_attn.o_proj": (h, q),
            "mlp.gate_proj": (inter, h), "mlp.up_proj": (inter, h),
            "mlp.down_proj": (h, inter)}
    moe = getattr(meta, "moe", None)
    sparse = moe.sparse_layers if moe is not None else (False,) * meta.num_layers
    out = {f"model.layers.{i}.{m}": dims[m] for i in range(meta.num_layers)
           for m in LAYER_LINEARS if not (sparse[i] and m.startswith("mlp."))}
    for i in range(meta.num_layers):
        if sparse[i]:   # the experts' (and shared expert's) linears; the router stays BF16
            out.update(expert_linear_shapes(meta, f"model.layers.{i}."))
    if "lm_head.weight" in expected_tensors(meta, names):
        out["lm_head"] = (meta.vocab_size, h)
    return out


def quantized_layout(meta, names=None):
    """(float tensors: name -> shape, quantized tensors: name -> (shape, dtypes, required),
    converted modules -> (n, k)) of a quantized checkpoint."""
    qc = meta.quantization
    floats = expected_tensors(meta, names)
    specs, converted = {}, {}
    if meta.tie_word_embeddings and "lm_head.weight" not in floats and qc.converts("lm_head"):
        # the head is the (BF16) input embedding; a config quantizing it describes a
        # checkpoint this one is not
        raise Unsupported(f"{qc.source}: quantization_config quantizes lm_head, which is tied "
                          "to the input embedding (modules_to_not_convert / ignore must list "
                          "it)")
    for module, (n, k) in linear_shapes(meta, names).items():
        if not qc.converts(module):
            continue
        converted[module] = (n, k)
        floats.pop(f"{module}.weight")
        specs.update(qc.tensor_specs(module, n, k))
    return floats, specs, converted


def dequant_bits(host) -> np.ndarray:
    """A repacked quantized linear's BF16 bits [n, k] (ops.gemm_q's formulas)."""
    from ...ops import gemm_q
    if isinstance(host, quant_int4.HostQ4):
        return gemm_q.dequant_q4(host.q, host.scales, host.zeros, host.k, host.group_size,
                                 host.gidx, host.gidx_row)
    return gemm_q.dequant_fp8(host.q, host.scales, host.scale_row, host.k, host.block_k)


def checkpoint_tensors(meta) -> dict[str, tuple[tuple[int, ...], str]]:
    """name -> (shape, dtype) of every tensor a quantized checkpoint of `meta` holds (the
    first dtype each spec allows; floats BF16): what random quantized presets generate."""
    floats, specs, _ = quantized_layout(meta)
    out = {n: (tuple(s), "BF16") for n, s in floats.items()}
    out.update({n: (tuple(s), dts[0]) for n, (s, dts, req) in specs.items() if req})
    return out
