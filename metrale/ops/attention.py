"""Paged attention (kernels/attention.cu): ragged causal prefill on CUDA cores, its launcher
and numpy twin; the split-K decode is attention_decode.py's (re-exported here), the checks
and constants both share attention_common.py's.

Scores are computed in base 2 like the kernels: s = (q . k) * scale * log2(e),
p = exp2(s - max), fp32 throughout, the output rounded once to bf16. Options (every paged
attention kernel, attention_common.py): `softcap` (Gemma 2) and `sinks_ptr` (gpt-oss).

Decode splits every sequence into fixed 256-token pieces of absolute positions
(`DECODE_SPLIT_TOKENS`), so the number of splits depends only on the sequence's own kv_len:
a sequence's result is the same alone or in any batch, on the GPU and in the twin.

The twins compute each sequence from its own data only (bit-identical alone or in a batch),
read block tables, kv_lens, qo_indptr and caches through `ctx.view` (bounds-checked), and
raise KernelError where the kernel would write NaN rows (inconsistent lengths).
"""
from __future__ import annotations

import numpy as np

from ..errors import InvalidArgument, KernelError
from ..gpu_runtime.types import NULL, DevicePtr
from .attention_common import (DECODE_SPLIT_TOKENS, GRID_YZ_MAX, LOG2E,  # noqa: F401
                               MAX_HEAD_DIM, MODULE, THREADS, WARPS, check_common,
                               sinks_base2)
from .attention_decode import (decode_attention, decode_max_splits,  # noqa: F401
                               decode_smem_bytes, decode_workspace_bytes)
from .attention_tile import attend_base2, gather_paged, softcap_base2
from .bf16 import bf16_to_f32, f32_to_bf16
from .checks import check_ptrs
from .registry import twin

PREFILL_BK = 32


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
                  sliding_window, softcap=0.0, sinks_ptr=NULL) -> None:
    """The argument checks every prefill attention launcher makes before launching (this
    module's and attention_tc's); raises InvalidArgument naming `what` and the argument."""
    check_common(what, num_heads, num_kv_heads, head_dim, block_size, max_blocks_per_seq,
                 scale, sliding_window, softcap, sinks_ptr)
    if not 1 <= n_seqs <= GRID_YZ_MAX:
        raise InvalidArgument(f"{what}: n_seqs must be in [1, {GRID_YZ_MAX}], got {n_seqs}")
    if not 1 <= n_tokens < 2**31:
        raise InvalidArgument(f"{what}: n_tokens must be in [1, 2^31), got {n_tokens}")
    if not 1 <= max_q_len <= n_tokens:
        raise InvalidArgument(f"{what}: max_q_len must be in [1, n_tokens={n_tokens}], "
                              f"got {max_q_len}")
    check_ptrs(what, 4, out=out_ptr, qkv=qkv_ptr, k_cache=k_cache_ptr, v_cache=v_cache_ptr,
                block_tables=block_tables_ptr, kv_lens=kv_lens_ptr, qo_indptr=qo_indptr_ptr)


def prefill_args(out_ptr, qkv_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, kv_lens_ptr,
                 qo_indptr_ptr, n_seqs, n_tokens, max_q_len, num_heads, num_kv_heads,
                 head_dim, block_size, max_blocks_per_seq, scale, sliding_window,
                 softcap=0.0, sinks_ptr=NULL) -> tuple:
    """The C argument tuple shared by every prefill attention kernel (attention.cu's and
    attention_tc.cu's entry points take the same parameters)."""
    return (DevicePtr(out_ptr), DevicePtr(qkv_ptr), DevicePtr(k_cache_ptr),
            DevicePtr(v_cache_ptr), DevicePtr(block_tables_ptr), DevicePtr(kv_lens_ptr),
            DevicePtr(qo_indptr_ptr), np.int32(n_seqs), np.int32(n_tokens),
            np.int32(max_q_len), np.int32(num_heads), np.int32(num_kv_heads),
            np.int32(head_dim), np.int32(block_size), np.int32(max_blocks_per_seq),
            np.float32(scale), np.int32(sliding_window), np.float32(softcap),
            DevicePtr(sinks_ptr))


def prefill_attention(backend, stream: int, out_ptr, qkv_ptr, k_cache_ptr, v_cache_ptr,
                      block_tables_ptr, kv_lens_ptr, qo_indptr_ptr, n_seqs: int,
                      n_tokens: int, max_q_len: int, num_heads: int, num_kv_heads: int,
                      head_dim: int, block_size: int, max_blocks_per_seq: int, scale: float,
                      sliding_window: int = 0, softcap: float = 0.0, sinks_ptr=NULL) -> None:
    """Causal attention of a ragged batch of query chunks against the paged cache, on CUDA
    cores (any even head_dim <= 256; attention_tc.prefill_attention_auto picks the
    tensor-core kernel where it applies).

    out [n_tokens, H*D] bf16; qkv [n_tokens, (H+2KV)*D] bf16 (q read from it);
    k_cache/v_cache [num_blocks, block_size, KV, D] bf16, already holding this step's k/v;
    block_tables int32 [n_seqs, max_blocks_per_seq]; kv_lens int32 [n_seqs] (including the
    new tokens); qo_indptr int32 [n_seqs+1]. Query row i of sequence s sits at position
    kv_lens[s] - q_len_s + i. max_q_len (>= every q_len_s) sizes the grid. softcap (0: off)
    and sinks_ptr (fp32 [num_heads] or NULL): attention_common.py's options.
    """
    n_seqs, n_tokens, max_q_len = int(n_seqs), int(n_tokens), int(max_q_len)
    num_heads, head_dim = int(num_heads), int(head_dim)
    a = (out_ptr, qkv_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, kv_lens_ptr,
         qo_indptr_ptr, n_seqs, n_tokens, max_q_len, num_heads, int(num_kv_heads), head_dim,
         int(block_size), int(max_blocks_per_seq), float(scale), int(sliding_window),
         float(softcap), sinks_ptr)
    check_prefill("prefill_attention", *a)
    name, bq = _prefill_variant(head_dim)
    backend.launch(backend.kernel(MODULE, name), (-(-max_q_len // bq), num_heads, n_seqs),
                   (THREADS,), prefill_smem_bytes(head_dim), stream, prefill_args(*a))


_PREFILL_ROWS = 128  # query rows per twin step (per sequence; never mixes sequences)


def prefill_twin(ctx, attend, what, out_ptr, qkv_ptr, k_cache_ptr, v_cache_ptr,
                 block_tables_ptr, kv_lens_ptr, qo_indptr_ptr, n_seqs, n_tokens, max_q_len,
                 num_heads, num_kv_heads, head_dim, block_size, max_blocks_per_seq, scale,
                 sliding_window, softcap, sinks_ptr) -> None:
    """The twin of every prefill attention kernel, given how its rows attend:
    `attend(scores [KV, G*R, T] float64 base-2 with masked keys -inf, values [KV, T, D]
    float64, key_pos [T] absolute positions, sink2 [KV, G*R, 1] base-2 sink logits or
    None)` -> [KV, G*R, D]. Raises KernelError where the kernel writes NaN rows."""
    ns, nt, mq = int(n_seqs), int(n_tokens), int(max_q_len)
    h, kv, d = int(num_heads), int(num_kv_heads), int(head_dim)
    bs, mb, w = int(block_size), int(max_blocks_per_seq), int(sliding_window)
    g = h // kv
    sinks = sinks_base2(ctx, sinks_ptr, h)
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
            sc = softcap_base2(np.matmul(qg.reshape(nk, g * (r1 - r0), d), kt), float(scale),
                               float(softcap))                          # [nk, G*R, T]
            sc = sc.reshape(nk, g, r1 - r0, -1)
            qpos = pos_first + np.arange(r0, r1)
            allowed = kpos[None, :] <= qpos[:, None]
            if w > 0:
                allowed &= kpos[None, :] > qpos[:, None] - w
            sc = np.where(allowed[None, None], sc, -np.inf).reshape(nk, g * (r1 - r0), -1)
            s2 = None if sinks is None else np.repeat(
                sinks[k0 * g:k1 * g].astype(np.float64), r1 - r0).reshape(nk, g * (r1 - r0), 1)
            o = attend(sc, vt, kpos, s2).reshape(nk, g, r1 - r0, d).astype(np.float32)
            out[q_start + r0:q_start + r1, k0 * g:k1 * g] = f32_to_bf16(
                o.transpose(2, 0, 1, 3).reshape(r1 - r0, nk * g, d))

    # sequences and kv heads are independent: over the twin threads (one sequence: halves)
    halves = 2 if kv > 1 and ns < 2 else 1
    tasks = [(s, kv * j // halves, kv * (j + 1) // halves)
             for s in range(ns) if qo[s + 1] > qo[s] for j in range(halves)]
    ctx.map_blocks(len(tasks), 1, lambda a, b: [one(*t) for t in tasks[a:b]])


def _prefill_twin(ctx, *args) -> None:
    prefill_twin(ctx, lambda sc, vt, kpos, s2: attend_base2(sc, vt, s2),
                 "attention.prefill_attention", *args)


for _maxp in (1, 2, 4):
    twin(MODULE, f"prefill_attention_p{_maxp}")(_prefill_twin)
