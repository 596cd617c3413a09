"""DeepSeek-V2 / V3 (`deepseek_v2`, `deepseek_v3`) and GLM-4.7-Flash (`glm4_moe_lite`:
DeepSeek-V3's attention and MoE block under GLM's defaults), as transformers 5.25's
configuration_*.py and modeling_*.py resolve config.json (deepseek_fields.py and
glm4_fields.py list every field). Against the Llama block:

  - attention is multi-head latent attention (MLA, `MlaConfig`):
        q      = x @ Wq^T                          (V2-Lite: q_lora_rank null)
               | rmsnorm(x @ Wqa^T; q_a_layernorm) @ Wqb^T     [H, nope + rope]
        c, kr  = x @ Wkva^T  split [kv_lora_rank | qk_rope_head_dim]
        c      = rmsnorm(c; kv_a_layernorm)         the latent the KV cache keeps with kr
        k_h    = [c @ Wuk_h^T | rope(kr)], v_h = c @ Wuv_h^T   (kv_b_proj rows per head:
                 qk_nope_head_dim of W_UK, then v_head_dim of W_UV)
        o      = softmax(q_h . k_h * scale) v_h, then @ Wo^T
    rope turns the qk_rope_head_dim tail of q and kr only; its pairs are adjacent dims
    (2i, 2i + 1) for V2 and for V3 with `rope_interleave` (the default), the two halves
    (i, i + d/2) for V3 without it. The score scale is (nope + rope) ** -0.5, times
    mscale(factor, mscale_all_dim) ** 2 when the rope is scaled and mscale_all_dim is set
    (HF yarn_apply_mscale); the yarn cos/sin carry mscale / mscale_all_dim as usual.
  - MLP: layer i is a DeepSeek MoE block (deepseek_moe_config.py has its routing) iff
    i >= first_k_dense_replace (glm4_moe_lite: iff mlp_layer_types[i] is "sparse", default
    ["dense"] + ["sparse"] * (n - 1)), else the dense MLP of intermediate_size.
  - glm4_moe_lite against deepseek_v3: the V3 router and rope pairs; `head_dim` is an alias
    of qk_rope_head_dim (HF attribute_map, and it wins); its class defaults (`DEFAULTS`).
Checkpoint keys: `self_attn.{q_proj | q_a_proj, q_a_layernorm, q_b_proj}`,
`self_attn.kv_a_proj_with_mqa`, `self_attn.kv_a_layernorm`, `self_attn.kv_b_proj`,
`self_attn.o_proj`; `mlp.gate.weight` [E, hidden], `mlp.gate.e_score_correction_bias` [E]
(V3 router), `mlp.experts.{e}.{gate,up,down}_proj.weight`, `mlp.shared_experts.*`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from ..errors import FormatError, Unsupported
from .config_fields import _Cfg
from .deepseek_moe_config import (deepseek_moe, first_dense_layers,
                                  refuse_routing, sized)

DEEPSEEK_ARCHS = ("deepseek_v2", "deepseek_v3", "glm4_moe_lite")
# model_types that name DeepSeek-V3's architecture under another name: Kimi K2's config.json
# (architectures DeepseekV3ForCausalLM, remote code DeepSeek's), as transformers' own
# Kimi_K25Config reads its text model
MODEL_TYPE_ALIASES = {"kimi_k2": "deepseek_v3"}


def resolve_model_type(config):
    """`config` with an aliased model_type replaced by the architecture it names (the
    others, and anything not a dict, unchanged: the parser names what is wrong)."""
    arch = config.get("model_type") if isinstance(config, dict) else None
    if isinstance(arch, str) and arch in MODEL_TYPE_ALIASES:
        return {**config, "model_type": MODEL_TYPE_ALIASES[arch]}
    return config
# the HF classes' defaults (configuration_deepseek_v2.py / _v3.py / glm4_moe_lite.py)
DEFAULTS = {
    "deepseek_v3": dict(vocab_size=129280, hidden_size=7168, intermediate_size=18432,
                        moe_intermediate_size=2048, num_hidden_layers=61,
                        num_attention_heads=128, n_shared_experts=1, n_routed_experts=256,
                        routed_scaling_factor=2.5, kv_lora_rank=512, q_lora_rank=1536,
                        qk_rope_head_dim=64, v_head_dim=128, qk_nope_head_dim=128,
                        n_group=8, topk_group=4, num_experts_per_tok=8,
                        first_k_dense_replace=3, norm_topk_prob=True,
                        max_position_embeddings=4096, bos_token_id=0, eos_token_id=1,
                        rms_norm_eps=1e-6),
    "deepseek_v2": dict(vocab_size=102400, hidden_size=4096, intermediate_size=11008,
                        moe_intermediate_size=1407, num_hidden_layers=32,
                        num_attention_heads=32, n_shared_experts=2, n_routed_experts=64,
                        routed_scaling_factor=1.0, kv_lora_rank=512, q_lora_rank=1536,
                        qk_rope_head_dim=64, v_head_dim=128, qk_nope_head_dim=128,
                        n_group=None, topk_group=None, num_experts_per_tok=None,
                        first_k_dense_replace=0, norm_topk_prob=False,
                        max_position_embeddings=2048, bos_token_id=1, eos_token_id=2,
                        rms_norm_eps=1e-6),
    "glm4_moe_lite": dict(vocab_size=154880, hidden_size=2048, intermediate_size=10240,
                          moe_intermediate_size=1536, num_hidden_layers=47,
                          num_attention_heads=20, n_shared_experts=1, n_routed_experts=64,
                          routed_scaling_factor=1.8, kv_lora_rank=512, q_lora_rank=768,
                          qk_rope_head_dim=64, v_head_dim=256, qk_nope_head_dim=192,
                          n_group=1, topk_group=1, num_experts_per_tok=4,
                          norm_topk_prob=True, max_position_embeddings=202752,
                          bos_token_id=0, eos_token_id=1, rms_norm_eps=1e-5),
}
# The widest latent row (kv_lora_rank + qk_rope_head_dim) the MLA decode kernel keeps per
# CTA in shared memory: V3's 576 with room.
MAX_LATENT_DIM = 1024
MLP_LAYER_TYPES = ("dense", "sparse")   # glm4_moe_lite


@dataclass(frozen=True)
class MlaConfig:
    """Multi-head latent attention of one DeepSeek decoder (ModelMetadata.mla)."""

    q_lora_rank: int          # 0: q_proj straight from the hidden state (V2-Lite)
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_pairs_adjacent: bool  # rope pairs (2i, 2i+1) (V2, V3 rope_interleave) or halves
    softmax_scale: float       # the score scale, yarn's mscale_all_dim folded in

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Values the KV cache keeps per token and layer: the latent and the roped key."""
        return self.kv_lora_rank + self.qk_rope_head_dim


def _default(c: _Cfg, arch: str, key: str):
    return DEFAULTS[arch][key]


def _int(c: _Cfg, arch: str, key: str, positive=True) -> int:
    return sized(c, arch, DEFAULTS[arch], key, positive)


def refuse_unsupported(c: _Cfg, arch: str) -> None:
    """Values of fields that would change the math and that metrale does not implement,
    refused by name (deepseek_fields.py says why each)."""
    d = c.d
    for key in ("attention_bias", "mlp_bias"):
        if c.bool(key, False):
            raise Unsupported(f"{c.source}: {key}=true on {arch} is not supported (the MLA "
                              "projections and DeepSeek MLPs are bias-free here)")
    refuse_routing(c, arch)
    prf = d.get("partial_rotary_factor")
    if prf is not None and prf != 1:
        raise Unsupported(f"{c.source}: partial_rotary_factor={prf!r} on {arch} is not "
                          "supported (the rope turns all qk_rope_head_dim dims)")


def deepseek_quantization(config: dict, source: str, arch: str):
    """The quantization_config of a DeepSeek checkpoint (None without one): fine-grained FP8
    as DeepSeek-V3 is released (e4m3 block-scaled linears with weight_scale_inv; the
    routers, norms, embeddings and the head stay BF16). Other methods: Unsupported."""
    from .quant.parse import parse_quantization
    if config.get("quantization_config") is None:
        return None
    if arch == "glm4_moe_lite":
        raise Unsupported(f"{source}: quantization_config on a glm4_moe_lite checkpoint is "
                          "not supported (fine-grained fp8 is, on deepseek_v3)")
    q = parse_quantization(config, source)
    if q.method != "fp8":
        raise Unsupported(f"{source}: quantization_config (quant_method={q.method!r}) on a "
                          f"{arch} checkpoint is not supported (fine-grained fp8, the form "
                          "DeepSeek-V3 is released in, is)")
    return q


def mla_config(c: _Cfg, arch: str, rope_dim: int, rope_parameters: dict, rope_scaled: bool,
               yarn_factor: float) -> MlaConfig:
    """The attention's ranks and dims (`rope_dim`: qk_rope_head_dim, `rope_head_dim`),
    checked, and its softmax scale."""
    q_lora = c.d.get("q_lora_rank", _default(c, arch, "q_lora_rank"))
    q_lora = 0 if q_lora is None else c.int("q_lora_rank", q_lora)   # absent: the default
    dims = {k: _int(c, arch, k) for k in ("kv_lora_rank", "qk_nope_head_dim", "v_head_dim")}
    dims["qk_rope_head_dim"] = rope_dim
    if dims["qk_rope_head_dim"] % 2:
        raise FormatError(f"{c.source}: qk_rope_head_dim must be even (rope pairs), got "
                          f"{dims['qk_rope_head_dim']}")
    latent = dims["kv_lora_rank"] + dims["qk_rope_head_dim"]
    if latent > MAX_LATENT_DIM or dims["v_head_dim"] > MAX_LATENT_DIM or \
            dims["qk_nope_head_dim"] > MAX_LATENT_DIM:
        raise Unsupported(f"{c.source}: kv_lora_rank + qk_rope_head_dim = {latent} (or a head "
                          f"dim) exceeds the MLA kernels' {MAX_LATENT_DIM}")
    pairs = True if arch == "deepseek_v2" else c.bool("rope_interleave", True)   # V3, lite
    scale = (dims["qk_nope_head_dim"] + dims["qk_rope_head_dim"]) ** -0.5
    # HF yarn_apply_mscale: any scaled rope with a non-zero mscale_all_dim
    mad = rope_parameters.get("mscale_all_dim") or 0
    if rope_scaled and mad:
        scale *= _mscale(yarn_factor, float(mad)) ** 2
    return MlaConfig(q_lora, dims["kv_lora_rank"], dims["qk_nope_head_dim"],
                     dims["qk_rope_head_dim"], dims["v_head_dim"], pairs, scale)


def _mscale(scale: float, mscale: float) -> float:
    """HF's yarn get_mscale."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def deepseek_layer_tensors(m, p: str) -> dict[str, tuple[int, ...]]:
    """One layer's attention tensors, and its MoE block's when the layer is sparse (prefix
    `p` = "model.layers.{i}."); the dense MLP and the norms are the Llama block's."""
    a, h, H = m.mla, m.hidden_size, m.num_heads
    t = {}
    s = p + "self_attn."
    if a.q_lora_rank:
        t[s + "q_a_proj.weight"] = (a.q_lora_rank, h)
        t[s + "q_a_layernorm.weight"] = (a.q_lora_rank,)
        t[s + "q_b_proj.weight"] = (H * a.qk_head_dim, a.q_lora_rank)
    else:
        t[s + "q_proj.weight"] = (H * a.qk_head_dim, h)
    t[s + "kv_a_proj_with_mqa.weight"] = (a.latent_dim, h)
    t[s + "kv_a_layernorm.weight"] = (a.kv_lora_rank,)
    t[s + "kv_b_proj.weight"] = (H * (a.qk_nope_head_dim + a.v_head_dim), a.kv_lora_rank)
    t[s + "o_proj.weight"] = (h, H * a.v_head_dim)
    return t


def mtp_prefixes(config: dict) -> tuple[str, ...]:
    """The tensor-name prefixes of the MTP layers of DeepSeek-V3 and the GLM-4.5 families,
    `model.layers.{num_hidden_layers + j}.` for j < num_nextn_predict_layers (alias
    num_mtp_layers; absent: 1): not part of the main model (transformers ignores them,
    `_keys_to_ignore_on_load_unexpected`). DeepSeek-V3's first loads as the draft proposer
    when present (model_engine/mtp.py checks and uploads it); the others, and GLM's, stay
    unread. () for any other model_type."""
    from .glm4_config import GLM4_DEFAULTS
    arch = config.get("model_type")
    defaults = {**DEFAULTS, "glm4_moe": GLM4_DEFAULTS}
    if arch not in ("deepseek_v3", "glm4_moe", "glm4_moe_lite"):
        return ()
    n = config.get("num_hidden_layers", defaults[arch]["num_hidden_layers"])
    k = config.get("num_nextn_predict_layers", config.get("num_mtp_layers", 1))
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (n, k)):
        return ()   # the metadata parser names the bad field
    return tuple(f"model.layers.{n + j}." for j in range(min(k, 64)))


def kv_bytes_per_token_layer(m) -> int:
    """KV cache bytes one token takes in one layer: the BF16 latent and roped key for MLA,
    K and V of every kv head otherwise."""
    if getattr(m, "mla", None) is not None:
        return m.mla.latent_dim * 2
    return 2 * m.num_kv_heads * m.head_dim * 2


def rope_head_dim(c: _Cfg, arch: str) -> int:
    """qk_rope_head_dim; glm4_moe_lite's `head_dim` is its alias and wins (HF attribute_map):
    a different qk_rope_head_dim beside it is refused."""
    if arch != "glm4_moe_lite" or "head_dim" not in c.d:
        return _int(c, arch, "qk_rope_head_dim")
    alias = c.int("head_dim", required=True)   # null refused, naming it
    rope_dim = c.int("qk_rope_head_dim")
    if rope_dim is not None and alias != rope_dim:
        raise FormatError(f"{c.source}: head_dim {alias} and qk_rope_head_dim {rope_dim} "
                          "disagree (glm4_moe_lite: head_dim is an alias of qk_rope_head_dim)")
    return alias


def lite_sparse_layers(c: _Cfg, n_layers: int) -> tuple[bool, ...]:
    """glm4_moe_lite's `mlp_layer_types` (default: layer 0 dense, the others sparse); its
    HF model never reads first_k_dense_replace, so one that disagrees is refused."""
    types = c.d.get("mlp_layer_types")
    if types is None:
        types = ["dense"] + ["sparse"] * (n_layers - 1)
    if not isinstance(types, list) or len(types) != n_layers or \
            any(t not in MLP_LAYER_TYPES for t in types):
        raise FormatError(f"{c.source}: mlp_layer_types must list 'dense' or 'sparse' for "
                          f"each of the {n_layers} layers, got {types!r}")
    sparse = tuple(t == "sparse" for t in types)
    first = c.int("first_k_dense_replace", positive=False)
    if first is not None and sparse != tuple(i >= first for i in range(n_layers)):
        raise Unsupported(f"{c.source}: first_k_dense_replace={first} disagrees with "
                          f"mlp_layer_types {types}: transformers' glm4_moe_lite reads "
                          "mlp_layer_types only")
    return sparse


def deepseek_fields(config: dict, source: str, arch: str) -> dict:
    """ModelMetadata's fields of a deepseek_v2 / deepseek_v3 / glm4_moe_lite config (all but
    the token ids and the dtype, which metadata.py reads as for every family)."""
    from .decoder_fields import activation
    from .rope_config import context_length, parse_rope
    c = _Cfg(config, source)
    refuse_unsupported(c, arch)
    hidden = _int(c, arch, "hidden_size")
    heads = _int(c, arch, "num_attention_heads")
    if arch == "deepseek_v2" and hidden % heads:   # DeepseekV2Config.validate_architecture
        raise FormatError(f"{source}: hidden_size {hidden} is not a multiple of "
                          f"num_attention_heads {heads}")
    layers = _int(c, arch, "num_hidden_layers")
    max_pos = _int(c, arch, "max_position_embeddings")
    rope_dim = rope_head_dim(c, arch)
    theta, scaling = parse_rope(config, source, max_pos, rope_dim)
    rp = config.get("rope_scaling") or config.get("rope_parameters") or {}
    mla = mla_config(c, arch, rope_dim, rp if isinstance(rp, dict) else {},
                     scaling is not None, scaling.factor if scaling is not None else 1.0)
    sparse = (lite_sparse_layers(c, layers) if arch == "glm4_moe_lite" else
              first_dense_layers(c, arch, DEFAULTS[arch], layers))
    return dict(
        architecture=arch, vocab_size=_int(c, arch, "vocab_size"), hidden_size=hidden,
        intermediate_size=_int(c, arch, "intermediate_size"), num_layers=layers,
        # every head has its own key and value, expanded from the one latent
        num_heads=heads, num_kv_heads=heads, head_dim=rope_dim,
        rope_theta=theta, rope_scaling=scaling,
        rms_norm_eps=c.float("rms_norm_eps", DEFAULTS[arch]["rms_norm_eps"], ge=0, f32=True),
        attention_bias=False, o_proj_bias=False, mlp_bias=False,
        hidden_act=activation(c), qk_norm=False,
        tie_word_embeddings=c.bool("tie_word_embeddings", False),
        sliding_window=None, layer_windows=(0,) * layers,
        max_position_embeddings=max_pos, context_length=context_length(max_pos, scaling),
        moe=deepseek_moe(c, arch, DEFAULTS[arch], sparse), mla=mla,
        quantization=deepseek_quantization(config, source, arch))
