"""Paged attention (kernels/attention.cu): ragged causal prefill and split-K decode, their
launchers and numpy twins.

Scores are computed in base 2 like the kernels: s = (q . k) * scale * log2(e),
p = exp2(s - max), fp32 throughout, the output rounded once to bf16.

Decode splits every sequence into fixed 256-token pieces of absolute positions
(`DECODE_SPLIT_TOKENS`), so the number of splits depends only on the sequence's own kv_len:
a sequence's result is the same alone or in any batch, on the GPU and in the twin. The twin
mirrors the split structure (per-split max/sum/acc written to the same workspace, combined in
the same fixed order), so GPU and twin differ only by fp32 summation order inside a split.

The twins compute each sequence from its own data only (bit-identical alone or in a batch),
read block tables, kv_lens, qo_indptr and caches through `ctx.view` (bounds-checked), and
raise KernelError where the kernel would write NaN rows (inconsistent lengths).

Where HostBackend's native library is loaded, the decode twins run in it (attention_native.py,
gpu_runtime/native/attention_f32.cpp): the same split structure and formula, its own fixed
float32 summation order (within the tests' tolerance of the numpy path, not bit for bit).
"""
from __future__ import annotations

import math

import numpy as np

from ..errors import InvalidArgument, KernelError
from ..gpu_runtime.types import DevicePtr
from .attention_native import decode_combine_native, decode_split_native
from .attention_tile import attend_base2, gather_paged
from .bf16 import bf16_to_f32, f32_to_bf16
from .checks import check_heads, check_ptrs
from .registry import twin

MODULE = "attention"
THREADS = 128
WARPS = 4
MAX_HEAD_DIM = 256
PREFILL_BK = 32
DECODE_SPLIT_TOKENS = 256
_LOG2E = np.float32(1.4426950408889634)
_GT = (1, 2, 4, 8)  # query heads per decode CTA (template instances)
_GRID_YZ_MAX = 65535


# --------------------------------------------------------------------------------------
# shared checks
# --------------------------------------------------------------------------------------
def _check_common(what, num_heads, num_kv_heads, head_dim, block_size, max_blocks_per_seq,
                  scale, sliding_window) -> None:
    check_heads(what, num_heads, num_kv_heads, head_dim, MAX_HEAD_DIM)
    if block_size < 1:
        raise InvalidArgument(f"{what}: block_size must be >= 1, got {block_size}")
    if max_blocks_per_seq < 1:
        raise InvalidArgument(f"{what}: max_blocks_per_seq must be >= 1, got "
                              f"{max_blocks_per_seq}")
    if block_size * max_blocks_per_seq >= 2**31:
        raise InvalidArgument(f"{what}: block_size * max_blocks_per_seq exceeds 2^31")
    if not (math.isfinite(scale) and scale > 0):
        raise InvalidArgument(f"{what}: scale must be finite and > 0, got {scale}")
    if sliding_window < 0 or sliding_window >= 2**31:
        raise InvalidArgument(f"{what}: sliding_window must be in [0, 2^31), got "
                              f"{sliding_window}")
    if num_heads > _GRID_YZ_MAX:
        raise InvalidArgument(f"{what}: num_heads {num_heads} exceeds {_GRID_YZ_MAX}")


# --------------------------------------------------------------------------------------
# prefill
# --------------------------------------------------------------------------------------
def _prefill_variant(head_dim: int) -> tuple[str, int]:
    maxp = -(-(head_dim // 2) // 32)
    maxp = 1 if maxp <= 1 else 2 if maxp <= 2 else 4
    bq = 16 if maxp == 4 else 32
    return f"prefill_attention_p{maxp}", bq


def prefill_smem_bytes(head_dim: int) -> int:
    _, bq = _prefill_variant(head_dim)
    return head_dim * (4 * bq + 128)


def check_prefill(what, out_ptr, qkv_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr,
                  kv_lens_ptr, qo_indptr_ptr, n_seqs, n_tokens, max_q_len, num_heads,
                  num_kv_heads, head_dim, block_size, max_blocks_per_seq, scale,
                  sliding_window) -> None:
    """The argument checks every prefill attention launcher makes before launching (this
    module's and attention_tc's); raises InvalidArgument naming `what` and the argument."""
    _check_common(what, num_heads, num_kv_heads, head_dim, block_size, max_blocks_per_seq,
                  scale, sliding_window)
    if not 1 <= n_seqs <= _GRID_YZ_MAX:
        raise InvalidArgument(f"{what}: n_seqs must be in [1, {_GRID_YZ_MAX}], got {n_seqs}")
    if not 1 <= n_tokens < 2**31:
        raise InvalidArgument(f"{what}: n_tokens must be in [1, 2^31), got {n_tokens}")
    if not 1 <= max_q_len <= n_tokens:
        raise InvalidArgument(f"{what}: max_q_len must be in [1, n_tokens={n_tokens}], "
                              f"got {max_q_len}")
    check_ptrs(what, 4, out=out_ptr, qkv=qkv_ptr, k_cache=k_cache_ptr, v_cache=v_cache_ptr,
                block_tables=block_tables_ptr, kv_lens=kv_lens_ptr, qo_indptr=qo_indptr_ptr)


def prefill_args(out_ptr, qkv_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, kv_lens_ptr,
                 qo_indptr_ptr, n_seqs, n_tokens, max_q_len, num_heads, num_kv_heads,
                 head_dim, block_size, max_blocks_per_seq, scale, sliding_window) -> tuple:
    """The C argument tuple shared by every prefill attention kernel (attention.cu's and
    attention_tc.cu's entry points take the same parameters)."""
    return (DevicePtr(out_ptr), DevicePtr(qkv_ptr), DevicePtr(k_cache_ptr),
            DevicePtr(v_cache_ptr), DevicePtr(block_tables_ptr), DevicePtr(kv_lens_ptr),
            DevicePtr(qo_indptr_ptr), np.int32(n_seqs), np.int32(n_tokens),
            np.int32(max_q_len), np.int32(num_heads), np.int32(num_kv_heads),
            np.int32(head_dim), np.int32(block_size), np.int32(max_blocks_per_seq),
            np.float32(scale), np.int32(sliding_window))


def prefill_attention(backend, stream: int, out_ptr, qkv_ptr, k_cache_ptr, v_cache_ptr,
                      block_tables_ptr, kv_lens_ptr, qo_indptr_ptr, n_seqs: int,
                      n_tokens: int, max_q_len: int, num_heads: int, num_kv_heads: int,
                      head_dim: int, block_size: int, max_blocks_per_seq: int, scale: float,
                      sliding_window: int = 0) -> None:
    """Causal attention of a ragged batch of query chunks against the paged cache, on CUDA
    cores (any even head_dim <= 256; attention_tc.prefill_attention_auto picks the
    tensor-core kernel where it applies).

    out [n_tokens, H*D] bf16; qkv [n_tokens, (H+2KV)*D] bf16 (q read from it);
    k_cache/v_cache [num_blocks, block_size, KV, D] bf16, already holding this step's k/v;
    block_tables int32 [n_seqs, max_blocks_per_seq]; kv_lens int32 [n_seqs] (including the
    new tokens); qo_indptr int32 [n_seqs+1]. Query row i of sequence s sits at position
    kv_lens[s] - q_len_s + i. max_q_len (>= every q_len_s) sizes the grid.
    """
    n_seqs, n_tokens, max_q_len = int(n_seqs), int(n_tokens), int(max_q_len)
    num_heads, head_dim = int(num_heads), int(head_dim)
    a = (out_ptr, qkv_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, kv_lens_ptr,
         qo_indptr_ptr, n_seqs, n_tokens, max_q_len, num_heads, int(num_kv_heads), head_dim,
         int(block_size), int(max_blocks_per_seq), float(scale), int(sliding_window))
    check_prefill("prefill_attention", *a)
    name, bq = _prefill_variant(head_dim)
    backend.launch(backend.kernel(MODULE, name), (-(-max_q_len // bq), num_heads, n_seqs),
                   (THREADS,), prefill_smem_bytes(head_dim), stream, prefill_args(*a))


_PREFILL_ROWS = 128  # query rows per twin step (per sequence; never mixes sequences)


def prefill_twin(ctx, attend, what, out_ptr, qkv_ptr, k_cache_ptr, v_cache_ptr,
                 block_tables_ptr, kv_lens_ptr, qo_indptr_ptr, n_seqs, n_tokens, max_q_len,
                 num_heads, num_kv_heads, head_dim, block_size, max_blocks_per_seq, scale,
                 sliding_window) -> None:
    """The twin of every prefill attention kernel, given how its rows attend:
    `attend(scores [KV, G*R, T] float64 base-2 with masked keys -inf, values [KV, T, D]
    float64, key_pos [T] absolute positions)` -> [KV, G*R, D]. Raises KernelError where the
    kernel writes NaN rows."""
    ns, nt, mq = int(n_seqs), int(n_tokens), int(max_q_len)
    h, kv, d = int(num_heads), int(num_kv_heads), int(head_dim)
    bs, mb, w = int(block_size), int(max_blocks_per_seq), int(sliding_window)
    g = h // kv
    sl2 = np.float32(scale) * _LOG2E
    qkv = ctx.read(qkv_ptr, nt * (h + 2 * kv) * d, np.uint16).reshape(nt, h + 2 * kv, d)
    out = ctx.view(out_ptr, nt * h * d, np.uint16).reshape(nt, h, d)
    qo = ctx.read(qo_indptr_ptr, ns + 1, np.int32).astype(np.int64)
    kv_lens = ctx.read(kv_lens_ptr, ns, np.int32).astype(np.int64)
    tables = ctx.read(block_tables_ptr, ns * mb, np.int32).reshape(ns, mb)
    for s in range(ns):   # every sequence checked before any output is written
        q_start, q_len, kv_len = int(qo[s]), int(qo[s + 1] - qo[s]), int(kv_lens[s])
        if not (q_start >= 0 and 0 <= q_len <= mq and q_start + q_len <= nt
                and q_len <= kv_len <= mb * bs):
            raise KernelError(f"{what}: sequence {s} is inconsistent: qo_indptr [{q_start}, "
                              f"{q_start + q_len}), max_q_len {mq}, n_tokens {nt}, kv_len "
                              f"{kv_len}, capacity {mb * bs} (the kernel writes NaN rows)")

    def one(s: int, k0: int, k1: int) -> None:
        """Sequence s, kv heads [k0, k1) (and their query heads)."""
        q_start, q_len, kv_len = int(qo[s]), int(qo[s + 1] - qo[s]), int(kv_lens[s])
        nk = k1 - k0
        pos_first = kv_len - q_len
        lo = max(0, pos_first - w + 1) if w > 0 else 0
        k = gather_paged(ctx, k_cache_ptr, tables[s], lo, kv_len, bs, kv, d, what)[:, k0:k1]
        v = gather_paged(ctx, v_cache_ptr, tables[s], lo, kv_len, bs, kv, d, what)[:, k0:k1]
        # float64 so a row's result does not depend on how many keys or rows share its
        # matmul: a prompt prefilled in chunks caches the same values as one prefilled whole
        # (differences ~1e-16 vanish in the BF16 store).
        kt = np.ascontiguousarray(k.transpose(1, 2, 0), np.float64)   # [nk, D, T]
        vt = np.ascontiguousarray(v.transpose(1, 0, 2), np.float64)   # [nk, T, D]
        kpos = np.arange(lo, kv_len)
        for r0 in range(0, q_len, _PREFILL_ROWS):
            r1 = min(q_len, r0 + _PREFILL_ROWS)
            q = bf16_to_f32(qkv[q_start + r0:q_start + r1, k0 * g:k1 * g]
                            ).astype(np.float64)                        # [R, nk*G, D]
            qg = q.reshape(r1 - r0, nk, g, d).transpose(1, 2, 0, 3)    # [nk, G, R, D]
            sc = np.matmul(qg.reshape(nk, g * (r1 - r0), d), kt) * float(sl2)  # [nk, G*R, T]
            sc = sc.reshape(nk, g, r1 - r0, -1)
            qpos = pos_first + np.arange(r0, r1)
            allowed = kpos[None, :] <= qpos[:, None]
            if w > 0:
                allowed &= kpos[None, :] > qpos[:, None] - w
            sc = np.where(allowed[None, None], sc, -np.inf).reshape(nk, g * (r1 - r0), -1)
            o = attend(sc, vt, kpos).reshape(nk, g, r1 - r0, d).astype(np.float32)
            out[q_start + r0:q_start + r1, k0 * g:k1 * g] = f32_to_bf16(
                o.transpose(2, 0, 1, 3).reshape(r1 - r0, nk * g, d))

    # sequences and kv heads are independent: over the twin threads (one sequence: halves)
    halves = 2 if kv > 1 and ns < 2 else 1
    tasks = [(s, kv * j // halves, kv * (j + 1) // halves)
             for s in range(ns) if qo[s + 1] > qo[s] for j in range(halves)]
    ctx.map_blocks(len(tasks), 1, lambda a, b: [one(*t) for t in tasks[a:b]])


def _prefill_twin(ctx, *args) -> None:
    prefill_twin(ctx, lambda sc, vt, kpos: attend_base2(sc, vt),
                 "attention.prefill_attention", *args)


for _maxp in (1, 2, 4):
    twin(MODULE, f"prefill_attention_p{_maxp}")(_prefill_twin)


# --------------------------------------------------------------------------------------
# decode
# --------------------------------------------------------------------------------------
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
                     sliding_window: int = 0) -> None:
    """One query per sequence (row s of qkv) at position kv_lens[s]-1, split-K over fixed
    256-token pieces, then a combine launch. out [n_seqs, H*D] bf16; workspace fp32 of
    `decode_workspace_bytes(n_seqs, H, D, max_splits)` bytes (may be NULL when
    max_splits == 1). Every sequence needs kv_lens[s] <= max_splits * 256 and
    <= max_blocks_per_seq * block_size; kv_lens[s] <= 0 gives a zero row. Graph safe: the
    grid depends only on (max_splits, KV, n_seqs)."""
    n_seqs, num_heads, num_kv_heads = int(n_seqs), int(num_heads), int(num_kv_heads)
    head_dim, block_size = int(head_dim), int(block_size)
    max_blocks_per_seq, max_splits = int(max_blocks_per_seq), int(max_splits)
    scale, sliding_window = float(scale), int(sliding_window)
    what = "decode_attention"
    _check_common(what, num_heads, num_kv_heads, head_dim, block_size, max_blocks_per_seq,
                  scale, sliding_window)
    if not 1 <= n_seqs <= _GRID_YZ_MAX:
        raise InvalidArgument(f"{what}: n_seqs must be in [1, {_GRID_YZ_MAX}], got {n_seqs}")
    if not 1 <= max_splits < 2**31:
        raise InvalidArgument(f"{what}: max_splits must be >= 1, got {max_splits}")
    check_ptrs(what, 4, out=out_ptr, qkv=qkv_ptr, k_cache=k_cache_ptr, v_cache=v_cache_ptr,
                block_tables=block_tables_ptr, kv_lens=kv_lens_ptr)
    if max_splits > 1 or int(workspace_ptr):
        check_ptrs(what, 4, workspace=workspace_ptr)
    name, _, gt, n_hg = _decode_variant(num_heads, num_kv_heads, head_dim,
                                        (qkv_ptr, k_cache_ptr, v_cache_ptr))
    if num_kv_heads * n_hg > _GRID_YZ_MAX:
        raise InvalidArgument(f"{what}: too many kv heads for the grid")
    args = (DevicePtr(out_ptr), DevicePtr(workspace_ptr), DevicePtr(qkv_ptr),
            DevicePtr(k_cache_ptr), DevicePtr(v_cache_ptr), DevicePtr(block_tables_ptr),
            DevicePtr(kv_lens_ptr), np.int32(n_seqs), np.int32(num_heads),
            np.int32(num_kv_heads), np.int32(head_dim), np.int32(block_size),
            np.int32(max_blocks_per_seq), np.int32(max_splits), np.float32(scale),
            np.int32(sliding_window))
    backend.launch(backend.kernel(MODULE, name), (max_splits, num_kv_heads * n_hg, n_seqs),
                   (THREADS,), decode_smem_bytes(gt, head_dim), stream, args)
    if max_splits > 1:
        backend.launch(backend.kernel(MODULE, "decode_attention_combine"),
                       (n_seqs, num_heads), (THREADS,), 0, stream,
                       (DevicePtr(out_ptr), DevicePtr(workspace_ptr), DevicePtr(kv_lens_ptr),
                        np.int32(n_seqs), np.int32(num_heads), np.int32(head_dim),
                        np.int32(block_size), np.int32(max_blocks_per_seq),
                        np.int32(max_splits), np.int32(sliding_window)))


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
                       sliding_window) -> None:
    ns, h, kv, d = int(n_seqs), int(num_heads), int(num_kv_heads), int(head_dim)
    bs, mb, msp, w = (int(block_size), int(max_blocks_per_seq), int(max_splits),
                      int(sliding_window))
    native = getattr(ctx.backend, "native", None)
    if native is not None and decode_split_native(
            ctx, native, out_ptr, workspace_ptr, qkv_ptr, k_cache_ptr, v_cache_ptr,
            block_tables_ptr, kv_lens_ptr, ns, h, kv, d, bs, mb, msp, float(scale), w):
        return
    g = h // kv
    S = DECODE_SPLIT_TOKENS
    sl2 = np.float32(scale) * _LOG2E
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
            m = sc.max(axis=-1)
            p = np.exp2(sc - m[..., None])
            lsum = p.sum(axis=-1, dtype=np.float32)
            acc = np.matmul(p, vt)                                        # [KV, G, D]
            if n_splits - first == 1:
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
                                  sliding_window) -> None:
    ns, h, d = int(n_seqs), int(num_heads), int(head_dim)
    bs, mb, msp, w = (int(block_size), int(max_blocks_per_seq), int(max_splits),
                      int(sliding_window))
    native = getattr(ctx.backend, "native", None)
    if native is not None and decode_combine_native(ctx, native, out_ptr, workspace_ptr,
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
        lsum = np.zeros(h, np.float32)
        acc = np.zeros((h, d), np.float32)
        for i in range(first, n_splits):  # fixed order, like the kernel
            wgt = np.exp2(ws_ml[s, :, i, 0] - big_m)
            lsum = lsum + wgt * ws_ml[s, :, i, 1]
            acc = acc + wgt[:, None] * ws_acc[s, :, i]
        inv = np.float32(1) / lsum
        ctx.view(int(out_ptr) + s * h * d * 2, h * d, np.uint16)[:] = f32_to_bf16(
            (acc * inv[:, None]).reshape(h * d))
