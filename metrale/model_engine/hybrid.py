"""`HybridModel`: the pointer API for the hybrid decoders with recurrent layers: gated
DeltaNet (qwen3_next, qwen3_5 text models; formats/hybrid_config.py, hybrid_layers.py) and
Mamba2 (nemotron_h; formats/nemotron_config.py, nemotron.py): `TransformerModel` with a
recurrent-state pool.

Beside the paged KV pool of its full-attention layers it holds a recurrent-state pool
(kv/state_pool.py, model_engine/state_arena.py): `alloc_sequence` takes a slot, whose FP32
states and conv windows the linear-attention layers read and write, `free_sequence` returns
it; a full pool raises CacheFull naming the pool. The layers run in hybrid_layers.py /
linear_attn.py; this module stages each pass's recurrent step (slots, start positions, the
rows of a verify) and keeps the state consistent with the KV length:

- `rollback` / a chunk-0 lookup undone: the state moves with the KV length where it can
  (within the last verify of the sequence, or to 0); elsewhere InvalidArgument: never a
  state that does not belong to the tokens.
- prefix caching: a prompt's state at its last checkpoint boundary (`ssm_checkpoint_interval`)
  is kept in the pool's prefix slots; a later prompt reuses cached blocks only up to a
  boundary whose state is kept, restoring it (never blocks without their state).
Load options (beside TransformerModel's): max_sequences (live slots, default max_batch),
ssm_verify_states (states kept inside a verify, default 8: decode_verify takes at most that
many tokens), decode_rollback_ring_slots (snapshots per sequence, default 0), ssm_prefix_states
(prefix states kept, default max_sequences).
"""
from __future__ import annotations

import math
from dataclasses import replace

import numpy as np

from ..errors import InvalidArgument, Unsupported
from ..formats import check_tensors, expected_tensors
from ..formats.hybrid_layout import skipped
from ..gpu_runtime.types import NULL
from ..kv.block_pool import BlockPool
from ..kv.state_pool import StatePool
from ..ops import rope
from .args import int_arg, list_arg
from .guard import CallGuard, exclusive
from .kv_groups import KvGroup
from .hybrid_buffers import HybridBuffers
from .hybrid_layers import run_hybrid_decoder
from .hybrid_weights import HybridWeights, hybrid_weight_bytes
from .linear_attn import RecurrentStep
from .memory_plan import plan_memory
from .nemotron import NemotronWeights, nemotron_weight_bytes, run_nemotron_decoder
from .prefix_reclaim import reused_prefix_blocks
from .sequence import SequenceState
from .ssm_state import VerifyStates
from .state_arena import StateArena
from .transformer import MAX_VERIFY_ROWS, TransformerModel, _check_options
from .workspace import Workspace

def check_hybrid_checkpoint(source, meta) -> None:
    """Every tensor of the layout present with its shape; any other tensor refused unless
    skipped by name (the MTP head, a wrapper's vision tower: formats/hybrid_layout.py)."""
    from ..errors import FormatError
    if meta.quantization is not None:   # FP8 linears: formats/quant/checkpoint.py
        from ..formats.quant.checkpoint import check_quantized
        check_quantized(source, meta)
        return
    expected = expected_tensors(meta, source.tensor_names())
    check_tensors(source, expected, complete=False)
    unused = sorted(n for n in set(source.tensor_names()) - set(expected) if not skipped(n))
    if unused:
        raise FormatError(f"{source.description}: {len(unused)} tensor(s) that no part of the "
                          f"model uses: {', '.join(unused[:8])}")


def partial_rope_table(head_dim: int, rotary_dim: int, positions: int, theta: float,
                       scaling) -> np.ndarray:
    """float32 [positions, head_dim] for ops/rope.py: the rotary dims' cos / sin on pairs
    j < rotary_dim / 2, cos 1 and sin 0 (the identity) on the other pairs (the head dims
    are permuted to match at load: hybrid_weights.rotary_permutation)."""
    t = rope.rope_table(rotary_dim, positions, theta, scaling)
    half, r = head_dim // 2, rotary_dim // 2
    out = np.zeros((positions, head_dim), np.float32)
    out[:, :half] = 1.0
    out[:, :r], out[:, half:half + r] = t[:, :r], t[:, r:]
    return out


class HybridModel(TransformerModel):
    """A hybrid linear-attention decoder on a `GpuBackend`, driven through raw pointers."""

    def __init__(self, backend, source, *, kv_blocks=None, block_size: int = 16,
                 max_batch: int = 64, fp32_logits: bool = False, max_prefill_tokens: int = 2048,
                 max_seq_len=None, graphs=None, progress: bool = True, max_sequences=None,
                 ssm_verify_states: int = 8, decode_rollback_ring_slots: int = 0,
                 ssm_prefix_states=None, gguf_dequantize: bool = False, _shard=None) -> None:
        meta = source.metadata()
        if meta.hybrid is None:
            raise Unsupported(f"{source.description}: model_type {meta.architecture!r} has no "
                              "recurrent layers (load it as a TransformerModel)")
        if _shard is not None:
            raise Unsupported(f"{source.description}: tensor parallelism is not supported for "
                              f"the hybrid model_type {meta.architecture!r}")
        _check_options(block_size, max_batch, max_prefill_tokens, kv_blocks, max_seq_len)
        seqs = max_batch if max_sequences is None else int_arg(
            "load option", "max_sequences", max_sequences, 1, 1 << 16)
        verify = int_arg("load option", "ssm_verify_states", ssm_verify_states, 1, 256)
        ring = int_arg("load option", "decode_rollback_ring_slots", decode_rollback_ring_slots,
                       0, 64)
        prefix = seqs if ssm_prefix_states is None else int_arg(
            "load option", "ssm_prefix_states", ssm_prefix_states, 0, 1 << 16)
        self.backend, self._meta, self._guard = backend, meta, CallGuard()
        self.use_fp32_logits = bool(fp32_logits)
        self._block_size, self._attn_scale = block_size, 1.0 / math.sqrt(meta.head_dim)
        self._max_batch, self._tp = max_batch, None
        self._weights = self._ws = self._hb = self._arena = None
        self._rope_table = NULL
        # TransformerModel's per-layer rope tables and LoRA pool: one table (below), no LoRA
        self._layer_rope, self._rope_tables, self._lora = [], [], None
        self._graphs: dict[int, int] = {}
        self._use_graphs = backend.decode_graphs_by_default if graphs is None else bool(graphs)
        self._step, self._ssm_verify, self._ssm_event = None, None, None
        self._verifying = False   # inside decode_verify (its rows keep their states)
        self._ring_pos: dict[int, tuple[int, int]] = {}   # ring slot -> (seq id, position)
        self._ssm_live_at = None   # (seq id, position) of a state a ring restore made live
        hy = meta.hybrid
        # the KV pool holds the full-attention layers only
        self._layer_meta = replace(meta, num_layers=len(hy.attention_layers))
        # prefix states at multiples of the block and of the recurrent chunk (hy.chunk: a
        # prefill split there keeps its bits)
        self._checkpoint_interval = block_size * hy.chunk // math.gcd(block_size, hy.chunk)
        check_hybrid_checkpoint(source, meta)
        state_el, conv_el = hy.state_shape()
        n_rec = len(hy.recurrent_layers)
        nemotron = hy.mamba is not None
        self._decoder = run_nemotron_decoder if nemotron else run_hybrid_decoder
        slot_bytes = StateArena.estimate_bytes(n_rec, state_el, conv_el, 1)
        self._states = StatePool(seqs, slot_bytes, verify_slots=verify, ring_depth=ring,
                                 prefix_slots=prefix)
        max_rows = max(max_batch, MAX_VERIFY_ROWS)
        rows = max(max_prefill_tokens, max_rows)
        extra = StateArena.estimate_bytes(n_rec, state_el, conv_el, self._states.total_slots) \
            + HybridBuffers.estimate_bytes(meta, rows)
        plan = plan_memory(backend, self._layer_meta, kv_blocks=kv_blocks,
                           block_size=block_size, max_rows=max_rows,
                           max_tokens=max_prefill_tokens, max_seq_len=max_seq_len,
                           fp32_logits=self.use_fp32_logits, where=source.description,
                           rank_weight_bytes=nemotron_weight_bytes(meta) if nemotron else
                           hybrid_weight_bytes(meta), extra_bytes=extra)
        self._max_seq_len = self._max_positions = plan.max_seq_len
        self.memory_plan = plan
        try:
            self._weights = NemotronWeights(backend, source, meta, plan.weight_bytes,
                                            progress) if nemotron else \
                HybridWeights(backend, source, meta, progress=progress)
            self._ws = Workspace(backend, self._layer_meta, max_tokens=max_prefill_tokens,
                                 max_rows=max_rows, num_blocks=plan.num_blocks,
                                 block_size=block_size, max_blocks_per_seq=plan.max_blocks_per_seq,
                                 fp32_logits=self.use_fp32_logits)
            self._hb = HybridBuffers(backend, meta, rows)
            self._arena = StateArena(backend, n_rec, state_el, conv_el, self._states.total_slots)
            if hy.rotary_dim:   # Nemotron-H's attention has no rotary embedding
                table = partial_rope_table(meta.head_dim, hy.rotary_dim, self._max_positions,
                                           meta.rope_theta, meta.rope_scaling)
                self._rope_table = backend.alloc(table.nbytes)
                self._rope_tables.append(self._rope_table)   # freed by _release_device
                backend.copy_h2d(table, self._rope_table)
        except BaseException:
            self._release_device()
            raise
        self._pool = BlockPool(plan.num_blocks, block_size)
        # one KV group: the full-attention layers (no sliding windows in these families)
        n_attn = self._layer_meta.num_layers
        self._kv_groups = [KvGroup(self._pool, "block_table", "reserved_blocks", 0,
                                   tuple(range(n_attn)))]
        self._layer_group = [0] * n_attn
        self.source_description = source.description

    # the passes' hooks (passes.py) --------------------------------------------------------
    def _run_layers(self, stream: int, n: int, lora=None, **kw) -> None:
        # no LoRA pool on a hybrid (its load refuses max_loras), so there is no LoRA step
        assert lora is None, "a hybrid model has no LoRA slots"
        self._decoder(self, stream, n, **kw)

    def _graphable(self, items) -> bool:
        # a verify (even of one row: it keeps the state before it) runs its rows one by one
        return not self._verifying and all(len(t) == 1 for _, t in items)

    def _before_pass(self, items, stream: int, decode: bool, n_rows: int) -> None:
        hb, pool, arena = self._hb, self._states, self._arena
        for seq, _ in items:   # the tensor API's passes reach here without _check_seq
            self._check_seq(seq)
            if self._ssm_live_at is not None and self._ssm_live_at[0] == seq.seq_id:
                self._ssm_live_at = None
        self._after_default(stream)
        for seq, _ in items:
            self._retire_verify(seq, checkpoint_too=False)
        if not decode:
            for i, (seq, _) in enumerate(items):
                hb.h_slots[i], hb.h_start[i] = seq.ssm_slot, seq.seq_len
            hb.upload(stream, len(items), start=True)
            self._step = RecurrentStep(False, n_seqs=len(items),
                                       max_len=max(n for _, n in items))
            return
        slots = []
        for seq, n in items:
            if seq.seq_len == 0:   # nothing cached: the decode starts from a zero state
                arena.zero_slot(seq.ssm_slot, stream)
            slots += [seq.ssm_slot] * n
        hb.h_slots[:n_rows] = slots + [pool.sink] * (n_rows - len(slots))
        hb.upload(stream, n_rows, start=False)
        if not self._verifying and all(n == 1 for _, n in items):   # one launch
            self._step = RecurrentStep(True)
            return
        verify = len(items) == 1   # decode_verify: keep the state before each row
        kept = min(len(slots), pool.verify_slots) if verify else 0
        rows = []
        for seq, n in items:
            for j in range(n):
                rows.append((seq.ssm_slot, pool.verify_slot(0) if verify and j == 0 else -1,
                             pool.verify_slot(j + 1) if j + 1 < kept else -1))
        if verify:
            seq, n = items[0]
            self._ssm_verify = VerifyStates(seq.seq_id, seq.seq_len, n, kept)
        self._step = RecurrentStep(True, sequential=rows)

    def _after_default(self, stream: int) -> None:
        """Make `stream` wait for the default stream, where the state methods copy."""
        default = self.default_stream()
        if stream != default:
            if self._ssm_event is None:
                self._ssm_event = self.backend.create_event()
            self.backend.record_event(self._ssm_event, default)
            self.backend.stream_wait_event(stream, self._ssm_event)

    def _run_plans(self, plans, stream: int, row_base: int):
        """Prefill, keeping each prompt's state at its last checkpoint boundary (before its
        last token) in the prefix slots: the pass is split there (a multiple of the recurrent
        chunk and of the block size, so the split keeps the bits)."""
        step = self._checkpoint_interval
        for p in plans if self._states.prefix_slots else ():
            target = (len(p.tokens) - 1) // step * step
            pos = max(p.start, p.seq.seq_len)
            if not (0 < target and pos < target <= p.end) or any(t < 0 for t in p.tokens):
                continue
            while pos < target:
                k = min(self._ws.max_tokens, target - pos)
                self._prefill_pass(p.seq, p.tokens[pos:pos + k], stream, want_logits=False)
                pos += k
            self._keep_prefix_state(p.seq, p.tokens[:target], stream)
        return super()._run_plans(plans, stream, row_base)

    # verify -------------------------------------------------------------------------------
    @exclusive
    def decode_verify(self, tokens, seq, stream):
        tokens = list_arg("decode_verify", tokens)
        if len(tokens) > self._states.verify_slots:
            raise InvalidArgument(f"decode_verify: {len(tokens)} tokens exceed the "
                                  f"{self._states.verify_slots} states a hybrid model keeps "
                                  "inside a verify (load option ssm_verify_states)")
        self._verifying = True
        try:
            return super().decode_verify(tokens, seq, stream)
        finally:
            self._verifying = False

    def max_verify_tokens(self) -> int:
        return min(self._ws.max_rows, self._states.verify_slots)

    # lifecycle ----------------------------------------------------------------------------
    def alloc_sequence(self, adapter=None) -> SequenceState:
        """A new, empty sequence holding a state slot (CacheFull when the pool is full).
        `adapter`: as TransformerModel's (a hybrid has no LoRA slots: only None passes)."""
        seq = super().alloc_sequence(adapter=adapter)   # checked before a slot is taken
        seq.ssm_slot = self._states.alloc()
        return seq

    def free_sequence(self, seq: SequenceState) -> None:
        self._check_seq(seq, allow_freed=True)
        if seq.freed:
            return
        super().free_sequence(seq)
        self._retire_verify(seq)
        self._states.free(seq.ssm_slot)
        seq.ssm_slot = -1

    def fork_sequence(self, seq: SequenceState) -> SequenceState:
        """A new sequence sharing `seq`'s blocks, with a copy of its recurrent state."""
        self._check_seq(seq)
        slot = self._states.alloc()
        try:
            child = super().fork_sequence(seq)
        except BaseException:
            self._states.free(slot)
            raise
        child.ssm_slot = slot
        self._arena.copy_slot(seq.ssm_slot, slot, self.default_stream())
        return child

    def reuse_prefix(self, seq: SequenceState, tokens) -> int:
        """For an empty sequence: the cached blocks of `tokens` up to the longest checkpoint
        boundary whose state the pool keeps, with that state restored; 0 (nothing taken)
        when there is none."""
        self._check_seq(seq)
        if seq.arena is not None or seq.seq_len != 0 or self._pool.num_cached() == 0 or \
                not self._states.prefix_slots:
            return 0
        tokens = list(tokens)
        blocks = reused_prefix_blocks(self._pool, tokens)
        found = self._prefix_state_for(tokens, len(blocks))
        if found is None:
            return 0
        p, slot = found
        taken = super().reuse_prefix(seq, tokens[:p + 1])   # exactly p // block_size blocks
        assert taken == p, (taken, p)
        self._arena.copy_slot(slot, seq.ssm_slot, self.default_stream())
        self._retire_verify(seq)
        return p

    def _truncate(self, seq: SequenceState, new_len: int) -> None:
        """Drop positions >= new_len, the recurrent state with them: to 0 (fresh), or within
        the last verify of the sequence (its kept states); elsewhere InvalidArgument."""
        src = None
        restored = self._ssm_live_at == (seq.seq_id, new_len)   # a ring restore's position
        if 0 < new_len < seq.seq_len and not restored:
            rec = self._ssm_verify
            n = new_len - rec.start if rec is not None and rec.seq_id == seq.seq_id else -1
            if n < 0 or (rec.rows and n > rec.rows):
                raise InvalidArgument(
                    f"rollback to {new_len} tokens: sequence {seq.seq_id}'s recurrent state "
                    "cannot be rewound there (a hybrid model rewinds only within the last "
                    "decode_verify of the sequence, or to 0)")
            src = self._verify_source(seq, n, "rollback")
        super()._truncate(seq, new_len)
        if restored:
            self._ssm_live_at = None
        if new_len == 0:
            self._retire_verify(seq)
        elif src is not None:
            self._arena.copy_slot(src, seq.ssm_slot, self.default_stream())

    def _check_seq(self, seq, allow_freed: bool = False) -> None:
        """TransformerModel's checks, and a live sequence must hold a state slot: the
        tensor API's contiguous cache (a dense KV arena, no slot) is refused by name."""
        super()._check_seq(seq, allow_freed)
        if seq.arena is not None:
            raise Unsupported("a hybrid model's sequences keep recurrent state in its state "
                              "pool: the contiguous KV cache is not supported (use "
                              "CacheConfig(kind='paged'))")
        if not seq.freed and not self._states.held(seq.ssm_slot):
            raise InvalidArgument(f"sequence {seq.seq_id} holds no recurrent-state slot "
                                  "(a hybrid model's sequences come from alloc_sequence)")

    def _release_device(self) -> None:
        super()._release_device()
        for part in ("_hb", "_arena"):
            if getattr(self, part, None) is not None:
                getattr(self, part).free()
                setattr(self, part, None)
        if self._ssm_event is not None:
            self.backend.destroy_event(self._ssm_event)
            self._ssm_event = None
