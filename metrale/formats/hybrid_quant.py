"""Quantized hybrid checkpoints: the dense Qwen3.5 text models in fine-grained FP8 as
released (`Qwen3.5-*-FP8`: quant_method "fp8", e4m3 block-scaled linears whose
weight_scale_inv is FP32, BF16 or FP16; `modules_to_not_convert` keeps in BF16 what it
names, typically the linear-attention b / a projections and the head). Everything else is
refused by name: the MoE forms (their experts are quantized too: they wait for the
quantized-MoE kernels), other methods, Nemotron-H.

The layout of quant/fp8.py applies to every linear the model runs (`hybrid_linear_shapes`);
a qwen3_5 wrapper's `modules_to_not_convert` names are read as the text model's (its
`model.language_model.` prefix mapped to `model.`, as hybrid_layout.canonical_name maps the
tensors).
"""
from __future__ import annotations

from dataclasses import replace

from ..errors import Unsupported
from .hybrid_layout import hybrid_tensors
from .quant.parse import parse_quantization

QUANTIZABLE = ("qwen3_5_text", "qwen3_5")   # the dense text models


def hybrid_quantization(config: dict, source: str, arch: str):
    """The quantization config of a hybrid checkpoint (None without one), or Unsupported."""
    if config.get("quantization_config") is None:
        return None
    q = parse_quantization(config, source)
    if arch not in QUANTIZABLE:
        why = ("its mixture-of-experts layers' experts are quantized too, and quantized MoE "
               "layers wait for the quantized-MoE kernels" if arch != "nemotron_h" else
               "no quantized Nemotron-H form is supported")
        raise Unsupported(f"{source}: quantization_config (quant_method={q.method!r}) on a "
                          f"{arch} checkpoint is not supported: {why}")
    if q.method != "fp8":
        raise Unsupported(f"{source}: quantization_config (quant_method={q.method!r}) on a "
                          f"{arch} checkpoint is not supported (fine-grained fp8, the "
                          "released form, is)")
    if arch == "qwen3_5" and q.skip is not None:
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
                name != "lm_head.weight":
            out[name[:-len(".weight")]] = tuple(shape)
    if not meta.tie_word_embeddings or (names is not None and "lm_head.weight" in set(names)):
        out["lm_head"] = (meta.vocab_size, meta.hidden_size)
    return out
