"""The 0.3 names that moved from ``families`` to ``foreign_classes`` still import from ``families``, with a warning."""

import importlib

import pytest

from fla_ac_isolation import families, foreign_classes

MOVED = ("FLA_BACKED_MIXERS", "FLA_LAYER_MODULES", "LEAKING_MIXERS", "PackageLeak", "fla_layer_mixer", "foreign_mixer")
IMPORTED = ("ForeignClass", "LeakingMixer", "UpstreamMixer")  # families imports these itself: no warning


@pytest.mark.parametrize("name", IMPORTED)
def test_a_name_families_imports_is_foreign_classes_own(name):
    assert getattr(families, name) is getattr(foreign_classes, name)


@pytest.mark.parametrize("name", MOVED)
def test_a_moved_name_is_the_same_object_and_warns(name):
    with pytest.warns(DeprecationWarning) as caught:
        value = getattr(importlib.import_module("fla_ac_isolation.families"), name)
    assert value is getattr(foreign_classes, name)
    assert [str(w.message) for w in caught] == [
        f"fla_ac_isolation.families.{name} is deprecated (its 0.3 place): import it from fla_ac_isolation.foreign_classes"
    ]


def test_an_unknown_name_is_still_an_attribute_error():
    with pytest.raises(AttributeError, match="has no attribute 'no_such_name'"):
        families.no_such_name  # noqa: B018


# 0.3's methods LeakingMixer.remedy() / UpstreamMixer.leak_remedy() became families.remedy / leak_remedy in 0.4
def _entry(qualified):
    return foreign_classes.named(qualified)


@pytest.mark.parametrize(("method", "function", "qualified", "expected"), [
    ("remedy", "remedy", "olmo_core.nn.attention.recurrent.NemotronMamba2Mixer",
     "use swap_mixers(model) (drop-in fla_ac_isolation.mixers.OlmoNemotronMamba2Mixer)"),
    ("leak_remedy", "leak_remedy", "transformers.models.qwen3_next.modeling_qwen3_next.Qwen3NextGatedDeltaNet",
     "use swap_mixers(model) (drop-in fla_ac_isolation.mixers.Qwen3NextGatedDeltaNet)"),
    ("leak_remedy", "leak_remedy", "torchtitan.models.qwen3_5.model.GatedDeltaNet", None),
])
def test_a_03_method_warns_naming_the_function_and_answers_as_it(method, function, qualified, expected):
    entry = _entry(qualified)
    cls = type(entry).__name__
    with pytest.warns(DeprecationWarning) as caught:
        value = getattr(entry, method)()
    assert [str(w.message) for w in caught] == [
        f"{cls}.{method}() is deprecated since 0.4.0: call fla_ac_isolation.families.{function}(entry)"]
    assert caught[0].filename == __file__  # stacklevel: the caller's line
    assert value == getattr(families, function)(entry) == expected
