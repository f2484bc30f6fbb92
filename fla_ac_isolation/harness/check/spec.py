"""What ``check`` is asked to check (:class:`CheckSpec`), each field checked at the boundary; the errors of the
check (:class:`CheckInputError`: exit 2, :class:`CheckEnvironmentError`: exit 3); the user's SAC policy and
``module:callable`` targets resolved (:func:`resolve_policy`, :func:`load_callable`). The check itself:
:mod:`fla_ac_isolation.harness.check.runner`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fla_ac_isolation.harness import spec_fields, user_code
from fla_ac_isolation.harness.environment import resolve_device
from fla_ac_isolation.harness.spec_fields import DEFAULT_POLICY, FULL_AC_POLICY, policy_name, shown_policy

__all__ = ["DEFAULT_POLICY", "CheckEnvironmentError", "CheckInputError", "CheckSpec", "load_callable",
           "resolve_policy"]


class CheckInputError(ValueError):
    """What the check was given cannot be checked: the spec, the callable, what it returned, or the model's
    layers (the message names which)."""


class CheckEnvironmentError(RuntimeError):
    """The environment cannot run the check: FLA refuses it (its #640 guard, recognised by
    :func:`fla_ac_isolation.harness.fla_seam.hopper_guard.is_hopper_gdn_refusal`); the message names what to
    install and FLA's own error. Not the model's fault, nor AC's (the command exits with 3)."""


@dataclass(frozen=True)
class CheckSpec:
    """What to check; :meth:`validate` checks every field.

    Attributes:
        model: ``"module:callable"`` or ``"path/to/file.py:callable"`` naming a callable that returns
            ``(model, batch)``, or that callable itself.
        config: a tiny model instead (:func:`fla_ac_isolation.harness.foreign_models.tiny_names`); exactly one of
            the two.
        ac: ``"selective"`` (with ``policy``) or ``"full"``. Ignored for a model that checkpoints itself (its
            factory's model already calls ``checkpoint``): it is audited as it is, with its own policy.
        policy: the SAC policy of ``ac="selective"``: a name (:data:`fla_ac_isolation.policies.POLICIES`),
            ``"module:callable"`` / ``"path/to/file.py:callable"`` naming the user's own policy function, or that
            function itself: a function as ``torch.utils.checkpoint.create_selective_checkpoint_contexts`` takes
            it, ``(ctx, op, *args, **kwargs) -> CheckpointPolicy`` (one with a ``fresh()`` method is renewed for
            every checkpointed call). ``None`` (not given): :data:`DEFAULT_POLICY`. Refused with ``ac="full"``:
            full AC saves no op, so a policy would be ignored.
        device: ``cpu``, ``cuda`` or ``auto`` (``cuda`` when a GPU is visible).
        seed: the tiny model's weights and batch (``config`` only).
        verify_fix: when the model diverges, run the fix on a fresh model too.
        first_config: on CUDA, every Triton autotuner of FLA keeps its first config (no autotuning: the first
            step takes seconds, not minutes; the kernels run untuned, the verdict is the same). No effect on CPU.
        autocast: ``"bf16"`` or ``"fp16"``: every step runs its forward and its backward inside
            ``torch.autocast(device, dtype)`` (a training loop that wraps its whole step), where torch's
            weight-cast cache can misalign a SAC recompute (torch issue #193338); ``None``: no autocast.
    """

    model: str | Callable | None = None
    config: str | None = None
    ac: str = "selective"
    policy: str | Callable | None = None
    device: str = "auto"
    seed: int = 0
    verify_fix: bool = True
    first_config: bool = False
    autocast: str | None = None

    def validate(self) -> CheckSpec:
        """Return self after checking every field.

        Raises:
            CheckInputError: naming the field and what it must be.
        """
        if (self.model is None) == (self.config is None):
            raise CheckInputError("give exactly one of model ('module:callable') and config (a model_type)")
        if self.model is not None and not callable(self.model) and (
                not isinstance(self.model, str) or self.model.count(":") != 1 or not all(self.model.split(":"))):
            raise CheckInputError(f"model must be 'module:callable', 'path/to/file.py:callable' or a callable "
                                  f"returning (model, batch), got {self.model!r}")
        if self.config is not None:
            from fla_ac_isolation.harness.foreign_models import tiny_names

            names = tiny_names()
            if self.config not in names:
                raise CheckInputError(f"config must be one of {sorted(names)}, got {self.config!r}")
        if self.ac not in ("full", "selective"):
            raise CheckInputError(f"ac must be 'full' or 'selective', got {self.ac!r}")
        if self.ac == "full" and self.policy is not None:
            raise CheckInputError(FULL_AC_POLICY.format(policy=shown_policy(self.policy)))
        if self.ac == "selective":
            resolve_policy(self.policy)
        try:
            resolve_device(self.device)
        except ValueError as err:
            raise CheckInputError(str(err)) from None
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise CheckInputError(f"seed must be an int, got {self.seed!r}")
        if not isinstance(self.first_config, bool):
            raise CheckInputError(f"first_config must be a bool, got {self.first_config!r}")
        if self.autocast not in AUTOCAST_DTYPES:
            raise CheckInputError(f"autocast must be one of {sorted(k for k in AUTOCAST_DTYPES if k)} or None, got "
                                  f"{self.autocast!r}")
        return self

    @property
    def model_name(self) -> str | None:
        """How the report names the model: its ``module:callable``, or the callable's ``module:qualname``."""
        if self.model is None or isinstance(self.model, str):
            return self.model
        name = getattr(self.model, "__qualname__", type(self.model).__name__)
        return f"{getattr(self.model, '__module__', '?')}:{name}"

    @property
    def policy_name(self) -> str:
        """How the report names the policy: its name, its ``module:callable``, or the function's name
        (:data:`DEFAULT_POLICY` when not given)."""
        return policy_name(self.policy)


AUTOCAST_DTYPES = {None: None, "bf16": "bfloat16", "fp16": "float16"}
""":attr:`CheckSpec.autocast` -> the ``torch`` dtype's name its steps autocast to."""


def resolve_policy(policy: Any) -> Callable:
    """The SAC policy function of ``policy`` (:attr:`CheckSpec.policy`):
    :func:`fla_ac_isolation.harness.spec_fields.resolve_policy`, shared with the audit and the regression.

    Raises:
        CheckInputError: naming ``policy`` and what it must be: an unknown name, a target that cannot be
            imported, or a function that does not take ``(ctx, op, ...)`` (e.g. a policy constructor uncalled);
            a named policy whose module is missing here (``torchtitan``, or its own dependency), with its install.
    """
    return spec_fields.resolve_policy(policy, CheckInputError)


def load_callable(target: str, argument: str = "model") -> Callable:
    """The callable of ``target``: ``"path/to/file.py:callable"`` or ``"module:callable"``, each file loaded once
    per process whichever way it is named (:func:`fla_ac_isolation.harness.user_code.load_callable`).

    Raises:
        CheckInputError: naming ``argument`` and ``target``: no such file, the import fails (a
            ``ModuleNotFoundError`` of the module itself says where modules are looked up), no such attribute,
            or it is not callable.
    """
    return user_code.load_callable(target, argument, CheckInputError)
