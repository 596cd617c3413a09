"""The decoder fields of config.json whose meaning differs per family (field_table.py):
HF's class defaults for absent keys, biases, the MLP activation and the attention window of
each layer. Values as transformers 5.24's Llama/Mistral/Qwen2/Qwen3 configs and modeling
code resolve them."""
from __future__ import annotations

from typing import NamedTuple

from ..errors import FormatError, Unsupported
from . import gemma_config as gemma
from . import gpt_oss_config as oss
from . import moe_config as moe
from . import phi3_config as phi3
from .config_fields import KERNEL_MAX_HEAD_DIM, _Cfg
from .field_table import HF_ACTIVATIONS

# HF class defaults of keys a config.json may leave out
KV_HEADS_DEFAULT = {"llama": None, "mistral": 8, "qwen2": 32, "qwen3": 32,  # None: = heads
                    "phi3": None}
MAX_POSITIONS_DEFAULT = {"llama": 2048, "mistral": 131072, "qwen2": 32768, "qwen3": 32768,
                         "phi3": 4096, "gpt_oss": oss.DEFAULTS["max_position_embeddings"],
                         **moe.MAX_POSITIONS_DEFAULT,
                         **{a: d["max_position_embeddings"]
                            for a, d in gemma.CLASS_DEFAULTS.items()}}
QWEN3_HEAD_DIM_DEFAULT = 128
WINDOW_DEFAULT = 4096
MAX_WINDOW_LAYERS_DEFAULT = 28
_LAYER_TYPES = {"full_attention": False, "attention": False, "sliding_attention": True}


class Biases(NamedTuple):
    qkv: bool   # q/k/v projections
    o: bool     # o_proj
    mlp: bool   # gate/up/down


def _present(config: dict, key: str) -> bool:
    return key in config


def size(c: _Cfg, arch: str, key: str) -> int:
    """A size every decoder needs (vocab_size, hidden_size, ...): required, unless the
    family's HF class has a default for it (Gemma: a `gemma3` text_config holds only the
    values that differ from the defaults)."""
    default = (oss.DEFAULTS if arch == "gpt_oss" else gemma.CLASS_DEFAULTS.get(arch, {})
               ).get(key)
    return c.int(key, default, required=default is None)


def kv_heads(c: _Cfg, arch: str, heads: int) -> int:
    """num_key_value_heads: absent -> the family's class default; null -> heads."""
    if arch in moe.MOE_ARCHS:
        return moe.kv_heads(c, arch)
    if arch == "gpt_oss":   # GptOssConfig: null means num_attention_heads
        if _present(c.d, "num_key_value_heads") and c.d["num_key_value_heads"] is None:
            return heads
        return c.int("num_key_value_heads", oss.DEFAULTS["num_key_value_heads"])
    if arch in gemma.GEMMA_ARCHS:
        if _present(c.d, "num_key_value_heads") and c.d["num_key_value_heads"] is None:
            raise FormatError(f"{c.source}: num_key_value_heads is null ({arch}: transformers "
                              "cannot run it)")
        return c.int("num_key_value_heads", gemma.CLASS_DEFAULTS[arch]["num_key_value_heads"])
    if _present(c.d, "num_key_value_heads") and c.d.get("num_key_value_heads") is None:
        return heads
    default = KV_HEADS_DEFAULT[arch]
    return c.int("num_key_value_heads", heads if default is None else default)


def head_dim(c: _Cfg, arch: str, hidden: int, heads: int) -> int:
    """head_dim: explicit; absent/null -> hidden // heads (qwen3: absent -> 128)."""
    if arch in ("qwen3", "phi3") + gemma.GEMMA_ARCHS and _present(c.d, "head_dim") and \
            c.d.get("head_dim") is None:
        raise FormatError(f"{c.source}: head_dim is null (transformers' {arch} cannot run "
                          "it either)")
    # the MoE families' defaults: moe_config.py; the checks below apply to them too
    d = moe.head_dim(c, arch, hidden, heads) if arch in moe.MOE_ARCHS else c.int(
        "head_dim", (oss.DEFAULTS if arch == "gpt_oss" and not _present(c.d, "head_dim")
                     else gemma.CLASS_DEFAULTS.get(arch, {})).get("head_dim"))
    if d is None and arch == "qwen3":
        d = QWEN3_HEAD_DIM_DEFAULT
    elif d is None:
        if hidden % heads:
            raise FormatError(f"{c.source}: hidden_size {hidden} is not a multiple of "
                              f"num_attention_heads {heads} and no head_dim is given")
        d = hidden // heads
    if d % 2:   # rotate-half pairs dimension j with j + head_dim/2 (HF fails on odd too)
        given = "" if c.d.get("head_dim") is not None else \
            f" (hidden_size {hidden} / num_attention_heads {heads})"
        raise FormatError(f"{c.source}: head_dim must be even for the rotary embedding, "
                          f"got {d}{given}")
    if d > KERNEL_MAX_HEAD_DIM:
        raise Unsupported(f"{c.source}: head_dim {d} is not supported (the attention "
                          f"kernels take at most {KERNEL_MAX_HEAD_DIM})")
    return d


def biases(c: _Cfg, arch: str) -> Biases:
    """Which projections carry biases: llama / qwen3 / gemma `attention_bias` covers q/k/v
    and o; qwen2 always biases q/k/v and never o; mistral never; `mlp_bias` is llama's
    only."""
    if arch in moe.MOE_ARCHS:
        return Biases(*moe.biases(c, arch))
    if arch == "qwen2":
        return Biases(True, False, False)
    if arch in ("mistral", "phi3"):
        return Biases(False, False, False)
    if arch == "gpt_oss":   # attention_bias defaults to true there
        att = c.bool("attention_bias", True)
        return Biases(att, att, False)
    att = c.bool("attention_bias", False)
    return Biases(att, att, c.bool("mlp_bias", False) if arch == "llama" else False)


def activation(c: _Cfg, arch: str = "llama") -> str:
    """The kernel activation of `hidden_act` (HF default silu; Gemma: `hidden_activation`,
    default gelu_pytorch_tanh); others are refused."""
    if arch == "gpt_oss":   # its experts' clamped SwiGLU; hidden_act is not read
        return "silu"
    key, default = (("hidden_activation", "gelu_pytorch_tanh") if arch in gemma.GEMMA_ARCHS
                    else ("hidden_act", "silu"))
    act = c.d.get(key, default)
    if not isinstance(act, str) or act not in HF_ACTIVATIONS:
        raise Unsupported(f"{c.source}: {key}={act!r} is not supported (supported: "
                          f"{', '.join(HF_ACTIVATIONS)})")
    return act


def layer_windows(c: _Cfg, arch: str, n_layers: int) -> tuple[int | None, tuple[int, ...]]:
    """(sliding_window, per-layer window: 0 = full attention) as HF resolves them.

    mistral: `sliding_window` (absent: 4096, null: none) on every layer. qwen2/qwen3: the
    window is on only with `use_sliding_window`; then the layers typed
    "sliding_attention" in `layer_types` use it, or, without layer_types, the layers with
    index >= `max_window_layers`. llama: no window. The MoE families: moe_config.py.
    """
    qwen2_moe_types = arch == "qwen2_moe" and c.d.get("layer_types") is not None
    if arch in moe.MOE_ARCHS and not qwen2_moe_types:   # those read as qwen2's below
        return moe.layer_windows(c, arch, n_layers)
    if arch in gemma.GEMMA_ARCHS:
        return gemma.layer_windows(c, arch, n_layers)
    if arch == "phi3":
        return phi3.layer_windows(c, n_layers)
    if arch == "gpt_oss":
        return oss.layer_windows(c, n_layers)
    if arch == "llama":
        return None, (0,) * n_layers
    if arch == "mistral":
        w = c.int("sliding_window", WINDOW_DEFAULT) if not (
            _present(c.d, "sliding_window") and c.d["sliding_window"] is None) else None
        return w, (w or 0,) * n_layers
    on = c.bool("use_sliding_window", False)
    w = (c.int("sliding_window", WINDOW_DEFAULT) if not (
        _present(c.d, "sliding_window") and c.d["sliding_window"] is None) else None) \
        if on else None
    types = c.d.get("layer_types")
    if types is None:
        mwl = c.int("max_window_layers", MAX_WINDOW_LAYERS_DEFAULT, positive=False)
        sliding = [w is not None and i >= mwl for i in range(n_layers)]
    else:
        if not isinstance(types, list) or len(types) != n_layers:
            raise FormatError(f"{c.source}: layer_types must list one type per layer "
                              f"({n_layers}), got {types!r}")
        bad = [t for t in types if not isinstance(t, str) or t not in _LAYER_TYPES]
        if bad:
            raise Unsupported(f"{c.source}: layer_types value {bad[0]!r} is not supported "
                              f"(supported: {', '.join(_LAYER_TYPES)})")
        sliding = [_LAYER_TYPES[t] for t in types]
        if any(sliding) and w is None:
            raise Unsupported(f"{c.source}: layer_types has 'sliding_attention' layers but "
                              f"use_sliding_window={on} / sliding_window={c.d.get('sliding_window')!r} "
                              "gives no window (transformers fails on this config)")
    windows = tuple(w if s else 0 for s in sliding)
    return (w if any(windows) else None), windows


def refuse_quantized(config: dict, source: str) -> None:
    """quantization_config changes what the weights mean: never loaded as plain floats."""
    if config.get("quantization_config") is not None:
        q = config["quantization_config"]
        method = q.get("quant_method") if isinstance(q, dict) else q
        raise Unsupported(f"{source}: quantization_config (quant_method={method!r}) is not "
                          "supported: metrale loads float checkpoints only")
