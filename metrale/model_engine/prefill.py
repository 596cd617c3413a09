"""`TransformerModel`'s prefill entry points and mixed steps: `prefill`, `prefill_chunk`,
`prefill_batch_chunk(_rows)`, `mixed_forward(_batch)`.

Semantics of the original engine (model/trait_impl/prefill_b/*.rs):
- Chunk positions are prompt positions. At chunk 0 of an empty sequence the prefix cache
  is looked up (`reuse_prefix`); cached positions are skipped inside the call, and a later
  chunk that starts inside the cached prefix skips them too (its tokens must match).
- A finishing slice writes its last position's logits to row `row_base + i` of the shared
  arena (row 0 for `prefill` / `prefill_chunk`, i.e. `decode_logits_ptr()`), its hidden
  state to the same row of `hidden_after_norm()`, and inserts the prompt into the prefix
  cache. When the arena cannot hold rows `row_base..row_base + n`, row_base falls back to 0
  (prefill_b/batch.rs).
Everything a caller can get wrong — arguments, rows, the pool's room for the whole step —
is checked before the first launch; a refused step changes nothing.
"""
from __future__ import annotations

from typing import NamedTuple, Sequence

from ..errors import InvalidArgument
from ..gpu_runtime.types import NULL, DevicePtr
from .args import bool_arg, int_arg, list_arg
from .forward import MixedBatchResult, MixedForwardResult, PrefillSlice
from .guard import exclusive
from .sequence import SequenceState


class _Plan(NamedTuple):
    tokens: list
    seq: SequenceState
    start: int
    end: int
    is_last: bool


class PromptPrefill:
    @exclusive
    def prefill(self, tokens: Sequence[int], seq: SequenceState, stream: int) -> DevicePtr:
        self._check_seq(seq)
        if seq.seq_len != 0:
            raise InvalidArgument(f"prefill: sequence {seq.seq_id} already holds {seq.seq_len} "
                                  "tokens; use prefill_chunk or decode to extend it")
        try:
            n = len(tokens)
        except TypeError:
            n = 0   # _plan_slices names the bad argument
        return self._prefill_slices([(tokens, seq, 0, n, True)], stream, 0, "prefill")[0]

    @exclusive
    def prefill_chunk(self, tokens: Sequence[int], seq: SequenceState, chunk_start: int,
                      chunk_len: int, is_last_chunk: bool, stream: int) -> DevicePtr:
        return self._prefill_slices([(tokens, seq, chunk_start, chunk_len, is_last_chunk)],
                                    stream, 0, "prefill_chunk")[0]

    @exclusive
    def prefill_batch_chunk(self, slices: Sequence[PrefillSlice], stream: int) -> list[DevicePtr]:
        return self._prefill_slices(slices, stream, 0, "prefill_batch_chunk")

    @exclusive
    def prefill_batch_chunk_rows(self, slices: Sequence[PrefillSlice], stream: int,
                                 row_base: int) -> list[DevicePtr]:
        return self._prefill_slices(slices, stream, row_base, "prefill_batch_chunk_rows")

    @exclusive
    def mixed_forward(self, decode_tokens, decode_seqs, prefill_tokens, prefill_seq,
                      prefill_chunk_start, prefill_chunk_len, prefill_is_last,
                      stream) -> MixedForwardResult:
        """`mixed_forward_batch` with one slice: its row follows the decode rows."""
        res = self.mixed_forward_batch(decode_tokens, decode_seqs,
                                       [(prefill_tokens, prefill_seq, prefill_chunk_start,
                                         prefill_chunk_len, prefill_is_last)], stream)
        return MixedForwardResult(res.decode_logits, res.prefill_logits[0])

    @exclusive
    def mixed_forward_batch(self, decode_tokens, decode_seqs, prefill_slices,
                            stream) -> MixedBatchResult:
        """The original's order: `decode_batch`, synchronize the default stream, then the
        slices at rows after the decode rows — every check made before the decode runs."""
        what = "mixed_forward_batch"
        stream = self._stream_of(stream)
        decode_tokens, decode_seqs = list_arg(what, decode_tokens), list_arg(what, decode_seqs)
        if decode_tokens or decode_seqs:
            self._check_decode_batch(decode_tokens, decode_seqs, what)
            self._check_decode_items([(s, [t]) for s, t in zip(decode_seqs, decode_tokens)],
                                     what)
        plans = self._plan_slices(prefill_slices, what, taken=decode_seqs)
        self._admit_plans(plans, [(s, 1) for s in decode_seqs])
        rows = NULL
        if decode_seqs:
            rows = self.decode_batch(decode_tokens, decode_seqs, stream)
            self.synchronize(self.default_stream())
        return MixedBatchResult(rows, self._run_plans(plans, stream, len(decode_seqs)))

    # ---------------------------------------------------------------------------------
    def _prefill_slices(self, slices, stream, row_base, what: str) -> list[DevicePtr]:
        stream = self._stream_of(stream)
        row_base = int_arg(what, "row_base", row_base, 0)
        plans = self._plan_slices(slices, what)
        self._admit_plans(plans, [])
        return self._run_plans(plans, stream, row_base)

    def _plan_slices(self, slices, what: str, taken=()) -> list[_Plan]:
        """Check every slice (no state is touched)."""
        plans, seen = [], {id(s) for s in taken}
        for i, sl in enumerate(list_arg(what, slices)):
            try:
                tokens, seq, chunk_start, chunk_len, is_last = sl
            except (TypeError, ValueError):
                raise InvalidArgument(f"{what}: slice {i} is not a PrefillSlice(prompt_tokens, "
                                      "seq, chunk_start, chunk_len, is_last_chunk)") from None
            tokens = self._check_tokens(tokens, what)
            self._check_seq(seq)
            start = int_arg(what, "chunk_start", chunk_start, 0)
            end = start + int_arg(what, "chunk_len", chunk_len, 1)
            is_last = bool_arg(what, "is_last_chunk", is_last)
            if id(seq) in seen:
                raise InvalidArgument(f"{what}: sequence {seq.seq_id} appears twice in the step")
            seen.add(id(seq))
            if end > len(tokens):
                raise InvalidArgument(f"{what}: chunk [{start}, {end}) is beyond the "
                                      f"{len(tokens)}-token prompt")
            if is_last and end != len(tokens):
                raise InvalidArgument(f"{what}: is_last_chunk but the chunk does not end the "
                                      f"prompt ({end} of {len(tokens)})")
            if start > seq.seq_len:
                raise InvalidArgument(f"{what}: chunk_start {start} is past seq_len "
                                      f"{seq.seq_len} of sequence {seq.seq_id}")
            cached = min(end, seq.seq_len)
            if seq.tokens[start:cached] != tokens[start:cached]:
                raise InvalidArgument(f"{what}: chunk [{start}, {end}) overlaps sequence "
                                      f"{seq.seq_id}'s cached tokens, which differ")
            if is_last and end <= seq.seq_len:
                raise InvalidArgument(f"{what}: the last chunk [{start}, {end}) is already in "
                                      f"the cache of sequence {seq.seq_id}: no position is "
                                      "left to compute its logits")
            self._check_capacity(seq, max(0, end - seq.seq_len))
            plans.append(_Plan(tokens, seq, start, end, is_last))
        if len(plans) > self._ws.logits_rows:
            raise InvalidArgument(f"{what}: {len(plans)} slices exceed the logits arena's "
                                  f"{self._ws.logits_rows} rows")
        return plans

    def _admit_plans(self, plans: list[_Plan], decode_items) -> None:
        """The chunk-0 prefix lookups, then the pool's room for the whole step; a refusal
        (CacheFull) undoes the lookups."""
        looked = [p.seq for p in plans
                  if p.start == 0 and p.seq.seq_len == 0 and self.reuse_prefix(p.seq, p.tokens)]
        try:
            self._check_room(list(decode_items) +
                             [(p.seq, max(0, p.end - p.seq.seq_len)) for p in plans])
        except BaseException:
            for seq in looked:
                self._truncate(seq, 0)
            raise

    def _run_plans(self, plans: list[_Plan], stream: int, row_base: int) -> list[DevicePtr]:
        """Every plan's chunk; plans whose rest fits one pass share passes (in order, up to
        ws.max_tokens tokens and ws.max_rows sequences each), the rest run alone in
        ws.max_tokens pieces. Slice i's logits go to row row_base + i."""
        ws = self._ws
        if row_base + len(plans) > ws.logits_rows:
            row_base = 0   # as the original: never write past the arena
        out: list[DevicePtr] = [NULL] * len(plans)
        group: list[int] = []

        def run_group() -> None:
            items = []
            for i in group:
                p = plans[i]
                pos = max(p.start, p.seq.seq_len)
                items.append((p.seq, p.tokens[pos:p.end], row_base + i if p.is_last else None))
            for i, ptr in zip(group, self._prefill_pass_batch(items, stream)):
                out[i] = ptr
                if plans[i].is_last:
                    self.cache_sequence(plans[i].seq)   # the prompt enters the prefix cache
            group.clear()

        for i, p in enumerate(plans):
            rest = p.end - max(p.start, p.seq.seq_len)
            if p.seq.arena is None and 0 < rest <= ws.max_tokens:
                if group and (sum(plans[j].end - max(plans[j].start, plans[j].seq.seq_len)
                                  for j in group) + rest > ws.max_tokens or
                              len(group) == ws.max_rows):
                    run_group()
                group.append(i)
                continue
            ptr, pos = NULL, max(p.start, p.seq.seq_len)
            while pos < p.end:
                n = min(ws.max_tokens, p.end - pos)
                ptr = self._prefill_pass(p.seq, p.tokens[pos:pos + n], stream,
                                         want_logits=p.is_last and pos + n == p.end,
                                         logits_row=row_base + i)
                pos += n
            if p.is_last:
                self.cache_sequence(p.seq)   # the prompt enters the prefix cache
            out[i] = ptr if p.is_last else NULL
        if group:
            run_group()
        return out

