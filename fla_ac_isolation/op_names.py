"""The names of the saveable operations: the one list every part of the package reads.

``saveable=True`` (:mod:`fla_ac_isolation.ops`) runs these operations as torch custom operators, one per
backend (:data:`fla_ac_isolation.ops.saveable.TABLE`, keyed by these names and built with :func:`by_operation`);
:data:`fla_ac_isolation.ops.SAVEABLE_OPS` pairs them, and :func:`fla_ac_isolation.policies.save_fla_ops` takes
these names. A leaf: it imports nothing.
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
        ValueError: the keywords are not exactly :data:`SAVEABLE_OP_NAMES` (naming the missing and extra ones).
    """
    missing = [name for name in SAVEABLE_OP_NAMES if name not in per_operation]
    extra = sorted(set(per_operation) - set(SAVEABLE_OP_NAMES))
    if missing or extra:
        raise ValueError(f"one entry per saveable operation {SAVEABLE_OP_NAMES} is needed; missing {missing}, "
                         f"extra {extra}")
    return {name: per_operation[name] for name in SAVEABLE_OP_NAMES}
