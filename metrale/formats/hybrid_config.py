"""Hybrid linear-attention decoders: Qwen3-Next (`qwen3_next`) and Qwen3.5 (`qwen3_5_text`,
`qwen3_5_moe_text`, and the `qwen3_5` / `qwen3_5_moe` checkpoints whose `text_config` is one
of them), as transformers 5.25's configuration_*.py / modeling_*.py resolve their config.json
(hybrid_fields.py lists every field).

Layers follow `layer_types` ("linear_attention" | "full_attention"; absent: every
`full_attention_interval`-th layer, default 4, is full attention):
  linear_attention  gated DeltaNet: in_proj -> q|k|v (conv1d + SiLU over them, with its state)
                    z, b, a; g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b); the
                    gated delta rule (q/k L2-normed) with its FP32 state; the gated RMSNorm
                    norm(o) * silu(z) per value head; out_proj.
                    qwen3_next stores in_proj_qkvz / in_proj_ba interleaved per key head
                    ([q k v z] and [b a] of each group); qwen3_5 in_proj_qkv, _z, _b, _a.
  full_attention    q_proj gives q and an output gate per head ([q_h | gate_h] rows); q/k
                    RMSNorm (1 + w); rotary on the first rotary_dim = head_dim *
                    partial_rotary_factor (default 0.25) dims; attn * sigmoid(gate); o_proj.
Every RMSNorm but the gated one is zero-centred: x * rsqrt(mean(x^2) + eps) * (1 + w).
The MLP: qwen3_5_text dense; qwen3_5_moe_text every layer a sparse block with a shared expert
and its sigmoid gate (top-k weights renormalised); qwen3_next sparse where qwen3_moe's rule
says (mlp_only_layers, decoder_sparse_step, num_experts > 0), else dense.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import FormatError, Unsupported
from .config_fields import KERNEL_MAX_HEAD_DIM, _Cfg
from .moe_config import MAX_EXPERTS, MAX_TOP_K, MoeConfig
from .nemotron_config import Mamba2Config, nemotron_fields
from .rope_config import context_length, partial_rope

QWEN_HYBRID = ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text")
WRAPPERS = {"qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text"}   # text_config
HYBRID_ARCHS = QWEN_HYBRID + tuple(WRAPPERS) + ("nemotron_h",)
LAYER_TYPES = ("linear_attention", "full_attention")
KV_HEADS_DEFAULT = {"qwen3_next": 2, "qwen3_5_text": 4, "qwen3_5_moe_text": 2}
# the kernels' limits (ops/gated_delta_rule.py, ops/causal_conv1d.py)
MAX_CONV_KERNEL, MAX_KEY_HEAD_DIM = 4, 128


@dataclass(frozen=True)
class GatedDeltaNetConfig:
    """The linear-attention layers' shapes."""

    num_k_heads: int
    num_v_heads: int
    k_head_dim: int
    v_head_dim: int
    conv_kernel: int
    fused_projections: bool   # qwen3_next: in_proj_qkvz / in_proj_ba, grouped per key head

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.k_head_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.v_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the conv: q | k | v."""
        return 2 * self.key_dim + self.value_dim

    @property
    def proj_dim(self) -> int:
        """Columns of the fused input projection: q | k | v | z | b | a."""
        return self.conv_dim + self.value_dim + 2 * self.num_v_heads


@dataclass(frozen=True)
class HybridConfig:
    """ModelMetadata.hybrid: which layers are recurrent and how (None for the others).
    layer_types: "linear_attention" (gated DeltaNet), "full_attention", and Nemotron-H's
    "mamba" (Mamba2) and "mlp" (a block that is only an MLP)."""

    layer_types: tuple[str, ...]
    gdn: GatedDeltaNetConfig | None
    rotary_dim: int              # rotated dims of a full-attention head (0: no rotary)
    text_config_key: str | None  # "text_config" for the qwen3_5 / qwen3_5_moe wrappers
    mamba: Mamba2Config | None = None

    @property
    def attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == "full_attention")

    @property
    def recurrent_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types)
                     if t in ("linear_attention", "mamba"))

    @property
    def chunk(self) -> int:
        """The recurrent kernels' chunk: prefills split at its multiples keep their bits."""
        return self.mamba.chunk_size if self.mamba is not None else 64

    def state_shape(self) -> tuple[int, int]:
        """(FP32 state elements, BF16 conv-window elements) of one recurrent layer."""
        if self.mamba is not None:
            m = self.mamba
            return m.num_heads * m.head_dim * m.d_state, (m.conv_kernel - 1) * m.conv_dim
        g = self.gdn
        return g.num_v_heads * g.k_head_dim * g.v_head_dim, (g.conv_kernel - 1) * g.conv_dim

    def state_bytes(self) -> int:
        """One sequence's recurrent state: per recurrent layer the FP32 state and the BF16
        conv window (the last conv_kernel - 1 inputs)."""
        state, conv = self.state_shape()
        return (state * 4 + conv * 2) * len(self.recurrent_layers)


def text_config(config: dict, arch: str, source: str) -> tuple[dict, str, str]:
    """(the decoder's config dict, its model_type, its source name) of a hybrid config."""
    if arch not in WRAPPERS:
        return config, arch, source
    text = config.get("text_config")
    if not isinstance(text, dict):
        raise FormatError(f"{source}: {arch} needs a text_config object")
    want = WRAPPERS[arch]
    if text.get("model_type", want) != want:
        raise Unsupported(f"{source}: text_config.model_type {text.get('model_type')!r} in a "
                          f"{arch} checkpoint is not supported (expected {want!r})")
    top, inner = config.get("tie_word_embeddings"), text.get("tie_word_embeddings")
    if top is not None and inner is not None and top != inner:
        raise FormatError(f"{source}: tie_word_embeddings is {top} at the top level but "
                          f"{inner} in text_config; refused rather than guessing which one "
                          "transformers ties")
    return text, want, f"{source} (text_config)"


def _layer_types(c: _Cfg, n_layers: int) -> tuple[str, ...]:
    types = c.d.get("layer_types")
    if types is None:
        interval = c.int("full_attention_interval", 4)
        return tuple("linear_attention" if (i + 1) % interval else "full_attention"
                     for i in range(n_layers))
    if not isinstance(types, list) or len(types) != n_layers:
        raise FormatError(f"{c.source}: layer_types must list one type per layer "
                          f"({n_layers}), got {types!r}")
    bad = [t for t in types if t not in LAYER_TYPES]
    if bad:
        raise Unsupported(f"{c.source}: layer_types value {bad[0]!r} is not supported "
                          f"(supported: {', '.join(LAYER_TYPES)})")
    return tuple(types)


def _gdn(c: _Cfg, arch: str) -> GatedDeltaNetConfig:
    g = GatedDeltaNetConfig(
        num_k_heads=c.int("linear_num_key_heads", 16),
        num_v_heads=c.int("linear_num_value_heads", 32),
        k_head_dim=c.int("linear_key_head_dim", 128),
        v_head_dim=c.int("linear_value_head_dim", 128),
        conv_kernel=c.int("linear_conv_kernel_dim", 4),
        fused_projections=arch == "qwen3_next")
    if g.num_v_heads % g.num_k_heads:
        raise FormatError(f"{c.source}: linear_num_value_heads {g.num_v_heads} is not a "
                          f"multiple of linear_num_key_heads {g.num_k_heads}")
    if g.k_head_dim % 16 or g.k_head_dim > MAX_KEY_HEAD_DIM:
        raise Unsupported(f"{c.source}: linear_key_head_dim {g.k_head_dim} is not supported "
                          f"(the gated delta rule kernels take a multiple of 16 up to "
                          f"{MAX_KEY_HEAD_DIM})")
    if g.v_head_dim % 32:
        raise Unsupported(f"{c.source}: linear_value_head_dim {g.v_head_dim} is not "
                          "supported (the gated delta rule kernels take a multiple of 32)")
    if not 2 <= g.conv_kernel <= MAX_CONV_KERNEL:
        raise Unsupported(f"{c.source}: linear_conv_kernel_dim {g.conv_kernel} is not "
                          f"supported (the causal conv kernels take 2..{MAX_CONV_KERNEL})")
    return g


def _moe(c: _Cfg, arch: str, n_layers: int, intermediate: int | None) -> MoeConfig | None:
    if arch == "qwen3_5_text":
        return None
    E = c.int("num_experts", 512 if arch == "qwen3_next" else 256, positive=False)
    k = c.int("num_experts_per_tok", 10 if arch == "qwen3_next" else 8)
    if arch == "qwen3_next":
        step = c.int("decoder_sparse_step", 1)
        only = c.d.get("mlp_only_layers") or []
        if not isinstance(only, list) or any(isinstance(i, bool) or not isinstance(i, int)
                                             or not 0 <= i < n_layers for i in only):
            raise FormatError(f"{c.source}: mlp_only_layers must list layer indices in "
                              f"[0, {n_layers}), got {only!r}")
        sparse = tuple(i not in only and E > 0 and (i + 1) % step == 0
                       for i in range(n_layers))
        norm = c.bool("norm_topk_prob", True)
    else:
        if E < 1:
            raise FormatError(f"{c.source}: num_experts must be >= 1 for {arch}, got {E}")
        sparse, norm = (True,) * n_layers, True   # HF renormalises unconditionally
    if any(sparse):
        if k > E:
            raise FormatError(f"{c.source}: num_experts_per_tok={k} exceeds num_experts {E}")
        if E > MAX_EXPERTS or k > MAX_TOP_K:
            raise Unsupported(f"{c.source}: num_experts={E} / num_experts_per_tok={k}: the "
                              f"MoE kernels support at most {MAX_EXPERTS} experts and top-"
                              f"{MAX_TOP_K}")
    if not all(sparse) and intermediate is None:
        raise FormatError(f"{c.source}: missing key 'intermediate_size' (the dense layers)")
    return MoeConfig(E, k, norm, c.int("moe_intermediate_size", 512),
                     c.int("shared_expert_intermediate_size", 512), sparse, "mlp",
                     ("gate_proj", "up_proj", "down_proj"))


def hybrid_fields(config: dict, source: str, arch: str) -> dict:
    """ModelMetadata keyword arguments of a hybrid config (all but the token ids and
    dtype, which metadata.py reads as for every decoder)."""
    if arch == "nemotron_h":
        fields, kinds, mamba = nemotron_fields(config, source)
        return dict(fields, hybrid=HybridConfig(kinds, None, 0, None, mamba))
    text, tarch, tsource = text_config(config, arch, source)
    c = _Cfg(text, tsource)
    if c.bool("attention_bias", False):
        raise Unsupported(f"{tsource}: attention_bias=true is not supported for {tarch} "
                          "(the gated q_proj's bias would need its rows regrouped; no "
                          "released checkpoint has one)")
    act = c.d.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise Unsupported(f"{tsource}: hidden_act={act!r} is not supported for {tarch}: it "
                          "also activates the linear-attention conv, which the causal conv "
                          "kernels compute with SiLU only")
    hidden = c.int("hidden_size", required=True)
    heads = c.int("num_attention_heads", required=True)
    kv = c.int("num_key_value_heads", KV_HEADS_DEFAULT[tarch])
    head_dim = c.int("head_dim", 256)
    if heads % kv:
        raise FormatError(f"{tsource}: num_attention_heads {heads} is not a multiple of "
                          f"num_key_value_heads {kv}")
    if head_dim % 2 or head_dim > KERNEL_MAX_HEAD_DIM:
        raise Unsupported(f"{tsource}: head_dim {head_dim} is not supported (even, at most "
                          f"{KERNEL_MAX_HEAD_DIM})")
    layers = c.int("num_hidden_layers", required=True)
    max_pos = c.int("max_position_embeddings", 32768)
    theta, scaling, rotary = partial_rope(c, max_pos, head_dim, 0.25)
    types = _layer_types(c, layers)
    inter = c.int("intermediate_size", None if tarch == "qwen3_5_moe_text" else 5632)
    moe = _moe(c, tarch, layers, inter)
    tie = c.bool("tie_word_embeddings", False)
    if arch in WRAPPERS:
        tie = tie or _Cfg(config, source).bool("tie_word_embeddings", False)
    return dict(
        architecture=arch, vocab_size=c.int("vocab_size", required=True),
        hidden_size=hidden, intermediate_size=inter or 0, num_layers=layers,
        num_heads=heads, num_kv_heads=kv, head_dim=head_dim, rope_theta=theta,
        rope_scaling=scaling, rms_norm_eps=c.float("rms_norm_eps", 1e-6, ge=0, f32=True),
        attention_bias=False, qk_norm=True, tie_word_embeddings=tie, sliding_window=None,
        max_position_embeddings=max_pos, hidden_act=act,
        layer_windows=(0,) * layers, context_length=context_length(max_pos, scaling), moe=moe,
        hybrid=HybridConfig(types, _gdn(c, tarch) if "linear_attention" in types else None,
                            rotary, "text_config" if arch in WRAPPERS else None))
