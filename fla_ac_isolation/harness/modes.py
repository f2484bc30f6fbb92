"""The four ways every regression, audit, benchmark and test runs a model: no-ac, shared, isolated, global-disable.

A *mode* says three things: whether the layers are checkpointed, what ``cu_seqlens`` object the layers
receive, and in which FLA cache context the step runs.

* ``no-ac``: not checkpointed; one :class:`SharedSeqlens` (harmless without AC); the reference.
* ``shared``: checkpointed; one :class:`SharedSeqlens` for every layer: the UNSAFE path, on purpose.
* ``isolated``: checkpointed; one :class:`~fla_ac_isolation.LayerLocalSeqlens`, each layer calls ``.local()``.
* ``global-disable``: checkpointed; one :class:`SharedSeqlens`, FLA's tensor cache off process-wide.

Each mode also knows its *role* in a check (:attr:`Mode.role`): ``no-ac`` is the ``reference``;
``isolated`` (this package's fix) and ``global-disable`` (the blunt alternative,
:func:`~fla_ac_isolation.fla_cache.tensor_cache_disabled`) are ``required`` to match it, and decide a check's
exit code; ``shared`` is what models do today (one ``cu_seqlens`` object for every layer), ``unsafe``: run so
that each check shows the fault it guards against, never changing the exit code. :func:`modes_with_role`
lists them; the regression, the audit and the benchmarks read the roles from here.

Under context parallelism (``cp=CPConfig(...)``) the four keep their meaning for FLA's CP context (one
context for every layer, or a fresh one per layer call), and a fifth mode exists, in :data:`CP_MODES`:

* ``field``: checkpointed; :class:`FieldCPSeqlens`: every layer builds FLA's CP context inside its forward
  from the one shared ``cu_seqlens`` (FLA's cached ``build_cp_context``, no host offsets), as models in
  the field do: UNSAFE, on purpose. Meaningful only with CP.

Example::

    mode = MODES["isolated"]
    seqlens = mode.from_seq_lens([5, 0, 17], device="cuda")
    with mode.cache_context():
        loss = model(input_ids, seqlens).sum()
        loss.backward()
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from fla_ac_isolation.fla_seam.cache import tensor_cache_disabled
from fla_ac_isolation.seqlens import LayerLocalSeqlens, LocalSeqlens

__all__ = [
    "ALL_MODES",
    "CP_MODES",
    "MODES",
    "MODE_NAMES",
    "ROLES",
    "FieldCPSeqlens",
    "Mode",
    "SharedSeqlens",
    "get_mode",
    "modes_with_role",
]

ROLES: tuple[str, ...] = ("reference", "required", "unsafe")
"""What a mode is in a check: the ``reference`` the others are compared with; ``required`` to match it (a
mismatch fails the check); ``unsafe``: the fault's path, run on purpose, never changing the outcome."""


class SharedSeqlens(LayerLocalSeqlens):
    """The UNSAFE path, on purpose: :meth:`local` returns the same tensor objects on every call.

    This is what a model does when it hands one ``cu_seqlens`` object to every layer. It exists so that
    regressions, audits and benchmarks can run the shared path through the very same mixers and compare
    it with :class:`~fla_ac_isolation.LayerLocalSeqlens`; never use it to train. Validation and attributes
    are those of :class:`~fla_ac_isolation.LayerLocalSeqlens`; ``chunk_indices`` defaults to ``False``
    here, as models that share one ``cu_seqlens`` object do not precompute FLA's chunk schedule either
    (with it, the conv and the gated delta rule skip ``prepare_chunk_indices``, which hides part of the
    fault this class exists to show).
    """

    __slots__ = ("_shared",)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("chunk_indices", False)
        super().__init__(*args, **kwargs)
        self._shared = LocalSeqlens(
            self._cu_seqlens, self._cu_seqlens_cpu if self._host_given else None, self.max_seqlen, self._chunk_indices
        )

    def local(self, *, whole_batch: bool = False) -> LocalSeqlens:
        """The same objects on every call (the shared, unsafe behaviour); under CP, one FLA CP context."""
        if self._cp is not None and not whole_batch:
            return self._cp.shared()
        return self._shared


class FieldCPSeqlens(SharedSeqlens):
    """UNSAFE under context parallelism, on purpose: each :meth:`local` builds FLA's CP context in the layer.

    What a model in the field does: every layer calls FLA's ``build_cp_context`` inside its forward with the
    one ``cu_seqlens`` object of the batch and no host offsets
    (:func:`fla_ac_isolation.fla_seam.cp.build_cp_context_in_layer`). FLA's identity cache then misses in
    the first layer's forward (on an accelerator it also copies the offsets to the host there) and hits in
    its recompute, so a checkpointed region runs other ops in the recompute than in the forward. Built
    like :class:`~fla_ac_isolation.LayerLocalSeqlens` with ``cp=`` (required here, with a process group).

    Raises:
        ValueError: ``cp`` is missing or has no process group (FLA's ``build_cp_context`` reads the rank
            from the group).
    """

    __slots__ = ()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self._cp is None or self._cp.config.group is None:
            raise ValueError(
                "mode 'field' builds FLA's CP context inside each layer and needs cp=CPConfig(group=...); "
                "it is meaningful only under context parallelism"
            )

    def local(self, *, whole_batch: bool = False) -> LocalSeqlens:
        """FLA's context from the shared ``cu_seqlens``, built now (``whole_batch``: the shared global offsets)."""
        if whole_batch:
            return self._shared
        from fla_ac_isolation.fla_seam.cp import build_cp_context_in_layer

        cp = self._cp.config
        context = build_cp_context_in_layer(
            self._cu_seqlens, group=cp.group, layout=cp.layout, conv_kernel_size=cp.conv_kernel_size
        )
        return LocalSeqlens(context.cu_seqlens, context.cu_seqlens_cpu, self._cp.max_seqlen, None, context)


@dataclass(frozen=True)
class Mode:
    """One mode: whether layers are checkpointed, which ``seqlens`` they get, which cache context runs.

    Attributes:
        name: ``"no-ac"``, ``"shared"``, ``"isolated"`` or ``"global-disable"``.
        summary: one line for help texts and reports.
        checkpointed: the layers run under activation checkpointing.
        isolated: every layer gets fresh ``cu_seqlens`` objects (:class:`~fla_ac_isolation.LayerLocalSeqlens`).
        cache_disabled: FLA's tensor cache is disabled process-wide while the step runs.
        role: ``"reference"``, ``"required"`` or ``"unsafe"`` (:data:`ROLES`).
        field: every layer builds FLA's CP context from the shared ``cu_seqlens`` (:class:`FieldCPSeqlens`);
            needs context parallelism.
    """

    name: str
    summary: str
    checkpointed: bool
    isolated: bool
    cache_disabled: bool
    role: str
    field: bool = False

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")

    @property
    def seqlens_class(self) -> type[LayerLocalSeqlens]:
        """:class:`~fla_ac_isolation.LayerLocalSeqlens` when isolated, :class:`FieldCPSeqlens` for ``field``,
        else :class:`SharedSeqlens`."""
        if self.field:
            return FieldCPSeqlens
        return LayerLocalSeqlens if self.isolated else SharedSeqlens

    def seqlens(self, cu_seqlens: torch.Tensor, **kwargs: Any) -> LayerLocalSeqlens:
        """This mode's ``seqlens`` for ``cu_seqlens`` (keywords of :class:`~fla_ac_isolation.LayerLocalSeqlens`)."""
        return self.seqlens_class(cu_seqlens, **kwargs)

    def from_seq_lens(
        self, seq_lens: Sequence[int], device: torch.device | str | None = None, **kwargs: Any
    ) -> LayerLocalSeqlens:
        """This mode's ``seqlens`` for document lengths (:meth:`~fla_ac_isolation.LayerLocalSeqlens.from_seq_lens`)."""
        return self.seqlens_class.from_seq_lens(seq_lens, device, **kwargs)

    def cache_context(self) -> contextlib.AbstractContextManager:
        """:func:`~fla_ac_isolation.fla_cache.tensor_cache_disabled` for ``global-disable``, else a no-op context."""
        return tensor_cache_disabled() if self.cache_disabled else contextlib.nullcontext()


MODES: dict[str, Mode] = {
    m.name: m
    for m in (
        Mode("no-ac", "reference: no checkpointing", checkpointed=False, isolated=False, cache_disabled=False,
             role="reference"),
        Mode("shared", "UNSAFE: one cu_seqlens object for every layer", checkpointed=True, isolated=False,
             cache_disabled=False, role="unsafe"),
        Mode("isolated", "LayerLocalSeqlens: fresh cu_seqlens per layer call", checkpointed=True, isolated=True,
             cache_disabled=False, role="required"),
        Mode("global-disable", "FLA's tensor cache disabled process-wide", checkpointed=True, isolated=False,
             cache_disabled=True, role="required"),
    )
}
"""Every mode by name, in the order they run (``no-ac`` first: it is the reference)."""

MODE_NAMES: tuple[str, ...] = tuple(MODES)

CP_MODES: dict[str, Mode] = {
    "field": Mode("field", "UNSAFE: each layer builds FLA's CP context from the shared cu_seqlens", checkpointed=True,
                  isolated=False, cache_disabled=False, role="unsafe", field=True),
}
"""Modes that exist only under context parallelism (run after the four of :data:`MODES`)."""

ALL_MODES: dict[str, Mode] = {**MODES, **CP_MODES}
"""Every mode by name: :data:`MODES`, then :data:`CP_MODES`."""


def get_mode(name: str) -> Mode:
    """The :class:`Mode` called ``name`` (one of :data:`ALL_MODES`).

    Raises:
        ValueError: naming ``name`` and the known modes.
    """
    if name not in ALL_MODES:
        raise ValueError(f"mode must be one of {tuple(ALL_MODES)}, got {name!r}")
    return ALL_MODES[name]


def modes_with_role(role: str) -> tuple[str, ...]:
    """The names of the modes of :data:`ALL_MODES` whose :attr:`Mode.role` is ``role``, in run order.

    Raises:
        ValueError: ``role`` is not one of :data:`ROLES`.
    """
    if role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}, got {role!r}")
    return tuple(name for name, mode in ALL_MODES.items() if mode.role == role)
