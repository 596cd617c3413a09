"""Mixture-of-experts decoders: qwen2_moe, qwen3_moe and mixtral, as transformers 5.25's
configuration_*.py / modeling_*.py resolve their config.json (field_table.py lists every
field).

The attention half of each family is a dense family's with its own defaults:
  qwen3_moe  qwen3's (q/k RMSNorm, `attention_bias` on q/k/v and o); head_dim absent ->
             hidden_size // num_attention_heads (not qwen3's 128); num_key_value_heads 4;
             `use_sliding_window` puts `sliding_window` (absent: 4096) on EVERY layer
             (max_window_layers / layer_types are not read).
  qwen2_moe  q/k/v biases by `qkv_bias` (default true), never o; num_key_value_heads 16;
             windows by `layer_types`, or without it on the even layers i < max_window_layers
             (HF's default list: "sliding" iff (i + 1) % 2 and i < max_window_layers).
  mixtral    mistral's (no biases) but `sliding_window` absent means none; 8 kv heads.
The MLP: layer i is a sparse MoE block iff i is not in `mlp_only_layers`, num_experts > 0
and (i + 1) % decoder_sparse_step == 0 (qwen; every layer of mixtral), else the dense
gated MLP of width intermediate_size. The block (HF `*SparseMoeBlock`):
  router_logits = x @ gate^T (float32 here, see model_engine/moe.py)
  p = softmax(router_logits) in float32; the top_k experts; w = p of the chosen
  (norm_topk_prob / mixtral: w /= sum(w)); out = sum_s w_s * expert_{e_s}(x)
  (mixtral too: transformers 5.25's MixtralTopKRouter takes the softmax over all experts,
  then the top-k, then renormalises, not a softmax over the chosen logits; the same
  weights in exact arithmetic, and this is the float32 formula it runs)
  qwen2_moe: + sigmoid(x @ shared_expert_gate^T) * shared_expert(x)
Checkpoint keys are the Hub's (what transformers 5.25's save_pretrained writes back):
`mlp.gate.weight` [E, hidden], `mlp.experts.{e}.{gate,up,down}_proj.weight`,
`mlp.shared_expert.*`, `mlp.shared_expert_gate.weight` [1, hidden]; mixtral
`block_sparse_moe.gate.weight`, `block_sparse_moe.experts.{e}.w1 (gate) / w3 (up) / w2
(down).weight`. The fused 3-D `experts.gate_up_proj` of transformers' in-memory modules is
not a checkpoint layout and is refused as unknown tensors.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import FormatError, Unsupported
from .config_fields import _Cfg

MOE_ARCHS = ("qwen2_moe", "qwen3_moe", "mixtral")
KV_HEADS_DEFAULT = {"qwen2_moe": 16, "qwen3_moe": 4, "mixtral": 8}
MAX_POSITIONS_DEFAULT = {"qwen2_moe": 32768, "qwen3_moe": 32768, "mixtral": 131072}
EXPERTS_DEFAULT = {"qwen2_moe": 60, "qwen3_moe": 128, "mixtral": 8}
TOP_K_DEFAULT = {"qwen2_moe": 4, "qwen3_moe": 8, "mixtral": 2}
WINDOW_DEFAULT = 4096
MAX_WINDOW_LAYERS_DEFAULT = 28
# The routing kernel keeps per-expert counts in shared memory and the router kernel holds
# a token's top-k in registers (kernels/moe_router.cu): the limits of those two.
MAX_EXPERTS = 512
MAX_TOP_K = 32


@dataclass(frozen=True)
class OssExperts:
    """gpt-oss's expert block (gpt_oss_config.py): a router with a bias, stacked expert
    tensors with biases (`mlp.experts.gate_up_proj` [E, hidden, 2I], gate and up columns
    interleaved; `down_proj` [E, I, hidden]), the clamped SwiGLU; `mxfp4`: the expert
    weights stored as MXFP4 blocks and scales."""

    swiglu_alpha: float
    swiglu_limit: float
    mxfp4: bool = False


@dataclass(frozen=True)
class MoeConfig:
    """The sparse MLP of a MoE decoder (ModelMetadata.moe)."""

    num_experts: int
    top_k: int                           # num_experts_per_tok
    norm_topk_prob: bool                 # renormalise the top-k weights (mixtral: always)
    expert_intermediate_size: int        # moe_intermediate_size (mixtral: intermediate_size)
    shared_expert_intermediate_size: int  # qwen2_moe's shared expert; 0: none
    sparse_layers: tuple[bool, ...]      # per layer: the MoE block (True) or the dense MLP
    block: str                           # checkpoint key of the block: "mlp" | "block_sparse_moe"
    expert_proj: tuple[str, str, str]    # gate, up, down tensor names of one expert
    oss: OssExperts | None = None        # gpt-oss's block (its own tensor layout)
    deepseek: object = None              # DeepSeek's routing (deepseek_moe_config.DeepseekRouting)

    @property
    def num_sparse_layers(self) -> int:
        return sum(self.sparse_layers)


def _null(c: _Cfg, key: str) -> bool:
    return key in c.d and c.d[key] is None


# -------------------------------------------------------------- the attention half
def kv_heads(c: _Cfg, arch: str) -> int:
    """num_key_value_heads: absent -> the class default; null refused (HF's strict config
    rejects it, or divides by it)."""
    if _null(c, "num_key_value_heads"):
        raise FormatError(f"{c.source}: num_key_value_heads is null ({arch}: transformers "
                          "cannot run it)")
    return c.int("num_key_value_heads", KV_HEADS_DEFAULT[arch])


def head_dim(c: _Cfg, arch: str, hidden: int, heads: int) -> int:
    """head_dim: explicit; absent -> hidden // heads (mixtral also when null; qwen*_moe read
    it with getattr, so null fails there and is refused)."""
    if arch != "mixtral" and _null(c, "head_dim"):
        raise FormatError(f"{c.source}: head_dim is null (transformers' {arch} cannot run "
                          "it either)")
    d = c.int("head_dim")
    if d is not None:
        return d
    if hidden % heads:
        raise FormatError(f"{c.source}: hidden_size {hidden} is not a multiple of "
                          f"num_attention_heads {heads} and no head_dim is given")
    return hidden // heads


def biases(c: _Cfg, arch: str) -> tuple[bool, bool, bool]:
    """(q/k/v, o_proj, mlp) biases: qwen2_moe `qkv_bias` (default true); qwen3_moe
    `attention_bias` on q/k/v and o; mixtral none; never on an MLP."""
    if arch == "qwen2_moe":
        return c.bool("qkv_bias", True), False, False
    if arch == "qwen3_moe":
        att = c.bool("attention_bias", False)
        return att, att, False
    return False, False, False


def _window(c: _Cfg, default):
    return None if _null(c, "sliding_window") else c.int("sliding_window", default)


def layer_windows(c: _Cfg, arch: str, n_layers: int) -> tuple[int | None, tuple[int, ...]]:
    """(sliding_window, per-layer window: 0 = full attention) as HF resolves them (see the
    module docstring)."""
    if arch == "mixtral":
        w = _window(c, None)
        return w, (w or 0,) * n_layers
    on = c.bool("use_sliding_window", False)
    w = _window(c, WINDOW_DEFAULT) if on else None
    if arch == "qwen3_moe":
        return w, (w or 0,) * n_layers
    # qwen2_moe without layer_types (with them decoder_fields reads them as qwen2's)
    mwl = c.int("max_window_layers", MAX_WINDOW_LAYERS_DEFAULT, positive=False)
    windows = tuple(w if w and (i + 1) % 2 and i < mwl else 0 for i in range(n_layers))
    return (w if any(windows) else None), windows


# -------------------------------------------------------------------- the MoE half
def _num_experts(c: _Cfg, arch: str) -> int:
    """qwen3_moe and mixtral alias num_experts and num_local_experts (HF attribute_map; when
    both are given HF keeps a different one per family, so differing values are refused);
    qwen2_moe reads num_experts only."""
    keys = ("num_experts",) if arch == "qwen2_moe" else ("num_experts", "num_local_experts")
    vals = {k: c.int(k, positive=False) for k in keys if c.d.get(k) is not None}
    if len(set(vals.values())) > 1:
        raise FormatError(f"{c.source}: num_experts={vals['num_experts']} and "
                          f"num_local_experts={vals['num_local_experts']} disagree (the same "
                          f"field in {arch})")
    return next(iter(vals.values())) if vals else EXPERTS_DEFAULT[arch]


def _sparse_layers(c: _Cfg, arch: str, n_layers: int, num_experts: int) -> tuple[bool, ...]:
    if arch == "mixtral":
        return (True,) * n_layers
    step = c.int("decoder_sparse_step", 1)
    only = c.d.get("mlp_only_layers")
    only = [] if only is None else only
    if not isinstance(only, list) or any(isinstance(i, bool) or not isinstance(i, int)
                                         for i in only):
        raise FormatError(f"{c.source}: mlp_only_layers must be a list of layer indices, "
                          f"got {only!r}")
    out = [i for i in only if not 0 <= i < n_layers]
    if out:
        raise FormatError(f"{c.source}: mlp_only_layers holds {out[0]}, outside the "
                          f"{n_layers} layers [0, {n_layers})")
    return tuple(i not in only and num_experts > 0 and (i + 1) % step == 0
                 for i in range(n_layers))


def moe_config(c: _Cfg, arch: str, n_layers: int, intermediate: int) -> MoeConfig:
    """The MoE fields of a qwen2_moe / qwen3_moe / mixtral config, checked."""
    E = _num_experts(c, arch)
    if arch == "mixtral" and E < 1:
        raise FormatError(f"{c.source}: num_local_experts must be >= 1 for mixtral, got {E}")
    sparse = _sparse_layers(c, arch, n_layers, E)
    k = c.int("num_experts_per_tok", TOP_K_DEFAULT[arch])
    if any(sparse):
        if k > E:
            raise FormatError(f"{c.source}: num_experts_per_tok={k} exceeds the expert count "
                              f"{E} (num_experts)")
        if E > MAX_EXPERTS or k > MAX_TOP_K:
            raise Unsupported(f"{c.source}: num_experts={E} / num_experts_per_tok={k}: the "
                              f"MoE kernels support at most {MAX_EXPERTS} experts and top-"
                              f"{MAX_TOP_K}")
    if arch == "mixtral":
        return MoeConfig(E, k, True, intermediate, 0, sparse, "block_sparse_moe",
                         ("w1", "w3", "w2"))
    shared = c.int("shared_expert_intermediate_size", 5632) if arch == "qwen2_moe" else 0
    return MoeConfig(E, k, c.bool("norm_topk_prob", False),
                     c.int("moe_intermediate_size", 1408 if arch == "qwen2_moe" else 768),
                     shared, sparse, "mlp", ("gate_proj", "up_proj", "down_proj"))


# ------------------------------------------------------------------- tensors and counts
def moe_layer_tensors(m, p: str) -> dict[str, tuple[int, ...]]:
    """The MoE block's tensors of one layer (prefix `p` = "model.layers.{i}.")."""
    moe, h = m.moe, m.hidden_size
    i, b = moe.expert_intermediate_size, f"{p}{moe.block}."
    gate, up, down = moe.expert_proj
    t = {b + "gate.weight": (moe.num_experts, h)}
    for e in range(moe.num_experts):
        t[f"{b}experts.{e}.{gate}.weight"] = (i, h)
        t[f"{b}experts.{e}.{up}.weight"] = (i, h)
        t[f"{b}experts.{e}.{down}.weight"] = (h, i)
    s = moe.shared_expert_intermediate_size
    if s:
        t[b + "shared_expert.gate_proj.weight"] = (s, h)
        t[b + "shared_expert.up_proj.weight"] = (s, h)
        t[b + "shared_expert.down_proj.weight"] = (h, s)
        t[b + "shared_expert_gate.weight"] = (1, h)
    return t


def expert_linear_shapes(m, p: str) -> dict[str, tuple[int, int]]:
    """HF module name -> (n, k) of the linears a quantization_config may quantize in the MoE
    block of layer prefix `p`: every expert's gate / up / down and the shared expert's (the
    router and the shared expert's one-row gate are read BF16, as releases keep them)."""
    moe, h = m.moe, m.hidden_size
    i, b = moe.expert_intermediate_size, f"{p}{moe.block}."
    gate, up, down = moe.expert_proj
    t = {}
    for e in range(moe.num_experts):
        t.update({f"{b}experts.{e}.{gate}": (i, h), f"{b}experts.{e}.{up}": (i, h),
                  f"{b}experts.{e}.{down}": (h, i)})
    s = moe.shared_expert_intermediate_size
    if s:
        t.update({b + "shared_expert.gate_proj": (s, h), b + "shared_expert.up_proj": (s, h),
                  b + "shared_expert.down_proj": (h, s)})
    return t


def expert_param_bytes(meta) -> float:
    """Device bytes of one routed-expert weight: 2 (BF16), or 17/32 for gpt-oss's MXFP4
    experts kept packed (a 4-bit code each and one scale byte per 32)."""
    moe = getattr(meta, "moe", None)
    return 17 / 32 if moe is not None and moe.oss is not None and moe.oss.mxfp4 else 2


def expert_parameters(meta) -> int:
    """Parameters of ONE routed expert (gate, up, down)."""
    return 3 * meta.moe.expert_intermediate_size * meta.hidden_size


def inactive_parameters(meta, n_rows: int = 1) -> int:
    """Routed-expert parameters a step over `n_rows` tokens does not read, expected over
    the routing: each of E experts of a layer is hit by at least one of n tokens choosing
    top_k each with probability 1 - (1 - k/E)^n under uniform routing (exact for n = 1:
    E - k experts idle). 0 for a dense model."""
    moe = getattr(meta, "moe", None)
    if moe is None or not moe.num_sparse_layers:
        return 0
    E, k = moe.num_experts, moe.top_k
    hit = E * (1.0 - (1.0 - k / E) ** max(int(n_rows), 1))
    return int(round((E - hit) * expert_parameters(meta))) * moe.num_sparse_layers


def rope_theta(config: dict, arch: str, theta: float) -> float:
    """mixtral's rope base when no rope_theta is given anywhere is its class default_theta
    1e6 (the others' is 10000, what rope_config.parse_rope returns)."""
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    given = "rope_theta" in config or (isinstance(rope, dict) and "rope_theta" in rope)
    return 1e6 if arch == "mixtral" and not given else theta
