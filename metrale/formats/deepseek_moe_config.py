"""DeepSeek's mixture-of-experts block as config.json describes it, shared by the families
whose sparse MLP is DeepSeek's (transformers 5.25's modeling_*.py of each):
deepseek_v2 / deepseek_v3 (deepseek_config.py), glm4_moe (glm4_config.py) and glm4_moe_lite
(deepseek_config.py: DeepSeek-V3 under GLM's names).

    V3 router (`V3_ROUTERS`: deepseek_v3, glm4_moe, glm4_moe_lite; their HF TopkRouter is
    the same code): s = sigmoid(x @ Wg^T) (float32); choice = s + e_score_correction_bias;
        group score = sum of the top two choices of each of n_group groups; the topk_group
        best groups; top_k of choice inside them; w = s of the chosen (norm_topk_prob:
        / (sum + 1e-20)) * routed_scaling_factor
    V2 router: s = softmax(x @ Wg^T); topk_method "greedy": top_k of s;
        "group_limited_greedy": group score = max of the group, the topk_group best groups,
        top_k of s inside them; w = s of the chosen * routed_scaling_factor (never
        renormalised)
    out = sum_s w_s expert_{e_s}(x) + shared_experts(x)   (n_shared_experts experts fused as
        one MLP of width moe_intermediate_size * n_shared_experts)
Checkpoint keys of a sparse layer: `mlp.gate.weight` [E, hidden],
`mlp.gate.e_score_correction_bias` [E] (V3 router), `mlp.experts.{e}.{gate,up,down}_proj.weight`,
`mlp.shared_experts.{gate,up,down}_proj.weight`.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import FormatError, Unsupported
from .config_fields import _Cfg
from .moe_config import MAX_EXPERTS, MAX_TOP_K, MoeConfig

V3_ROUTERS = ("deepseek_v3", "glm4_moe", "glm4_moe_lite")
V2_TOPK_METHODS = ("greedy", "group_limited_greedy")


@dataclass(frozen=True)
class DeepseekRouting:
    """How a DeepSeek MoE block picks and weighs its experts (MoeConfig.deepseek)."""

    scoring: str               # "sigmoid" (V3 router) | "softmax" (V2)
    n_group: int               # 1: no group limit
    topk_group: int
    routed_scaling_factor: float
    correction_bias: bool      # V3: e_score_correction_bias joins the choice, not the weight


def sized(c: _Cfg, arch: str, defaults: dict, key: str, positive: bool = True) -> int:
    """An integer field, the HF class's default when absent; null refused (HF cannot run
    it)."""
    v = c.int(key, defaults[key], positive=positive)
    if v is None or (key in c.d and c.d[key] is None):
        raise FormatError(f"{c.source}: {key} is null ({arch}: transformers cannot run it)")
    return v


def first_dense_layers(c: _Cfg, arch: str, defaults: dict, n_layers: int) -> tuple[bool, ...]:
    """Per layer, sparse or not: layer i is a MoE block iff i >= first_k_dense_replace."""
    first = sized(c, arch, defaults, "first_k_dense_replace", positive=False)
    return tuple(i >= first for i in range(n_layers))


def refuse_routing(c: _Cfg, arch: str) -> None:
    """Routing fields whose other values would change the math, refused by name (transformers
    runs one router per family whatever they say; DeepSeek's own code would not)."""
    d = c.d
    if c.int("moe_layer_freq", 1) != 1:
        raise Unsupported(f"{c.source}: moe_layer_freq={d['moe_layer_freq']!r} is not "
                          f"supported: transformers' {arch} puts a MoE block on every sparse "
                          "layer (moe_layer_freq 1), DeepSeek's own code would skip layers; "
                          "the two differ")
    v3 = arch in V3_ROUTERS
    scoring, want = d.get("scoring_func"), "sigmoid" if v3 else "softmax"
    if scoring is not None and scoring != want:
        raise Unsupported(f"{c.source}: scoring_func={scoring!r} is not supported: "
                          f"transformers' {arch} router always scores with {want}")
    if v3:
        tm = d.get("topk_method")
        if tm is not None and tm != "noaux_tc":
            raise Unsupported(f"{c.source}: topk_method={tm!r} is not supported: "
                              f"transformers' {arch} router is noaux_tc (the corrected "
                              "scores choose, group-limited)")
    elif c.bool("norm_topk_prob", False):
        raise Unsupported(f"{c.source}: norm_topk_prob=true on {arch} is not supported: "
                          f"transformers' {arch} router never renormalises, DeepSeek's own "
                          "code would; the two differ")


def deepseek_moe(c: _Cfg, arch: str, defaults: dict, sparse: tuple[bool, ...]) -> MoeConfig:
    """The expert block: routed experts, their routing and the shared experts' width, on the
    layers `sparse` marks."""
    alias = "num_experts" if arch == "deepseek_v2" else "num_local_experts"   # attribute_map
    vals = {k: c.int(k) for k in ("n_routed_experts", alias) if c.d.get(k) is not None}
    if len(set(vals.values())) > 1:
        raise FormatError(f"{c.source}: {vals} disagree (aliases of n_routed_experts)")
    E = next(iter(vals.values())) if vals else defaults["n_routed_experts"]
    inter = sized(c, arch, defaults, "moe_intermediate_size")
    shared = c.int("n_shared_experts", defaults["n_shared_experts"], positive=False)
    shared = 0 if shared is None else shared
    scale = c.float("routed_scaling_factor", defaults["routed_scaling_factor"], f32=True)
    k = c.int("num_experts_per_tok", defaults["num_experts_per_tok"])
    v3 = arch in V3_ROUTERS
    if v3:
        n_group = sized(c, arch, defaults, "n_group")
        topk_group = sized(c, arch, defaults, "topk_group")
    else:
        method = c.d.get("topk_method", "greedy")
        if method not in V2_TOPK_METHODS:
            raise Unsupported(f"{c.source}: topk_method={method!r} is not supported "
                              f"({arch}: {', '.join(V2_TOPK_METHODS)})")
        limited = method == "group_limited_greedy"
        n_group = c.int("n_group") if limited else 1
        topk_group = c.int("topk_group") if limited else 1
        if limited and (n_group is None or topk_group is None):
            raise FormatError(f"{c.source}: topk_method group_limited_greedy needs n_group "
                              "and topk_group")
    if any(sparse):
        if k is None:
            raise FormatError(f"{c.source}: num_experts_per_tok is null but layer "
                              f"{sparse.index(True)} is a MoE block")
        if E % n_group:
            raise FormatError(f"{c.source}: n_routed_experts {E} is not a multiple of "
                              f"n_group {n_group}")
        if topk_group > n_group:
            raise FormatError(f"{c.source}: topk_group {topk_group} exceeds n_group {n_group}")
        if v3 and E // n_group < 2:
            raise FormatError(f"{c.source}: {arch} scores a group by its top two experts; "
                              f"{E} experts in {n_group} groups leave one a group")
        if k > topk_group * (E // n_group):
            raise FormatError(f"{c.source}: num_experts_per_tok {k} exceeds the "
                              f"{topk_group * (E // n_group)} experts of the topk_group "
                              f"{topk_group} groups it may choose from")
        if E > MAX_EXPERTS or k > MAX_TOP_K:
            raise Unsupported(f"{c.source}: n_routed_experts={E} / num_experts_per_tok={k}: "
                              f"the MoE kernels support at most {MAX_EXPERTS} experts and "
                              f"top-{MAX_TOP_K}")
    routing = DeepseekRouting("sigmoid" if v3 else "softmax", n_group, topk_group, scale, v3)
    norm = v3 and c.bool("norm_topk_prob", True)
    return MoeConfig(E, k or 1, norm, inter, inter * shared, sparse, "mlp",
                     ("gate_proj", "up_proj", "down_proj"), deepseek=routing)


def deepseek_moe_tensors(m, p: str) -> dict[str, tuple[int, ...]]:
    """A sparse layer's MoE block (prefix `p` = "model.layers.{i}."): the router, its
    correction bias (V3 router), the routed experts and the fused shared experts."""
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
