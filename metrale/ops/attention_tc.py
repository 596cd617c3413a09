"""Tensor-core causal prefill attention over the paged cache (kernels/attention_tc.cu): its
launcher, the choice between it and attention.py's CUDA-core kernel, and its numpy twin.

Same arguments and contract as `attention.prefill_attention` (ragged batch via qo_indptr,
kv_lens including this step's tokens, causal + optional sliding window, NaN rows for an
inconsistent sequence). The kernel differs in one documented way: P is rounded to BF16
before the P.V tensor-core product, against the running max of its key tile (64 keys; 16
for head_dim 256), so its twin is `attend_base2_bf16p` with that tile, not `attend_base2`.

Choice (`prefill_attention_auto`, what the model's prefill runs on every backend): the
tensor-core kernel for head_dim in TC_HEAD_DIMS when qkv and both caches are 16-byte aligned
(cp.async), the CUDA-core kernel otherwise (e.g. the tiny fixtures' head_dim 8, or 6, 18).
The choice depends only on the model's shapes and buffers, never on the batch, so a row's
bits do not depend on the batch either way.
"""
from __future__ import annotations

from ..errors import InvalidArgument
from ..gpu_runtime.types import NULL
from .attention import check_prefill, prefill_args, prefill_attention, prefill_twin
from .attention_tile import attend_base2_bf16p
from .registry import twin

MODULE = "attention_tc"
THREADS = 128
ROWS_PER_CTA = 64  # (token, head) rows per CTA: the kernel's TC_BM
# head_dim -> keys per tile (the kernel's BN; part of the numerics: P is rounded per tile)
TILE_KEYS = {16: 64, 32: 64, 64: 64, 80: 64, 96: 64, 128: 64, 256: 16}
TC_HEAD_DIMS = tuple(TILE_KEYS)
MAX_DYNAMIC_SMEM = 48 * 1024  # no opt-in attribute needed on any GPU


def smem_bytes(head_dim: int) -> int:
    """Dynamic shared memory of the head_dim instance: sQ [64][D] + sK, sV [BN][D] bf16,
    rows padded to an odd number of 16-byte chunks unless D/8 % 8 == 0 (XOR-swizzled)."""
    chunks = head_dim // 8
    stride = chunks if chunks % 8 == 0 else chunks + 1
    return (ROWS_PER_CTA + 2 * TILE_KEYS[head_dim]) * stride * 16


def tc_applies(head_dim: int, qkv_ptr, k_cache_ptr, v_cache_ptr) -> bool:
    """Whether the tensor-core kernel serves this launch (see the module doc)."""
    return int(head_dim) in TILE_KEYS and all(
        int(p) % 16 == 0 for p in (qkv_ptr, k_cache_ptr, v_cache_ptr))


def prefill_attention_tc(backend, stream: int, out_ptr, qkv_ptr, k_cache_ptr, v_cache_ptr,
                         block_tables_ptr, kv_lens_ptr, qo_indptr_ptr, n_seqs: int,
                         n_tokens: int, max_q_len: int, num_heads: int, num_kv_heads: int,
                         head_dim: int, block_size: int, max_blocks_per_seq: int,
                         scale: float, sliding_window: int = 0, softcap: float = 0.0,
                         sinks_ptr=NULL) -> None:
    """Causal attention of a ragged batch of query chunks against the paged cache, on tensor
    cores. Shapes as `attention.prefill_attention`: out [n_tokens, H*D] bf16; qkv
    [n_tokens, (H+2KV)*D] bf16; k_cache/v_cache [num_blocks, block_size, KV, D] bf16;
    block_tables int32 [n_seqs, max_blocks_per_seq]; kv_lens int32 [n_seqs]; qo_indptr
    int32 [n_seqs+1]. head_dim must be in TC_HEAD_DIMS and qkv/k_cache/v_cache 16-byte
    aligned. softcap (0: off) and sinks_ptr (fp32 [num_heads] or NULL): attention_common.py's
    options."""
    n_seqs, max_q_len = int(n_seqs), int(max_q_len)
    num_heads, num_kv_heads, head_dim = int(num_heads), int(num_kv_heads), int(head_dim)
    a = (out_ptr, qkv_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, kv_lens_ptr,
         qo_indptr_ptr, n_seqs, int(n_tokens), max_q_len, num_heads, num_kv_heads, head_dim,
         int(block_size), int(max_blocks_per_seq), float(scale), int(sliding_window),
         float(softcap), sinks_ptr)
    what = "prefill_attention_tc"
    check_prefill(what, *a)
    if head_dim not in TILE_KEYS:
        raise InvalidArgument(f"{what}: head_dim {head_dim} has no tensor-core instance "
                              f"(supported: {TC_HEAD_DIMS}); use prefill_attention_auto")
    for name, p in (("qkv", qkv_ptr), ("k_cache", k_cache_ptr), ("v_cache", v_cache_ptr)):
        if int(p) % 16:
            raise InvalidArgument(f"{what}: {name} pointer {int(p):#x} is not 16-byte aligned "
                                  "(cp.async)")
    rows = max_q_len * (num_heads // num_kv_heads)
    if rows >= 2**31:
        raise InvalidArgument(f"{what}: max_q_len * (num_heads / num_kv_heads) = {rows} "
                              "must be < 2^31")
    grid = (-(-rows // ROWS_PER_CTA), num_kv_heads, n_seqs)
    backend.launch(backend.kernel(MODULE, f"prefill_attention_tc_d{head_dim}"), grid,
                   (THREADS,), smem_bytes(head_dim), stream, prefill_args(*a))


def prefill_attention_auto(backend, stream: int, out_ptr, qkv_ptr, k_cache_ptr, v_cache_ptr,
                           block_tables_ptr, kv_lens_ptr, qo_indptr_ptr, n_seqs: int,
                           n_tokens: int, max_q_len: int, num_heads: int, num_kv_heads: int,
                           head_dim: int, block_size: int, max_blocks_per_seq: int,
                           scale: float, sliding_window: int = 0, softcap: float = 0.0,
                           sinks_ptr=NULL) -> None:
    """`prefill_attention_tc` where `tc_applies`, else the CUDA-core `prefill_attention`;
    same arguments."""
    launch = (prefill_attention_tc if tc_applies(head_dim, qkv_ptr, k_cache_ptr, v_cache_ptr)
              else prefill_attention)
    launch(backend, stream, out_ptr, qkv_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr,
           kv_lens_ptr, qo_indptr_ptr, n_seqs, n_tokens, max_q_len, num_heads, num_kv_heads,
           head_dim, block_size, max_blocks_per_seq, scale, sliding_window, softcap, sinks_ptr)


def _tc_twin(tile: int):
    def run(ctx, *args) -> None:
        prefill_twin(ctx, lambda sc, vt, kpos, s2: attend_base2_bf16p(sc, vt, kpos, tile, s2),
                     "attention_tc.prefill_attention_tc", *args)
    return run


for _d, _bn in TILE_KEYS.items():
    twin(MODULE, f"prefill_attention_tc_d{_d}")(_tc_twin(_bn))
