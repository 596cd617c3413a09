"""How big the KV pool is, and whether the whole model fits, decided before any allocation."""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import OutOfMemory
from ..formats import expected_tensors
from ..formats.deepseek_config import kv_bytes_per_token_layer
from .kv_groups import group_layers, window_blocks
from .workspace import Workspace

_CPU_DEFAULT_CONTEXT = 2048     # tokens per batch row the CPU pool is sized for by default
_GPU_MEMORY_FRACTION = 0.90     # of free memory the model may take when kv_blocks is None
_GPU_MARGIN = 512 << 20         # left for CuPy, cuBLAS workspaces and the graph pool


@dataclass(frozen=True)
class MemoryPlan:
    num_blocks: int
    max_seq_len: int
    max_blocks_per_seq: int
    weight_bytes: int
    total_bytes: int
    active_weight_bytes: int = 0   # what one token reads (MoE: its top_k experts per layer)


def weight_bytes(meta, packed_source=None) -> int:
    """Device bytes of the weights: BF16 everywhere, or the quantized linears' real bytes;
    with `packed_source` (a GGUF source loaded packed) its block-type tensors' planes
    (gguf_weights.held_bytes)."""
    if packed_source is not None:
        from .gguf_weights import held_bytes
        return held_bytes(meta, packed_source)[0]
    if getattr(meta, "hybrid", None) is not None:   # linear-attention / Mamba2 layers
        from .hybrid_weights import hybrid_weight_bytes
        from .nemotron import nemotron_weight_bytes
        return nemotron_weight_bytes(meta) if meta.hybrid.mamba is not None else \
            hybrid_weight_bytes(meta)
    if getattr(meta, "quantization", None) is not None and getattr(meta, "mla", None):
        from .deepseek_fp8 import deepseek_fp8_bytes   # DeepSeek-V3 FP8: kv_b_proj BF16
        return deepseek_fp8_bytes(meta)
    if getattr(meta, "quantization", None) is not None:
        from .linear import quantized_weight_bytes
        return quantized_weight_bytes(meta)
    return sum(held_bytes_of(name, shape) for name, shape in expected_tensors(meta).items())


def held_bytes_of(name: str, shape) -> int:
    """Device bytes of one checkpoint tensor as held: BF16, except gpt-oss's attention sinks
    (FP32, as the attention kernels read them), DeepSeek-V3's e_score_correction_bias
    (FP32, as its router reads it) and MXFP4 experts' blocks and scales (their stored
    bytes)."""
    n = 4 if name.endswith((".sinks", ".e_score_correction_bias")) else 1 if name.endswith(("_blocks", "_scales")) else 2
    for s in shape:
        n *= int(s)
    return n


def active_weight_bytes(meta, packed_source=None) -> int:
    """Weight bytes one token's forward pass reads: all of them for a dense model; for a
    mixture of experts all but the routed experts it did not choose."""
    from ..formats.moe_config import inactive_parameters
    return weight_bytes(meta, packed_source) - int(expert_bytes_per_parameter(meta) *
                                                   inactive_parameters(meta, 1))


def expert_bytes_per_parameter(meta) -> float:
    """Device bytes per routed-expert parameter: BF16 2, gpt-oss's MXFP4 17/32, or the
    packed bytes of a quantized checkpoint's experts (one expert's three linears as
    moe_quant.py holds them, over its parameters; a layer quantized in part is BF16)."""
    from ..formats.moe_config import expert_param_bytes, expert_parameters
    qc, moe = getattr(meta, "quantization", None), getattr(meta, "moe", None)
    if qc is None or moe is None or not moe.num_sparse_layers or moe.oss is not None:
        return expert_param_bytes(meta)
    from .linear import linear_device_bytes
    layer = moe.sparse_layers.index(True)
    b = f"model.layers.{layer}.{moe.block}.experts.0."
    if not all(qc.converts(b + p) for p in moe.expert_proj):
        return 2
    i, h = moe.expert_intermediate_size, meta.hidden_size
    return (2 * linear_device_bytes(qc, i, h) + linear_device_bytes(qc, h, i)) / \
        expert_parameters(meta)


def plan_memory(backend, meta, *, kv_blocks, block_size, max_rows, max_tokens, max_seq_len,
                fp32_logits, where: str, rank_weight_bytes: int | None = None,
                extra_bytes: int = 0, packed_source=None,
                extra_kv_layers: int = 0) -> MemoryPlan:
    """Size the pool (from free memory on a GPU when `kv_blocks` is None) and check that
    weights + workspaces + pool fit; DeviceError naming bytes needed and free otherwise.
    A tensor-parallel rank passes the bytes of its weight slices (`rank_weight_bytes`) and of
    its combine buffers (`extra_bytes`); `meta` then has its own head counts. A GGUF loaded
    packed passes its source (`packed_source`): the weights are its planes' bytes.
    `extra_kv_layers`: latent caches of the pool's size held beside it (the MTP layer's)."""
    w = weight_bytes(meta, packed_source) if rank_weight_bytes is None \
        else int(rank_weight_bytes)
    # the checkpoint's context (max_position_embeddings; yarn: its scaled length)
    context = meta.context_length or meta.max_position_embeddings
    limit = context if max_seq_len is None else min(max_seq_len, context)
    layer_block = block_size * kv_bytes_per_token_layer(meta)   # MLA: its latent row
    per_block = (meta.num_layers + extra_kv_layers) * layer_block
    free = backend.free_memory()
    # a sliding-window group beside full layers has a pool of its own (kv_groups.py)
    groups = group_layers(meta)
    win_layers, window = (groups[1][1], groups[1][0]) if len(groups) > 1 else ((), 0)

    def win_blocks(nb):
        return window_blocks(nb, window, block_size, max_rows, max_tokens) if window else 0

    def ws_bytes(nb, seq_len):
        return extra_bytes + Workspace.estimate_bytes(
            meta, max_tokens=max_tokens, max_rows=max_rows, num_blocks=nb,
            block_size=block_size, max_blocks_per_seq=-(-seq_len // block_size),
            fp32_logits=fp32_logits, window_layers=win_layers, window_blocks=win_blocks(nb))

    if kv_blocks is None:
        if backend.name.startswith("cuda"):
            budget = int(free * _GPU_MEMORY_FRACTION) - _GPU_MARGIN - w - ws_bytes(0, limit)
            kv_blocks = max(budget // (per_block + 4 * max_rows), 0)
            if win_layers:   # the window layers hold a bounded pool: the rest goes to the
                full = (meta.num_layers - len(win_layers)) * layer_block   # full layers
                fixed = win_blocks(1 << 40) * len(win_layers) * layer_block
                kv_blocks = max(kv_blocks, (budget - fixed) // (full + 4 * max_rows))
        else:
            kv_blocks = -(-max_rows * min(limit, _CPU_DEFAULT_CONTEXT) // block_size)
            kv_blocks = min(kv_blocks, max(free // 4 // per_block, 1))
        if kv_blocks < 1:   # (the GPU's budget above keeps a fraction and a margin back)
            usable = int(free * _GPU_MEMORY_FRACTION) - _GPU_MARGIN \
                if backend.name.startswith("cuda") else free
            _refuse(where, backend.name, free, usable, w, ws_bytes(0, limit), 0, 0,
                    block_size)
    seq_len = min(limit, kv_blocks * block_size)
    total = w + ws_bytes(kv_blocks, seq_len) + extra_kv_layers * kv_blocks * layer_block
    if total > free:
        ws = ws_bytes(0, seq_len)
        _refuse(where, backend.name, free, free, w, ws, total - w - ws, kv_blocks, block_size)
    return MemoryPlan(num_blocks=int(kv_blocks), max_seq_len=int(seq_len),
                      max_blocks_per_seq=-(-seq_len // block_size), weight_bytes=w,
                      total_bytes=int(total),
                      active_weight_bytes=active_weight_bytes(meta, packed_source))


def size_text(nbytes: int) -> str:
    """Bytes for a person: GiB with two decimals, MiB below one GiB, bytes below one MiB."""
    if nbytes >= 1 << 30:
        return f"{nbytes / (1 << 30):.2f} GiB"
    if nbytes >= 1 << 20:
        return f"{nbytes / (1 << 20):.1f} MiB"
    return f"{nbytes} bytes"


def _refuse(where: str, device: str, free: int, usable: int, weights: int, workspaces: int,
            kv: int, kv_blocks: int, block_size: int):
    """OutOfMemory: what is needed (weights, KV pool, workspaces) against what is free, and
    what to lower; when the weights and workspaces alone do not fit in `usable` (free less
    what a GPU keeps back), that is said instead: no smaller KV pool or context helps."""
    if weights + workspaces >= usable:
        kept = "" if usable == free else \
            f" (of which {size_text(max(usable, 0))} may hold the model: the rest is kept " \
            "for CuPy, cuBLAS and CUDA graphs)"
        alone = f"the weights alone need {size_text(weights)}" if weights >= usable else \
            f"the weights and workspaces need {size_text(weights + workspaces)} " \
            f"({size_text(weights)} weights)"
        raise OutOfMemory(
            f"{where}: {alone} but {size_text(free)} is free on {device}{kept}, so the model "
            "does not fit", "a quantized checkpoint (FP8, GPTQ or AWQ) or "
            "tensor_parallel_size over several devices would", fits_without_kv=False)
    total = weights + workspaces + kv
    raise OutOfMemory(
        f"{where}: needs {size_text(total)} on {device} ({size_text(weights)} weights, "
        f"{size_text(kv)} KV pool of {kv_blocks} blocks of {block_size} tokens, "
        f"{size_text(workspaces)} workspaces) but {size_text(free)} is free",
        "lower the load options kv_blocks (or max_seq_len), max_batch or max_prefill_tokens",
        fits_without_kv=True)
