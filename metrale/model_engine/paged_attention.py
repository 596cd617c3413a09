"""One layer's attention over the paged KV cache, as every decoder's layer runs it: the
split-K decode kernel for decode steps, the prefill kernel (tensor cores where the head dim
has an instance) for prefill and verify passes."""
from __future__ import annotations

from ..gpu_runtime.types import NULL
from ..ops import attention, attention_tc


def paged_attention(model, stream: int, kc, vc, tables, n: int, decode: bool, n_seqs: int,
                    max_q_len: int, H: int, KV: int, D: int, window: int = 0,
                    softcap: float = 0.0, sinks=NULL) -> None:
    """ws.attn_out[n, H * D] = attention of ws.qkv's H query heads over the paged cache (kc,
    vc of one layer: KV heads of D, block tables `tables`; H and KV are a rank's own under
    tensor parallelism): the split-K decode kernel for one row per sequence, else the
    prefill kernel (tensor cores for the head dims with an instance)."""
    b, ws = model.backend, model._ws
    if decode:
        attention.decode_attention(b, stream, ws.attn_out, ws.qkv, kc, vc, tables, ws.kv_lens,
                                   n_seqs, H, KV, D, model._block_size, ws.max_blocks_per_seq,
                                   model._attn_scale, ws.decode_ws, ws.max_splits, window,
                                   softcap, sinks)
    else:
        attention_tc.prefill_attention_auto(b, stream, ws.attn_out, ws.qkv, kc, vc, tables,
                                            ws.kv_lens, ws.qo_indptr, n_seqs, n, max_q_len,
                                            H, KV, D, model._block_size,
                                            ws.max_blocks_per_seq, model._attn_scale, window,
                                            softcap, sinks)
