"""Which modules of a base model a PEFT LoRA config adapts: PEFT's matching rules
(`check_target_module_exists`, `_maybe_include_all_linear_layers`) over the module names the
HF model of this checkpoint has.

Matching, as PEFT does it for a module name (e.g. `model.layers.3.self_attn.q_proj`):
  exclude_modules   a string: re.fullmatch excludes; a list: the name itself or `.<entry>`
                    as its suffix excludes
  target_modules    a string: re.fullmatch ("all-linear": every linear but the output head);
                    a list: the name itself, or `.<entry>` as its suffix; with a list,
                    layers_to_transform keeps only those layer indices (the first number after
                    `<layers_pattern>.`, or after any `.<name>.` when no pattern is given)
Served: the seven dense projections of a decoder layer (`SERVED`). A target that matches
the embedding, the output head, a mixture-of-experts router, expert or shared expert is
refused by name.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from ...errors import Unsupported

# HF module suffix -> (fused group on the device, part within it)
SERVED = {"self_attn.q_proj": ("qkv", 0), "self_attn.k_proj": ("qkv", 1),
          "self_attn.v_proj": ("qkv", 2), "self_attn.o_proj": ("o", 0),
          "mlp.gate_proj": ("gate_up", 0), "mlp.up_proj": ("gate_up", 1),
          "mlp.down_proj": ("down", 0)}


@dataclass(frozen=True)
class BaseModule:
    """One nn.Linear / nn.Embedding of the HF model: its name, layer, kind and shape."""

    name: str              # e.g. "model.layers.0.self_attn.q_proj"
    layer: int | None
    kind: str              # a SERVED suffix, or "embedding", "lm_head", "router", "expert",
    #                        "shared_expert"
    shape: tuple[int, int] | None    # (out_features, in_features) of a served module
    linear: bool = True


def base_modules(meta) -> list[BaseModule]:
    """Every module of the HF model a LoRA target may name, served or not."""
    h, d = meta.hidden_size, meta.head_dim
    q, kv, inter = meta.num_heads * d, meta.num_kv_heads * d, meta.intermediate_size
    dims = {"self_attn.q_proj": (q, h), "self_attn.k_proj": (kv, h),
            "self_attn.v_proj": (kv, h), "self_attn.o_proj": (h, q),
            "mlp.gate_proj": (inter, h), "mlp.up_proj": (inter, h),
            "mlp.down_proj": (h, inter)}
    out = [BaseModule("model.embed_tokens", None, "embedding", None, linear=False)]
    moe = getattr(meta, "moe", None)
    for i in range(meta.num_layers):
        p = f"model.layers.{i}."
        sparse = moe is not None and moe.sparse_layers[i]
        for suffix, shape in dims.items():
            if sparse and suffix.startswith("mlp."):
                continue
            out.append(BaseModule(p + suffix, i, suffix, shape))
        if sparse:
            b = p + moe.block + "."
            out.append(BaseModule(b + "gate", i, "router", None))
            out += [BaseModule(f"{b}experts.{e}.{proj}", i, "expert", None)
                    for e in range(moe.num_experts) for proj in moe.expert_proj]
            if moe.shared_expert_intermediate_size:
                # DeepSeek's / GLM's fused `shared_experts`, else Qwen2-MoE's gated one
                shared = "shared_experts" if moe.deepseek is not None else "shared_expert"
                out += [BaseModule(f"{b}{shared}.{proj}", i, "shared_expert", None)
                        for proj in ("gate_proj", "up_proj", "down_proj")]
                if moe.deepseek is None:
                    out.append(BaseModule(b + "shared_expert_gate", i, "shared_expert", None))
    out.append(BaseModule("lm_head", None, "lm_head", None))
    return out


def matches(cfg, name: str) -> bool:
    """PEFT's check_target_module_exists for the module `name` (see the module docstring)."""
    ex = cfg.exclude_modules
    if ex is not None:
        if isinstance(ex, str):
            if re.fullmatch(ex, name):
                return False
        elif name in ex or any(name.endswith("." + e) for e in ex):
            return False
    t = cfg.target_modules
    if isinstance(t, str):
        return re.fullmatch(t, name) is not None
    if name in t:
        return True
    if not any(name.endswith("." + e) for e in t):
        return False
    if cfg.layers_to_transform is None:
        return True
    if cfg.layers_pattern is None:
        m = re.match(r".*?\.[^.]*\.(?P<idx>\d+)\.", name)
    else:
        m = None
        for pattern in cfg.layers_pattern:
            m = re.match(rf"(?:^|.*?\.){pattern}\.(?P<idx>\d+)\.", name)
            if m is not None:
                break
    return m is not None and int(m.group("idx")) in cfg.layers_to_transform


def targeted(cfg, meta) -> list[BaseModule]:
    """The served modules `cfg` adapts, in model order; Unsupported naming the first target
    that is not served (embedding, head, router, expert)."""
    out = []
    for mod in base_modules(meta):
        if cfg.all_linear:
            hit = mod.linear and mod.kind != "lm_head"
        else:
            try:
                hit = matches(cfg, mod.name)
            except re.error as e:
                raise Unsupported(f"{cfg.source}: target_modules / exclude_modules is not a "
                                  f"regular expression Python accepts ({e})") from None
        if not hit:
            continue
        if mod.kind not in SERVED:
            raise Unsupported(f"{cfg.source}: target_modules matches {mod.name} "
                              f"({_WHAT[mod.kind]}); LoRA is served on the q/k/v/o and dense "
                              "gate/up/down projections only")
        out.append(mod)
    return out


_WHAT = {"embedding": "the token embedding", "lm_head": "the output head",
         "router": "a mixture-of-experts router", "expert": "a mixture-of-experts expert",
         "shared_expert": "a mixture-of-experts shared expert"}
