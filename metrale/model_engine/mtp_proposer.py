"""The MTP proposer of a DeepSeek-V3 model (mtp.py has the module and its data): what
`save_hidden_for_mtp`, `run_mtp_propose_multi` and `trim_proposer_state` do when the model
has one (draft.py dispatches here).

- save(idx): copies rows 0..idx of the last target pass (the residual stream before the
  final norm) and remembers their positions (the pass's staged positions). Row idx is the
  original's MTP input row (`mtp_hidden_ptr`); the rows before it are the accepted
  positions before it, which a propose needs to feed the pairs the MTP has not seen.
- propose(token, position p, nd, seq): `p` is seq.seq_len and `token` the sequence's token
  at p (not yet in the cache). Feeds the missing true pairs up to key p - 1 (their hidden
  rows must be among the saved ones: else the MTP lacks context and proposes nothing, which
  costs drafts, never correctness), then drafts nd tokens by the chain (mtp.py). nd 0:
  only the pairs are fed (after each chunk of a prompt prefilled in several).
- trim(seq, num_accepted): after a verify and its rollback, the true pairs whose token is
  no longer the sequence's are dropped (the original's `after_verify`).
"""
from __future__ import annotations

import numpy as np

from ..ops import rmsnorm
from .deepseek import run_mla_block
from .linear import run_embedding, run_linear
from .mtp import MtpBuffers, mtp_state, scratch_blocks, upload_mtp


class MtpProposer:
    def __init__(self, model, source, tensors, *, max_chain: int, progress: bool) -> None:
        m, ws = model._meta, model._ws
        self.max_chain = max_chain
        self.weights = upload_mtp(model._weights, source, m, tensors, progress)
        self.buffers = MtpBuffers(model.backend, m, ws, num_blocks=ws.pad_block,
                                  scratch=scratch_blocks(model._block_size, max_chain),
                                  max_chain=max_chain, logit_bytes=ws.logit_bytes)
        self.saved_positions = np.zeros(0, np.int64)   # of the rows `save` copied
        self.last_drafts = 0

    def free(self) -> None:
        self.buffers.free()

    # save_hidden_for_mtp ------------------------------------------------------------
    def save(self, model, idx: int, stream: int) -> None:
        """Rows 0..idx of the last pass (pre-final-norm hidden) into the saved rows."""
        ws, hid = model._ws, model._meta.hidden_size
        model.backend.copy_d2d_async(ws.residual, self.buffers.saved, (idx + 1) * hid * 2,
                                     stream)
        # the staged positions of the last pass's rows (DeepSeek has no LongRoPE offset);
        # rows 0..idx are one sequence's when their query groups (a prefill's one, a
        # verify's one per row) read one block table and their positions run on
        pos = ws.h_positions[:idx + 1].astype(np.int64)
        g = 0
        while int(ws.h_indptr[g + 1]) <= idx:
            g += 1
        one_seq = bool((ws.h_tables[:g + 1] == ws.h_tables[0]).all()) and np.array_equal(
            pos, np.arange(pos[0], pos[0] + idx + 1))
        self.saved_positions = pos if one_seq else pos[idx:]

    # run_mtp_propose_multi ----------------------------------------------------------
    def propose(self, model, token: int, p: int, num_drafts: int, seq, stream: int) -> list[int]:
        st = mtp_state(seq)
        toks = list(seq.tokens) + [token]            # t_0 .. t_p
        keep = 0
        lim = min(len(st.tokens), p)
        while keep < lim and st.tokens[keep] == toks[keep + 1]:
            keep += 1
        del st.tokens[keep:]
        nd = min(num_drafts, self.max_chain, model._max_seq_len - p)
        saved = self.saved_positions
        if p < 1 or not len(saved) or int(saved[-1]) != p - 1 or (nd <= 0 and num_drafts):
            return []
        k0 = min(keep, p - 1)        # key p - 1 always runs: its logits are draft 1
        if k0 < int(saved[0]):
            return []                # pairs the saved rows cannot give: no context
        if num_drafts == 0 and keep == p:
            return []                # nothing to feed, nothing asked
        nd = max(nd, 1)              # (num_drafts 0: the pairs are fed, no draft kept)
        hid = model._meta.hidden_size
        table = self._table(model, seq, p - 1 + nd)
        first = self.buffers.saved.offset((k0 - int(saved[0])) * hid * 2)
        n = self._pass(model, stream, k0, toks[k0 + 1:p + 1], first, table, 0)
        st.tokens.extend(toks[len(st.tokens) + 1:p + 1])   # keys 0..p-1 are true pairs now
        if num_drafts == 0:
            return []
        drafts = [model.argmax_on_device(self._logits(model, 0), stream)]
        for j in range(1, nd):
            model.backend.copy_d2d_async(model._ws.residual.offset((n - 1) * hid * 2),
                                         self.buffers.chain, hid * 2, stream)
            n = self._pass(model, stream, p - 1 + j, [drafts[-1]], self.buffers.chain, table, j)
            drafts.append(model.argmax_on_device(self._logits(model, j), stream))
        self.last_drafts = len(drafts)
        return drafts

    def trim(self, seq) -> None:
        """Drop the true pairs whose token t_{k+1} is past the sequence (rolled back)."""
        st = mtp_state(seq)
        del st.tokens[max(seq.seq_len - 1, 0):]

    # the pass -----------------------------------------------------------------------
    def _logits(self, model, row: int):
        return self.buffers.logits.offset(row * model._meta.vocab_size * model._ws.logit_bytes)

    def _table(self, model, seq, keys: int) -> list[int]:
        """The sequence's blocks, then scratch blocks for chain keys past them."""
        bs = model._block_size
        table = list(seq.block_table)
        need = -(-keys // bs) - len(table)
        return table + [self.buffers.first_scratch + i for i in range(max(need, 0))]

    def _pass(self, model, stream: int, k0: int, tokens, hid_ptr, table, row: int) -> int:
        """The module on pair keys k0..k0+n-1 (`tokens`: t_{k+1}; `hid_ptr`: their hidden
        rows [n, hidden]): latents to the MTP cache, the last row's logits to logits row
        `row`; ws.residual keeps the module's output rows. Returns n."""
        b, ws, m = model.backend, model._ws, model._meta
        W, B = self.weights, self.buffers
        n, hid, eps, bs, V = len(tokens), m.hidden_size, m.rms_norm_eps, model._block_size, \
            m.vocab_size
        keys = np.arange(k0, k0 + n, dtype=np.int64)
        tab = np.asarray(table, np.int64)
        ws.h_tokens[:n] = tokens
        ws.h_positions[:n] = keys + 1          # pair key k rotates at position k + 1
        ws.h_slots[:n] = tab[keys // bs] * bs + keys % bs
        model._fill_table_row(0, table)
        ws.h_kv_lens[0] = k0 + n
        ws.h_indptr[:2] = (0, n)
        ws.upload_step(stream, n, 1)
        run_embedding(b, stream, B.e, W.embed, ws.token_ids, ws.h_tokens[:n], n, hid, V)
        rmsnorm.rmsnorm(b, stream, B.normed, B.e, W.enorm, n, hid, eps)
        rmsnorm.rmsnorm(b, stream, B.e, hid_ptr, W.hnorm, n, hid, eps)
        # eh_proj as its halves: the block's first norm adds them (x = residual + hidden)
        run_linear(b, stream, ws.residual, B.normed, W.eh_e, n, hid, hid)
        run_linear(b, stream, ws.hidden, B.e, W.eh_h, n, hid, hid)
        run_mla_block(model, stream, n, 0, W.block, 1, first=False, cache=B.cache)
        row_bytes = hid * 2
        rmsnorm.rmsnorm(b, stream, B.normed, ws.hidden, W.norm, n, hid, eps,
                        residual_ptr=ws.residual)
        run_linear(b, stream, self._logits(model, row), B.normed.offset((n - 1) * row_bytes),
                   W.head, 1, V, hid, out_fp32=model.use_fp32_logits)
        return n
