"""A user's own mixer class in the tiny decoders' linear-attention slots (``RegressionSpec(mixer=...)``).

Contract: built as ``cls(config, layer_idx)`` (the family's transformers text config at tiny sizes; on the CPU in
float32, then moved); called as ``mixer(hidden_states [1, T, D], seqlens) -> [1, T, D]`` with ONE ``seqlens`` for
every layer, on which it calls ``.local()`` inside its own forward; defined at module level of an importable
module (the rank processes import it by ``"module:qualname"``; not under pytest's ``--import-mode=importlib``).
"""

from __future__ import annotations

import importlib
import inspect

from torch import nn

from fla_ac_isolation.harness.failures import first_line

__all__ = ["load_mixer", "mixer_target"]


def mixer_target(mixer: object) -> str:
    """``"module:qualname"`` of a mixer class (or the same string, checked for its form).

    Raises:
        ValueError: ``mixer`` is neither a class nor a ``"module:qualname"`` string, or is a class defined
            inside a function.
    """
    if isinstance(mixer, type):
        target = f"{mixer.__module__}:{mixer.__qualname__}"
    elif isinstance(mixer, str):
        target = mixer
    else:
        raise ValueError(f"mixer must be a mixer class or 'module:qualname', got {type(mixer).__name__} {mixer!r}")
    module, sep, qualname = target.partition(":")
    if not sep or not module or not qualname or ":" in qualname:
        raise ValueError(f"mixer must be a mixer class or 'module:qualname', got {target!r}")
    if "<locals>" in qualname:
        raise ValueError(
            f"mixer {target!r} is defined inside a function: the rank processes import the mixer class by module "
            "path, so define it at module level"
        )
    return target


def load_mixer(target: str) -> type[nn.Module]:
    """The class ``target`` names, checked against the constructor contract.

    Raises:
        ValueError: the module cannot be imported, has no such attribute, it is not an ``nn.Module`` class, or
            it cannot be built as ``cls(config, layer_idx)``.
    """
    module_name, _, qualname = mixer_target(target).partition(":")
    try:
        obj = importlib.import_module(module_name)
    except Exception as err:
        raise ValueError(
            f"mixer {target!r}: importing {module_name} failed ({first_line(err)}); the rank processes import the "
            "mixer class by module path, so its module must be importable from sys.path (pytest's default import "
            "mode puts a test module's folder there; --import-mode=importlib does not)"
        ) from err
    for part in qualname.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"mixer {target!r}: {module_name} has no attribute {qualname!r}")
        obj = getattr(obj, part)
    if not (isinstance(obj, type) and issubclass(obj, nn.Module)):
        raise ValueError(f"mixer {target!r} must be an nn.Module class, got {type(obj).__name__}")
    try:
        inspect.signature(obj).bind(None, 0)
    except TypeError as err:
        raise ValueError(
            f"mixer {target!r} must be constructible as cls(config, layer_idx) (the family's transformers config, the "
            f"block index): {err}"
        ) from None
    except ValueError:  # no signature to read (a C type): the call itself will tell
        pass
    return obj
