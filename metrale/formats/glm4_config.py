"""GLM-4.5 / GLM-4.5-Air / GLM-4.6 (`glm4_moe`), as transformers 5.25's
configuration_glm4_moe.py and modeling_glm4_moe.py resolve config.json (glm4_fields.py lists
every field). A Llama-style GQA block whose MLP is DeepSeek-V3's:

  - attention: q/k/v projections with biases when `attention_bias` (o_proj never has one);
    with `use_qk_norm` a per-head RMSNorm (head_dim, rms_norm_eps) on q and k before the
    rope; the rope turns the first rotary_dim = int(head_dim * partial_rotary_factor) dims
    of each head, NeoX-style (rotate_half over those dims: pairs (i, i + rotary_dim / 2)),
    the rest pass through; its frequencies are those of a head of rotary_dim; the factor is
    the rope dict's, else the top level's, else 0.5 (Glm4MoeConfig.__post_init__). head_dim:
    the config's, else hidden_size // num_attention_heads (floored); scores scaled by
    head_dim ** -0.5.
  - MLP: layer i is DeepSeek-V3's MoE block (deepseek_moe_config.py: sigmoid router with
    e_score_correction_bias, group-limited top-k, norm_topk_prob, routed_scaling_factor,
    n_shared_experts fused) iff i >= first_k_dense_replace, else the dense gated MLP of
    intermediate_size.
  - the MTP layers (model.layers.{num_hidden_layers + j}.*, GLM-4.5's `num_nextn_predict_
    layers`) are not part of the model (transformers ignores them): held, never read
    (deepseek_config.mtp_prefixes). Their block is this GQA block fed the main model's
    final-norm hidden state, not DeepSeek's MLA module that model_engine/mtp.py drafts with.
Checkpoint keys: Llama's attention and dense MLP names (`self_attn.{q,k,v,o}_proj`, biases,
`self_attn.{q,k}_norm.weight`), DeepSeek's MoE block names.
"""
from __future__ import annotations

from ..errors import FormatError, Unsupported
from .config_fields import KERNEL_MAX_HEAD_DIM, _Cfg
from .decoder_variant import DecoderVariant
from .deepseek_moe_config import deepseek_moe, first_dense_layers, refuse_routing, sized
from .rope_config import context_length, partial_rope

GLM4_ARCHS = ("glm4_moe",)
# Glm4MoeConfig's defaults
GLM4_DEFAULTS = dict(vocab_size=151552, hidden_size=4096, intermediate_size=10944,
                     num_hidden_layers=46, num_attention_heads=96, num_key_value_heads=8,
                     max_position_embeddings=131072, moe_intermediate_size=1408,
                     num_experts_per_tok=8, n_shared_experts=1, n_routed_experts=128,
                     routed_scaling_factor=1.0, n_group=1, topk_group=1,
                     first_k_dense_replace=1, rms_norm_eps=1e-5)
PARTIAL_ROTARY_DEFAULT = 0.5


def _head_dim(c: _Cfg, arch: str, hidden: int, heads: int) -> int:
    """`head_dim`, else hidden_size // num_attention_heads, floored as HF's getattr default
    is (the class defaults give 4096 // 96 = 42); null fails in HF and is refused here."""
    if "head_dim" in c.d and c.d["head_dim"] is None:
        raise FormatError(f"{c.source}: head_dim is null ({arch}: transformers cannot run it)")
    d = c.int("head_dim")
    d = hidden // heads if d is None else d
    if d % 2 or d > KERNEL_MAX_HEAD_DIM:
        raise Unsupported(f"{c.source}: head_dim {d} is not supported (the attention kernels "
                          f"take an even head_dim of at most {KERNEL_MAX_HEAD_DIM})")
    return d


def glm4_fields(config: dict, source: str, arch: str) -> dict:
    """ModelMetadata's fields of a glm4_moe config (all but the token ids and the dtype,
    which metadata.py reads as for every family)."""
    from .decoder_fields import activation, refuse_quantized
    c, D = _Cfg(config, source), GLM4_DEFAULTS
    refuse_quantized(config, source)
    refuse_routing(c, arch)
    hidden = sized(c, arch, D, "hidden_size")
    heads = sized(c, arch, D, "num_attention_heads")
    kv = sized(c, arch, D, "num_key_value_heads")
    if heads % kv:
        raise FormatError(f"{source}: num_attention_heads {heads} is not a multiple of "
                          f"num_key_value_heads {kv}")
    head_dim = _head_dim(c, arch, hidden, heads)
    layers = sized(c, arch, D, "num_hidden_layers")
    max_pos = sized(c, arch, D, "max_position_embeddings")
    theta, scaling, rotary = partial_rope(c, max_pos, head_dim, PARTIAL_ROTARY_DEFAULT)
    return dict(
        architecture=arch, vocab_size=sized(c, arch, D, "vocab_size"), hidden_size=hidden,
        intermediate_size=sized(c, arch, D, "intermediate_size"), num_layers=layers,
        num_heads=heads, num_kv_heads=kv, head_dim=head_dim,
        rope_theta=theta, rope_scaling=scaling,
        rms_norm_eps=c.float("rms_norm_eps", D["rms_norm_eps"], ge=0, f32=True),
        attention_bias=c.bool("attention_bias", False), o_proj_bias=False, mlp_bias=False,
        hidden_act=activation(c), qk_norm=c.bool("use_qk_norm", False),
        tie_word_embeddings=c.bool("tie_word_embeddings", False),
        sliding_window=None, layer_windows=(0,) * layers,
        max_position_embeddings=max_pos, context_length=context_length(max_pos, scaling),
        moe=deepseek_moe(c, arch, D, first_dense_layers(c, arch, D, layers)),
        variant=DecoderVariant(rotary_dim=rotary if rotary < head_dim else 0))
