"""Quantized hybrid checkpoints: the Qwen3.5 / Qwen3-Next text models in fine-grained FP8 as
released (`Qwen3.5-*-FP8`, `Qwen3.5-*-A*-FP8`, `Qwen3-Next-*-FP8`: quant_method "fp8", e4m3
block-scaled linears whose weight_scale_inv is FP32, BF16 or FP16; `modules_to_not_convert`
keeps in BF16 what it names, typically the linear-attention b / a projections, the routers,
the shared experts' gates and the head). The MoE forms' routed experts stay FP8 in the
grouped GEMM (model_engine/moe_quant.py), their shared experts as the dense linears; the
routers and the one-row shared-expert gates are read BF16 whatever the config says (HF's
routers are no nn.Linear; a release names both in modules_to_not_convert), as for the
decoder MoE families (moe_config.expert_linear_shapes). Refused by name: other methods,
Nemotron-H.

The layout of quant/fp8.py applies to every linear the model runs (`hybrid_linear_shapes`);
a wrapper's (qwen3_5, qwen3_5_moe) `modules_to_not_convert` names are read as the text
model's (its `model.language_model.` prefix mapped to `model.`, as
hybrid_layout.canonical_name maps the tensors).
"""
from __future__ import annotations

from dataclasses import replace

from ..errors import Unsupported
from .hybrid_layout import hybrid_tensors
from .quant.parse import parse_quantization

QUANTIZABLE = ("qwen3_5_text", "qwen3_5", "qwen3_5_moe_text", "qwen3_5_moe", "qwen3_next")
# read BF16 in every checkpoint (module doc): the router and the shared expert's gate
BF16_MOE_PARTS = ("mlp.gate.weight", "mlp.shared_expert_gate.weight")


def hybrid_quantization(config: dict, source: str, arch: str):
    """The quantization config of a hybrid checkpoint (None without one), or Unsupported."""
    if config.get("quantization_config") is None:
        return None
    q = parse_quantization(config, source)
    if arch not in QUANTIZABLE:
        raise Unsupported(f"{source}: quantization_config (quant_method={q.method!r}) on a "
                          f"{arch} checkpoint is not supported: no quantized Nemotron-H form "
                          "is supported")
    if q.method != "fp8":
        raise Unsupported(f"{source}: quantization_config (quant_method={q.method!r}) on a "
                          f"{arch} checkpoint is not supported (fine-grained fp8, the "
                          "released form, is)")
    if arch in ("qwen3_5", "qwen3_5_moe") and q.skip is not None:
        skip = tuple("model." + p[len("model.language_model."):]
                     if p.startswith("model.language_model.") else p for p in q.skip)
        q = replace(q, skip=skip)
    return q


def hybrid_linear_shapes(meta, names=None) -> dict[str, tuple[int, int]]:
    """HF module name -> (out_features n, in_features k) of every linear of a hybrid model
    (its 2-D `.weight` tensors but the embedding); the head when the checkpoint has one."""
    out = {}
    for name, shape in hybrid_tensors(meta).items():
        if name.endswith(".weight") and len(shape) == 2 and "embed" not in name and \
                name != "lm_head.weight" and not name.endswith(BF16_MOE_PARTS):
            out[name[:-len(".weight")]] = tuple(shape)
    if not meta.tie_word_embeddings or (names is not None and "lm_head.weight" in set(names)):
        out["lm_head"] = (meta.vocab_size, meta.hidden_size)
    return out
