"""A GGUF file's metadata as the Hugging Face config.json it stands for.

Every key of the file is looked up in field_table.GGUF (`classify`): REFUSED keys and keys
the table does not list raise `Unsupported` naming the key; HONOURED keys that allow only a
neutral value (causal attention, no ALiBi, no experts, one split file...) are checked here.
The config is then parsed by `ModelMetadata.from_config`, so every check of config.json
applies to GGUF files too.

Float32 values (rms epsilon, rope base, linear factor) are read back as the shortest
decimal that rounds to the same float32 (`f32_value`): 9.999999747378752e-06 becomes 1e-05,
the value in the checkpoint's config.json. HF's GGUF loader keeps the widened float64;
both are the same float32, which is all that RMSNorm in float32 (HF) or the kernels'
np.float32 argument (metrale) ever see.
"""
from __future__ import annotations

import numpy as np

from ...errors import FormatError, Unsupported
from ..field_table import GGUF, HONOURED, REFUSED, Field
from .archs import ARCH_KEYS, ARCH_VALUES, MODEL_TYPE, YARN, family_config, ffn_rows
from .shapes import check_block_count, check_dim

ARCHITECTURES = tuple(MODEL_TYPE)

# HONOURED keys that accept only one (neutral) value: key -> allowed values
_NEUTRAL = {
    "general.type": ("model",), "general.quantization_version": (2,),
    "{arch}.attention.causal": (True,), "{arch}.attention.max_alibi_bias": (0, 0.0),
    "{arch}.attention.clamp_kqv": (0, 0.0), "{arch}.attention.sliding_window": (0,),
    "{arch}.expert_count": (0,), "{arch}.expert_used_count": (0,),
    "{arch}.use_parallel_residual": (False,), "split.count": (1,),
    "tokenizer.ggml.remove_extra_whitespaces": (False,),
    "tokenizer.ggml.add_sep_token": (False,),
}


def classify(key: str, arch: str) -> tuple[str, Field] | None:
    """(table key, Field) of a GGUF metadata key, or None when the table lacks it."""
    generic = "{arch}." + key[len(arch) + 1:] if key.startswith(arch + ".") else key
    if generic in GGUF:
        return generic, GGUF[generic]
    parts = generic.split(".")
    for i in range(len(parts) - 1, 0, -1):
        wild = ".".join(parts[:i]) + ".*"
        if wild in GGUF:
            return wild, GGUF[wild]
    return None


def f32_value(x) -> float:
    """The shortest decimal that rounds to float32 `x` (1e-05 for 9.999999747378752e-06)."""
    return float(str(np.float32(x)))


def check_keys(fields: dict, arch: str, where: str) -> None:
    """Unsupported naming the first key that is refused, unlisted or not neutral."""
    for key, value in fields.items():
        hit = classify(key, arch)
        if hit is None:
            raise Unsupported(f"{where}: metadata key {key!r} is not understood by metrale "
                              "(formats/field_table.py GGUF); it may change the model, so "
                              "the file is refused")
        entry, field = hit
        if field.status == REFUSED:
            raise Unsupported(f"{where}: metadata key {key!r} ({field.why}) is not supported")
        if arch not in ARCH_KEYS.get(entry, (arch,)):
            raise Unsupported(f"{where}: metadata key {key!r} is not read for architecture "
                              f"{arch!r} (only {', '.join(ARCH_KEYS[entry])}); it may change "
                              "the model, so the file is refused")
        allowed = None if entry in ARCH_VALUES.get(arch, ()) else _NEUTRAL.get(entry)
        if field.status == HONOURED and allowed is not None and \
                not any(_same(value, a) for a in allowed):
            raise Unsupported(f"{where}: {key} = {value!r} is not supported ({field.why})")


def _same(value, allowed) -> bool:
    if isinstance(value, (bool, np.bool_)) or isinstance(allowed, bool):
        return isinstance(value, (bool, np.bool_)) and bool(value) == allowed
    return value == allowed


def hf_config(fields: dict, tensors: dict, where: str) -> dict:
    """The config.json dict of a GGUF's metadata (after `check_keys`); `tensors`: the
    tensor directory {name: TensorInfo}, which every count and size must agree with."""
    arch = fields.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise Unsupported(f"{where}: general.architecture {arch!r} is not supported "
                          f"(supported: {', '.join(ARCHITECTURES)})")
    check_keys(fields, arch, where)

    def get(name, default=None, required=False):
        v = fields.get(f"{arch}.{name}", default)
        if v is None and required:
            raise FormatError(f"{where}: missing metadata key '{arch}.{name}'")
        if isinstance(v, (list, np.ndarray)):
            raise Unsupported(f"{where}: {arch}.{name} holds a per-layer list; only one "
                              "value for every layer is supported")
        return v

    hidden = _int(get("embedding_length", required=True), f"{arch}.embedding_length", where)
    heads = _int(get("attention.head_count", required=True), f"{arch}.attention.head_count",
                 where)
    head_dim = get("attention.key_length")
    head_dim = hidden // heads if head_dim is None else \
        _int(head_dim, f"{arch}.attention.key_length", where)
    kv = _int(get("attention.head_count_kv", heads), f"{arch}.attention.head_count_kv", where)
    ffn_key = "feed_forward_length"    # qwen3moe's dense size is unused: may be absent
    if arch == "qwen3moe" and get(ffn_key) is None:
        ffn_key = "expert_feed_forward_length"
    ffn = _int(get(ffn_key, required=True), f"{arch}.{ffn_key}", where)
    layers = _int(get("block_count", required=True), f"{arch}.block_count", where)
    tokens = fields.get("tokenizer.ggml.tokens")
    vocab_key = f"{arch}.vocab_size" if f"{arch}.vocab_size" in fields else \
        "tokenizer.ggml.tokens (its length)"
    vocab = _int(get("vocab_size", len(tokens) if tokens is not None else None,
                     required=True), vocab_key, where)
    # every size against the tensor that carries it, before anything is sized by one
    check_block_count(layers, f"{arch}.block_count", tensors, where)
    check_dim(tensors, "token_embd.weight", 0, vocab_key, vocab, where)
    check_dim(tensors, "token_embd.weight", 1, f"{arch}.embedding_length", hidden, where)
    rows_of, per = ffn_rows(arch)
    check_dim(tensors, rows_of, 0, f"{arch}.feed_forward_length", per * ffn, where,
              shown=None if per == 1 else f"{ffn} (x {per}: gate|up)")
    for key, n, t in (("head_count", heads, "q"), ("head_count_kv", kv, "k")):
        check_dim(tensors, f"blk.0.attn_{t}.weight", 0, f"{arch}.attention.{key}",
                  n * head_dim, where, shown=f"{n} (x head_dim {head_dim})")
    check_dim(tensors, "blk.0.attn_qkv.weight", 0, f"{arch}.attention.head_count(_kv)",
              (heads + 2 * kv) * head_dim, where,
              shown=f"{heads} + 2 x {kv} (x head_dim {head_dim})")
    if get("attention.value_length", head_dim) != head_dim:
        raise Unsupported(f"{where}: {arch}.attention.value_length "
                          f"{get('attention.value_length')} differs from key_length {head_dim}")
    rot = get("rope.dimension_count", head_dim)
    if rot != head_dim and arch != "phi3":   # phi3: partial rotary (archs.family_config)
        raise Unsupported(f"{where}: {arch}.rope.dimension_count {rot} is not head_dim "
                          f"{head_dim} (partial rotary embeddings are not supported)")
    names = set(tensors)
    cfg = {
        "model_type": MODEL_TYPE[arch],
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": ffn,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "head_dim": head_dim,
        "max_position_embeddings": get("context_length", required=True),
        "rms_norm_eps": f32_value(get("attention.layer_norm_rms_epsilon", required=True)),
        "rope_theta": f32_value(get("rope.freq_base", 10000.0)),
        "rope_scaling": _rope_scaling(get, arch, where),
        "hidden_act": "silu",
        # llama.cpp writes output.weight only when the head is not the embedding
        "tie_word_embeddings": "output.weight" not in names,
        "dtype": "float32",   # what ggml's dequantized values are (HF loads them so)
    }
    if arch in ("llama", "qwen3", "qwen3moe"):
        cfg["attention_bias"] = "blk.0.attn_q.bias" in names
    if arch == "llama":
        cfg["mlp_bias"] = "blk.0.ffn_gate.bias" in names
    cfg.update(family_config(arch, get, tensors, where, dict(
        hidden=hidden, heads=heads, kv=kv, head_dim=head_dim, layers=layers)))
    if arch in ("gemma2", "gemma3"):
        del cfg["hidden_act"]      # Gemma reads hidden_activation
    bos = fields.get("tokenizer.ggml.bos_token_id")
    if bos is not None:
        cfg["bos_token_id"] = int(bos)
    stops = [int(fields[k]) for k in ("tokenizer.ggml.eos_token_id",
                                      "tokenizer.ggml.eot_token_id",
                                      "tokenizer.ggml.eom_token_id") if k in fields]
    if stops:
        cfg["eos_token_id"] = list(dict.fromkeys(stops))
    return cfg


def _int(v, key: str, where: str) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v <= 0:
        raise FormatError(f"{where}: {key} must be a positive integer, got {v!r}")
    return int(v)


def _rope_scaling(get, arch: str, where: str) -> dict | None:
    kind = get("rope.scaling.type", "none")
    factor = get("rope.scaling.factor")
    if kind == "none" and get("rope.scale_linear") is not None:
        kind, factor = "linear", get("rope.scale_linear")
    if kind == "none":
        return None
    kinds = ("linear", "yarn") if arch in YARN else ("linear",)
    if kind not in kinds:
        raise Unsupported(f"{where}: {arch}.rope.scaling.type {kind!r} is not supported "
                          f"(supported: none, {', '.join(kinds)})")
    if factor is None:
        raise FormatError(f"{where}: {kind} rope scaling without {arch}.rope.scaling.factor")
    if kind == "linear":
        return {"rope_type": "linear", "factor": f32_value(factor)}
    # Qwen2Model's converter writes yarn's factor and original context; llama.cpp's
    # defaults for the rest (beta_fast 32, beta_slow 1, mscale 0.1 ln(factor) + 1) are HF's
    orig = get("rope.scaling.original_context_length", required=True)
    return {"rope_type": "yarn", "factor": f32_value(factor),
            "original_max_position_embeddings": _int(
                orig, f"{arch}.rope.scaling.original_context_length", where)}
