"""Keys of a decoder's `quantization_config`, per quant_method (formats/quant/fp8.py,
quant/int4.py), in field_table.py's three statuses; a key not listed here is refused by name
(quant/rules.py: check_fields). field_table.FIELD_TABLE holds them as the scopes
`quantization_config.<method>`."""
from __future__ import annotations

from ..field_status import honoured as _h, irrelevant as _i, refused as _r

_QLOAD = "a loading option of transformers / the quantizer; the dequantized math is the same"
_QCAL = "calibration setting of the quantizer; the stored weights are what is loaded"
_QMETH = _h("selects the family")
_ACT_DYN = ("activations stay BF16 (weight-only; the reference quantizes them per group at "
            "run time, which only loses precision)")

QUANT_FP8 = {
    "quant_method": _QMETH,
    "activation_scheme": _h("dynamic: " + _ACT_DYN + "; static refused"),
    "weight_block_size": _h("[rows, cols] of a weight_scale_inv block (ragged edge blocks "
                            "allowed); null: one scale per tensor; cols must be a multiple of 8"),
    "modules_to_not_convert": _h("modules left BF16 (transformers' should_convert_module rule); "
                                 "null: transformers' default skips (the output head)"),
    "ignored_layers": _h("alias of modules_to_not_convert (MiniMax)"),
    "modules_to_convert": _r("extra modules (embedding tables) quantized to FP8"),
    "scale_fmt": _h("float (weight_scale_inv stored float32, bfloat16 or float16); ue8m0 "
                   "refused"),
    "fmt": _h("e4m3 (DeepSeek configs); others refused"),
    "expert_dtype": _h("fp8 (MoE experts; dense models have none); fp4 refused"),
    "dequantize": _i(_QLOAD),
}

QUANT_CT = {
    "quant_method": _QMETH,
    "format": _h("float-quantized / naive-quantized (FP8 weights); pack-quantized and other "
                 "formats refused"),
    "quantization_status": _h("compressed (weights stored quantized); others refused"),
    "config_groups": _h("schemes (scope quantization_config.compressed-tensors.scheme); every "
                        "group must target Linear with the same weight scheme"),
    "ignore": _h("modules left BF16: exact names or 're:' regexes matched from the start"),
    "kv_cache_scheme": _r("a quantized KV cache"),
    "sparsity_config": _r("sparse (2:4, bitmask) weights"),
    "transform_config": _r("rotations / Hadamard transforms applied to weights"),
    "global_compression_ratio": _i("informational"),
    "version": _i("the writer's version"),
    "run_compressed": _i(_QLOAD),
    "dequantize": _i(_QLOAD),
    "use_optimized_inference": _i(_QLOAD),
}

QUANT_CT_SCHEME = {
    "targets": _h("[\"Linear\"] only"),
    "weights": _h("the weight scheme (scope quantization_config.compressed-tensors.args)"),
    "input_activations": _h("dynamic: " + _ACT_DYN + "; static refused"),
    "output_activations": _r("quantized layer outputs"),
    "format": _i("per-group storage format; the top-level format decides"),
}

QUANT_CT_ARGS = {
    "num_bits": _h("8"), "type": _h("float"), "symmetric": _h("true (no zero points)"),
    "strategy": _h("weights: tensor, channel, block; activations: any (kept BF16)"),
    "block_structure": _h("[rows, cols] of a scale block"),
    "dynamic": _h("weights false; activations true"),
    "group_size": _h("must be null (group strategy refused)"),
    "actorder": _r("activation-ordered groups"),
    "scale_dtype": _i("the stored scale's dtype is what is read (F32 or BF16)"),
    "zp_dtype": _i("symmetric: no zero points are stored"),
    "observer": _i(_QCAL), "observer_kwargs": _i(_QCAL),
}

QUANT_GPTQ = {
    "quant_method": _QMETH,
    "bits": _h("4; 2, 3 and 8 refused"),
    "group_size": _h("inputs per scale / zero point (-1: the whole row); must divide "
                     "in_features and be a multiple of 8"),
    "desc_act": _h("act-order: g_idx honoured per input (a non-trivial g_idx without it "
                   "refused)"),
    "sym": _h("zero points are read from qzeros either way (symmetric ones store 8)"),
    "checkpoint_format": _h("gptq (stored zero point = z - 1) or gptq_v2 (z); marlin, "
                            "bitblas, ... refused"),
    "format": _h("newer name of checkpoint_format"),
    "lm_head": _r("a quantized output head"),
    "dynamic": _r("per-module overrides of bits / group size"),
    "modules_in_block_to_quantize": _h("the layer linears quantized (others BF16)"),
    "block_name_to_quantize": _h("model.layers only"),
    "true_sequential": _i(_QCAL), "damp_percent": _i(_QCAL), "damp_auto_increment": _i(_QCAL),
    "static_groups": _i(_QCAL), "act_group_aware": _i(_QCAL), "mse": _i(_QCAL),
    "dataset": _i(_QCAL), "tokenizer": _i(_QCAL), "batch_size": _i(_QCAL),
    "model_seqlen": _i(_QCAL), "cache_block_outputs": _i(_QCAL), "pad_token_id": _i(_QCAL),
    "module_name_preceding_first_block": _i(_QCAL), "v2": _i(_QCAL), "v2_alpha": _i(_QCAL),
    "hyb_act": _i(_QCAL), "fail_safe": _i(_QCAL), "rotation": _i(_QCAL),
    "meta": _i("tooling metadata"), "model_name_or_path": _i("tooling metadata"),
    "model_file_base_name": _i("tooling metadata"), "quantizer": _i("tooling metadata"),
    "backend": _i(_QLOAD), "use_exllama": _i(_QLOAD), "exllama_config": _i(_QLOAD),
    "max_input_length": _i(_QLOAD), "use_cuda_fp16": _i(_QLOAD),
    "disable_exllama": _i(_QLOAD), "pack_dtype": _h("int32 words (the only packing read)"),
    "is_marlin_format": _r("Marlin-repacked weights"),
}

QUANT_AWQ = {
    "quant_method": _QMETH,
    "bits": _h("4"), "w_bit": _h("alias of bits (AutoAWQ)"),
    "group_size": _h("inputs per scale / zero point; must divide in_features"),
    "q_group_size": _h("alias of group_size (AutoAWQ)"),
    "zero_point": _h("true (GEMM checkpoints always carry zero points); false refused"),
    "version": _h("gemm; gemv, gemv_fast, marlin, exllama refused"),
    "format": _h("newer name of version"),
    "modules_to_not_convert": _h("modules left BF16 (plus the output head, as transformers)"),
    "backend": _i(_QLOAD), "do_fuse": _i(_QLOAD), "fuse_max_seq_len": _i(_QLOAD),
    "exllama_config": _i(_QLOAD), "modules_to_fuse": _i(_QLOAD),
    "desc_act": _h("false (AWQ has no act-order)"), "sym": _i("AWQ GEMM is asymmetric"),
}


QUANT_MXFP4 = {   # gpt-oss's released experts (quant/mxfp4.py)
    "quant_method": _QMETH,
    "modules_to_not_convert": _h("modules left BF16: the attention, router, embeddings and "
                                 "head as released; an experts module refused (metrale loads "
                                 "the experts of every layer in one form)"),
    "dequantize": _i(_QLOAD + " (transformers' own choice of kernels; the values are the "
                     "blocks times their scales either way)"),
}

QUANT_SCOPES = {
    "quantization_config.mxfp4": QUANT_MXFP4,
    "quantization_config.fp8": QUANT_FP8,
    "quantization_config.compressed-tensors": QUANT_CT,
    "quantization_config.compressed-tensors.scheme": QUANT_CT_SCHEME,
    "quantization_config.compressed-tensors.args": QUANT_CT_ARGS,
    "quantization_config.gptq": QUANT_GPTQ,
    "quantization_config.awq": QUANT_AWQ,
}
