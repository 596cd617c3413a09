"""`KVCache` of the tensor API: a generation session's cache, paged or contiguous.

A cache holds one sequence per batch row. Paged caches take blocks from the model's pool
(and give them back on `free`/`reset`); contiguous ones own a dense buffer (the baseline).
"""
from __future__ import annotations

from ..errors import InvalidArgument
from ..kv.config import CacheConfig
from ..kv.contiguous import ContiguousArena


class KVCache:
    """`seq_len()`, `reset()`, `popn(n)`, `free()`; usable as a context manager."""

    def __init__(self, model, config: CacheConfig, batch: int = 1) -> None:
        if not isinstance(config, CacheConfig):
            raise InvalidArgument(f"create_kv_cache: expected a CacheConfig, got "
                                  f"{type(config).__name__}")
        if config.block_size != model.kv_block_size():
            raise InvalidArgument(f"CacheConfig.block_size {config.block_size} != the model's "
                                  f"block size {model.kv_block_size()}")
        self.model = model
        self.config = config
        self.batch = batch
        self.arenas: list[ContiguousArena] = []
        self.seqs = []
        self._open()

    def _open(self) -> None:
        m, cfg = self.model, self.config
        meta = m.metadata()
        self.seqs = [m.alloc_sequence() for _ in range(self.batch)]
        if cfg.kind == "contiguous":
            limit = m._max_seq_len
            if cfg.max_seq_len > limit:
                raise InvalidArgument(f"CacheConfig.max_seq_len {cfg.max_seq_len} exceeds the "
                                      f"model's max_seq_len {limit}")
            # a tensor-parallel rank's arena holds its own KV heads (model._layer_meta)
            a = ContiguousArena(m.backend, meta.num_layers, m._layer_meta.num_kv_heads,
                                meta.head_dim, cfg.max_seq_len, cfg.block_size,
                                n_seqs=self.batch)
            self.arenas.append(a)
            for i, s in enumerate(self.seqs):
                s.arena, s.block_table = a, a.block_table(i)

    def kind(self) -> str:
        return self.config.kind

    def seq_len(self) -> int:
        return self.seqs[0].seq_len if self.seqs else 0

    def check_room(self, n_new: int) -> None:
        limit = self.config.max_seq_len
        if self.seq_len() + n_new > limit:
            raise InvalidArgument(f"KV cache overflow: {self.seq_len()} + {n_new} tokens exceed "
                                  f"CacheConfig.max_seq_len={limit}")

    def popn(self, n: int) -> None:
        """Drop the last `n` positions (speculative rollback); contiguous caches too."""
        if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= self.seq_len():
            raise InvalidArgument(f"popn({n!r}): the cache holds {self.seq_len()} positions")
        for s in self.seqs:
            self.model.rollback(s, n)

    def reset(self) -> None:
        """Empty the cache (keeps a contiguous buffer; paged blocks go back to the pool)."""
        for s in self.seqs:
            self.model.rollback(s, s.seq_len)

    def free(self) -> None:
        for s in self.seqs:
            self.model.free_sequence(s)
        self.seqs = []
        for a in self.arenas:
            a.free()
        self.arenas = []

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.free()
