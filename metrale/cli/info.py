"""`metrale info`: architecture, parameter count, the context metrale runs, every config
field that changes the math (info_math.py) and the device memory a checkpoint needs
(weights + KV cache + workspaces, + LoRA slots with --lora / --max-loras: info_lora.py)."""
from __future__ import annotations

import json

from .args import add_model, positive_int, resolve_model
from .checkpoint import open_checkpoint
from .info_lora import lora_info, lora_lines
from .info_presets import human_count
from .lora_args import add_lora, lora_load_options


def register(sub) -> None:
    i = sub.add_parser("info", help="architecture, parameters, dtype and memory of a checkpoint",
                       description="Architecture, parameter count, dtype and the device memory "
                       "a checkpoint needs (weights + KV cache + workspaces).")
    add_model(i)
    i.add_argument("--context", type=positive_int, default=None,
                   help=f"tokens per sequence for the memory estimate (default "
                        f"{DEFAULT_CONTEXT}, or the model's context when it is shorter; at "
                        "most the model's context)")
    i.add_argument("--batch", type=positive_int, default=1,
                   help="sequences for the memory estimate (default 1)")
    i.add_argument("--json", action="store_true", help="print JSON")
    add_lora(i, generate=False)
    i.add_argument("--presets", action="store_true",
                   help="list every preset:NAME (random weights at a real model's shapes) "
                        "instead of describing a MODEL")
    i.set_defaults(func=run, resolve=resolve_info)


def resolve_info(args) -> None:
    """MODEL as every command takes it, or --presets without one."""
    if args.presets:
        if args.model is not None or args.model_option is not None:
            import argparse
            raise argparse.ArgumentTypeError("--presets lists the presets: give no MODEL")
        return
    resolve_model(args)
    args.lora_options = lora_load_options(args)


DEFAULT_CONTEXT = 4096


def context_tokens(asked: int | None, meta, model: str) -> int:
    """The context of the memory estimate: --context, at most the model's; by default
    DEFAULT_CONTEXT or the model's when shorter."""
    limit = meta.context_length or meta.max_position_embeddings
    if asked is None:
        return min(DEFAULT_CONTEXT, limit)
    if asked > limit:
        from ..errors import InvalidArgument
        how = "max_position_embeddings" if limit == meta.max_position_embeddings else \
            "max_position_embeddings scaled by its rope_scaling"
        raise InvalidArgument(f"--context {asked} exceeds {model}'s context of {limit:,} "
                              f"positions ({how}): give at most --context {limit}")
    return asked


def human_bytes(n: float) -> str:
    """1536 -> "1.5 KiB"; whole bytes below 1 KiB."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:,.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n} B"  # pragma: no cover


def kv_text(groups, kv_layer: int, kv_tok: int) -> str:
    """KV bytes per token, by kind of layer: sliding-window ones hold at most their window
    and one block (16 tokens) per sequence."""
    if not groups or all(not w for w, _ in groups):
        return f"{human_bytes(kv_tok)} per token"
    parts = []
    for w, layers in groups:
        n = len(layers)
        per = human_bytes(kv_layer * n)
        if not w:
            parts.append(f"{per} per token in {n} full layer{'s' * (n != 1)}")
        else:
            blocks = -(-w // 16) + 1
            parts.append(f"{per} per token in {n} sliding-window layer{'s' * (n != 1)} "
                         f"(window {w}: at most {blocks} blocks of 16 tokens, "
                         f"{human_bytes(blocks * 16 * kv_layer * n)}, held per sequence)")
    return "; ".join(parts)


def run(args) -> int:
    if args.presets:
        from .info_presets import run_presets
        return run_presets(args)
    import math

    from ..bench.roofline import decode_step_bytes, kv_bytes_per_token, weight_read_bytes
    from ..formats import DECODER_ARCHS, expected_tensors
    from ..formats.layout import head_name
    from ..formats.moe_config import inactive_parameters
    from ..formats.deepseek_config import kv_bytes_per_token_layer
    from collections import Counter

    from ..model_engine.gguf_weights import held_bytes, held_types, keeps_packed
    from ..model_engine.memory_plan import weight_bytes
    from .info_hybrid import hybrid_info, print_hybrid
    from .info_math import math_fields, stored_dtypes
    source = open_checkpoint(args.model)
    meta = source.metadata()
    context = context_tokens(args.context, meta, source.description)
    names = source.tensor_names()
    used = expected_tensors(meta, names)   # what the model reads (tied head counted once)
    n_params = sum(math.prod(source.tensor_shape(n)) for n in used if n in set(names))
    if getattr(meta, "quantization", None) is not None:   # logical weights, not packed words
        n_params = sum(math.prod(shape) for shape in used.values())
    head_stored = meta.tie_word_embeddings and head_name(meta) in used
    fields = math_fields(meta, source, head_stored)
    # a GGUF's block-type tensors as the device holds them: at their stored bytes
    held = held_bytes(meta, source) if keeps_packed(source) else None
    w = weight_bytes(meta) if held is None else held[0]
    # one layer's K and V, BF16 (MLA: its latent and roped key, deepseek_config.py)
    kv_layer = kv_bytes_per_token_layer(meta)
    kv_tok = kv_bytes_per_token(meta)   # a hybrid: its full-attention layers only
    kv = kv_tok * context * args.batch
    kv_and_ws = kv
    groups = None
    hybrid = None if meta.hybrid is None else hybrid_info(meta, context, args.batch)
    if hybrid is not None:   # KV pool, state pool and workspaces (info_hybrid.py)
        kv_and_ws = hybrid["kv_state_workspaces_bytes"]
    elif meta.architecture in DECODER_ARCHS:
        # The decoder's own estimate: KV pool (+1 padding block) and every workspace; a
        # sliding-window group beside full layers holds a bounded pool (kv_groups.py)
        from ..model_engine.kv_groups import group_layers, window_blocks
        from ..model_engine.workspace import Workspace
        bs, rows, nb = 16, max(args.batch, 16), -(-context // 16) * args.batch
        groups = group_layers(meta)
        win = groups[1] if len(groups) > 1 else (0, ())
        kv_and_ws = Workspace.estimate_bytes(
            meta, max_tokens=2048, max_rows=rows, num_blocks=nb, block_size=bs,
            max_blocks_per_seq=-(-context // bs), fp32_logits=False, window_layers=win[1],
            window_blocks=window_blocks(nb, win[0], bs, rows, 2048) if win[1] else 0)
    # the LoRA slots the options reserve (counted like the workspaces: 2048-token chunks)
    lora = lora_info(meta, args.lora_options, max(2048, args.batch, 16)) \
        if meta.architecture in DECODER_ARCHS else None
    if lora is not None:
        kv_and_ws += lora["bytes"]
    elif args.lora_options:
        from ..errors import Unsupported
        raise Unsupported(f"{source.description}: LoRA slots are served on decoder "
                          f"checkpoints, not {meta.architecture}")
    info = {
        "model": source.description, "architecture": meta.architecture,
        # a GGUF has no config dtype: its stored ggml types by tensor group
        "parameters": n_params, "dtype": (f"GGUF {source.stored_types()}" if hasattr(
            source, "stored_types") else meta.dtype), "device_dtype": "bfloat16",
        "stored_dtypes": stored_dtypes(source),
        # a GGUF: how many tensors the device holds in each type (block types as stored)
        "held_dtypes": None if held is None else dict(sorted(Counter(
            held_types(meta, source).values()).items())),
        "layers": meta.num_layers, "hidden_size": meta.hidden_size,
        "intermediate_size": meta.intermediate_size, "heads": meta.num_heads,
        "kv_heads": meta.num_kv_heads, "head_dim": meta.head_dim,
        "vocab_size": meta.vocab_size, "max_position_embeddings": meta.max_position_embeddings,
        "context_length": meta.context_length, "tie_word_embeddings": meta.tie_word_embeddings,
        "rope_type": "default" if meta.rope_scaling is None else meta.rope_scaling.rope_type,
        "layer_windows": list(meta.layer_windows), "hidden_act": meta.hidden_act,
        "biases": {"qkv": meta.attention_bias, "o_proj": meta.o_proj_bias,
                   "mlp": meta.mlp_bias},
        "math": fields,
        "weight_bytes": w, "kv_bytes_per_token": kv_tok,
        # sliding-window layers hold at most their window (+ one block) per sequence
        "kv_bytes_per_token_full_layers": kv_layer * sum(
            len(ly) for wd, ly in groups if not wd) if groups else kv_tok,
        "kv_bytes_per_token_window_layers": kv_layer * sum(
            len(ly) for wd, ly in groups if wd) if groups else 0,
        # what one batch-1 decode step reads: every weight (the embedding's one row unless
        # tied to the head; a MoE layer's chosen experts only) and the KV cache of `context`
        # positions (bench/roofline.py)
        "decode_step_bytes": decode_step_bytes(meta, [context], held) if meta.architecture in
        DECODER_ARCHS or hybrid else None,
        # a hybrid's recurrent layers, state per sequence and state pool (info_hybrid.py)
        "recurrent": hybrid,
        "quantization": None if getattr(meta, "quantization", None) is None else
        meta.quantization.method,
        # a token reads all weights but the routed experts it did not choose (MoE); a decode
        # step of `batch` rows reads the weights its rows need (bench/roofline.py)
        "active_parameters": n_params - inactive_parameters(meta, 1),
        "decode_step_weight_bytes": weight_read_bytes(meta, args.batch, held) if meta.architecture
        in DECODER_ARCHS or hybrid else None,
        "context": context, "batch": args.batch,
        "memory_needed_bytes": w + kv_and_ws,
        "lora": lora,
        "tokenizer": str(source.tokenizer_path()) if source.tokenizer_path() else
        ("the GGUF metadata (tokenizer.ggml.*)" if callable(getattr(source, "tokenizer", None))
         and source.tokenizer() is not None else None),
    }
    if args.json:
        print(json.dumps(info, indent=1))
        return 0
    print(f"model          {info['model']}")
    print(f"architecture   {meta.architecture}")
    print(f"parameters     {n_params:,} ({human_count(n_params)})")
    if meta.moe is not None:
        act = info["active_parameters"]
        print(f"active         {act:,} ({human_count(act)}) per token: "
              f"{meta.moe.top_k} of {meta.moe.num_experts} experts in each sparse layer")
    print(f"shape          {meta.num_layers} layers, hidden {meta.hidden_size}, "
          f"intermediate {meta.intermediate_size}, {meta.num_heads} heads / "
          f"{meta.num_kv_heads} kv heads x {meta.head_dim}, vocab {meta.vocab_size}")
    ctx = f"{meta.context_length:,} positions"
    if meta.context_length != meta.max_position_embeddings:
        ctx += f" (max_position_embeddings {meta.max_position_embeddings:,}, scaled by the rope)"
    print(f"context        {ctx}")
    for k, v in fields.items():
        print(f"{k.replace('_', ' '):14s} {v}")
    print(f"weights        {human_bytes(w)}" + ("" if held is None else
          f" as held (block types at their stored bytes; {human_bytes(weight_bytes(meta))} "
          "dequantized at load with gguf_dequantize=True)"))
    if hybrid is not None:
        print_hybrid(info, human_bytes)
    if info["decode_step_bytes"] is not None:
        print(f"decode step    {human_bytes(info['decode_step_bytes'])} read per batch-1 step "
              f"at {context:,} tokens (weights + KV cache" +
              (" + the recurrent state, read and written)" if hybrid else ")"))
    if meta.moe is not None:
        print(f"step weights   {human_bytes(info['decode_step_weight_bytes'])} read per decode "
              f"step at batch {args.batch} (the experts the rows choose, expected under "
              "uniform routing past batch 1)")
    print(f"KV cache       {kv_text(groups, kv_layer, kv_tok)}")
    if lora is not None:
        print("\n".join(lora_lines(lora, human_bytes)))
    print(f"memory needed  {human_bytes(info['memory_needed_bytes'])} for batch {args.batch} "
          f"x {context:,} tokens (weights + KV cache + " +
          ("state pool + " if hybrid else "") + "workspaces" +
          (" + LoRA slots" if lora else "") + ")")
    print(f"tokenizer      {info['tokenizer'] or 'none (use --ids)'}")
    return 0
