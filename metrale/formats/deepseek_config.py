"""DeepSeek-V2 / V3 (`deepseek_v2`, `deepseek_v3`), as transformers 5.25's configuration_*.py
and modeling_*.py resolve config.json (deepseek_fields.py lists every field). Against the
Llama block:

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
  - MLP: layer i is a DeepSeek MoE block iff i >= first_k_dense_replace (else the dense
    MLP of intermediate_size); the block (`DeepseekRouting`):
        V3: s = sigmoid(x @ Wg^T) (float32); choice = s + e_score_correction_bias;
            group score = sum of the top two choices of each of n_group groups; the
            topk_group best groups; top_k of choice inside them; w = s of the chosen
            (norm_topk_prob: / (sum + 1e-20)) * routed_scaling_factor
        V2: s = softmax(x @ Wg^T); topk_method "greedy": top_k of s; "group_limited_greedy":
            group score = max of the group, the topk_group best groups, top_k of s inside
            them (others 0); w = s of the chosen * routed_scaling_factor (HF's V2 never
            renormalises)
        out = sum_s w_s expert_{e_s}(x) + shared_experts(x)   (n_shared_experts experts
            fused as one MLP of width moe_intermediate_size * n_shared_experts)
Checkpoint keys: `self_attn.{q_proj | q_a_proj, q_a_layernorm, q_b_proj}`,
`self_attn.kv_a_proj_with_mqa`, `self_attn.kv_a_layernorm`, `self_attn.kv_b_proj`,
`self_attn.o_proj`; `mlp.gate.weight` [E, hidden], `mlp.gate.e_score_correction_bias` [E]
(V3), `mlp.experts.{e}.{gate,up,down}_proj.weight`, `mlp.shared_experts.*`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from ..errors import FormatError, Unsupported
from .config_fields import _Cfg
from .moe_config import MAX_EXPERTS, MAX_TOP_K, MoeConfig

DEEPSEEK_ARCHS = ("deepseek_v2", "deepseek_v3")
# the HF classes' defaults (configuration_deepseek_v2.py / _v3.py)
DEFAULTS = {
    "deepseek_v3": dict(vocab_size=129280, hidden_size=7168, intermediate_size=18432,
                        moe_intermediate_size=2048, num_hidden_layers=61,
                        num_attention_heads=128, n_shared_experts=1, n_routed_experts=256,
                        routed_scaling_factor=2.5, kv_lora_rank=512, q_lora_rank=1536,
                        qk_rope_head_dim=64, v_head_dim=128, qk_nope_head_dim=128,
                        n_group=8, topk_group=4, num_experts_per_tok=8,
                        first_k_dense_replace=3, norm_topk_prob=True,
                        max_position_embeddings=4096, bos_token_id=0, eos_token_id=1),
    "deepseek_v2": dict(vocab_size=102400, hidden_size=4096, intermediate_size=11008,
                        moe_intermediate_size=1407, num_hidden_layers=32,
                        num_attention_heads=32, n_shared_experts=2, n_routed_experts=64,
                        routed_scaling_factor=1.0, kv_lora_rank=512, q_lora_rank=1536,
                        qk_rope_head_dim=64, v_head_dim=128, qk_nope_head_dim=128,
                        n_group=None, topk_group=None, num_experts_per_tok=None,
                        first_k_dense_replace=0, norm_topk_prob=False,
                        max_position_embeddings=2048, bos_token_id=1, eos_token_id=2),
}
# The widest latent row (kv_lora_rank + qk_rope_head_dim) the MLA decode kernel keeps per
# CTA in shared memory: V3's 576 with room.
MAX_LATENT_DIM = 1024
V2_TOPK_METHODS = ("greedy", "group_limited_greedy")


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


@dataclass(frozen=True)
class DeepseekRouting:
    """How a DeepSeek MoE block picks and weighs its experts (MoeConfig.deepseek)."""

    scoring: str               # "sigmoid" (V3) | "softmax" (V2)
    n_group: int               # 1: no group limit
    topk_group: int
    routed_scaling_factor: float
    correction_bias: bool      # V3: e_score_correction_bias joins the choice, not the weight


def _default(c: _Cfg, arch: str, key: str):
    return DEFAULTS[arch][key]


def _int(c: _Cfg, arch: str, key: str, positive=True) -> int:
    v = c.int(key, _default(c, arch, key), positive=positive)
    if v is None or (key in c.d and c.d[key] is None):
        raise FormatError(f"{c.source}: {key} is null ({arch}: transformers cannot run it)")
    return v


def refuse_unsupported(c: _Cfg, arch: str) -> None:
    """Values of fields that would change the math and that metrale does not implement,
    refused by name (deepseek_fields.py says why each)."""
    d = c.d
    for key in ("attention_bias", "mlp_bias"):
        if c.bool(key, False):
            raise Unsupported(f"{c.source}: {key}=true on {arch} is not supported (the MLA "
                              "projections and DeepSeek MLPs are bias-free here)")
    if c.int("moe_layer_freq", 1) != 1:
        raise Unsupported(f"{c.source}: moe_layer_freq={d['moe_layer_freq']!r} is not "
                          f"supported: transformers' {arch} puts a MoE block on every layer "
                          "from first_k_dense_replace on (moe_layer_freq 1), DeepSeek's own "
                          "code would skip layers; the two differ")
    prf = d.get("partial_rotary_factor")
    if prf is not None and prf != 1:
        raise Unsupported(f"{c.source}: partial_rotary_factor={prf!r} on {arch} is not "
                          "supported (the rope turns all qk_rope_head_dim dims)")
    scoring = d.get("scoring_func")
    want = "sigmoid" if arch == "deepseek_v3" else "softmax"
    if scoring is not None and scoring != want:
        raise Unsupported(f"{c.source}: scoring_func={scoring!r} is not supported: "
                          f"transformers' {arch} router always scores with {want}")
    if arch == "deepseek_v3":
        tm = d.get("topk_method")
        if tm is not None and tm != "noaux_tc":
            raise Unsupported(f"{c.source}: topk_method={tm!r} is not supported: "
                              "transformers' deepseek_v3 router is noaux_tc (the corrected "
                              "scores choose, group-limited)")
    elif c.bool("norm_topk_prob", False):
        raise Unsupported(f"{c.source}: norm_topk_prob=true on deepseek_v2 is not supported: "
                          "transformers' deepseek_v2 router never renormalises, DeepSeek's "
                          "own code would; the two differ")


def deepseek_quantization(config: dict, source: str, arch: str):
    """The quantization_config of a DeepSeek checkpoint (None without one): fine-grained FP8
    as DeepSeek-V3 is released (e4m3 block-scaled linears with weight_scale_inv; the
    routers, norms, embeddings and the head stay BF16). Other methods: Unsupported."""
    from .quant.parse import parse_quantization
    if config.get("quantization_config") is None:
        return None
    q = parse_quantization(config, source)
    if q.method != "fp8":
        raise Unsupported(f"{source}: quantization_config (quant_method={q.method!r}) on a "
                          f"{arch} checkpoint is not supported (fine-grained fp8, the form "
                          "DeepSeek-V3 is released in, is)")
    return q


def mla_config(c: _Cfg, arch: str, rope_parameters: dict, rope_scaled: bool,
               yarn_factor: float) -> MlaConfig:
    """The attention's ranks and dims, checked, and its softmax scale."""
    q_lora = c.d.get("q_lora_rank", _default(c, arch, "q_lora_rank"))
    q_lora = 0 if q_lora is None else c.int("q_lora_rank")
    dims = {k: _int(c, arch, k) for k in ("kv_lora_rank", "qk_nope_head_dim",
                                          "qk_rope_head_dim", "v_head_dim")}
    if dims["qk_rope_head_dim"] % 2:
        raise FormatError(f"{c.source}: qk_rope_head_dim must be even (rope pairs), got "
                          f"{dims['qk_rope_head_dim']}")
    latent = dims["kv_lora_rank"] + dims["qk_rope_head_dim"]
    if latent > MAX_LATENT_DIM or dims["v_head_dim"] > MAX_LATENT_DIM or \
            dims["qk_nope_head_dim"] > MAX_LATENT_DIM:
        raise Unsupported(f"{c.source}: kv_lora_rank + qk_rope_head_dim = {latent} (or a head "
                          f"dim) exceeds the MLA kernels' {MAX_LATENT_DIM}")
    pairs = True if arch == "deepseek_v2" else c.bool("rope_interleave", True)
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


def moe(c: _Cfg, arch: str, n_layers: int) -> MoeConfig:
    """The expert block: routed experts, their routing, the shared experts' width and which
    layers are sparse."""
    alias = "num_local_experts" if arch == "deepseek_v3" else "num_experts"   # attribute_map
    vals = {k: c.int(k) for k in ("n_routed_experts", alias) if c.d.get(k) is not None}
    if len(set(vals.values())) > 1:
        raise FormatError(f"{c.source}: {vals} disagree (aliases of n_routed_experts)")
    E = next(iter(vals.values())) if vals else _default(c, arch, "n_routed_experts")
    first = _int(c, arch, "first_k_dense_replace", positive=False)
    sparse = tuple(i >= first for i in range(n_layers))
    inter = _int(c, arch, "moe_intermediate_size")
    shared = c.int("n_shared_experts", _default(c, arch, "n_shared_experts"), positive=False)
    shared = 0 if shared is None else shared
    scale = c.float("routed_scaling_factor", _default(c, arch, "routed_scaling_factor"),
                    f32=True)
    k = c.int("num_experts_per_tok", _default(c, arch, "num_experts_per_tok"))
    if arch == "deepseek_v3":
        n_group = _int(c, arch, "n_group")
        topk_group = _int(c, arch, "topk_group")
        limited = True
    else:
        method = c.d.get("topk_method", "greedy")
        if method not in V2_TOPK_METHODS:
            raise Unsupported(f"{c.source}: topk_method={method!r} is not supported "
                              f"(deepseek_v2: {', '.join(V2_TOPK_METHODS)})")
        limited = method == "group_limited_greedy"
        n_group = c.int("n_group") if limited else 1
        topk_group = c.int("topk_group") if limited else 1
        if limited and (n_group is None or topk_group is None):
            raise FormatError(f"{c.source}: topk_method group_limited_greedy needs n_group "
                              "and topk_group")
    if any(sparse):
        if k is None:
            raise FormatError(f"{c.source}: num_experts_per_tok is null but layers "
                              f"{first}.. are MoE blocks")
        if E % n_group:
            raise FormatError(f"{c.source}: n_routed_experts {E} is not a multiple of "
                              f"n_group {n_group}")
        if topk_group > n_group:
            raise FormatError(f"{c.source}: topk_group {topk_group} exceeds n_group {n_group}")
        if arch == "deepseek_v3" and E // n_group < 2:
            raise FormatError(f"{c.source}: deepseek_v3 scores a group by its top two "
                              f"experts; {E} experts in {n_group} groups leave one a group")
        if k > topk_group * (E // n_group):
            raise FormatError(f"{c.source}: num_experts_per_tok {k} exceeds the "
                              f"{topk_group * (E // n_group)} experts of the topk_group "
                              f"{topk_group} groups it may choose from")
        if E > MAX_EXPERTS or k > MAX_TOP_K:
            raise Unsupported(f"{c.source}: n_routed_experts={E} / num_experts_per_tok={k}: "
                              f"the MoE kernels support at most {MAX_EXPERTS} experts and "
                              f"top-{MAX_TOP_K}")
    routing = DeepseekRouting("sigmoid" if arch == "deepseek_v3" else "softmax",
                              n_group, topk_group, scale, arch == "deepseek_v3")
    norm = arch == "deepseek_v3" and c.bool("norm_topk_prob", True)
    return MoeConfig(E, k or 1, norm, inter, inter * shared, sparse, "mlp",
                     ("gate_proj", "up_proj", "down_proj"), deepseek=routing)


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


def deepseek_moe_tensors(m, p: str) -> dict[str, tuple[int, ...]]:
    """A sparse layer's MoE block: the router, its correction bias (V3), the routed experts
    and the fused shared experts."""
    moe, h, b = m.moe, m.hidden_size, p + "mlp."
    i = moe.expert_intermediate_size
    t = {b + "gate.weight": (moe.num_experts, h)}
    if moe.deepseek.correction_bias:
        t[b + "gate.e_score_correction_bias"] = (moe.num_experts,)
    for e in range(moe.num_experts):
        t[f"{b}experts.{e}.gate_proj.weight"] = (i, h)
        t[f"{b}experts.{e}.up_proj.weight"] = (i, h)
        t[f"{b}experts.{e}.down_proj.weight"] = (h, i)
    s = moe.shared_expert_intermediate_size
    if s:
        t[b + "shared_experts.gate_proj.weight"] = (s, h)
        t[b + "shared_experts.up_proj.weight"] = (s, h)
        t[b + "shared_experts.down_proj.weight"] = (h, s)
    return t


def mtp_prefixes(config: dict) -> tuple[str, ...]:
    """The tensor-name prefixes of DeepSeek-V3's MTP layers, `model.layers.{num_hidden_layers
    + j}.` for j < num_nextn_predict_layers: not part of the main model (transformers ignores
    them, `_keys_to_ignore_on_load_unexpected`); the first loads as the draft proposer when
    present (model_engine/mtp.py checks and uploads it), the others stay unread. () for any
    other model_type."""
    if config.get("model_type") != "deepseek_v3":
        return ()
    n = config.get("num_hidden_layers", DEFAULTS["deepseek_v3"]["num_hidden_layers"])
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


def deepseek_fields(config: dict, source: str, arch: str) -> dict:
    """ModelMetadata's fields of a deepseek_v2 / deepseek_v3 config (all but the token ids
    and the dtype, which metadata.py reads as for every family)."""
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
    rope_dim = _int(c, arch, "qk_rope_head_dim")
    theta, scaling = parse_rope(config, source, max_pos, rope_dim)
    rp = config.get("rope_scaling") or config.get("rope_parameters") or {}
    mla = mla_config(c, arch, rp if isinstance(rp, dict) else {}, scaling is not None,
                     scaling.factor if scaling is not None else 1.0)
    return dict(
        architecture=arch, vocab_size=_int(c, arch, "vocab_size"), hidden_size=hidden,
        intermediate_size=_int(c, arch, "intermediate_size"), num_layers=layers,
        # every head has its own key and value, expanded from the one latent
        num_heads=heads, num_kv_heads=heads, head_dim=rope_dim,
        rope_theta=theta, rope_scaling=scaling,
        rms_norm_eps=c.float("rms_norm_eps", 1e-6, ge=0, f32=True),
        attention_bias=False, o_proj_bias=False, mlp_bias=False,
        hidden_act=activation(c), qk_norm=False,
        tie_word_embeddings=c.bool("tie_word_embeddings", False),
        sliding_window=None, layer_windows=(0,) * layers,
        max_position_embeddings=max_pos, context_length=context_length(max_pos, scaling),
        moe=moe(c, arch, layers), mla=mla,
        quantization=deepseek_quantization(config, source, arch))
