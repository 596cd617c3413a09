"""Layer 3: KV cache configuration and the paged block pool."""
from .block_pool import BlockPool
from .config import CacheConfig
from .prefix import prefix_keys

__all__ = ["BlockPool", "CacheConfig", "prefix_keys"]
