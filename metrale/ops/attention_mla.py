"""Multi-head latent attention decode over the latent KV cache (DeepSeek-V2/V3 MLA, the
absorbed form): the launcher and the numpy twins (module "attention_mla").

The cache keeps one row per token and layer, `latent_dim = kv_lora_rank + rope_dim` BF16
values: the normalized latent c (kv_lora_rank) then the roped shared key kr (rope_dim)
(formats/deepseek_config.py). With W_UK_h [nope, kv_lora_rank] and W_UV_h [v_dim,
kv_lora_rank] the rows of head h of kv_b_proj, a head's key and value are
k_h = [c @ W_UK_h^T | kr], v_h = c @ W_UV_h^T, so
    q_h . k_h = (q_nope_h @ W_UK_h) . c + q_rope_h . kr = qa_h . row      (absorbed query)
    o_h = sum_t p_t v_h,t = (sum_t p_t c_t) @ W_UV_h^T
The kernel therefore reads the absorbed queries qa [n_rows, H, latent_dim] (bf16: W_UK
folded in by the caller) and writes the attention-weighted latent
    out[r, h, :] = bf16( sum_t softmax_t(scale * qa[r,h] . row_t) row_t[:kv_lora_rank] )
for t < kv_lens[r], rows found through block_tables (paged, `block_size` tokens a block);
the caller applies W_UV (and o_proj) after it. One pass over the latent serves every head:
every head's scores and its weighted sum read the same rows.

Split-K as the decode attention (attention_decode.py): each row's sequence is cut into fixed
DECODE_SPLIT_TOKENS pieces of absolute positions, so the number of splits depends on the
row's own kv_len only and a row's bits do not depend on the batch. Split kernel: per (split,
row, heads) its float32 running max m, sum l and acc[kv_lora_rank] in the workspace
(acc [rows, H, max_splits, kv_lora_rank] then (m, l) [rows, H, max_splits, 2], base-2
exponents of scale * log2(e) * score). Combine: the splits in increasing order,
M = max m_s, L = sum l_s 2^(m_s - M), out = bf16(sum acc_s 2^(m_s - M) / L).
"""
from __future__ import annotations

import numpy as np

from ..errors import InvalidArgument, KernelError
from ..gpu_runtime.types import DevicePtr
from .attention_common import DECODE_SPLIT_TOKENS, LOG2E
from .bf16 import bf16_to_f32, f32_to_bf16
from .checks import check_ptrs, check_sizes
from .registry import twin

MODULE = "attention_mla"
HEADS_PER_CTA = 8           # heads sharing one CTA's read of the latent rows (MLA_HEADS)
THREADS = 256
MAX_LATENT_DIM = 1024       # formats/deepseek_config.py MAX_LATENT_DIM


def mla_max_splits(max_kv_len: int) -> int:
    """Splits for the longest allowed sequence (the split grid's x extent)."""
    if int(max_kv_len) < 1:
        raise InvalidArgument(f"mla_max_splits: max_kv_len must be >= 1, got {max_kv_len}")
    return -(-int(max_kv_len) // DECODE_SPLIT_TOKENS)


def mla_workspace_bytes(n_rows: int, num_heads: int, kv_lora_rank: int,
                        max_splits: int) -> int:
    """float32 acc [rows, H, splits, kv_lora_rank] and (m, l) [rows, H, splits, 2]."""
    return int(n_rows) * int(num_heads) * int(max_splits) * (int(kv_lora_rank) + 2) * 4


def attention_mla(backend, stream: int, out_ptr, q_ptr, cache_ptr, block_tables_ptr,
               kv_lens_ptr, n_rows: int, num_heads: int, kv_lora_rank: int, rope_dim: int,
               block_size: int, max_blocks_per_seq: int, scale: float, workspace_ptr,
               max_splits: int, qo_indptr_ptr=None, n_seqs: int = 0,
               row_base: int = 0) -> None:
    """out bf16 [n_rows, H, kv_lora_rank] = attention of the absorbed queries q bf16
    [n_rows, H, kv_lora_rank + rope_dim] over the latent cache bf16 [blocks, block_size,
    kv_lora_rank + rope_dim]; workspace: mla_workspace_bytes(n_rows, ...).
    Without `qo_indptr_ptr` row r is sequence r: block_tables int32 [n_rows,
    max_blocks_per_seq], kv_lens int32 [n_rows] (each >= 1, read on the device). With it
    (int32 [n_seqs + 1], a prefill's or verify's query rows per sequence) the launch's row r
    is query row g = row_base + r of sequence s (qo_indptr[s] <= g < qo_indptr[s + 1]),
    causal: it sees kv_lens[s] - (qo_indptr[s + 1] - 1 - g) positions of table row s. A
    row's bits depend only on its own query, length and cache rows (batch invariance)."""
    what = "attention_mla"
    check_sizes(what, n_rows=n_rows, num_heads=num_heads, kv_lora_rank=kv_lora_rank,
                rope_dim=rope_dim, block_size=block_size,
                max_blocks_per_seq=max_blocks_per_seq, max_splits=max_splits)
    D = int(kv_lora_rank) + int(rope_dim)
    if D > MAX_LATENT_DIM or int(kv_lora_rank) % 32:
        raise InvalidArgument(f"{what}: kv_lora_rank + rope_dim = {D} must be at most "
                              f"{MAX_LATENT_DIM} with kv_lora_rank a multiple of 32, got "
                              f"kv_lora_rank={kv_lora_rank}")
    if not np.isfinite(scale) or scale <= 0:
        raise InvalidArgument(f"{what}: scale must be a finite number > 0, got {scale}")
    check_ptrs(what, align=4, out_ptr=out_ptr, q_ptr=q_ptr, cache_ptr=cache_ptr,
               block_tables_ptr=block_tables_ptr, kv_lens_ptr=kv_lens_ptr,
               workspace_ptr=workspace_ptr)
    if qo_indptr_ptr is not None and (int(n_seqs) < 1 or int(row_base) < 0):
        raise InvalidArgument(f"{what}: n_seqs={n_seqs} must be >= 1 and row_base="
                              f"{row_base} >= 0")
    indptr = DevicePtr(0 if qo_indptr_ptr is None else qo_indptr_ptr)
    seq_args = (indptr, np.int32(n_seqs if qo_indptr_ptr is not None else 0),
                np.int32(row_base))
    args = (DevicePtr(workspace_ptr), DevicePtr(q_ptr), DevicePtr(cache_ptr),
            DevicePtr(block_tables_ptr), DevicePtr(kv_lens_ptr), *seq_args, np.int32(n_rows),
            np.int32(num_heads), np.int32(kv_lora_rank), np.int32(rope_dim),
            np.int32(block_size), np.int32(max_blocks_per_seq),
            np.float32(float(scale) * LOG2E), np.int32(max_splits))
    groups = -(-int(num_heads) // HEADS_PER_CTA)
    backend.launch(backend.kernel(MODULE, "attention_mla_split"),
                   (int(max_splits), int(n_rows), groups), (THREADS,), 0, stream, args)
    backend.launch(backend.kernel(MODULE, "attention_mla_combine"), (int(n_rows), int(num_heads)),
                   (THREADS,), 0, stream,
                   (DevicePtr(out_ptr), DevicePtr(workspace_ptr), DevicePtr(kv_lens_ptr),
                    *seq_args, np.int32(n_rows), np.int32(num_heads), np.int32(kv_lora_rank),
                    np.int32(max_splits)))


def _rows_of(ctx, cache_ptr, table, start, stop, bs, D) -> np.ndarray:
    """float32 [stop - start, D]: the latent rows of positions start..stop-1."""
    pos = np.arange(start, stop)
    blocks = table[pos // bs].astype(np.int64)
    if (blocks < 0).any():
        raise KernelError("attention_mla: a block table entry read is negative")
    out = np.empty((len(pos), D), np.float32)
    for j, (b, o) in enumerate(zip(blocks, pos % bs)):
        out[j] = bf16_to_f32(ctx.read(int(cache_ptr) + (int(b) * bs + int(o)) * D * 2, D,
                                      np.uint16))
    return out


def _row_lens(ctx, kv_lens_ptr, indptr_ptr, n_seqs, row_base, n) -> tuple:
    """(kv_len int64 [n], sequence int64 [n]) of the launch's rows (see attention_mla)."""
    if not int(indptr_ptr):
        return ctx.read(kv_lens_ptr, n, np.int32).astype(np.int64), np.arange(n)
    ns = int(n_seqs)
    ind = ctx.read(indptr_ptr, ns + 1, np.int32).astype(np.int64)
    lens = ctx.read(kv_lens_ptr, ns, np.int32).astype(np.int64)
    g = int(row_base) + np.arange(n)
    seq = np.searchsorted(ind, g, side="right") - 1
    if (seq < 0).any() or (seq >= ns).any():
        raise KernelError("attention_mla: a query row lies outside qo_indptr")
    return lens[seq] - (ind[seq + 1] - 1 - g), seq


@twin(MODULE, "attention_mla_split")
def _split_twin(ctx, ws_ptr, q_ptr, cache_ptr, tables_ptr, kv_lens_ptr, indptr_ptr, n_seqs,
                row_base, n_rows, num_heads, kv_lora_rank, rope_dim, block_size, max_blocks,
                scale_log2, max_splits) -> None:
    n, H, R = int(n_rows), int(num_heads), int(kv_lora_rank)
    D, bs, mb, msp = R + int(rope_dim), int(block_size), int(max_blocks), int(max_splits)
    S = DECODE_SPLIT_TOKENS
    kv_lens, seq_of = _row_lens(ctx, kv_lens_ptr, indptr_ptr, n_seqs, row_base, n)
    tables = ctx.read(tables_ptr, (int(seq_of.max()) + 1) * mb, np.int32).reshape(-1, mb)
    acc = ctx.view(ws_ptr, n * H * msp * R, np.float32).reshape(n, H, msp, R)
    ml = ctx.view(int(ws_ptr) + n * H * msp * R * 4, n * H * msp * 2,
                  np.float32).reshape(n, H, msp, 2)
    c = np.float32(scale_log2)
    for r in range(n):
        L = int(kv_lens[r])
        if not 1 <= L <= min(mb * bs, msp * S):
            raise KernelError(f"attention_mla: kv_len {L} of row {r} outside [1, "
                              f"min(max_blocks_per_seq * block_size, max_splits * {S})]")
        q = bf16_to_f32(ctx.read(int(q_ptr) + r * H * D * 2, H * D, np.uint16)).reshape(H, D)
        for s in range(-(-L // S)):
            rows = _rows_of(ctx, cache_ptr, tables[seq_of[r]], s * S, min(L, (s + 1) * S),
                            bs, D)
            t = (q @ rows.T).astype(np.float32) * c          # [H, tokens], base-2 logits
            m = t.max(axis=1)
            p = np.exp2(t - m[:, None]).astype(np.float32)
            acc[r, :, s] = (p @ rows[:, :R]).astype(np.float32)
            ml[r, :, s, 0] = m
            ml[r, :, s, 1] = p.sum(axis=1, dtype=np.float32)


@twin(MODULE, "attention_mla_combine")
def _combine_twin(ctx, out_ptr, ws_ptr, kv_lens_ptr, indptr_ptr, n_seqs, row_base, n_rows,
                  num_heads, kv_lora_rank, max_splits) -> None:
    n, H, R, msp = int(n_rows), int(num_heads), int(kv_lora_rank), int(max_splits)
    kv_lens, _ = _row_lens(ctx, kv_lens_ptr, indptr_ptr, n_seqs, row_base, n)
    acc = ctx.read(ws_ptr, n * H * msp * R, np.float32).reshape(n, H, msp, R)
    ml = ctx.read(int(ws_ptr) + n * H * msp * R * 4, n * H * msp * 2,
                  np.float32).reshape(n, H, msp, 2)
    out = ctx.view(out_ptr, n * H * R, np.uint16).reshape(n, H, R)
    for r in range(n):
        k = -(-int(kv_lens[r]) // DECODE_SPLIT_TOKENS)
        m = ml[r, :, :k, 0].max(axis=1)
        w = np.exp2(ml[r, :, :k, 0] - m[:, None]).astype(np.float32)    # [H, k]
        total = np.zeros(H, np.float32)
        o = np.zeros((H, R), np.float32)
        for s in range(k):                      # increasing split order
            total += ml[r, :, s, 1] * w[:, s]
            o += acc[r, :, s] * w[:, s, None]
        out[r] = f32_to_bf16(o / total[:, None])


def absorb_query(q_nope: np.ndarray, q_rope: np.ndarray, w_uk: np.ndarray) -> np.ndarray:
    """float32 [n, H, kv_lora_rank + rope_dim]: [q_nope_h @ W_UK_h | q_rope_h] per head.
    q_nope [n, H, nope], q_rope [n, H, rope], w_uk [H, nope, kv_lora_rank]."""
    qa = np.einsum("nhd,hdr->nhr", q_nope.astype(np.float32), w_uk.astype(np.float32))
    return np.concatenate([qa, q_rope.astype(np.float32)], axis=-1)
