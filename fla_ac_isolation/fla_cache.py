"""Public name of FLA's cache seam: :func:`tensor_cache_disabled`, :func:`probe_tensor_cache`, sizes.

The implementation lives with the rest of what this package knows about FLA, in
:mod:`fla_ac_isolation.fla_seam.cache`; this module re-exports its public names, unchanged.
"""

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
