"""What each GGUF architecture adds to the llama block: its HF model_type, its tensor names,
how llama.cpp's converter (convert_hf_to_gguf.py) stored its weights, and the config fields
its metadata stands for.

  llama     q/k rows permuted per head into interleaved rotary pairs (LlamaModel.permute;
            source.py undoes it); every other architecture here uses llama.cpp's NEOX rope,
            HF's own half-split layout, and is stored unpermuted.
  qwen2     q/k/v biases; a tied head when the file has no output.weight.
  qwen3     q/k RMSNorms (attn_q_norm / attn_k_norm), head_dim from key_length.
  qwen3moe  qwen3's attention, every layer a routed MoE: ffn_gate_inp [E, hidden] (the
            router), ffn_{gate,up}_exps [E, I, hidden] and ffn_down_exps [E, hidden, I] (the
            experts stacked; source.py reads expert e as HF's mlp.experts.e.*). llama.cpp
            always renormalises the top-k routing weights (llm_build_qwen3moe's norm_w), so
            the file stands for norm_topk_prob = true.
  phi3      q|k|v stored fused as attn_qkv and gate|up as ffn_up [2I, hidden] (HF's
            qkv_proj / gate_up_proj, the same row order); partial rotary from
            rope.dimension_count; a sliding window on every layer (HF's Phi3 applies it;
            llama.cpp currently ignores it: its loader says so); per-frequency rope factors
            (rope_factors_long / short, LongRoPE) refused.
  gemma2    four norms a layer (attn_norm, post_attention_norm, ffn_norm = HF's
            pre_feedforward_layernorm, post_ffw_norm); every norm weight stored as w + 1
            (the converter folds Gemma's (1 + w) in, in float32); attention and final
            soft-capping; layers alternate sliding / full (layer 0 sliding); a tied head.
  gemma3    gemma2's block with q/k norms (also + 1), no attention soft-capping, every sixth
            layer full, sliding layers on a rope base of 10000 (llama.cpp's fixed values:
            the converter writes no pattern and no local base); final soft-capping when
            the file has the key (the converter writes it when the config sets it; HF's
            Gemma3ForCausalLM applies it, llama.cpp's sliding-window graph does not).
Where llama.cpp departs from the HF model the converter read (phi3's window, gemma3's final
cap, the embedding scale sqrt(hidden) that HF rounds to BF16), the HF model is what loads.
Gemma 2 / 3's query scale is not in the file: llama.cpp uses head_dim ** -0.5, except for
the 27B models (46 / 62 layers) where it is (hidden / heads) ** -0.5; so does this reader
(query_pre_attn_scalar).
"""
from __future__ import annotations

from ...errors import FormatError, Unsupported
from .shapes import check_dim

# GGUF general.architecture -> the HF model_type it loads as
MODEL_TYPE = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen3moe": "qwen3_moe",
              "phi3": "phi3", "gemma2": "gemma2", "gemma3": "gemma3_text"}
PERMUTED = ("llama",)                  # q/k rows interleaved by the converter
NORM_PLUS_ONE = ("gemma2", "gemma3")   # norm weights stored as w + 1

LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GEMMA = {"ffn_norm": "pre_feedforward_layernorm",
          "post_attention_norm": "post_attention_layernorm",
          "post_ffw_norm": "post_feedforward_layernorm"}
_ARCH_LAYER_NAMES = {
    "qwen3moe": {"ffn_gate_inp": "mlp.gate", "ffn_gate": None, "ffn_up": None,
                 "ffn_down": None},
    "phi3": {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj",
             "attn_q": None, "attn_k": None, "attn_v": None, "ffn_gate": None},
    "gemma2": _GEMMA, "gemma3": _GEMMA,
}
# qwen3moe's stacked experts: GGUF name -> the HF projection each expert's slice is
EXPERT_NAMES = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj",
                "ffn_down_exps": "down_proj"}
# tensors llama.cpp reads that change the math but have no HF counterpart here
REFUSED_TENSORS = {
    "rope_freqs.weight": "llama.cpp's per-frequency rope factors, e.g. Llama 3.1's rope "
                         "scaling",
    "rope_factors_long.weight": "Phi-3's LongRoPE factors",
    "rope_factors_short.weight": "Phi-3's LongRoPE factors",
}
# metadata entries (field_table.GGUF keys) only some architectures honour: another
# architecture carrying one is refused by name (llama.cpp ignores it there, HF too: a
# file with it was not written for that architecture)
ARCH_KEYS = {
    "{arch}.expert_feed_forward_length": ("qwen3moe",),
    "{arch}.expert_weights_norm": ("qwen3moe",),
    "{arch}.attn_logit_softcapping": ("gemma2",),
    "{arch}.final_logit_softcapping": ("gemma2", "gemma3"),
}
# HONOURED entries that accept only a neutral value (config._NEUTRAL) except here, where
# the architecture reads them
ARCH_VALUES = {
    "qwen3moe": ("{arch}.expert_count", "{arch}.expert_used_count"),
    "phi3": ("{arch}.attention.sliding_window",),
    "gemma2": ("{arch}.attention.sliding_window",),
    "gemma3": ("{arch}.attention.sliding_window",),
}
YARN = ("qwen2", "qwen3", "qwen3moe")   # Qwen2Model's converter writes yarn scaling
_LLAMA_CPP_27B = {"gemma2": 46, "gemma3": 62}   # block counts of llama.cpp's LLM_TYPE_27B


def layer_names(arch: str) -> dict[str, str]:
    """GGUF layer tensor stem -> HF module name in architecture `arch`."""
    names = {**LAYER_NAMES, **_ARCH_LAYER_NAMES.get(arch, {})}
    return {k: v for k, v in names.items() if v is not None}


def ffn_rows(arch: str) -> tuple[str, int]:
    """(the tensor whose rows carry feed_forward_length, rows per unit of it)."""
    return ("blk.0.ffn_up.weight", 2) if arch == "phi3" else ("blk.0.ffn_gate.weight", 1)


def family_config(arch: str, get, tensors: dict, where: str, dims: dict) -> dict:
    """The config.json fields architecture `arch` adds, from its metadata (`get(name,
    default, required)` reads `{arch}.name`); `dims`: hidden, heads, kv, head_dim, layers.
    Checked against the tensor directory like the common fields."""
    if arch == "qwen3moe":
        return _qwen3moe(get, tensors, where, dims)
    if arch == "phi3":
        rot = get("rope.dimension_count", dims["head_dim"])
        if not isinstance(rot, int) or not 0 < rot <= dims["head_dim"] or rot % 2:
            raise FormatError(f"{where}: phi3.rope.dimension_count = {rot!r} is not an even "
                              f"count of at most head_dim {dims['head_dim']}")
        out = {"partial_rotary_factor": rot / dims["head_dim"],
               "sliding_window": get("attention.sliding_window", 0) or None}
        orig = get("rope.scaling.original_context_length")
        if orig is not None:
            out["original_max_position_embeddings"] = orig
        return out
    if arch in ("gemma2", "gemma3"):
        heads, layers = dims["heads"], dims["layers"]
        scalar = dims["hidden"] // heads if layers == _LLAMA_CPP_27B[arch] else dims["head_dim"]
        out = {"hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": scalar,
               "sliding_window": get("attention.sliding_window", 0) or None,
               "final_logit_softcapping": get("final_logit_softcapping")}
        if arch == "gemma2":
            out["attn_logit_softcapping"] = get("attn_logit_softcapping")
        else:
            out.update(sliding_window_pattern=6, rope_local_base_freq=10000.0)
        if out["sliding_window"] is None:
            raise Unsupported(f"{where}: a {arch} file without {arch}.attention."
                              "sliding_window (its sliding layers need the window)")
        return out
    return {}


def _qwen3moe(get, tensors: dict, where: str, dims: dict) -> dict:
    def count(name):
        v = get(name, required=True)
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise FormatError(f"{where}: qwen3moe.{name} must be a positive integer, "
                              f"got {v!r}")
        return v
    experts, used = count("expert_count"), count("expert_used_count")
    inter = count("expert_feed_forward_length")
    if used > experts:
        raise FormatError(f"{where}: qwen3moe.expert_used_count = {used} exceeds "
                          f"qwen3moe.expert_count = {experts}")
    if get("expert_weights_norm", True) is not True:
        raise Unsupported(f"{where}: qwen3moe.expert_weights_norm = false is not supported "
                          "(llama.cpp's qwen3moe renormalises the top-k weights)")
    h = dims["hidden"]
    check_dim(tensors, "blk.0.ffn_gate_inp.weight", 0, "qwen3moe.expert_count", experts,
              where)
    for stem, axis, n, key in (("gate", 1, inter, "expert_feed_forward_length"),
                               ("up", 1, inter, "expert_feed_forward_length"),
                               ("down", 2, inter, "expert_feed_forward_length"),
                               ("gate", 0, experts, "expert_count")):
        check_dim(tensors, f"blk.0.ffn_{stem}_exps.weight", axis, f"qwen3moe.{key}", n, where)
    check_dim(tensors, "blk.0.ffn_down_exps.weight", 1, "qwen3moe.embedding_length", h, where)
    return {"num_experts": experts, "num_experts_per_tok": used,
            "moe_intermediate_size": inter, "norm_topk_prob": True,
            "decoder_sparse_step": 1, "mlp_only_layers": []}
