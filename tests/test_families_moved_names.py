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
