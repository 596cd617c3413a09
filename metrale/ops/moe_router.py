"""Mixture-of-experts routing (kernels/moe_router.cu): launchers and numpy twins.

  moe_topk_softmax: float32 router logits [n_tokens, E] -> each token's top-k expert ids
      (int32 [n_tokens, k], rank order) and weights (float32 [n_tokens, k]): softmax in
      float32, the k experts ranked first (larger logit first, equal logits by lower index,
      NaN first), optionally renormalised to sum 1; with `bias_ptr` (bf16 [E], gpt-oss's
      router bias) the logits plus it, one float32 add. The .cu header says why ranking by
      logit is HF's top-k of the probabilities and how torch.topk's own ties behave.
  moe_route: those ids -> the pairs p = t * k + s grouped by expert (sorted_pairs, in
      increasing p within an expert), expert_offsets [E + 1] and the grouped GEMM's row
      tiles per expert (tile_offsets [E + 1] for a tile height block_m).
"""
from __future__ import annotations

import numpy as np

from ..errors import InvalidArgument
from ..gpu_runtime.types import NULL, DevicePtr
from .bf16 import bf16_to_f32
from .checks import check_ptrs, check_sizes
from .registry import twin

MODULE = "moe_router"
ROUTER_THREADS = 128        # 4 warps, one token each
ROUTE_THREADS = 512
MAX_EXPERTS = 512           # kernels/moe_router.cu MOE_MAX_EXPERTS
MAX_TOP_K = 32              # one lane per slot


def _check_experts(what: str, num_experts: int, top_k: int | None = None) -> None:
    if not 1 <= int(num_experts) <= MAX_EXPERTS:
        raise InvalidArgument(f"{what}: num_experts must be in [1, {MAX_EXPERTS}], got "
                              f"{num_experts}")
    if top_k is not None and not 1 <= int(top_k) <= min(int(num_experts), MAX_TOP_K):
        raise InvalidArgument(f"{what}: top_k must be in [1, min(num_experts={num_experts}, "
                              f"{MAX_TOP_K})], got {top_k}")


def moe_topk_softmax(backend, stream: int, topk_ids_ptr, topk_weights_ptr, logits_ptr,
                     n_tokens: int, num_experts: int, top_k: int, renormalize: bool,
                     bias_ptr=NULL) -> None:
    """Top-k routing of `n_tokens` rows. logits: float32 [n_tokens, num_experts];
    topk_ids: int32 [n_tokens, top_k]; topk_weights: float32 [n_tokens, top_k]; bias_ptr:
    bf16 [num_experts] added to every row's logits, or NULL."""
    check_sizes("moe_topk_softmax", n_tokens=n_tokens)
    _check_experts("moe_topk_softmax", num_experts, top_k)
    check_ptrs("moe_topk_softmax", topk_ids_ptr=topk_ids_ptr,
               topk_weights_ptr=topk_weights_ptr, logits_ptr=logits_ptr)
    per_block = ROUTER_THREADS // 32
    grid = (-(-int(n_tokens) // per_block),)
    backend.launch(backend.kernel(MODULE, "moe_topk_softmax"), grid, (ROUTER_THREADS,), 0,
                   stream, (DevicePtr(topk_ids_ptr), DevicePtr(topk_weights_ptr),
                            DevicePtr(logits_ptr), np.int32(n_tokens), np.int32(num_experts),
                            np.int32(top_k), np.int32(bool(renormalize)),
                            DevicePtr(bias_ptr)))


def moe_route(backend, stream: int, sorted_pairs_ptr, expert_offsets_ptr, tile_offsets_ptr,
              topk_ids_ptr, n_pairs: int, num_experts: int, block_m: int) -> None:
    """Group the n_pairs = n_tokens * top_k (token, slot) pairs by expert. topk_ids: int32
    [n_pairs] in [0, num_experts); sorted_pairs: int32 [n_pairs]; expert_offsets,
    tile_offsets: int32 [num_experts + 1]; block_m: the grouped GEMM tile's height."""
    check_sizes("moe_route", n_pairs=n_pairs, block_m=block_m)
    _check_experts("moe_route", num_experts)
    check_ptrs("moe_route", sorted_pairs_ptr=sorted_pairs_ptr,
               expert_offsets_ptr=expert_offsets_ptr, tile_offsets_ptr=tile_offsets_ptr,
               topk_ids_ptr=topk_ids_ptr)
    backend.launch(backend.kernel(MODULE, "moe_route"), (1,), (ROUTE_THREADS,), 0, stream,
                   (DevicePtr(sorted_pairs_ptr), DevicePtr(expert_offsets_ptr),
                    DevicePtr(tile_offsets_ptr), DevicePtr(topk_ids_ptr), np.int32(n_pairs),
                    np.int32(num_experts), np.int32(block_m)))


# ----------------------------------------------------------------------------- twins
def rank_experts(logits: np.ndarray) -> np.ndarray:
    """int64 [n, E]: each row's experts in the kernel's rank order (NaN first, then the
    larger logit, equal logits by the lower index)."""
    n, E = logits.shape
    nan = np.isnan(logits)
    neg = np.where(nan, 0.0, -logits.astype(np.float64))   # -0.0 == +0.0: a tie, as in C
    idx = np.broadcast_to(np.arange(E), (n, E))
    # lexsort sorts by the last key first: not-NaN flag, then -logit, then the index
    return np.lexsort((idx, neg, ~nan), axis=-1)


def softmax_f32(logits: np.ndarray) -> np.ndarray:
    """The kernel's float32 softmax of each row: max without NaN, expf(l - m), the lanes'
    sequential sums (lane l: experts l, l + 32, ...) then the xor butterfly, x / s."""
    n, E = logits.shape
    l = np.asarray(logits, np.float32)
    m = np.max(np.where(np.isnan(l), np.float32(-np.inf), l), axis=1, initial=-np.inf)
    with np.errstate(invalid="ignore", over="ignore"):
        x = np.exp(l - m[:, None].astype(np.float32)).astype(np.float32)
    lanes = np.zeros((n, 32), np.float32)
    for j in range(-(-E // 32)):
        part = x[:, 32 * j:32 * (j + 1)]
        lanes[:, :part.shape[1]] += part
    for half in (16, 8, 4, 2, 1):
        lanes = lanes[:, :half] + lanes[:, half:2 * half]
    with np.errstate(invalid="ignore", divide="ignore"):
        return x / lanes[:, :1]


def topk_softmax_f32(logits: np.ndarray, top_k: int, renormalize: bool):
    """(ids int32 [n, k], weights float32 [n, k]): moe_topk_softmax's formula."""
    p = softmax_f32(logits)
    ids = rank_experts(logits)[:, :top_k]
    w = np.take_along_axis(p, ids, axis=1).astype(np.float32)
    if renormalize:
        total = np.zeros(len(w), np.float32)
        for s in range(top_k):          # slot order, one float32 rounding per add
            total = total + w[:, s]
        with np.errstate(invalid="ignore", divide="ignore"):
            w = w / total[:, None]
    return ids.astype(np.int32), w.astype(np.float32)


def route(ids: np.ndarray, num_experts: int, block_m: int):
    """(sorted_pairs, expert_offsets, tile_offsets): moe_route's result for flat ids
    [n_pairs]; ids outside [0, num_experts) are skipped, as the kernel does (sorted_pairs
    then holds expert_offsets[E] < n_pairs entries)."""
    ids = np.asarray(ids, np.int64).reshape(-1)
    valid = np.flatnonzero((ids >= 0) & (ids < num_experts))
    counts = np.bincount(ids[valid], minlength=num_experts)
    offsets = np.zeros(num_experts + 1, np.int32)
    np.cumsum(counts, out=offsets[1:])
    tiles = np.zeros(num_experts + 1, np.int32)
    np.cumsum(-(-counts // block_m), out=tiles[1:])
    pairs = valid[np.argsort(ids[valid], kind="stable")]
    return pairs.astype(np.int32), offsets, tiles


@twin(MODULE, "moe_topk_softmax")
def _topk_softmax_twin(ctx, ids_ptr, weights_ptr, logits_ptr, n_tokens, num_experts, top_k,
                       renormalize, bias_ptr) -> None:
    n, E, k = int(n_tokens), int(num_experts), int(top_k)
    logits = ctx.read(logits_ptr, n * E, np.float32).reshape(n, E)
    if int(bias_ptr):
        logits = logits + bf16_to_f32(ctx.read(bias_ptr, E, np.uint16))[None, :]
    ids, w = topk_softmax_f32(logits, k, bool(renormalize))
    ctx.view(ids_ptr, n * k, np.int32)[:] = ids.reshape(-1)
    ctx.view(weights_ptr, n * k, np.float32)[:] = w.reshape(-1)


@twin(MODULE, "moe_route")
def _route_twin(ctx, sorted_ptr, offsets_ptr, tiles_ptr, ids_ptr, n_pairs, num_experts,
                block_m) -> None:
    n, E = int(n_pairs), int(num_experts)
    pairs, offsets, tiles = route(ctx.read(ids_ptr, n, np.int32), E, int(block_m))
    ctx.view(sorted_ptr, len(pairs), np.int32)[:] = pairs
    ctx.view(offsets_ptr, E + 1, np.int32)[:] = offsets
    ctx.view(tiles_ptr, E + 1, np.int32)[:] = tiles
