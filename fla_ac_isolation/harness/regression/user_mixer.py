"""A user's own mixer class in the tiny decoders' linear-attention slots (``RegressionSpec(mixer=...)``).

The contract a mixer class meets (the one this package's drop-ins meet, e.g.
:class:`fla_ac_isolation.mixers.Qwen3_5MoeGatedDeltaNet`):

* **Constructor** ``cls(config, layer_idx)``: ``config`` is the family's transformers text config at the tiny
  decoder's sizes (for ``qwen3_5_moe`` a ``Qwen3_5MoeTextConfig`` carrying ``hidden_size`` ``D``,
  ``linear_num_key_heads``, ``linear_num_value_heads``, ``linear_key_head_dim``, ``linear_value_head_dim``,
  ``linear_conv_kernel_dim``, ``rms_norm_eps``, ``layer_types``; for ``nemotron_h`` a ``NemotronHConfig`` with
  its Mamba2 fields), ``layer_idx`` the block's index. It is built on the CPU in float32 from a seeded global
  RNG (identical on every rank and in every mode), then moved to the run's device and dtype.
* **Forward** ``mixer(hidden_states, seqlens) -> [1, T, D]``: ``hidden_states [1, T, D]`` (packed, the run's
  dtype) and ``seqlens``, ONE :class:`~fla_ac_isolation.LayerLocalSeqlens` for the whole model forward (the same
  object for every layer). The mixer calls ``seqlens.local()`` inside its own forward (so inside its
  checkpointed region) and hands FLA what that returns (:class:`~fla_ac_isolation.local_seqlens.LocalSeqlens`:
  ``cu_seqlens [N + 1]`` on the device, ``cu_seqlens_cpu``, ``max_seqlen``, ``chunk_indices``). The unsafe
  ``shared`` mode (and ``no-ac``, ``global-disable``) passes :class:`~fla_ac_isolation.harness.modes.SharedSeqlens`,
  whose ``.local()`` returns the same objects on every call: what a model that shares one ``cu_seqlens`` does.
* **Importable by module path**: the rank processes import the class again by ``"module:qualname"``, so it is
  defined at module level of a module on ``sys.path`` (a test module under pytest's default import mode is;
  one under ``--import-mode=importlib`` is not, nor a class defined inside a function).
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
        ValueError: ``mixer`` is neither a class nor a ``"module:qualname"`` string; a class defined inside a
            function (its qualname holds ``<locals>``: the rank processes cannot import it).
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
    """The class ``target`` (``"module:qualname"``) names, checked against the constructor contract.

    Raises:
        ValueError: naming ``mixer``: the module cannot be imported (with the hint that the rank processes
            import it by module path), has no such attribute, the attribute is not an ``nn.Module`` class, or its
            constructor cannot be called as ``cls(config, layer_idx)``.
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
