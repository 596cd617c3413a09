"""`CacheConfig`: what kind of KV cache a generation session gets and how large."""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import InvalidArgument


@dataclass(frozen=True)
class CacheConfig:
    """kind "paged" (blocks from the model's pool) or "contiguous" (a dense baseline buffer).

    max_seq_len: the most tokens a cache may hold; block_size: tokens per paged block (the
    contiguous cache is laid out in blocks of the same size so the same kernels serve it).
    """

    kind: str = "paged"
    max_seq_len: int = 4096
    block_size: int = 16

    def __post_init__(self) -> None:
        if self.kind not in ("paged", "contiguous"):
            raise InvalidArgument(f"CacheConfig.kind must be 'paged' or 'contiguous', "
                                  f"got {self.kind!r}")
        for name in ("max_seq_len", "block_size"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise InvalidArgument(f"CacheConfig.{name} must be a positive int, got {v!r}")
        if self.max_seq_len > 1 << 24:
            raise InvalidArgument(f"CacheConfig.max_seq_len {self.max_seq_len} exceeds the "
                                  f"limit of {1 << 24} tokens")
        if self.block_size > 1024 or self.block_size & (self.block_size - 1):
            raise InvalidArgument(f"CacheConfig.block_size must be a power of two <= 1024, "
                                  f"got {self.block_size}")

    def blocks_needed(self) -> int:
        return -(-self.max_seq_len // self.block_size)
