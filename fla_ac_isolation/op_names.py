"""The names of the saveable operations (``saveable=True`` in :mod:`fla_ac_isolation.ops`), the one list every
part of the package reads; a leaf module.
"""

from __future__ import annotations

from typing import TypeVar

__all__ = ["SAVEABLE_OP_NAMES", "by_operation"]

SAVEABLE_OP_NAMES: tuple[str, ...] = ("gated_delta_rule", "causal_conv1d", "ssd")
"""The saveable operations: the gated delta rule (GDN core), the causal conv, Mamba2's SSD scan."""

_T = TypeVar("_T")


def by_operation(**per_operation: _T) -> dict[str, _T]:
    """``per_operation`` (one entry per name of :data:`SAVEABLE_OP_NAMES`) as a dict in that order.

    Raises:
        ValueError: the keywords are not exactly :data:`SAVEABLE_OP_NAMES`.
    """
    missing = [name for name in SAVEABLE_OP_NAMES if name not in per_operation]
    extra = sorted(set(per_operation) - set(SAVEABLE_OP_NAMES))
    if missing or extra:
        raise ValueError(f"one entry per saveable operation {SAVEABLE_OP_NAMES} is needed; missing {missing}, "
                         f"extra {extra}")
    return {name: per_operation[name] for name in SAVEABLE_OP_NAMES}
