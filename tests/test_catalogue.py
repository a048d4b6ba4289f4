"""xformers_jax_experiments.catalogue: one table row per registered kind of every slot of the
registry."""

import re

from xformers_jax import nn
from xformers_jax_experiments import catalogue as C


def _rows(text):
    return re.findall(r"^\| `([a-z0-9_]+)` \|", text, flags=re.MULTILINE)


def test_every_registered_kind_of_every_slot_has_one_row():
    text = C.catalogue()
    expected = []
    for title, _, slot, _ in C._SLOTS:
        kinds = C.slot_kinds(slot)
        assert f"## {title}" in text
        names = nn.registered_kinds(slot)
        # Every registered kind declares its metadata (a kind without it is not listed).
        assert [k.name for k in kinds] == [n for n in names
                                           if nn.get_kind(slot, n).missing() == ()]
        expected += [k.name for k in kinds]
    assert sorted(_rows(text)) == sorted(expected)
    assert "dot_product" in _rows(text)


def test_a_registry_nn_does_not_have_is_skipped(monkeypatch):
    monkeypatch.setattr(C, "_SLOTS", C._SLOTS[:1] + (
        ("Imaginary layers", "`nn.NoSpec`", "imaginary", ()),))
    text = C.catalogue()
    assert "Imaginary layers" not in text and "## Attention kinds" in text
