"""The rules of the fields the audit's and the regression's specs share, and the SAC policy a spec names: one of
:data:`~fla_ac_isolation.policies.POLICIES`, the user's own as ``module:callable`` / ``path/to/file.py:callable``
(:mod:`~fla_ac_isolation.harness.user_code`), or the function itself (:func:`resolve_policy`, shared with
``check``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fla_ac_isolation.harness import user_code
from fla_ac_isolation.harness.extras import install_hint
from fla_ac_isolation.harness.failures import first_line
from fla_ac_isolation.policies import POLICIES, Policy

__all__ = ["DEFAULT_POLICY", "FULL_AC_POLICY", "POLICY_EXPECTED", "check_checkpointing", "check_counts", "check_seed",
           "policy_name", "resolve_policy", "sac_policy", "shown_policy"]

DEFAULT_POLICY = "save-all-copies"
"""The SAC policy of ``ac="selective"`` when a spec gives none (``policy=None``): the field's most sensitive on a
CPU."""

FULL_AC_POLICY = ("policy {policy} was given with ac='full': full AC recomputes every op and saves none, so a SAC "
                  "policy has nothing to choose: leave policy out, or give ac='selective' to apply it")
"""Why a policy given with full AC is refused (``{policy}``: the policy as the message shows it)."""


POLICY_EXPECTED = ("one of {names}, 'module:callable' or 'path/to/file.py:callable' naming your own SAC policy, or "
                   "that function: (ctx, op, *args, **kwargs) -> CheckpointPolicy, as "
                   "torch.utils.checkpoint.create_selective_checkpoint_contexts takes it")
"""What a policy must be (``{names}``: the sorted names of :data:`~fla_ac_isolation.policies.POLICIES`)."""


def shown_policy(policy: Any) -> str:
    """``policy`` as messages show it: a string's ``repr``, a function's qualified name."""
    return repr(policy) if isinstance(policy, str) else getattr(policy, "__qualname__", repr(policy))


def resolve_policy(policy: Any, error: type[Exception] = ValueError) -> Callable:
    """The SAC policy function of ``policy``: a name of :data:`~fla_ac_isolation.policies.POLICIES` is built fresh
    (``None``: :data:`DEFAULT_POLICY`), a ``module:callable`` / ``path/to/file.py:callable`` is loaded (its file
    once per process, :func:`~fla_ac_isolation.harness.user_code.load_callable`), a function is returned as it is.

    Raises:
        error: naming ``policy`` and what it must be (:data:`POLICY_EXPECTED`): an unknown name, a target that
            cannot be loaded, or a function that does not take ``(ctx, op, ...)`` (e.g. a policy constructor
            uncalled); a named policy whose module is missing here (``torchtitan``, or its own dependency), with its
            install.
    """
    from fla_ac_isolation.policies import sac_context_fn

    expected = POLICY_EXPECTED.format(names=sorted(POLICIES))
    if policy is None:
        policy = DEFAULT_POLICY
    if isinstance(policy, str) and policy in POLICIES:
        try:
            return POLICIES[policy]()
        except ModuleNotFoundError as err:
            install = f" ({install_hint(err.name)})" if err.name else ""
            raise error(f"policy {policy!r} cannot be built here: {first_line(err)}{install}") from err
    if isinstance(policy, str):
        if policy.count(":") != 1 or not all(policy.split(":")):
            raise error(f"policy must be {expected}, got {policy!r}")
        fn = user_code.load_callable(policy, "policy", error)
    elif callable(policy):
        fn = policy
    else:
        raise error(f"policy must be {expected}, got {type(policy).__name__}")
    try:
        sac_context_fn(fn)
    except TypeError as err:
        raise error(f"policy {shown_policy(policy)}: {err}") from None
    return fn


def check_checkpointing(ac: Any, policy: Any) -> None:
    """``ac`` is ``"full"`` or ``"selective"``; ``policy`` is ``None`` (:data:`DEFAULT_POLICY`) or, with
    ``"selective"`` only, what :func:`resolve_policy` takes (a target is loaded here).

    Raises:
        ValueError: naming ``ac`` or ``policy`` and the accepted values; a policy given with ``ac="full"``
            (:data:`FULL_AC_POLICY`).
    """
    if ac not in ("full", "selective"):
        raise ValueError(f"ac must be 'full' or 'selective', got {ac!r}")
    if ac == "full" and policy is not None:
        raise ValueError(FULL_AC_POLICY.format(policy=shown_policy(policy)))
    if ac == "selective":
        resolve_policy(policy)


def policy_name(policy: Any) -> str:
    """How reports name the SAC policy ``policy``: its name or target, a function's qualified name (``None``:
    :data:`DEFAULT_POLICY`)."""
    if policy is None:
        return DEFAULT_POLICY
    if isinstance(policy, str):
        return policy
    return getattr(policy, "__qualname__", None) or type(policy).__name__


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


def sac_policy(ac: str, policy: Any) -> Policy | None:
    """The SAC policy of ``policy`` (:func:`resolve_policy`: a name built anew) with ``ac="selective"``, ``None``
    for full AC."""
    return resolve_policy(policy) if ac == "selective" else None
