"""The contiguous baseline KV cache: one dense buffer per cache, no pool, no sharing.

Laid out `[layers, 2, n_blocks, block_size, num_kv_heads, head_dim]` BF16 so that the
paged kernels serve it through an identity block table (block i of the sequence is
block i of this buffer): the comparison paged vs contiguous then measures the layout and
the indirection, not two different kernel sets.
"""
from __future__ import annotations

from ..errors import InvalidArgument


class ContiguousArena:
    """A dense KV buffer for `n_seqs` sequences of up to `max_seq_len` tokens each; sequence
    i owns blocks [i * n_blocks, (i + 1) * n_blocks)."""

    def __init__(self, backend, num_layers: int, num_kv_heads: int, head_dim: int,
                 max_seq_len: int, block_size: int, n_seqs: int = 1) -> None:
        if max_seq_len < 1:
            raise InvalidArgument(f"contiguous cache: max_seq_len must be >= 1, got {max_seq_len}")
        self.backend = backend
        self.max_seq_len = max_seq_len
        self.n_blocks = -(-max_seq_len // block_size)
        self.block_bytes = block_size * num_kv_heads * head_dim * 2
        self.layer_bytes = n_seqs * self.n_blocks * self.block_bytes
        self.nbytes = num_layers * 2 * self.layer_bytes
        self.base = backend.alloc(self.nbytes)

    def block_table(self, i: int) -> list[int]:
        """The identity block table of sequence i."""
        return list(range(i * self.n_blocks, (i + 1) * self.n_blocks))

    def k_cache(self, layer: int):
        return self.base.offset(2 * layer * self.layer_bytes)

    def v_cache(self, layer: int):
        return self.base.offset((2 * layer + 1) * self.layer_bytes)

    def free(self) -> None:
        if self.base is not None:
            self.backend.free(self.base)
            self.base = None
