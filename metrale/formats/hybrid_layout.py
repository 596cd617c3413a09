"""The tensors of a hybrid linear-attention checkpoint (hybrid_config.py), HF key names as
transformers 5.25 saves them; the qwen3_5 / qwen3_5_moe wrappers' `model.language_model.*`
names are read as `model.*` (`canonical_name`, applied by DirectorySource).

Skipped by name (`skipped`): the multi-token-prediction head `mtp.*` (transformers ignores it
too: `_keys_to_ignore_on_load_unexpected`) and a wrapper's vision tower `model.visual.*`
(metrale runs the text model). Any other tensor the layout does not list is refused.
"""
from __future__ import annotations

from .moe_config import moe_layer_tensors

SKIPPED_PREFIXES = ("mtp.", "model.visual.")
_WRAPPED = ("qwen3_5", "qwen3_5_moe")


def canonical_name(model_type, raw: str) -> str:
    """A wrapper's text-model tensor name as the text model's own checkpoints name it."""
    if model_type in _WRAPPED and raw.startswith("model.language_model."):
        return "model." + raw[len("model.language_model."):]
    return raw


def skipped(name: str) -> bool:
    """Whether a checkpoint tensor is one this runtime skips by name (module docstring)."""
    return name.startswith(SKIPPED_PREFIXES)


def gdn_tensors(g, p: str, hidden: int) -> dict[str, tuple[int, ...]]:
    """A gated DeltaNet layer's tensors (prefix p = "model.layers.{i}.linear_attn.")."""
    t = {p + "A_log": (g.num_v_heads,), p + "dt_bias": (g.num_v_heads,),
         p + "conv1d.weight": (g.conv_dim, 1, g.conv_kernel),
         p + "norm.weight": (g.v_head_dim,), p + "out_proj.weight": (hidden, g.value_dim)}
    if g.fused_projections:
        t[p + "in_proj_qkvz.weight"] = (2 * g.key_dim + 2 * g.value_dim, hidden)
        t[p + "in_proj_ba.weight"] = (2 * g.num_v_heads, hidden)
    else:
        t[p + "in_proj_qkv.weight"] = (g.conv_dim, hidden)
        t[p + "in_proj_z.weight"] = (g.value_dim, hidden)
        t[p + "in_proj_b.weight"] = (g.num_v_heads, hidden)
        t[p + "in_proj_a.weight"] = (g.num_v_heads, hidden)
    return t


def nemotron_tensors(m) -> dict[str, tuple[int, ...]]:
    """Every tensor of a Nemotron-H checkpoint (formats/nemotron_config.py)."""
    h, hd, mb = m.hidden_size, m.head_dim, m.hybrid.mamba
    t: dict[str, tuple[int, ...]] = {"backbone.embeddings.weight": (m.vocab_size, h)}
    for n, kind in enumerate(m.hybrid.layer_types):
        p = f"backbone.layers.{n}."
        t[p + "norm.weight"] = (h,)
        x = p + "mixer."
        if kind == "mamba":
            t.update({x + "A_log": (mb.num_heads,), x + "D": (mb.num_heads,),
                      x + "dt_bias": (mb.num_heads,),
                      x + "conv1d.weight": (mb.conv_dim, 1, mb.conv_kernel),
                      x + "in_proj.weight": (mb.proj_dim, h), x + "norm.weight": (mb.inner,),
                      x + "out_proj.weight": (h, mb.inner)})
            if mb.conv_bias:
                t[x + "conv1d.bias"] = (mb.conv_dim,)
        elif kind == "full_attention":
            t.update({x + "q_proj.weight": (m.num_heads * hd, h),
                      x + "k_proj.weight": (m.num_kv_heads * hd, h),
                      x + "v_proj.weight": (m.num_kv_heads * hd, h),
                      x + "o_proj.weight": (h, m.num_heads * hd)})
        else:   # mlp: down(relu(up(x))^2)
            t[x + "up_proj.weight"] = (m.intermediate_size, h)
            t[x + "down_proj.weight"] = (h, m.intermediate_size)
    t["backbone.norm_f.weight"] = (h,)
    if not m.tie_word_embeddings:
        t["lm_head.weight"] = (m.vocab_size, h)
    return t


def hybrid_tensors(m) -> dict[str, tuple[int, ...]]:
    """Every tensor of a hybrid decoder: HF key name -> shape ([out, in] for linears)."""
    if m.hybrid.mamba is not None:
        return nemotron_tensors(m)
    h, hd, hy = m.hidden_size, m.head_dim, m.hybrid
    q, kv = m.num_heads * hd, m.num_kv_heads * hd
    t: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (m.vocab_size, h)}
    for n, kind in enumerate(hy.layer_types):
        p = f"model.layers.{n}."
        t[p + "input_layernorm.weight"] = (h,)
        t[p + "post_attention_layernorm.weight"] = (h,)
        if kind == "linear_attention":
            t.update(gdn_tensors(hy.gdn, p + "linear_attn.", h))
        else:
            a = p + "self_attn."
            t[a + "q_proj.weight"] = (2 * q, h)   # q and its output gate, per head
            t[a + "k_proj.weight"] = (kv, h)
            t[a + "v_proj.weight"] = (kv, h)
            t[a + "o_proj.weight"] = (h, q)
            t[a + "q_norm.weight"] = (hd,)
            t[a + "k_norm.weight"] = (hd,)
        if m.moe is not None and m.moe.sparse_layers[n]:
            t.update(moe_layer_tensors(m, p))
        else:
            i = m.intermediate_size
            t[p + "mlp.gate_proj.weight"] = (i, h)
            t[p + "mlp.up_proj.weight"] = (i, h)
            t[p + "mlp.down_proj.weight"] = (h, i)
    t["model.norm.weight"] = (h,)
    if not m.tie_word_embeddings:
        t["lm_head.weight"] = (m.vocab_size, h)
    return t
