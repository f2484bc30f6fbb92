"""The modes every regression, audit, benchmark and test runs a model in: ``no-ac`` (reference), ``shared``
(one ``cu_seqlens`` for every layer: UNSAFE, on purpose), ``isolated`` (:class:`~fla_ac_isolation.LayerLocalSeqlens`),
``global-disable`` (FLA's tensor cache off), and under CP ``field`` (:data:`CP_MODES`). A mode's
:attr:`Mode.role` says whether it decides a check's exit code; its ``seqlens`` are a
:class:`~fla_ac_isolation.LayerLocalSeqlens`, or under CP a :class:`~fla_ac_isolation.parallel.CPSeqlens`."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from fla_ac_isolation.fla_seam.cache import tensor_cache_disabled
from fla_ac_isolation.local_seqlens import LocalSeqlens, PackedSeqlens
from fla_ac_isolation.parallel import CPConfig, CPSeqlens
from fla_ac_isolation.seqlens import LayerLocalSeqlens

__all__ = [
    "ALL_MODES",
    "CP_MODES",
    "MODES",
    "MODE_NAMES",
    "ROLES",
    "FieldCPSeqlens",
    "Mode",
    "SharedCPSeqlens",
    "SharedSeqlens",
    "get_mode",
    "modes_with_role",
]

ROLES: tuple[str, ...] = ("reference", "required", "unsafe")
"""What a mode is in a check: the ``reference`` the others are compared with; ``required`` to match it (a
mismatch fails the check); ``unsafe``: the fault's path, run on purpose, never changing the outcome."""


class SharedSeqlens(LayerLocalSeqlens):
    """The UNSAFE path, on purpose: :meth:`local` returns the same tensor objects on every call. Never train with it.

    Built like :class:`~fla_ac_isolation.LayerLocalSeqlens`, but ``chunk_indices`` defaults to ``False``
    (precomputed chunk indices would hide part of the fault).
    """

    __slots__ = ("_shared",)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("chunk_indices", False)
        super().__init__(*args, **kwargs)
        self._shared = LocalSeqlens(
            self._cu_seqlens, self._cu_seqlens_cpu if self._host_given else None, self.max_seqlen, self._chunk_indices
        )

    def local(self, *, whole_batch: bool = False) -> LocalSeqlens:
        """The same objects on every call."""
        return self._shared


class SharedCPSeqlens(CPSeqlens):
    """The UNSAFE path under CP, on purpose: :meth:`local` returns one FLA CP context (and its offsets) on every
    call, ``local(whole_batch=True)`` one set of whole-batch offsets. Built like
    :class:`~fla_ac_isolation.parallel.CPSeqlens`, but ``chunk_indices`` defaults to ``False``.
    """

    __slots__ = ("_shared_local", "_shared_whole")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("chunk_indices", False)
        super().__init__(*args, **kwargs)
        self._shared_local = super().local()
        self._shared_whole = super().local(whole_batch=True)

    def local(self, *, whole_batch: bool = False) -> LocalSeqlens:
        """The same objects on every call: one FLA CP context, or with ``whole_batch`` one set of global offsets."""
        return self._shared_whole if whole_batch else self._shared_local


class FieldCPSeqlens(SharedCPSeqlens):
    """UNSAFE under CP, on purpose: each :meth:`local` calls FLA's ``build_cp_context`` in the layer on the shared
    ``cu_seqlens``, so its cache misses in the forward and hits in the recompute. Built like
    :class:`~fla_ac_isolation.parallel.CPSeqlens`.

    Raises:
        ValueError: ``cp`` has no process group.
    """

    __slots__ = ()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.cp.group is None:
            raise ValueError(
                "mode 'field' builds FLA's CP context inside each layer and needs CPConfig(group=...): FLA's "
                "build_cp_context takes the CP process group"
            )

    def local(self, *, whole_batch: bool = False) -> LocalSeqlens:
        """FLA's CP context from the shared ``cu_seqlens``, built now."""
        if whole_batch:
            return self._shared_whole
        from fla_ac_isolation.harness.fla_seam.cp_field import build_cp_context_in_layer

        cp = self.cp
        context = build_cp_context_in_layer(
            self._shared_whole.cu_seqlens, group=cp.group, layout=cp.layout, conv_kernel_size=cp.conv_kernel_size
        )
        return LocalSeqlens(context.cu_seqlens, context.cu_seqlens_cpu, self._shared_local.max_seqlen, None, context)


@dataclass(frozen=True)
class Mode:
    """One mode: whether layers are checkpointed, which ``seqlens`` they get, which cache context runs.

    Attributes:
        name: the mode's name (a key of :data:`ALL_MODES`).
        summary: one line for help texts and reports.
        checkpointed: the layers run under activation checkpointing.
        isolated: every layer gets fresh ``cu_seqlens`` objects (:class:`~fla_ac_isolation.LayerLocalSeqlens`).
        cache_disabled: FLA's tensor cache is disabled process-wide while the step runs.
        role: ``"reference"``, ``"required"`` or ``"unsafe"`` (:data:`ROLES`).
        field: layers build FLA's CP context from the shared ``cu_seqlens`` (:class:`FieldCPSeqlens`); CP only.
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
        """The ``seqlens`` class of this mode without CP.

        Raises:
            ValueError: for ``field``, which exists only under CP.
        """
        if self.field:
            raise ValueError(
                f"mode {self.name!r} builds FLA's CP context inside each layer: it is meaningful only under context "
                "parallelism (cp=CPConfig(group=...))"
            )
        return LayerLocalSeqlens if self.isolated else SharedSeqlens

    @property
    def cp_seqlens_class(self) -> type[CPSeqlens]:
        """The ``seqlens`` class of this mode under CP."""
        if self.field:
            return FieldCPSeqlens
        return CPSeqlens if self.isolated else SharedCPSeqlens

    def seqlens(self, cu_seqlens: torch.Tensor, *, cp: CPConfig | None = None, **kwargs: Any) -> PackedSeqlens:
        """This mode's ``seqlens`` for ``cu_seqlens`` (keywords of :class:`~fla_ac_isolation.LayerLocalSeqlens`), or
        with ``cp`` the whole batch's under CP. ``ValueError`` for ``field`` without ``cp``."""
        if cp is not None:
            return self.cp_seqlens_class(cu_seqlens, cp=cp, **kwargs)
        return self.seqlens_class(cu_seqlens, **kwargs)

    def from_seq_lens(
        self, seq_lens: Sequence[int], device: torch.device | str | None = None, *, cp: CPConfig | None = None,
        **kwargs: Any,
    ) -> PackedSeqlens:
        """This mode's ``seqlens`` for document lengths (with ``cp``: the whole batch's, under CP)."""
        if cp is not None:
            return self.cp_seqlens_class.from_seq_lens(seq_lens, device, cp=cp, **kwargs)
        return self.seqlens_class.from_seq_lens(seq_lens, device, **kwargs)

    def cache_context(self) -> contextlib.AbstractContextManager:
        """``tensor_cache_disabled()`` for ``global-disable``, else a no-op context."""
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
