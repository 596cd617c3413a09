"""The two kinds of forward pass of `TransformerModel`, with their argument checks.

`_prefill_pass`: one sequence's chunk of at most `max_tokens` tokens.
`_decode_rows`: query rows `(seq, [tokens...])` — one row per new position; decode and
decode_batch give one token per sequence, decode_verify k+1 tokens of one sequence. A
verify row at position p is computed exactly like a decode step at p (same kernels, same
per-row reduction order), which is what makes speculative greedy equal plain greedy.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from ..errors import InvalidArgument
from ..gpu_runtime.types import DevicePtr
from .ladder import padded_batch_n
from .layers import lm_head, run_decoder
from .kv_groups import trim
from .linear import run_embedding
from .sequence import SequenceState

_INT_TYPES = (int, np.integer)


class DecoderPasses:
    # checks --------------------------------------------------------------------------
    def _check_tokens(self, tokens, what: str) -> list[int]:
        if isinstance(tokens, np.ndarray):
            if tokens.ndim != 1 or tokens.dtype.kind not in "iu":
                raise InvalidArgument(f"{what}: tokens must be a 1-D integer array, got "
                                      f"{tokens.dtype} with shape {tokens.shape}")
            tokens = tokens.tolist()
        try:
            toks = list(tokens)
        except TypeError:
            raise InvalidArgument(f"{what}: tokens must be a sequence of ints, got "
                                  f"{type(tokens).__name__}") from None
        if not toks:
            raise InvalidArgument(f"{what}: empty token list")
        V = self._meta.vocab_size
        for i, t in enumerate(toks):
            if isinstance(t, bool) or not isinstance(t, _INT_TYPES):
                raise InvalidArgument(f"{what}: token {i} is {type(t).__name__}, not an int")
            if not 0 <= t < V:
                raise InvalidArgument(f"{what}: token id {t} at index {i} is outside "
                                      f"[0, vocab_size={V})")
        return [int(t) for t in toks]

    def _check_capacity(self, seq: SequenceState, n_new: int) -> None:
        limit = self._max_seq_len if seq.arena is None else seq.arena.max_seq_len
        if seq.seq_len + n_new > limit:
            why = ""
            rs = self._meta.rope_scaling
            if rs is not None and rs.rope_type == "dynamic" and \
                    limit == self._meta.max_position_embeddings:
                why = (" (rope type 'dynamic': positions past max_position_embeddings are "
                       "refused; transformers rescales the rope there per call)")
            raise InvalidArgument(f"sequence {seq.seq_id}: {seq.seq_len} + {n_new} tokens exceed "
                                  f"max_seq_len={limit}{why}")

    def _check_decode_batch(self, tokens, seqs, what: str) -> None:
        if len(tokens) != len(seqs):
            raise InvalidArgument(f"{what}: {len(tokens)} tokens for {len(seqs)} sequences")
        if not 1 <= len(seqs) <= self._max_batch:
            raise InvalidArgument(f"{what}: batch of {len(seqs)} outside [1, max_batch="
                                  f"{self._max_batch}]")
        if len({id(s) for s in seqs}) != len(seqs):
            raise InvalidArgument(f"{what}: a sequence appears twice in the batch")

    def _check_decode_items(self, rows, what: str, tokens_checked: bool = False) -> list:
        """Checked `(seq, tokens)` decode rows (`tokens_checked`: placeholders of the
        tensor API, not token ids)."""
        items = []
        arenas = {id(seq.arena) for seq, _ in rows}
        if len(arenas) > 1:
            raise InvalidArgument(f"{what}: sequences of different caches in one batch")
        for seq, toks in rows:
            # an empty sequence is fine: its first token goes to position 0, as in the
            # original's decode paths (trait_impl/decode_a.rs, upload_batch_metadata_*)
            self._check_seq(seq)
            if not tokens_checked:
                toks = self._check_tokens(toks, what)
            self._check_capacity(seq, len(toks))
            items.append((seq, toks))
        n = sum(len(t) for _, t in items)
        if n > self._ws.max_rows:
            raise InvalidArgument(f"{what}: {n} rows exceed the workspace's {self._ws.max_rows}")
        return items

    # prefill -------------------------------------------------------------------------
    def _prefill_pass(self, seq: SequenceState, chunk: Sequence[int], stream: int,
                      want_logits: bool, embeds: np.ndarray | None = None,
                      hidden_out: DevicePtr | None = None, splice=None,
                      recorded: Sequence[int] | None = None, logits_row: int = 0) -> DevicePtr:
        """Run `chunk` (token ids; or `embeds` [n, hidden] bf16 bits) at positions
        seq_len.. of `seq`. When `want_logits`, returns logits row `logits_row` of the shared
        arena, holding the last position's logits (its hidden state goes to the same row of
        `hidden_after_norm()`). `hidden_out`: where final-norm hidden rows go (default
        ws.normed). `splice(stream)` runs after the token embeddings are in `ws.residual` and
        may overwrite rows (image features); `recorded` is what `seq.tokens` keeps (default
        `chunk`)."""
        ws, bs, b = self._ws, self._block_size, self.backend
        n = len(chunk)
        start = seq.seq_len
        lora_rows = self._lora_row_slots([seq], [n])
        with self._growth_guard([seq]):
            self._reserve_for_writes([(seq, n)], stream)
            pos = np.arange(start, start + n, dtype=np.int64)
            table = np.asarray(seq.block_table, np.int64)
            ws.h_tokens[:n] = chunk
            ws.h_positions[:n] = pos + self._rope_row(seq)
            ws.h_slots[:n] = table[pos // bs] * bs + pos % bs
            self._fill_table_row(0, seq.block_table)
            self._fill_window_rows(seq, pos, 0, 0)
            ws.h_kv_lens[0] = start + n
            ws.h_indptr[:2] = (0, n)
            ws.upload_step(stream, n, 1)
            if embeds is not None:
                b.copy_h2d_async(np.ascontiguousarray(embeds, np.uint16), ws.residual, stream)
            elif splice is not None:
                run_embedding(b, stream, ws.residual, self._weights.embed_tokens,
                              ws.token_ids, ws.h_tokens[:n], n, self._meta.hidden_size,
                              self._meta.vocab_size)
                splice(stream)
            out = ws.normed if hidden_out is None else hidden_out
            self._before_pass([(seq, n)], stream, False, 1)
            self._run_layers(stream, n, decode=False, n_seqs=1, max_q_len=n, out_ptr=out,
                             embeds_uploaded=embeds is not None or splice is not None,
                             arena=seq.arena, lora=self._lora_step(lora_rows, stream, False))
        seq.tokens.extend(int(t) for t in (chunk if recorded is None else recorded))
        seq.seq_len += n
        self._trim_windows(seq, seq.seq_len)   # the next query's window (kv_groups.py)
        if not want_logits:
            return DevicePtr.NULL
        # As the original's prefill finish (trait_impl/prefill_b/finalize_last.rs): the last
        # position's post-norm hidden state is what hidden_after_norm() shows, and its logits
        # go to row `logits_row` of the shared arena (row 0 is decode_logits_ptr()).
        hid_bytes = self._meta.hidden_size * 2
        hidden_row = ws.final_hidden.offset(logits_row * hid_bytes)
        b.copy_d2d_async(out.offset((n - 1) * hid_bytes), hidden_row, hid_bytes, stream)
        logits = ws.logits.offset(logits_row * self._meta.vocab_size * ws.logit_bytes)
        lm_head(self, stream, hidden_row, 1, logits)
        return logits

    def _prefill_pass_batch(self, items, stream: int) -> list[DevicePtr]:
        """Several sequences' chunks in one forward pass: items (seq, chunk, logits_row or
        None), sequences distinct and in the model's pool, sum of chunk lengths <=
        ws.max_tokens, at most ws.max_rows items. Per item the logits pointer (row
        `logits_row`, as `_prefill_pass`) or NULL. Every kernel keeps rows or sequences
        apart (the GEMM is batch-invariant, attention runs per sequence), so each item's
        results are the bits of its own `_prefill_pass`."""
        ws, bs, b = self._ws, self._block_size, self.backend
        seqs = [seq for seq, _, _ in items]
        ends, n = [], 0
        lora_rows = self._lora_row_slots(seqs, [len(chunk) for _, chunk, _ in items])
        with self._growth_guard(seqs):
            self._reserve_for_writes([(seq, len(chunk)) for seq, chunk, _ in items], stream)
            for r, (seq, chunk, _) in enumerate(items):
                k = len(chunk)
                pos = np.arange(seq.seq_len, seq.seq_len + k, dtype=np.int64)
                table = np.asarray(seq.block_table, np.int64)
                ws.h_tokens[n:n + k] = chunk
                ws.h_positions[n:n + k] = pos + self._rope_row(seq)
                ws.h_slots[n:n + k] = table[pos // bs] * bs + pos % bs
                self._fill_table_row(r, seq.block_table)
                self._fill_window_rows(seq, pos, n, r)
                ws.h_kv_lens[r] = seq.seq_len + k
                ws.h_indptr[r] = n
                n += k
                ends.append(n)
            ws.h_indptr[len(items)] = n
            ws.upload_step(stream, n, len(items))
            self._before_pass([(seq, len(chunk)) for seq, chunk, _ in items], stream, False,
                              len(items))
            self._run_layers(stream, n, decode=False, n_seqs=len(items),
                             max_q_len=max(len(c) for _, c, _ in items), out_ptr=ws.normed,
                             lora=self._lora_step(lora_rows, stream, False))
        for seq, chunk, _ in items:
            seq.tokens.extend(int(t) for t in chunk)
            seq.seq_len += len(chunk)
            self._trim_windows(seq, seq.seq_len)
        hid_bytes = self._meta.hidden_size * 2
        row_bytes = self._meta.vocab_size * ws.logit_bytes
        out, rows = [], []
        for (_, _, row), end in zip(items, ends):
            if row is None:
                out.append(DevicePtr.NULL)
                continue
            b.copy_d2d_async(ws.normed.offset((end - 1) * hid_bytes),
                             ws.final_hidden.offset(row * hid_bytes), hid_bytes, stream)
            out.append(ws.logits.offset(row * row_bytes))
            rows.append(row)
        # consecutive rows (the usual case) share one lm_head GEMM: it reads the head's
        # weights once, and a row's logits are the same bits either way (batch-invariant)
        runs = []
        for row in rows:
            if runs and row == runs[-1][0] + runs[-1][1]:
                runs[-1][1] += 1
            else:
                runs.append([row, 1])
        for first, count in runs:
            lm_head(self, stream, ws.final_hidden.offset(first * hid_bytes), count,
                    ws.logits.offset(first * row_bytes))
        return out

    # decode --------------------------------------------------------------------------
    def _decode_rows(self, rows: Sequence[tuple[SequenceState, Sequence[int]]], stream: int,
                     what: str, embeds: np.ndarray | None = None) -> DevicePtr:
        """Append each row's tokens to its sequence and leave one logits row per token at
        `logits_buffer_ptr()`. `embeds` ([n_rows, hidden] bf16 bits) replaces the
        embedding lookup (tensor API); then token ids are placeholders (-1)."""
        ws, bs = self._ws, self._block_size
        items = self._check_decode_items(rows, what, tokens_checked=embeds is not None)
        n = sum(len(t) for _, t in items)
        lora_rows = self._lora_row_slots([s for s, _ in items], [len(t) for _, t in items])
        with self._growth_guard([s for s, _ in items]):
            self._reserve_for_writes([(s, len(t)) for s, t in items], stream)
            r = 0
            for seq, toks in items:
                for j, tok in enumerate(toks):
                    p = seq.seq_len + j
                    ws.h_tokens[r] = tok
                    ws.h_positions[r] = p + self._rope_row(seq)
                    ws.h_slots[r] = seq.block_table[p // bs] * bs + p % bs
                    self._fill_table_row(r, seq.block_table)
                    self._fill_window_rows(seq, np.array([p]), r, r)
                    ws.h_kv_lens[r] = p + 1
                    r += 1
            arena = rows[0][0].arena
            graphs = self._use_graphs and arena is None and embeds is None and \
                self._graphable(items)
            padded = self._graph_rows(n) if graphs else n
            for r in range(n, padded):  # padding rows read the sink block's first slot,
                ws.h_tokens[r] = 0        # which the first of them writes: only one, as
                ws.h_positions[r] = 0     # several blocks writing one cache slot race
                ws.h_slots[r] = ws.pad_block * bs if r == n else -1
                self._fill_table_row(r, [ws.pad_block])
                if ws.windowed:
                    ws.h_window_slots[r] = ws.window_pad_block * bs if r == n else -1
                    ws.h_window_tables[r] = ws.window_pad_block
                ws.h_kv_lens[r] = 1
            ws.h_indptr[: padded + 1] = np.arange(padded + 1)
            ws.upload_step(stream, padded, padded)
            if embeds is not None:
                self.backend.copy_h2d_async(np.ascontiguousarray(embeds, np.uint16), ws.residual,
                                            stream)
            self._before_pass([(s, len(t)) for s, t in items], stream, True, padded)
            lora = self._lora_step(lora_rows, stream, True, padded if graphs else None)
            if graphs:
                self._replay_decode_graph(padded, stream, lora)
            else:
                self._decode_body(padded, stream, embeds_uploaded=embeds is not None, arena=arena,
                                  lora=lora)
        for seq, toks in items:
            first = seq.seq_len
            seq.tokens.extend(toks)
            seq.seq_len += len(toks)
            # kept: the window of the step's second position, so that a rollback to any
            # accepted length (at least one token) finds its keys
            self._trim_windows(seq, first + 1)
        return ws.logits

    def _decode_body(self, n: int, stream: int, embeds_uploaded: bool = False,
                     arena=None, lora=None) -> None:
        ws = self._ws
        self._run_layers(stream, n, decode=True, n_seqs=n, max_q_len=1,
                         out_ptr=ws.final_hidden, embeds_uploaded=embeds_uploaded, arena=arena,
                         lora=lora)
        lm_head(self, stream, ws.final_hidden, n, ws.logits)

    # what a model with recurrent layers overrides (model_engine/hybrid.py) -------------
    def _run_layers(self, stream: int, n: int, **kw) -> None:
        """Run the decoder stack over the `n` rows of the step (layers.run_decoder)."""
        run_decoder(self, stream, n, **kw)

    def _before_pass(self, items, stream: int, decode: bool, n_rows: int) -> None:
        """Called once a pass's metadata is staged, right before its layers run, with the
        pass's `(seq, new_tokens)` and its row (decode) or sequence (prefill) count;
        nothing to do where every layer keeps its state in the KV cache."""

    def _graphable(self, items) -> bool:
        """Whether a decode step of these `(seq, tokens)` may replay a captured graph."""
        return True

    def _graph_rows(self, n: int) -> int:
        """Rows a graphed decode of `n` rows runs: the ladder rung where the backend pads
        decode graphs (`pads_decode_graphs`, protocol.py), capped at the workspace (n <=
        max_rows always, so the cap never drops a live row); else n itself."""
        if not self.backend.pads_decode_graphs:
            return n
        return min(padded_batch_n(n), self._ws.max_rows)

    def _replay_decode_graph(self, padded: int, stream: int, lora=None) -> None:
        # a rung has two graphs: without LoRA, and with the LoRA launches, which read the
        # rows' slots (the tiles) and the slots' weights from device memory, so one graph
        # serves every mix of adapters and every slot contents
        key = padded if lora is None else (padded, "lora")
        g = self._graphs.get(key)
        if g is None:
            # Eager once (compiles and loads every kernel outside capture), then capture.
            self._decode_body(padded, stream, lora=lora)
            self.backend.synchronize(stream)
            self.backend.begin_capture(stream)
            try:
                self._decode_body(padded, stream, lora=lora)
            except BaseException:
                self.backend.destroy_graph(self.backend.end_capture(stream))
                raise
            self._graphs[key] = self.backend.end_capture(stream)
            return
        self.backend.launch_graph(g, stream)

    def _fill_window_rows(self, seq: SequenceState, pos: np.ndarray, slot0: int,
                          row: int) -> None:
        """The sliding-window group's slots for positions `pos` (from slot index slot0) and
        its table row `row` (a dense-cache sequence: its identity table), when the model
        has that group; EVICTED entries (never read) as the pad block."""
        ws = self._ws
        if not ws.windowed:
            return
        bs = self._block_size
        blocks = seq.block_table if seq.arena is not None else seq.window_table
        table = np.asarray(blocks, np.int64)
        ws.h_window_slots[slot0:slot0 + len(pos)] = table[pos // bs] * bs + pos % bs
        out = ws.h_window_tables[row]
        out[:len(blocks)] = np.where(table < 0, ws.window_pad_block, table)
        out[len(blocks):] = ws.window_pad_block

    def _trim_windows(self, seq: SequenceState, next_pos: int) -> None:
        """Release the sliding-window blocks the query at `next_pos` no longer reads."""
        trim(self._kv_groups, seq, next_pos)

    def _rope_row(self, seq: SequenceState) -> int:
        """The rope table row of a sequence's position 0: a LongRoPE sequence rotated with
        its long factors throughout reads the table's second half (ops/rope_table.py)."""
        return self._max_positions if seq.rope_long else 0

    def _fill_table_row(self, r: int, blocks: Sequence[int]) -> None:
        row = self._ws.h_tables[r]
        row[: len(blocks)] = blocks
        row[len(blocks):] = self._ws.pad_block
