"""The base of every drop-in mixer (:class:`DropIn`): a subclass of the class it replaces (transformers',
OLMo-core's or flash-linear-attention's) that takes over one path, the packed training forward, and leaves every
other to the replaced class: construction and initialisation (``_init_weights`` knows it), parameters and
``state_dict``, cached prefill and decoding, whatever the next release of that class adds.

Its forward reads the call as the replaced class declares it (the cache argument by its name there: ``cache``,
``cache_params`` or ``past_key_values``), then:

* no cache, packed or not: our path (:meth:`DropIn.packed_forward`), with this call's own offsets
  (:func:`~fla_ac_isolation.mixers.offsets_keywords.resolve_offsets`, then ``.local()``);
* a cache, unpacked: the replaced class's forward, unchanged (FLA's recurrent kernels on CUDA through transformers,
  its torch path on a CPU);
* a cache and packed offsets: our path; the cache is not written (one recurrent state per document has no decoding
  to continue), with a :class:`PackedCacheWarning`.
"""

from __future__ import annotations

import inspect
import warnings
from typing import Any, ClassVar

import torch
from torch import nn

from fla_ac_isolation.local_seqlens import LocalSeqlens, PackedSeqlens
from fla_ac_isolation.mixers.offsets_keywords import COMPANIONS, SOURCES, resolve_offsets
from fla_ac_isolation.ops.backend import check_backend, check_saveable

__all__ = ["CACHE_NAMES", "DropIn", "PackedCacheWarning"]

CACHE_NAMES: tuple[str, ...] = ("cache", "cache_params", "past_key_values")
"""The names a replaced class gives its cache argument (transformers 5.24+, 5.23, flash-linear-attention)."""


class PackedCacheWarning(UserWarning):
    """A packed batch came with a cache: the mixer computes per document and leaves the cache unwritten."""


class DropIn(nn.Module):
    """Mixin base of the drop-in mixers; a concrete drop-in is ``class X(<path>, <replaced class>)``.

    Construct it as the replaced class (same arguments) plus ``backend`` and ``saveable``; or let
    :func:`~fla_ac_isolation.swap_mixers` turn an existing module into it (:meth:`adopt`).

    Args:
        backend: ``"auto"`` (FLA's kernels for CUDA inputs, the pure-torch reference elsewhere), ``"fla"`` or
            ``"reference"``: the ops of our path.
        saveable: run our path's ops as custom operators a SAC policy can save
            (:func:`fla_ac_isolation.policies.save_fla_ops`).

    Raises:
        ValueError: an unknown ``backend``; what the replaced class raises for its arguments.
        TypeError: ``saveable`` not a bool.
        NotImplementedError: ``saveable=True`` where the path has no saveable operators.
    """

    replaced: ClassVar[type[nn.Module]]
    """The class this drop-in replaces (set on each concrete class)."""

    saveable_ops: ClassVar[bool] = True
    """Our path's ops exist as saveable custom operators."""

    backend: str
    saveable: bool

    def __init__(self, *args: Any, backend: str = "auto", saveable: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._configure(backend, saveable)

    def _configure(self, backend: str, saveable: bool) -> None:
        backend, saveable = check_backend(backend), check_saveable(saveable)
        if saveable and not self.saveable_ops:
            raise NotImplementedError(
                f"saveable=True is not implemented for {type(self).__name__}: its ops are not wrapped as custom "
                "operators here; use saveable=False (the mixer still isolates its offsets)")
        self.check_supported()
        self.backend, self.saveable = backend, saveable

    def check_supported(self) -> None:
        """Raise for a configuration of the replaced class our path does not compute (default: none)."""

    # --------------------------------------------------------------------------------------- swap in and out
    @classmethod
    def adopt(cls, module: nn.Module, backend: str = "auto", saveable: bool = False) -> None:
        """Turn ``module``, an instance of exactly :attr:`replaced`, into this drop-in in place (its class changes;
        its tensors, submodules and attributes stay).

        Raises:
            TypeError: ``module`` is not exactly a :attr:`replaced`.
            ValueError, NotImplementedError: as the constructor (``module`` is then unchanged).
        """
        if type(module) is not cls.replaced:
            raise TypeError(f"{cls.__name__} adopts a {cls.replaced.__qualname__}, got {type(module).__qualname__}")
        module.__class__ = cls
        try:
            module._configure(backend, saveable)
        except Exception:
            module.__class__ = cls.replaced
            raise

    def release(self) -> nn.Module:
        """Turn this module back into :attr:`replaced` in place; returns it."""
        for name in ("backend", "saveable"):
            self.__dict__.pop(name, None)
        self.__class__ = self.replaced
        return self

    # ------------------------------------------------------------------------------------------------ forward
    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        """The replaced class's call convention and return value; packed offsets as keywords (:data:`SOURCES`), or a
        :class:`~fla_ac_isolation.PackedSeqlens` as the second positional argument (``mixer(h, seqlens)``)."""
        if args and isinstance(args[0], PackedSeqlens):
            if kwargs.get("seqlens") is not None:
                raise TypeError(f"{type(self).__name__} got seqlens both positionally and as a keyword")
            args, kwargs = args[1:], {**kwargs, "seqlens": args[0]}
        bound = _bind(self.replaced, self, hidden_states, args, kwargs)
        cache_name = next((n for n in CACHE_NAMES
                           if bound.get(n) is not None or bound["kwargs"].get(n) is not None), None)
        where = type(self).__name__
        check_hidden_states(hidden_states, self)
        seqlens = resolve_offsets(bound.get("kwargs", {}) | _named_sources(bound), hidden_states, where)
        if cache_name is not None and seqlens is None and not self.packed_only(bound):
            upstream = {k: v for k, v in kwargs.items() if k not in ("seqlens", "cu_seqlens", "cu_seqlens_cpu")}
            return super().forward(hidden_states, *args, **upstream)
        if cache_name is not None:
            warnings.warn(f"{where}: a packed batch came with a cache ({cache_name}); this mixer computes per "
                          "document and does not write the cache, but the model's attention layers may mix the "
                          "documents: pass use_cache=False when training on packed batches", PackedCacheWarning,
                          stacklevel=2)
        local = seqlens.local() if seqlens is not None else None
        if local is None:
            check_unpacked(hidden_states)
        out = self.packed_forward(hidden_states, local, bound.get("attention_mask"), seqlens)
        return self.wrap_output(out, bound)

    def packed_only(self, bound: dict[str, Any]) -> bool:
        """Whether a call with a cache must take our path anyway (default: never)."""
        return False

    def packed_forward(self, hidden_states: torch.Tensor, local: LocalSeqlens | None,
                       attention_mask: torch.Tensor | None, seqlens: PackedSeqlens | None) -> torch.Tensor:
        """Our path: ``[B, T, D]`` -> ``[B, T, D]`` with this call's offsets (``None``: one document per row)."""
        raise NotImplementedError

    def wrap_output(self, out: torch.Tensor, bound: dict[str, Any]) -> Any:
        """``out`` as the replaced class returns its output (default: the tensor itself)."""
        return out

    def extra_repr(self) -> str:
        return f"backend={self.backend!r}" + (", saveable=True" if self.saveable else "")


def _bind(replaced: type, module: nn.Module, hidden_states: torch.Tensor, args: tuple, kwargs: dict) -> dict:
    """The call's arguments by the replaced forward's parameter names (its ``**kwargs`` under ``"kwargs"``).

    The ``Signature`` is built here from cached parameters: a cached one's ``parameters`` mapping proxy, read while
    ``torch.compile(fullgraph=True)`` traces a forward whose caller popped a keyword, breaks the graph."""
    params, var_kw = _parameters(replaced)
    signature = inspect.Signature(params, __validate_parameters__=False)
    try:
        bound = signature.bind(module, hidden_states, *args, **kwargs)
    except TypeError as err:
        raise TypeError(f"{type(module).__name__}: {err} (the call convention of "
                        f"{replaced.__module__}.{replaced.__qualname__}.forward)") from None
    out = dict(bound.arguments)
    out.pop("self", None)
    out["kwargs"] = dict(out.pop(var_kw, {}))
    return out


_PARAMETERS: dict[type, tuple[tuple[inspect.Parameter, ...], str]] = {}


def _parameters(replaced: type) -> tuple[tuple[inspect.Parameter, ...], str]:
    """The replaced forward's parameters (a ``**kwargs`` added where it has none) and its ``**`` parameter's name."""
    if replaced not in _PARAMETERS:
        params = list(inspect.signature(replaced.forward).parameters.values())
        if not any(p.kind is p.VAR_KEYWORD for p in params):  # our offsets keywords must bind somewhere
            params.append(inspect.Parameter("kwargs", inspect.Parameter.VAR_KEYWORD))
        var_kw = next(p.name for p in params if p.kind is p.VAR_KEYWORD)
        _PARAMETERS[replaced] = (tuple(params), var_kw)
    return _PARAMETERS[replaced]


def _named_sources(bound: dict) -> dict:
    """Offsets keywords the replaced forward names itself (OLMo-core's ``cu_doc_lens``, FLA's ``cu_seqlens``)."""
    return {k: v for k, v in bound.items() if k in SOURCES or k in COMPANIONS}


def check_hidden_states(hidden_states: Any, module: nn.Module) -> None:
    """``hidden_states`` is a floating ``[B, T, D]`` tensor (``D`` the module's ``hidden_size``) of ``module``'s
    weights' dtype (or under autocast).

    Raises:
        TypeError: not a tensor, not floating point, or another dtype than the weights outside autocast.
        ValueError: not 3-D, or another ``D``.
    """
    if not isinstance(hidden_states, torch.Tensor):
        raise TypeError(f"hidden_states must be a torch.Tensor, got {type(hidden_states).__name__}")
    if not hidden_states.is_floating_point():
        raise TypeError(f"hidden_states must be a floating-point tensor, got dtype {hidden_states.dtype}")
    width = getattr(module, "hidden_size", None) or getattr(module, "d_model", None)  # OLMo-core: d_model
    if hidden_states.dim() != 3 or (isinstance(width, int) and hidden_states.shape[-1] != width):
        raise ValueError(f"hidden_states must be [B, T, hidden_size={width}], got shape {tuple(hidden_states.shape)}")
    weight = next((p for p in module.parameters() if p.is_floating_point() and p.dim() == 2), None)
    if weight is not None and hidden_states.dtype != weight.dtype and not torch.is_autocast_enabled(
            hidden_states.device.type):
        raise TypeError(
            f"hidden_states has dtype {hidden_states.dtype} but this mixer's weights are {weight.dtype}: cast one to "
            "the other (hidden_states.to(dtype) or mixer.to(dtype)) or run under torch.autocast")


def check_unpacked(hidden_states: torch.Tensor) -> None:
    """Refuse ``T == 0`` without offsets."""
    if hidden_states.shape[1] == 0:
        raise ValueError(
            f"hidden_states has no tokens (shape {tuple(hidden_states.shape)}) and no offsets: an unpacked batch "
            "needs T >= 1 (packed, pass seqlens= describing zero-length documents)")


def apply_padding_mask(hidden_states: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
    """Zero padded positions of a 2-D ``[B, T]`` mask (1 = token), as transformers does; ``None`` passes.

    Raises:
        ValueError: ``attention_mask`` is not ``None`` nor a ``[B, T]`` mask matching ``hidden_states``.
    """
    if attention_mask is None:
        return hidden_states
    if attention_mask.dim() != 2 or tuple(attention_mask.shape) != tuple(hidden_states.shape[:2]):
        raise ValueError(
            "attention_mask must be None or a 2-D [B, T] padding mask matching hidden_states "
            f"{tuple(hidden_states.shape[:2])}, got shape {tuple(attention_mask.shape)}")
    return (hidden_states * attention_mask[:, :, None]).to(hidden_states.dtype)
