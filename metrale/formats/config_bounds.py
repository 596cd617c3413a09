"""config.json's counts and sizes bounded by the tensors the checkpoint really holds.

Parsing a config builds per-layer tuples (layer windows, MoE layer kinds) and the layout
one entry per layer and expert; the memory plan multiplies the sizes. A value far beyond
the checkpoint (num_hidden_layers = 10**9: a MemoryError; intermediate_size = 10**9: "needs
13 TB") is refused here first, naming config.json and the key:

- `check_layer_counts`, before the config is parsed: a layer count may not exceed the layers
  whose tensors the checkpoint holds (a smaller one leaves tensors unused, which
  `check_tensors` refuses by name).
- `check_decoder_sizes`, on the parsed metadata of a decoder: every size the model uses
  (vocab_size, hidden_size, the intermediate sizes, heads x head_dim) at most the longest
  dimension of any tensor: each of them is a whole dimension of some tensor in every
  supported layout (BF16, FP8, the packed 4-bit ones keep the output dimension whole). A
  smaller but wrong size is refused by `check_tensors`, which runs before the memory plan
  (model_engine/transformer.py). Expert counts are bounded by the MoE kernels' limit
  (moe_config.py) and missing experts are refused by name.
"""
from __future__ import annotations

import re
from typing import Callable, Iterable

from ..errors import FormatError

# model_type -> (the config key of a layer count ("a.b": key b of sub-config a), the
# checkpoint name prefix of its layers); names as DirectorySource gives them (llava-hf)
_DECODER_LAYERS = (("num_hidden_layers", "model.layers."),)
LAYER_COUNTS = {
    "llava": (("text_config.num_hidden_layers", "language_model.model.layers."),
              ("vision_config.num_hidden_layers", "vision_tower.vision_model.encoder.layers.")),
    "whisper": (("encoder_layers", "model.encoder.layers."),
                ("decoder_layers", "model.decoder.layers.")),
    "gemma3": (("text_config.num_hidden_layers", "model.layers."),),   # its text model
    # the hybrid wrappers' text models (names as hybrid_layout.canonical_name gives them)
    "qwen3_5": (("text_config.num_hidden_layers", "model.layers."),),
    "qwen3_5_moe": (("text_config.num_hidden_layers", "model.layers."),),
}


def _count(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def indices_held(names: Iterable[str], prefix: str) -> list[int]:
    """The sorted indices n of the tensors named `{prefix}{n}.*`."""
    pattern = re.compile(re.escape(prefix) + r"(\d+)\.")
    return sorted({int(m.group(1)) for name in names if (m := pattern.match(name))})


def check_layer_counts(config: dict, names: Iterable[str], where: str) -> None:
    """FormatError naming `where` and the key when a layer count of `config` exceeds the
    layers the checkpoint's tensors (`names`) hold. Values that are not integers are left
    to the parser, which refuses them by name."""
    names = list(names)
    arch = config.get("model_type")
    for key, prefix in LAYER_COUNTS.get(arch, _DECODER_LAYERS):
        sub, _, field = key.rpartition(".")
        d = config.get(sub) if sub else config
        value = d.get(field) if isinstance(d, dict) else None
        if not _count(value):
            continue
        held = indices_held(names, prefix)
        bound = held[-1] + 1 if held else 0
        if value > bound:
            have = (f"tensors for {bound} layers ({prefix}0 .. {prefix}{bound - 1})" if held
                    else f"no {prefix}N.* tensors")
            raise FormatError(f"{where}: {key} = {value} but the checkpoint holds {have}")


def check_decoder_sizes(meta, names: Iterable[str], shape_of: Callable, where: str) -> None:
    """FormatError naming `where` and the key when a size of a decoder's metadata exceeds
    the longest dimension of every tensor (`names`, `shape_of(name)`)."""
    moe = meta.moe
    longest, longest_name = 0, None
    for n in names:
        for s in shape_of(n):
            if s > longest:
                longest, longest_name = s, n
    sizes = [("vocab_size", meta.vocab_size, ""), ("hidden_size", meta.hidden_size, ""),
             # num_key_value_heads divides num_attention_heads: bounded with it
             ("num_attention_heads", meta.num_heads * meta.head_dim,
              f"{meta.num_heads} (x head_dim {meta.head_dim})")]
    if moe is None or not all(moe.sparse_layers):        # a dense MLP somewhere
        sizes.append(("intermediate_size", meta.intermediate_size, ""))
    if moe is not None and moe.num_sparse_layers:
        key = "moe_intermediate_size" if "moe_intermediate_size" in meta.config \
            else "intermediate_size"
        sizes.append((key, moe.expert_intermediate_size, ""))
        if moe.shared_expert_intermediate_size:
            sizes.append(("shared_expert_intermediate_size",
                          moe.shared_expert_intermediate_size, ""))
    for key, value, shown in sizes:
        if value > longest:
            shown = f"{shown} = {value}" if shown else value
            raise FormatError(f"{where}: {key} = {shown} but no tensor of the checkpoint is "
                              f"that long in any dimension (the longest: {longest}, "
                              f"{longest_name})")
