"""Public name of FLA's cache seam: re-exports :mod:`fla_ac_isolation.fla_seam.cache`'s public names."""

from fla_ac_isolation.fla_seam.cache import (
    CacheEvent,
    CacheProbe,
    cache_enabled,
    cache_size,
    cached_helpers,
    clear_tensor_cache,
    probe_tensor_cache,
    tensor_cache_disabled,
    tensor_cache_size,
)

__all__ = [
    "CacheEvent",
    "CacheProbe",
    "cache_enabled",
    "cache_size",
    "cached_helpers",
    "clear_tensor_cache",
    "probe_tensor_cache",
    "tensor_cache_disabled",
    "tensor_cache_size",
]
