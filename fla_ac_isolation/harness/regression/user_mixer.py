"""A user's own mixer in the tiny decoders' linear-attention slots (``RegressionSpec(mixer=..., mixer_config=...)``).

Contract: a class built as ``cls(config, layer_idx)`` (``config``: the family's transformers text config at tiny
sizes, or ``mixer_config``), or a factory function built as ``factory(layer_idx)`` (it builds its own config); on
the CPU in float32, then moved. Called as ``mixer(hidden_states [1, T, D], seqlens) -> [1, T, D]`` with ONE
``seqlens`` for every layer, on which it calls ``.local()`` inside its own forward. Defined at module level: the
rank processes load it again by ``"module:qualname"`` or ``"path/to/file.py:qualname"`` (not under pytest's
``--import-mode=importlib``). :func:`check_fits` runs one forward before any rank starts, so widths that do not
fit the decoder are named at the boundary.
"""

from __future__ import annotations

import contextlib
import inspect
import pickle
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from fla_ac_isolation.harness.failures import first_line
from fla_ac_isolation.harness.user_code import callable_target, importable, is_file_target, load_module

__all__ = ["PROBE_SEQ_LENS", "MixerBuilder", "check_fits", "load_mixer", "mixer_builder", "mixer_target"]

PROBE_SEQ_LENS = (5, 11)
"""The packed documents of :func:`check_fits`' forward (16 tokens)."""

_EXPECTED = "a mixer class, a factory function (layer_idx) -> nn.Module, or 'module:qualname'"


def mixer_target(mixer: object) -> str:
    """``"module:qualname"`` (or ``"path/to/file.py:qualname"``) of a mixer class or factory, or the same string,
    checked for its form.

    Raises:
        ValueError: ``mixer`` is neither a class, a function nor a target string, or is defined inside a function.
    """
    if isinstance(mixer, type) or inspect.isfunction(mixer):
        target = callable_target(mixer)
    elif isinstance(mixer, str):
        target = mixer
    else:
        raise ValueError(f"mixer must be {_EXPECTED}, got {type(mixer).__name__} {mixer!r}")
    module, sep, qualname = target.partition(":")
    if not sep or not module or not qualname or ":" in qualname:
        raise ValueError(f"mixer must be {_EXPECTED}, got {target!r}")
    if "<locals>" in qualname or "<lambda>" in qualname:
        raise ValueError(
            f"mixer {target!r} is defined inside a function: the rank processes import the mixer (class or "
            "factory) by module path, so define it at module level"
        )
    return target


def load_mixer(target: str) -> Callable[..., nn.Module]:
    """The class or factory ``target`` names, checked against the constructor contract.

    Raises:
        ValueError: the module cannot be loaded, has no such attribute, it is neither an ``nn.Module`` class nor
            a function, or it cannot be called as ``cls(config, layer_idx)`` / ``factory(layer_idx)``.
    """
    module_name, _, qualname = mixer_target(target).partition(":")
    try:
        obj = load_module(module_name)
    except Exception as err:
        where = "its file must exist" if is_file_target(module_name) else "its module must be importable from sys.path"
        raise ValueError(
            f"mixer {target!r}: importing {module_name} failed ({first_line(err)}); the rank processes import the "
            f"mixer by module path, so {where} (pytest's default import mode puts a test module's folder there; "
            "--import-mode=importlib does not)"
        ) from err
    for part in qualname.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"mixer {target!r}: {module_name} has no attribute {qualname!r}")
        obj = getattr(obj, part)
    if isinstance(obj, type) and issubclass(obj, nn.Module):
        arguments, how = (None, 0), "cls(config, layer_idx) (the family's transformers config or mixer_config, "
    elif inspect.isfunction(obj):
        arguments, how = (0,), "factory(layer_idx) (a factory builds its own config; "
    else:
        raise ValueError(f"mixer {target!r} must be an nn.Module class or a factory function (layer_idx) -> "
                         f"nn.Module, got {type(obj).__name__}")
    try:
        inspect.signature(obj).bind(*arguments)
    except TypeError as err:
        raise ValueError(f"mixer {target!r} must be constructible as {how}the block index): {err}") from None
    except ValueError:  # no signature to read (a C type): the call itself will tell
        pass
    return obj


@dataclass(frozen=True)
class MixerBuilder:
    """How the linear-attention slots are built: ``builder(config, layer_idx) -> nn.Module``,
    ``cls(mixer_config or config, layer_idx)`` or ``factory(layer_idx)``. Make one with :func:`mixer_builder`.

    Raises:
        TypeError: (a call) the factory returned something else than an ``nn.Module``.
    """

    target: str
    make: Callable[..., Any]
    mixer_config: Any = None

    @property
    def how(self) -> str:
        """The call that builds layer 0's mixer, as messages show it."""
        if not isinstance(self.make, type):
            return "factory(0)"
        return "cls(config, 0)" if self.mixer_config is None else "cls(mixer_config, 0)"

    def __call__(self, config: Any, layer_idx: int) -> nn.Module:
        if not isinstance(self.make, type):
            mixer = self.make(layer_idx)
            if not isinstance(mixer, nn.Module):
                raise TypeError(f"factory({layer_idx}) returned {type(mixer).__name__}, not an nn.Module")
            return mixer
        return self.make(config if self.mixer_config is None else self.mixer_config, layer_idx)


def mixer_builder(target: str, mixer_config: Any = None) -> MixerBuilder:
    """The :class:`MixerBuilder` of ``target`` (:func:`load_mixer`) and ``mixer_config``.

    Raises:
        ValueError: (from :func:`load_mixer`) ``target`` cannot be loaded; ``mixer_config`` given with a factory,
            or one the rank processes cannot unpickle.
    """
    made = load_mixer(target)
    if mixer_config is not None:
        if not isinstance(made, type):
            raise ValueError(f"mixer_config is handed to a mixer class as cls(mixer_config, layer_idx); the factory "
                             f"{target!r} builds its own config: leave mixer_config out")
        _check_pickles(mixer_config)
    return MixerBuilder(target, made, mixer_config)


def _check_pickles(mixer_config: Any) -> None:
    cls = type(mixer_config)
    if not importable(cls.__module__):
        raise ValueError(f"mixer_config is a {cls.__qualname__} of a file loaded by path ({callable_target(cls)}), "
                         f"which the rank processes cannot unpickle by module name: give a types.SimpleNamespace or "
                         f"dict of its fields, a class of an importable module, or a factory (layer_idx) -> "
                         f"nn.Module")
    try:
        pickle.loads(pickle.dumps(mixer_config))
    except Exception as err:
        raise ValueError(f"mixer_config must pickle (it is sent to every rank process): {first_line(err)}") from None


def check_fits(build: MixerBuilder, config: Any, device: str) -> None:
    """Build one mixer (``layer_idx=0``, the global RNG left as it was) and run its forward once on
    ``hidden_states [1, 16, D]`` of two packed documents (:data:`PROBE_SEQ_LENS`) with one ``LayerLocalSeqlens``,
    without grad, on ``device`` in float32 (a CPU with FLA's kernels served by ``reference_kernels()``).
    ``D`` is ``config.hidden_size``, the tiny decoder's width.

    Raises:
        ValueError: naming the mixer and the decoder's width: ``mixer_config.hidden_size`` differs from it; the
            build or the forward raised (its first line); the forward returned something else than a tensor
            ``[1, 16, D]``.
    """
    from fla_ac_isolation.seqlens import LayerLocalSeqlens

    width, tokens = config.hidden_size, sum(PROBE_SEQ_LENS)
    head = f"mixer {build.target!r} in the tiny decoder (hidden_size {width})"
    given = getattr(build.mixer_config, "hidden_size", width)
    if given != width:
        raise ValueError(f"{head}: mixer_config.hidden_size is {given}; give RegressionSpec(hidden_size={given}) or "
                         f"a mixer_config of hidden_size {width}")
    call = f"its forward on hidden_states [1, {tokens}, {width}] with one LayerLocalSeqlens"
    with torch.random.fork_rng(devices=[]), torch.no_grad(), _serving(device):
        try:
            mixer = build(config, 0).to(device=device, dtype=torch.float32)
        except Exception as err:
            raise ValueError(f"{head}: building it as {build.how} raised {first_line(err)}") from err
        hidden = torch.randn(1, tokens, width, device=device)
        seqlens = LayerLocalSeqlens.from_seq_lens(list(PROBE_SEQ_LENS), device=device)
        try:
            out = mixer(hidden, seqlens)
        except Exception as err:
            raise ValueError(f"{head}: {call} raised {first_line(err)}") from err
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != (1, tokens, width):
        got = f"a tensor {list(out.shape)}" if isinstance(out, torch.Tensor) else type(out).__name__
        raise ValueError(f"{head}: {call} returned {got}; the decoder adds it to the residual stream: return a "
                         f"tensor [1, {tokens}, {width}]")


def _serving(device: str) -> Any:
    if device != "cpu":
        return contextlib.nullcontext()
    from fla_ac_isolation.harness.reference_kernels import reference_kernels

    return reference_kernels()
