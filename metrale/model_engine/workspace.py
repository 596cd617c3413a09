"""Device buffers of one model: activations, per-step metadata, logits, the KV arena.

Everything is allocated once at load time (CUDA graphs need fixed addresses, CUPY_NOTES
§4), sized by `max_tokens` (the largest forward pass: a prefill chunk) and `max_rows` (the
largest decode batch or verify width).
"""
from __future__ import annotations

import numpy as np

from ..gpu_runtime.owned import OwnedBuffers
from ..gpu_runtime.types import DevicePtr
from ..ops import attention
from .mla import MLA_CHUNK_ROWS, MlaBuffers
from .moe import MoeBuffers, mlp_width


class Workspace(OwnedBuffers):
    def __init__(self, backend, meta, *, max_tokens: int, max_rows: int, num_blocks: int,
                 block_size: int, max_blocks_per_seq: int, fp32_logits: bool,
                 window_layers: tuple[int, ...] = (), window_blocks: int = 0) -> None:
        self.backend = backend
        self._owned: list[DevicePtr] = []
        H, KV, D = meta.num_heads, meta.num_kv_heads, meta.head_dim
        hid, inter, V = meta.hidden_size, mlp_width(meta), meta.vocab_size
        T, R = max_tokens, max_rows
        self.max_tokens, self.max_rows = T, R
        self.max_blocks_per_seq = max_blocks_per_seq
        self.qkv_dim = (H + 2 * KV) * D
        try:
            a = self._alloc
            # activations, BF16 ------------------------------------------------------
            self.residual = a(T * hid * 2)          # [T, hidden] running residual stream
            self.hidden = a(T * hid * 2)            # [T, hidden] sublayer outputs
            self.normed = a(T * hid * 2)            # [T, hidden] norm outputs
            self.qkv = a(T * self.qkv_dim * 2)      # [T, (H+2KV)*D]
            self.attn_out = a(T * H * D * 2)        # [T, H*D]
            self.gate_up = a(T * 2 * inter * 2)     # [T, 2*intermediate]
            self.act = a(T * inter * 2)             # [T, intermediate]
            # [rows, hidden]: row r is the final-norm hidden state behind logits row r
            self.final_hidden = a(max(T, 2 * R) * hid * 2)
            # [hidden]: the pre-final-norm row `save_hidden_for_mtp` keeps for a draft head
            self.mtp_hidden = a(hid * 2)
            # per-step metadata, int32 ---------------------------------------------------
            # One region, packed per step by `upload_step` so a step's metadata goes up in
            # a single copy; the section pointers below are set for each step.
            # a model with a sliding-window group (kv_groups.py) adds that group's slots and
            # block tables
            self.windowed = bool(window_layers)
            groups = 2 if self.windowed else 1
            self.meta_ints = (2 + groups) * T + groups * R * max_blocks_per_seq + 2 * R + 1
            self.meta = a(self.meta_ints * 4)
            self.token_ids = self.positions = self.slot_mapping = self.meta
            self.block_tables = self.kv_lens = self.qo_indptr = self.meta
            self.window_slots = self.window_tables = self.meta
            self.argmax_out = a(2 * R * 4)      # one id per logits row
            self.mask_ids = a(2 * R * 8 * 4)    # [rows, 8] suppressed ids of a masked argmax
            self.max_splits = attention.decode_max_splits(max_blocks_per_seq * block_size)
            self.decode_ws = a(attention.decode_workspace_bytes(R, H, D, self.max_splits))
            # logits: the shared arena of decode / verify / prefill rows (prefill writes row
            # 0, a batched prefill row_base + i, as in the original engine)
            self.logit_bytes = 4 if fp32_logits else 2
            self.logits_rows = 2 * R
            self.logits = a(self.logits_rows * V * self.logit_bytes)
            # KV arena: per layer [2, blocks + 1, block_size, KV, D], blocks = num_blocks
            # (window_blocks for the sliding-window group's layers); the extra block is a
            # sink for padded graph rows and is never handed out by a pool.
            # MLA (deepseek_config.py): one plane, the latent row of each token
            row, planes = kv_row(meta)
            self.block_bytes = block_size * row * 2
            self.layer_kv_bytes = (num_blocks + 1) * self.block_bytes
            self.pad_block = num_blocks
            self.window_pad_block = window_blocks
            sizes = [((window_blocks if i in window_layers else num_blocks) + 1) *
                     self.block_bytes for i in range(meta.num_layers)]
            self._layer_off = [planes * sum(sizes[:i]) for i in range(meta.num_layers)]
            self._layer_size = sizes if planes == 2 else [0] * meta.num_layers
            self.kv_bytes = planes * sum(sizes)
            self.kv = a(self.kv_bytes)
            # mixture-of-experts buffers (moe.py), for as many rows as the activations
            self.moe = MoeBuffers(a, meta, max(T, R)) if MoeBuffers.estimate_bytes(
                meta, 1) else None
            self.mla = MlaBuffers(a, meta, T, min(R, MLA_CHUNK_ROWS),
                                  block_size * max_blocks_per_seq) if meta.mla is not None else None
        except BaseException:
            self.free()
            raise
        # host staging for the per-step metadata
        self.h_tokens = np.zeros(T, np.int32)
        self.h_positions = np.zeros(T, np.int32)
        self.h_slots = np.zeros(T, np.int32)
        self.h_tables = np.zeros((R, max_blocks_per_seq), np.int32)
        self.h_window_slots = np.zeros(T, np.int32)
        self.h_window_tables = np.zeros((R, max_blocks_per_seq), np.int32)
        self.h_kv_lens = np.zeros(R, np.int32)
        self.h_indptr = np.zeros(R + 1, np.int32)
        self.h_meta = np.zeros(self.meta_ints, np.int32)

    def k_cache(self, layer: int) -> DevicePtr:
        return self.kv.offset(self._layer_off[layer])

    def v_cache(self, layer: int) -> DevicePtr:
        """The layer's V plane (an MLA layer has none: its latent plane again)."""
        return self.kv.offset(self._layer_off[layer] + self._layer_size[layer])

    def upload_step(self, stream: int, n_tokens: int, n_rows: int) -> None:
        """Copy the first n_tokens / n_rows of the host staging arrays to the device in one
        copy: [tokens | positions | slots | kv_lens | qo_indptr | block_tables rows], then
        (a model with a sliding-window group) [window slots | window block_tables rows].

        Section offsets depend only on (n_tokens, n_rows), so a graph captured for a padded
        batch size reads its sections at the same addresses on every replay. The host
        buffer is pageable: CUDA stages it before the call returns, so the next step may
        refill it at once.
        """
        n, r = n_tokens, n_rows
        parts = (self.h_tokens[:n], self.h_positions[:n], self.h_slots[:n],
                 self.h_kv_lens[:r], self.h_indptr[:r + 1], self.h_tables[:r].reshape(-1))
        if self.windowed:
            parts += (self.h_window_slots[:n], self.h_window_tables[:r].reshape(-1))
        ptrs, off = [], 0
        for part in parts:
            self.h_meta[off:off + part.size] = part
            ptrs.append(self.meta.offset(4 * off))
            off += part.size
        (self.token_ids, self.positions, self.slot_mapping, self.kv_lens, self.qo_indptr,
         self.block_tables) = ptrs[:6]
        if self.windowed:
            self.window_slots, self.window_tables = ptrs[6:]
        self.backend.copy_h2d_async(self.h_meta[:off], self.meta, stream)

    @staticmethod
    def estimate_bytes(meta, *, max_tokens, max_rows, num_blocks, block_size,
                       max_blocks_per_seq, fp32_logits, window_layers=(),
                       window_blocks=0) -> int:
        """Bytes `Workspace(...)` will allocate (for the fits-in-memory check)."""
        H, KV, D = meta.num_heads, meta.num_kv_heads, meta.head_dim
        hid, inter, V = meta.hidden_size, mlp_width(meta), meta.vocab_size
        T, R = max_tokens, max_rows
        act = T * (3 * hid + (H + 2 * KV) * D + H * D + 3 * inter) * 2 + max(T, 2 * R) * hid * 2
        act += hid * 2   # mtp_hidden
        groups = 2 if window_layers else 1
        md = ((2 + groups) * T + groups * R * max_blocks_per_seq + 2 * R + 1) * 4 + \
            2 * R * 4 + 2 * R * 8 * 4
        splits = attention.decode_max_splits(max_blocks_per_seq * block_size)
        dec = attention.decode_workspace_bytes(R, H, D, splits)
        lb = 4 if fp32_logits else 2
        logits = 2 * R * V * lb
        nw = len(window_layers)
        row, planes = kv_row(meta)
        kv = planes * ((meta.num_layers - nw) * (num_blocks + 1) + nw * (window_blocks + 1)) \
            * block_size * row * 2
        mla = 0 if meta.mla is None else MlaBuffers.estimate_bytes(
            meta, T, min(R, MLA_CHUNK_ROWS), block_size * max_blocks_per_seq)
        return act + md + dec + logits + kv + MoeBuffers.estimate_bytes(meta, max(T, R)) + mla


def kv_row(meta) -> tuple[int, int]:
    """(values per token a KV plane row holds, planes per layer): K and V of every kv head,
    or MLA's one latent row."""
    if meta.mla is not None:
        return meta.mla.latent_dim, 1
    return meta.num_kv_heads * meta.head_dim, 2
