"""DeepSeek's group-limited top-k routing (kernels/deepseek_router.cu): launcher and numpy
twin (module "deepseek_router").

  moe_topk_grouped: float32 router logits [n_tokens, E] -> top-k expert ids (int32 [n, k],
  rank order) and weights (float32 [n, k]), per token, every step in float32:
    mode 1 (DeepSeek-V3, "noaux_tc"):
        s = 1 / (1 + exp(-l)); c = s + bias (e_score_correction_bias, float32 [E])
        group score = the sum of the two largest c of each of n_group equal groups
        the topk_group best groups; the k largest c inside them
        w = s of the chosen (renormalize: w / (sum_slots w + 1e-20), slots in rank order)
    mode 0 (DeepSeek-V2, softmax; greedy = n_group 1):
        s = softmax(l) (max-subtracted, sum over experts in index order); c = s
        group score = the largest c of the group; the topk_group best groups; the k
        largest c inside them; w = s of the chosen
    then w *= routed_scaling_factor.
Ranking (groups and experts): the larger value first, equal values by the lower index
(torch.topk on the CPU keeps the lower index first among equal values, which is what the
goldens are made with); a NaN ranks below every number.
"""
from __future__ import annotations

import numpy as np

from ..errors import InvalidArgument
from ..gpu_runtime.types import NULL, DevicePtr
from .checks import check_ptrs, check_sizes
from .registry import twin

MODULE = "deepseek_router"
THREADS = 128               # 4 warps, one token each
MAX_EXPERTS = 512
MAX_TOP_K = 32
MAX_GROUPS = 32


def moe_topk_grouped(backend, stream: int, topk_ids_ptr, topk_weights_ptr, logits_ptr,
                     n_tokens: int, num_experts: int, top_k: int, n_group: int,
                     topk_group: int, mode: int, renormalize: bool, scale: float,
                     bias_ptr=NULL) -> None:
    """Route `n_tokens` rows as above. logits float32 [n_tokens, num_experts]; topk_ids int32
    [n_tokens, top_k]; topk_weights float32 [n_tokens, top_k]; bias_ptr float32
    [num_experts] (mode 1) or NULL."""
    what = "moe_topk_grouped"
    check_sizes(what, n_tokens=n_tokens, num_experts=num_experts, top_k=top_k,
                n_group=n_group, topk_group=topk_group)
    E, k, g, tg = int(num_experts), int(top_k), int(n_group), int(topk_group)
    if E > MAX_EXPERTS or g > MAX_GROUPS or E % g or tg > g or k > MAX_TOP_K or \
            k > tg * (E // g):
        raise InvalidArgument(f"{what}: num_experts={E} (<= {MAX_EXPERTS}) must split into "
                              f"n_group={g} (<= {MAX_GROUPS}) equal groups, topk_group={tg} "
                              f"<= n_group and top_k={k} <= min({MAX_TOP_K}, topk_group * "
                              "group size)")
    if int(mode) not in (0, 1) or (int(mode) == 1 and E // g < 2):
        raise InvalidArgument(f"{what}: mode must be 0 (softmax) or 1 (sigmoid, groups of at "
                              f"least two), got mode={mode} with groups of {E // g}")
    if not np.isfinite(scale):
        raise InvalidArgument(f"{what}: routed_scaling_factor must be finite, got {scale}")
    check_ptrs(what, align=4, topk_ids_ptr=topk_ids_ptr, topk_weights_ptr=topk_weights_ptr,
               logits_ptr=logits_ptr)
    grid = (-(-int(n_tokens) // (THREADS // 32)),)
    backend.launch(backend.kernel(MODULE, "moe_topk_grouped"), grid, (THREADS,), 0, stream,
                   (DevicePtr(topk_ids_ptr), DevicePtr(topk_weights_ptr), DevicePtr(logits_ptr),
                    DevicePtr(bias_ptr), np.int32(n_tokens), np.int32(E), np.int32(k),
                    np.int32(g), np.int32(tg), np.int32(mode), np.int32(bool(renormalize)),
                    np.float32(scale)))


def _rank(v: np.ndarray) -> np.ndarray:
    """Indices of each row, larger first, ties by lower index, NaN last."""
    n, m = v.shape
    key = np.where(np.isnan(v), np.inf, -v.astype(np.float64))
    return np.lexsort((np.broadcast_to(np.arange(m), (n, m)), key), axis=-1)


def grouped_topk(logits: np.ndarray, k: int, n_group: int, topk_group: int, mode: int,
                 renormalize: bool, scale: float, bias: np.ndarray | None = None):
    """(ids int32 [n, k], weights float32 [n, k]): moe_topk_grouped's float32 formula."""
    l = np.asarray(logits, np.float32)
    n, E = l.shape
    one = np.float32(1)
    with np.errstate(over="ignore", invalid="ignore"):
        if mode == 1:
            s = (one / (one + np.exp(-l))).astype(np.float32)
            c = s + (np.zeros(E, np.float32) if bias is None else bias.astype(np.float32))
        else:
            m = np.max(l, axis=1, keepdims=True)
            x = np.exp(l - m).astype(np.float32)
            total = np.zeros((n, 1), np.float32)
            for e in range(E):                       # index order, one rounding per add
                total = total + x[:, e:e + 1]
            s = (x / total).astype(np.float32)
            c = s
    G = E // n_group
    cg = c.reshape(n, n_group, G)
    if mode == 1:
        two = np.take_along_axis(cg, _rank(cg.reshape(-1, G)).reshape(n, n_group, G)[..., :2],
                                 axis=-1)
        gscore = (two[..., 0] + two[..., 1]).astype(np.float32)
    else:
        gscore = cg.max(axis=-1)
    groups = _rank(gscore)[:, :topk_group]
    allowed = np.zeros((n, n_group), bool)
    np.put_along_axis(allowed, groups, True, axis=1)
    # masked experts: -inf (V3's masked_fill) or 0.0 (V2's, below any softmax score > 0)
    masked = np.where(np.repeat(allowed, G, axis=1), c,
                      -np.inf if mode == 1 else 0.0).astype(np.float32)
    ids = _rank(masked)[:, :k]
    w = np.take_along_axis(s, ids, axis=1).astype(np.float32)
    if renormalize:
        total = np.zeros(n, np.float32)
        for j in range(k):                           # rank order
            total = total + w[:, j]
        w = w / (total + np.float32(1e-20))[:, None]
    return ids.astype(np.int32), (w * np.float32(scale)).astype(np.float32)


@twin(MODULE, "moe_topk_grouped")
def _grouped_twin(ctx, ids_ptr, weights_ptr, logits_ptr, bias_ptr, n_tokens, num_experts,
                  top_k, n_group, topk_group, mode, renormalize, scale) -> None:
    n, E, k = int(n_tokens), int(num_experts), int(top_k)
    logits = ctx.read(logits_ptr, n * E, np.float32).reshape(n, E)
    bias = ctx.read(bias_ptr, E, np.float32) if int(bias_ptr) else None
    ids, w = grouped_topk(logits, k, int(n_group), int(topk_group), int(mode),
                          bool(renormalize), float(np.float32(scale)), bias)
    ctx.view(ids_ptr, n * k, np.int32)[:] = ids.reshape(-1)
    ctx.view(weights_ptr, n * k, np.float32)[:] = w.reshape(-1)
