"""The rules of the fields the audit's and the regression's specs share, and the SAC policy a spec names."""

from __future__ import annotations

from typing import Any

from fla_ac_isolation.policies import POLICIES, Policy

__all__ = ["DEFAULT_POLICY", "FULL_AC_POLICY", "check_checkpointing", "check_counts", "check_seed", "policy_name",
           "sac_policy"]

DEFAULT_POLICY = "save-all-copies"
"""The SAC policy of ``ac="selective"`` when a spec gives none (``policy=None``): the field's most sensitive on a
CPU."""

FULL_AC_POLICY = ("policy {policy} was given with ac='full': full AC recomputes every op and saves none, so a SAC "
                  "policy has nothing to choose: leave policy out, or give ac='selective' to apply it")
"""Why a policy given with full AC is refused (``{policy}``: the policy as the message shows it)."""


def check_checkpointing(ac: Any, policy: Any) -> None:
    """``ac`` is ``"full"`` or ``"selective"``; ``policy`` is ``None`` (:data:`DEFAULT_POLICY`) or, with
    ``"selective"`` only, a key of :data:`fla_ac_isolation.policies.POLICIES`.

    Raises:
        ValueError: naming ``ac`` or ``policy`` and the accepted values; a policy given with ``ac="full"``
            (:data:`FULL_AC_POLICY`).
    """
    if ac not in ("full", "selective"):
        raise ValueError(f"ac must be 'full' or 'selective', got {ac!r}")
    if ac == "full" and policy is not None:
        raise ValueError(FULL_AC_POLICY.format(policy=repr(policy)))
    if ac == "selective" and policy is not None and policy not in POLICIES:
        raise ValueError(f"policy must be one of {sorted(POLICIES)}, got {policy!r}")


def policy_name(policy: str | None) -> str:
    """The name of the SAC policy ``policy`` (``None``: :data:`DEFAULT_POLICY`)."""
    return DEFAULT_POLICY if policy is None else policy


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


def sac_policy(ac: str, policy: str | None) -> Policy | None:
    """A new instance of the SAC policy named ``policy`` (``None``: :data:`DEFAULT_POLICY`) with
    ``ac="selective"``, ``None`` for full AC."""
    return POLICIES[policy_name(policy)]() if ac == "selective" else None
