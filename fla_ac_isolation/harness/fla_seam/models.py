"""flash-linear-attention's model zoo (``fla.models``, ``fla.layers``), for ``check --model <family>`` and ``doctor``.
FLA is imported on first call (which registers its configs with transformers' Auto classes)."""

from __future__ import annotations

import importlib
import inspect
import pathlib

from torch import nn

__all__ = ["fla_causal_lm_class", "fla_config_classes", "fla_layer_and_model_classes", "fla_layer_exports"]


def fla_config_classes() -> dict[str, type]:
    """``{model_type: config class}`` of every model ``fla.models`` exports.

    Raises:
        ImportError: flash-linear-attention is not installed.
    """
    models = importlib.import_module("fla.models")
    found = {}
    for name in getattr(models, "__all__", dir(models)):
        cls = getattr(models, name, None)
        model_type = getattr(cls, "model_type", None)
        if isinstance(cls, type) and name.endswith("Config") and isinstance(model_type, str) and model_type:
            found[model_type] = cls
    return found


def fla_causal_lm_class(config_class: type) -> type[nn.Module]:
    """The ``...ForCausalLM`` of ``fla.models`` that ``config_class`` configures.

    Raises:
        ValueError: ``fla.models`` has no causal LM for it.
    """
    models = importlib.import_module("fla.models")
    name = config_class.__name__.removesuffix("Config") + "ForCausalLM"
    cls = getattr(models, name, None)
    if cls is None:
        raise ValueError(f"fla.models has no {name} for {config_class.__name__}")
    return cls


def fla_layer_and_model_classes() -> list[type[nn.Module]]:
    """Every ``nn.Module`` class defined in ``fla.layers`` or ``fla.models.*.modeling_*``, in file order; a module
    that fails to import is skipped.

    Raises:
        ImportError: flash-linear-attention is not installed.
    """
    layers = importlib.import_module("fla.layers")
    models = importlib.import_module("fla.models")
    names = [f"fla.layers.{p.stem}" for p in sorted(pathlib.Path(layers.__file__).parent.glob("*.py"))
             if p.stem != "__init__"]
    names += [f"fla.models.{p.parent.name}.{p.stem}"
              for p in sorted(pathlib.Path(models.__file__).parent.glob("*/modeling_*.py"))]
    found = []
    for name in names:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        found += [c for _, c in inspect.getmembers(module, inspect.isclass)
                  if c.__module__ == name and issubclass(c, nn.Module)]
    return found


def fla_layer_exports() -> tuple[str, ...]:
    """The class names ``fla.layers`` exports (its ``__all__``).

    Raises:
        ImportError: flash-linear-attention is not installed.
    """
    return tuple(importlib.import_module("fla.layers").__all__)
