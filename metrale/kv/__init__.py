"""Layer 3: KV cache configuration, the paged block pool and the recurrent-state pool."""
from .block_pool import BlockPool
from .config import CacheConfig
from .prefix import prefix_keys
from .state_pool import StatePool

__all__ = ["BlockPool", "CacheConfig", "StatePool", "prefix_keys"]
