"""Split-K paged decode attention (kernels/attention.cu's decode_attention_v{8,2}_g{1,2,4,8}
and decode_attention_combine): the launcher and the numpy twins (module "attention"; re-
exported by ops/attention.py).

Decode splits every sequence into fixed 256-token pieces of absolute positions
(`DECODE_SPLIT_TOKENS`), so the number of splits depends only on the sequence's own kv_len:
a sequence's result is the same alone or in any batch, on the GPU and in the twin. The twin
mirrors the split structure (per-split max/sum/acc written to the same workspace, combined in
the same fixed order), so GPU and twin differ only by fp32 summation order inside a split.
Options (attention_common.py): `softcap` pre-scales q by scale / softcap and takes
softcap * log2(e) * tanh of each dot product; `sinks_ptr` adds each head's 2^(s2 - M) to the
denominator where the output is written (the split kernel for one split, else the combine).

Where HostBackend's native library is loaded, the decode twins run in it (attention_native.py,
gpu_runtime/native/attention_f32.cpp): the same split structure and formula, its own fixed
float32 summation order (within the tests' tolerance of the numpy path, not bit for bit).
The library has neither option: a launch with one takes the numpy path.
"""
from __future__ import annotations

import numpy as np

from ..errors import InvalidArgument, KernelError
from ..gpu_runtime.types import NULL, DevicePtr
from .attention_common import (DECODE_SPLIT_TOKENS, GRID_YZ_MAX, LOG2E, MODULE, THREADS,
                               WARPS, check_common, sinks_base2)
from .attention_native import decode_combine_native, decode_split_native
from .attention_tile import gather_paged
from .bf16 import bf16_to_f32, f32_to_bf16
from .checks import check_ptrs
from .registry import twin

_GT = (1, 2, 4, 8)  # query heads per decode CTA (template instances)


def decode_max_splits(max_kv_len: int) -> int:
    """Splits needed for the longest allowed sequence (the decode grid's x extent)."""
    max_kv_len = int(max_kv_len)
    if max_kv_len < 1:
        raise InvalidArgument(f"decode_max_splits: max_kv_len must be >= 1, got {max_kv_len}")
    return -(-max_kv_len // DECODE_SPLIT_TOKENS)


def decode_workspace_bytes(n_seqs: int, num_heads: int, head_dim: int, max_splits: int) -> int:
    """fp32 workspace of decode_attention: acc [n_seqs, H, max_splits, D] + (m, l) pairs."""
    for name, v in (("n_seqs", n_seqs), ("num_heads", num_heads), ("head_dim", head_dim),
                    ("max_splits", max_splits)):
        if int(v) < 1:
            raise InvalidArgument(f"decode_workspace_bytes: {name} must be >= 1, got {v}")
    return int(n_seqs) * int(num_heads) * int(max_splits) * (int(head_dim) + 2) * 4


def _decode_variant(num_heads, num_kv_heads, head_dim, ptrs) -> tuple[str, int, int, int]:
    """(kernel name, vec, GT, number of head groups per kv head)."""
    g = num_heads // num_kv_heads
    gt = next((x for x in _GT if x >= g), _GT[-1])
    vec = 8 if head_dim % 8 == 0 and all(int(p) % 16 == 0 for p in ptrs) else 2
    return f"decode_attention_v{vec}_g{gt}", vec, gt, -(-g // gt)


def decode_smem_bytes(gt: int, head_dim: int) -> int:
    """[gt, 256] logits, [WARPS, gt, head_dim * 33 / 32] padded partial sums (attention.cu)."""
    return (gt * DECODE_SPLIT_TOKENS + WARPS * gt * (head_dim + head_dim // 32)) * 4


def decode_attention(backend, stream: int, out_ptr, qkv_ptr, k_cache_ptr, v_cache_ptr,
                     block_tables_ptr, kv_lens_ptr, n_seqs: int, num_heads: int,
                     num_kv_heads: int, head_dim: int, block_size: int,
                     max_blocks_per_seq: int, scale: float, workspace_ptr, max_splits: int,
                     sliding_window: int = 0, softcap: float = 0.0, sinks_ptr=NULL) -> None:
    """One query per sequence (row s of qkv) at position kv_lens[s]-1, split-K over fixed
    256-token pieces, then a combine launch. out [n_seqs, H*D] bf16; workspace fp32 of
    `decode_workspace_bytes(n_seqs, H, D, max_splits)` bytes (may be NULL when
    max_splits == 1). Every sequence needs kv_lens[s] <= max_splits * 256 and
    <= max_blocks_per_seq * block_size; kv_lens[s] <= 0 gives a zero row. Graph safe: the
    grid depends only on (max_splits, KV, n_seqs). softcap (0: off) and sinks_ptr (fp32
    [num_heads] or NULL): attention_common.py's options."""
    n_seqs, num_heads, num_kv_heads = int(n_seqs), int(num_heads), int(num_kv_heads)
    head_dim, block_size = int(head_dim), int(block_size)
    max_blocks_per_seq, max_splits = int(max_blocks_per_seq), int(max_splits)
    scale, sliding_window, softcap = float(scale), int(sliding_window), float(softcap)
    what = "decode_attention"
    check_common(what, num_heads, num_kv_heads, head_dim, block_size, max_blocks_per_seq,
                 scale, sliding_window, softcap, sinks_ptr)
    if not 1 <= n_seqs <= GRID_YZ_MAX:
        raise InvalidArgument(f"{what}: n_seqs must be in [1, {GRID_YZ_MAX}], got {n_seqs}")
    if not 1 <= max_splits < 2**31:
        raise InvalidArgument(f"{what}: max_splits must be >= 1, got {max_splits}")
    check_ptrs(what, 4, out=out_ptr, qkv=qkv_ptr, k_cache=k_cache_ptr, v_cache=v_cache_ptr,
                block_tables=block_tables_ptr, kv_lens=kv_lens_ptr)
    if max_splits > 1 or int(workspace_ptr):
        check_ptrs(what, 4, workspace=workspace_ptr)
    name, _, gt, n_hg = _decode_variant(num_heads, num_kv_heads, head_dim,
                                        (qkv_ptr, k_cache_ptr, v_cache_ptr))
    if num_kv_heads * n_hg > GRID_YZ_MAX:
        raise InvalidArgument(f"{what}: too many kv heads for the grid")
    args = (DevicePtr(out_ptr), DevicePtr(workspace_ptr), DevicePtr(qkv_ptr),
            DevicePtr(k_cache_ptr), DevicePtr(v_cache_ptr), DevicePtr(block_tables_ptr),
            DevicePtr(kv_lens_ptr), np.int32(n_seqs), np.int32(num_heads),
            np.int32(num_kv_heads), np.int32(head_dim), np.int32(block_size),
            np.int32(max_blocks_per_seq), np.int32(max_splits), np.float32(scale),
            np.int32(sliding_window), np.float32(softcap), DevicePtr(sinks_ptr))
    backend.launch(backend.kernel(MODULE, name), (max_splits, num_kv_heads * n_hg, n_seqs),
                   (THREADS,), decode_smem_bytes(gt, head_dim), stream, args)
    if max_splits > 1:
        backend.launch(backend.kernel(MODULE, "decode_attention_combine"),
                       (n_seqs, num_heads), (THREADS,), 0, stream,
                       (DevicePtr(out_ptr), DevicePtr(workspace_ptr), DevicePtr(kv_lens_ptr),
                        np.int32(n_seqs), np.int32(num_heads), np.int32(head_dim),
                        np.int32(block_size), np.int32(max_blocks_per_seq),
                        np.int32(max_splits), np.int32(sliding_window), DevicePtr(sinks_ptr)))


def _decode_seq(kv_len, bs, mb, max_splits, w, s, what):
    """(start, first split, n_splits) of one sequence; raises where the kernel writes NaN."""
    if kv_len > mb * bs or kv_len > max_splits * DECODE_SPLIT_TOKENS:
        raise KernelError(
            f"attention.{what}: kv_lens[{s}] = {kv_len} exceeds the capacity "
            f"(max_blocks_per_seq*block_size = {mb * bs}, max_splits*"
            f"{DECODE_SPLIT_TOKENS} = {max_splits * DECODE_SPLIT_TOKENS}); the kernel "
            "writes a NaN row")
    start = kv_len - w if 0 < w < kv_len else 0
    return start, start // DECODE_SPLIT_TOKENS, -(-kv_len // DECODE_SPLIT_TOKENS)


def _decode_split_twin(ctx, out_ptr, workspace_ptr, qkv_ptr, k_cache_ptr, v_cache_ptr,
                       block_tables_ptr, kv_lens_ptr, n_seqs, num_heads, num_kv_heads,
                       head_dim, block_size, max_blocks_per_seq, max_splits, scale,
                       sliding_window, softcap, sinks_ptr) -> None:
    ns, h, kv, d = int(n_seqs), int(num_heads), int(num_kv_heads), int(head_dim)
    bs, mb, msp, w = (int(block_size), int(max_blocks_per_seq), int(max_splits),
                      int(sliding_window))
    cap = float(softcap)
    sinks = sinks_base2(ctx, sinks_ptr, h)
    native = getattr(ctx.backend, "native", None)
    if native is not None and cap == 0 and sinks is None and decode_split_native(
            ctx, native, out_ptr, workspace_ptr, qkv_ptr, k_cache_ptr, v_cache_ptr,
            block_tables_ptr, kv_lens_ptr, ns, h, kv, d, bs, mb, msp, float(scale), w):
        return
    g = h // kv
    S = DECODE_SPLIT_TOKENS
    # pre-scale of q: scale * log2(e), soft-capped scale / cap (tanh of the dot products)
    sl2 = np.float32(scale) / np.float32(cap) if cap > 0 else np.float32(scale) * LOG2E
    cap_l2 = np.float32(cap) * LOG2E
    qkv_row = (h + 2 * kv) * d
    kv_lens = ctx.read(kv_lens_ptr, ns, np.int32).astype(np.int64)
    tables = ctx.read(block_tables_ptr, ns * mb, np.int32).reshape(ns, mb)
    for s in range(ns):
        kv_len = int(kv_lens[s])
        out = ctx.view(int(out_ptr) + s * h * d * 2, h * d, np.uint16)
        if kv_len <= 0:
            out[:] = 0
            continue
        start, first, n_splits = _decode_seq(kv_len, bs, mb, msp, w, s, "decode_attention")
        q = bf16_to_f32(ctx.read(int(qkv_ptr) + s * qkv_row * 2, h * d, np.uint16))
        q = (q * sl2).reshape(kv, g, d)                                   # pre-scaled
        k = gather_paged(ctx, k_cache_ptr, tables[s], start, kv_len, bs, kv, d,
                         "attention.decode_attention")
        v = gather_paged(ctx, v_cache_ptr, tables[s], start, kv_len, bs, kv, d,
                         "attention.decode_attention")
        for i in range(first, n_splits):
            t0, t1 = max(i * S, start) - start, min(i * S + S, kv_len) - start
            kt = np.ascontiguousarray(k[t0:t1].transpose(1, 2, 0))       # [KV, D, n]
            vt = np.ascontiguousarray(v[t0:t1].transpose(1, 0, 2))       # [KV, n, D]
            sc = np.matmul(q, kt)                                         # [KV, G, n]
            if cap > 0:
                sc = (cap_l2 * np.tanh(sc)).astype(np.float32)
            m = sc.max(axis=-1)
            p = np.exp2(sc - m[..., None])
            lsum = p.sum(axis=-1, dtype=np.float32)
            acc = np.matmul(p, vt)                                        # [KV, G, D]
            if n_splits - first == 1 and sinks is not None:
                s2 = sinks.reshape(kv, g)
                big = np.maximum(m, s2)
                e = np.exp2(m - big)
                out[:] = f32_to_bf16((acc * (e / (lsum * e + np.exp2(s2 - big)))[..., None]
                                      ).reshape(h * d))
            elif n_splits - first == 1:
                out[:] = f32_to_bf16((acc / lsum[..., None]).reshape(h * d))
            else:
                ws_acc = ctx.view(workspace_ptr, ns * h * msp * d, np.float32).reshape(
                    ns, h, msp, d)
                ws_ml = ctx.view(int(workspace_ptr) + ns * h * msp * d * 4, ns * h * msp * 2,
                                 np.float32).reshape(ns, h, msp, 2)
                ws_acc[s, :, i] = acc.reshape(h, d)
                ws_ml[s, :, i, 0] = m.reshape(h)
                ws_ml[s, :, i, 1] = lsum.reshape(h)


for _vec in (8, 2):
    for _gt in _GT:
        twin(MODULE, f"decode_attention_v{_vec}_g{_gt}")(_decode_split_twin)


@twin(MODULE, "decode_attention_combine")
def decode_attention_combine_twin(ctx, out_ptr, workspace_ptr, kv_lens_ptr, n_seqs, num_heads,
                                  head_dim, block_size, max_blocks_per_seq, max_splits,
                                  sliding_window, sinks_ptr) -> None:
    ns, h, d = int(n_seqs), int(num_heads), int(head_dim)
    bs, mb, msp, w = (int(block_size), int(max_blocks_per_seq), int(max_splits),
                      int(sliding_window))
    sinks = sinks_base2(ctx, sinks_ptr, h)
    native = getattr(ctx.backend, "native", None)
    if native is not None and sinks is None and decode_combine_native(ctx, native, out_ptr, workspace_ptr,
                                                     kv_lens_ptr, ns, h, d, bs, mb, msp, w,
                                                     DECODE_SPLIT_TOKENS):
        return
    kv_lens = ctx.read(kv_lens_ptr, ns, np.int32).astype(np.int64)
    for s in range(ns):
        kv_len = int(kv_lens[s])
        if kv_len <= 0:
            continue
        _, first, n_splits = _decode_seq(kv_len, bs, mb, msp, w, s, "decode_attention_combine")
        if n_splits - first <= 1:
            continue
        ws_acc = ctx.read(workspace_ptr, ns * h * msp * d, np.float32).reshape(ns, h, msp, d)
        ws_ml = ctx.read(int(workspace_ptr) + ns * h * msp * d * 4, ns * h * msp * 2,
                         np.float32).reshape(ns, h, msp, 2)
        ml = ws_ml[s, :, first:n_splits]                                  # [H, n, 2]
        big_m = ml[..., 0].max(axis=1)                                    # [H]
        if sinks is not None:
            big_m = np.maximum(big_m, sinks)
        lsum = np.zeros(h, np.float32)
        acc = np.zeros((h, d), np.float32)
        for i in range(first, n_splits):  # fixed order, like the kernel
            wgt = np.exp2(ws_ml[s, :, i, 0] - big_m)
            lsum = lsum + wgt * ws_ml[s, :, i, 1]
            acc = acc + wgt[:, None] * ws_acc[s, :, i]
        if sinks is not None:
            lsum = lsum + np.exp2(sinks - big_m)
        inv = np.float32(1) / lsum
        ctx.view(int(out_ptr) + s * h * d * 2, h * d, np.uint16)[:] = f32_to_bf16(
            (acc * inv[:, None]).reshape(h * d))
