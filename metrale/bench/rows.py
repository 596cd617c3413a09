"""The sequences one benchmark repetition decodes: B of one cache kind (the model's paged
pool, or the contiguous baseline), opened and closed together, with a prompt copied from
one row to another without a prefill when the time budget is spent."""
from __future__ import annotations


class Rows:
    """B sequences of one cache kind, opened and closed together."""

    def __init__(self, model, kind: str, batch: int, max_seq_len: int) -> None:
        self.model, self.kind, self.cache = model, kind, None
        if kind == "paged":
            self.seqs = [model.alloc_sequence() for _ in range(batch)]
        else:
            from ..generative.kv_cache import KVCache
            from ..kv.config import CacheConfig
            cfg = CacheConfig(kind="contiguous", max_seq_len=max_seq_len,
                              block_size=model.kv_block_size())
            self.cache = KVCache(model, cfg, batch)
            self.seqs = self.cache.seqs

    def replicate(self, src: int, dst: int, stream: int) -> None:
        """Make sequence `dst` hold the same cached prompt as `src` without a prefill."""
        m, s = self.model, self.seqs[src]
        if self.kind == "paged":
            m.free_sequence(self.seqs[dst])
            self.seqs[dst] = m.fork_sequence(s)
            return
        d = self.seqs[dst]
        bs = m.kv_block_size()
        for j in range(-(-s.seq_len // bs)):
            for layer in range(m.metadata().num_layers):
                for a, b in ((s.arena.k_cache(layer), d.arena.k_cache(layer)),
                             (s.arena.v_cache(layer), d.arena.v_cache(layer))):
                    nb = s.arena.block_bytes
                    m.backend.copy_d2d_async(a.offset(s.block_table[j] * nb),
                                             b.offset(d.block_table[j] * nb), nb, stream)
        d.tokens, d.seq_len = list(s.tokens), s.seq_len

    def close(self) -> None:
        if self.cache is not None:
            self.cache.free()
        else:
            for s in self.seqs:
                self.model.free_sequence(s)
        self.seqs = []
