"""The rules of the fields the audit's and the regression's specs share, and the SAC policy a spec names."""

from __future__ import annotations

from typing import Any

from fla_ac_isolation.policies import POLICIES, Policy

__all__ = ["check_checkpointing", "check_counts", "check_seed", "sac_policy"]


def check_checkpointing(ac: Any, policy: Any) -> None:
    """``ac`` is ``"full"`` or ``"selective"``; with ``"selective"``, ``policy`` is a key of
    :data:`fla_ac_isolation.policies.POLICIES`.

    Raises:
        ValueError: naming ``ac`` or ``policy`` and the accepted values.
    """
    if ac not in ("full", "selective"):
        raise ValueError(f"ac must be 'full' or 'selective', got {ac!r}")
    if ac == "selective" and policy not in POLICIES:
        raise ValueError(f"policy must be one of {sorted(POLICIES)}, got {policy!r}")


def check_counts(spec: Any, names: tuple[str, ...]) -> None:
    """Each attribute ``names`` of ``spec`` is an int >= 1 (a bool is not).

    Raises:
        ValueError: naming the first attribute that is not, and its value.
    """
    for name in names:
        value = getattr(spec, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")


def check_seed(seed: Any) -> None:
    """Raises ``ValueError`` naming ``seed`` unless it is an int (a bool is not)."""
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"seed must be an int, got {seed!r}")


def sac_policy(ac: str, policy: str) -> Policy | None:
    """A new instance of the SAC policy named ``policy`` with ``ac="selective"``, ``None`` for full AC."""
    return POLICIES[policy]() if ac == "selective" else None
