"""DeepSeek-V3 in fine-grained FP8 as released (formats/deepseek_config.py
`deepseek_quantization`): the pieces of DeepseekWeights that differ from the BF16 upload.

  - kv_a_proj_with_mqa is one linear whose first kv_lora_rank rows (Wc) and the
    qk_rope_head_dim rows after them (Wkr) run as two GEMMs. BF16: two offsets into one
    buffer. FP8: two Fp8Linear views of the one upload, their codes and scale_row rows
    offset and the scale grid shared, so a scale block that straddles the split serves
    both halves with the checkpoint's scale (no repacking, no copy).
  - kv_b_proj is read in place per head by the absorbed attention (mla_project's
    mla_absorb_q / mla_expand_v take BF16 W_UK / W_UV), so an FP8 kv_b_proj is dequantized
    at load by ops.gemm_q's formula (bf16(f32(e4m3 * scale))): the BF16 bits the FP8
    formula gives, held as BF16 (2 bytes a weight).
  - every other linear goes through linear.py (Fp8Linear), the routed experts through
    moe_quant.py (kept packed); norms, routers and their e_score_correction_bias, the
    embedding and (unless a config converts it) the head stay BF16.
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np

from ..formats.layout import expected_tensors
from ..formats.quant.layout import dequant_bits, linear_shapes
from ..gpu_runtime.types import DevicePtr
from ..ops import gemm_q
from .linear import Fp8Linear, linear_device_bytes


def split_kv_a(w, mla, hidden: int):
    """(Wc [kv_lora_rank, hidden], Wkr [qk_rope_head_dim, hidden]) of the uploaded
    kv_a_proj_with_mqa `w` (a BF16 DevicePtr or an Fp8Linear), as views into it."""
    R = mla.kv_lora_rank
    if not isinstance(w, Fp8Linear):
        return w, DevicePtr(w).offset(R * hidden * 2)
    c = replace(w, n=R, nbytes=w.nbytes)   # the upload's bytes counted once, here
    kr = replace(w, q=DevicePtr(w.q).offset(R * gemm_q.fp8_row_bytes(w.k)),
                 scale_row=DevicePtr(w.scale_row).offset(R * 4), n=w.n - R, nbytes=0)
    return c, kr


def upload_kv_b(weights, up, meta, module: str) -> DevicePtr:
    """kv_b_proj [H * (nope + v_head_dim), kv_lora_rank] as BF16 on the device: the stored
    weight, or the FP8 one dequantized exactly (module doc)."""
    qc, src = meta.quantization, up.source
    if qc is None or not qc.converts(module):
        return weights._own(up.upload(module + ".weight"))
    n, k = linear_shapes(meta, src.tensor_names())[module]
    return weights._own(up.upload_array(np.ascontiguousarray(dequant_bits(
        qc.read(src, module, n, k)))))


def deepseek_fp8_bytes(meta, names=None) -> int:
    """Device bytes of a quantized DeepSeek checkpoint's weights as DeepseekWeights holds
    them: converted linears at their packed bytes (kv_b_proj: BF16), the rest BF16."""
    qc = meta.quantization
    shapes = linear_shapes(meta, names)
    total = 0
    for name, shape in expected_tensors(meta, names).items():
        module = name[:-len(".weight")]
        if module not in shapes or not qc.converts(module):   # BF16; the router's
            # correction bias FP32 (memory_plan.held_bytes_of, which imports this module)
            total += (4 if name.endswith(".e_score_correction_bias") else 2) * int(
                np.prod(shape))
        elif module.endswith("kv_b_proj"):
            total += 2 * int(np.prod(shape))
        else:
            total += linear_device_bytes(qc, *shapes[module])
    return total
