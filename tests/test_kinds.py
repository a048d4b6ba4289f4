"""The kind records (``xformers_jax.kinds.Kind``) and the one slot registry over them: every
registered kind declares every hyperparameter it accepts with a one-line doc and the default
its function, adapter or layer actually has (so the documentation cannot drift), its test
hyperparameters resolve, and specs of every slot check names the same way."""

import inspect

import jax
import pytest

from xformers_jax import nn
from xformers_jax.kinds import (
    REQUIRED,
    SLOTS,
    AttentionAdapter,
    Hyperparameter,
    Kind,
    KVDecoding,
    Paper,
)

ALL = [(slot, name) for slot in SLOTS for name in nn.registered_kinds(slot)
       if nn.get_kind(slot, name).missing() == ()]

# Kinds sharing one layer that give a hyperparameter a default of their own (the layer's
# keyword default is another kind's): GShard's top-2 with a random second expert, Switch's
# jitter, expert choice's capacity, prototyping's groups, aMLP's tiny attention on gMLP.
OWN_DEFAULTS = {("ffn", "switch", "jitter"), ("ffn", "gshard", "k"),
                ("ffn", "gshard", "second_policy"), ("ffn", "st_moe", "k"),
                ("ffn", "expert_choice", "capacity_factor"), ("ffn", "prototype", "groups"),
                ("mixer", "amlp", "attention_dim")}


def _callables(kind):
    """``(callable, is_the_layer)`` for the kind's function and everything of its adapter that
    receives hyperparameters, each with the functions it wraps (``lifted``'s ``__wrapped__``)."""
    found = [(kind.function, False)]
    a = kind.adapter
    if isinstance(a, AttentionAdapter):
        found += [(f, False) for f in (a.attend, a.init, a.state, a.layer_carry) if f]
        if a.decoding is not None:
            found += [(f, False) for f in vars(a.decoding).values() if callable(f)]
        if a.sequence is not None:
            found.append((a.sequence.attend, False))
    elif a is not None:
        found.append((a, True))
    out = []
    for f, is_layer in found:
        while f is not None:
            out.append((f, is_layer))
            f = getattr(f, "__wrapped__", None)
    return out


def _keyword_defaults(f):
    try:
        params = inspect.signature(f, follow_wrapped=False).parameters.values()
    except (TypeError, ValueError):
        return {}
    return {p.name: p.default for p in params if p.default is not inspect.Parameter.empty}


@pytest.mark.parametrize("slot,name", ALL)
def test_declared_defaults_are_the_signatures_defaults(slot, name):
    kind = nn.get_kind(slot, name)
    assert kind.adapter is not None, f"{slot} kind {name!r} has no adapter or layer"
    for hp_name, h in kind.hyperparameters.items():
        assert isinstance(h, Hyperparameter) and h.doc, (name, hp_name)
    own = set()
    for f, is_layer in _callables(kind):
        for hp_name, default in _keyword_defaults(f).items():
            if hp_name not in kind.hyperparameters:
                continue
            declared = kind.hyperparameters[hp_name].default
            if is_layer and (slot, name, hp_name) in OWN_DEFAULTS:
                assert declared != default, (f"{name}.{hp_name} is declared in OWN_DEFAULTS but "
                                             f"equals {getattr(f, '__name__', f)}'s default")
                own.add(hp_name)
                continue
            assert declared is not REQUIRED and declared == default, (
                f"{slot} kind {name!r}: {hp_name} is declared with default {declared!r} but "
                f"{getattr(f, '__qualname__', f)} has {default!r}")
    assert own == {n for s, k, n in OWN_DEFAULTS if (s, k) == (slot, name)}


@pytest.mark.parametrize("slot,name", ALL)
def test_test_hyperparameters_resolve(slot, name):
    kind = nn.get_kind(slot, name)
    resolved = kind.resolve(kind.test_hyperparameters)
    assert set(resolved) == set(kind.hyperparameters)
    assert resolved == {**{n: h.default for n, h in kind.hyperparameters.items()},
                        **dict(kind.test_hyperparameters)}


def test_resolve_fills_defaults_and_names_what_is_wrong():
    nystrom = nn.get_kind("attention", "nystrom")
    assert nystrom.resolve({"num_landmarks": 8}) == {"num_landmarks": 8, "kernel_size": 33,
                                                     "pinv_iterations": 6}
    with pytest.raises(ValueError, match=r"attention kind 'nystrom': missing required "
                                         r"hyperparameters: 'num_landmarks' \(landmarks m"):
        nystrom.resolve({})
    with pytest.raises(ValueError, match=r"unknown hyperparameters \['num_landmark'\]; it "
                                         r"accepts \['kernel_size', 'num_landmarks', "
                                         r"'pinv_iterations'\] \(did you mean "
                                         r"'num_landmarks' for 'num_landmark'\?\)"):
        nystrom.resolve({"num_landmark": 8})
    # A spec checks names when it is made, the required ones when a layer is built from it.
    spec = nn.AttentionSpec("nystrom", {})
    with pytest.raises(ValueError, match="missing required hyperparameters: 'num_landmarks'"):
        nn.MultiHeadAttention(16, 2, spec=spec, key=jax.random.PRNGKey(0))
    with pytest.raises(ValueError, match=r"FFN kind 'switch': unknown hyperparameters "
                                         r"\['num_expert'\].*did you mean 'num_experts'"):
        nn.FFNSpec("switch", {"num_expert": 4})
    with pytest.raises(ValueError, match=r"mixer 'mamba': unknown hyperparameters \['state'\]"):
        nn.MixerSpec("mamba", {"state": 4})


def test_the_declared_defaults_are_the_ones_in_effect():
    # The MoE kinds' own defaults reach the shared layer through the spec.
    gshard = nn.FFNSpec("gshard", {"num_experts": 4}).build(8, 16, key=jax.random.PRNGKey(0))
    switch = nn.FFNSpec("switch", {"num_experts": 4}).build(8, 16, key=jax.random.PRNGKey(0))
    assert (gshard.router, gshard.k, gshard.second_policy) == ("top_k", 2, "random")
    assert (switch.k, switch.jitter) == (1, 1e-2)
    hashed = nn.FFNSpec("hash", {"num_experts": 4}).build(8, 16, key=jax.random.PRNGKey(0))
    assert hashed.router == "hash"
    with pytest.raises(ValueError, match=r"unknown hyperparameters \['router'\]"):
        nn.FFNSpec("hash", {"router": "top_k"})
    # aMLP is gMLP with its declared attention width; the block's chunk_size reaches the
    # dense FFN unless its spec gives one.
    amlp = nn.MixerSpec("amlp").build(16, 2, causal=False, max_len=8, key=jax.random.PRNGKey(0))
    assert amlp.w_attn is not None and amlp.w_attn.shape[-1] == 3 * 64
    dense = nn.FFNSpec().build(8, 16, chunk_size=4, key=jax.random.PRNGKey(0))
    assert dense.chunk_size == 4
    assert nn.FFNSpec("dense", {"chunk_size": 2}).build(
        8, 16, chunk_size=4, key=jax.random.PRNGKey(0)).chunk_size == 2


def _kind(**fields):
    base = dict(name="toy", function=len, family="exact", paper=Paper("A", 2020, "T"),
                time="O(1)", memory="O(1)", causal=True)
    return Kind(**{**base, **fields})


def test_a_record_checks_itself():
    toy = _kind(hyperparameters={"width": (REQUIRED, "the width"), "depth": (2, "the depth")})
    assert toy.slot == "attention" and toy.missing() == ()
    assert toy.hyperparameters["width"].required and not toy.hyperparameters["depth"].required
    assert _kind(family="experts").slot == "ffn" and _kind(family="mixers").slot == "mixer"
    with pytest.raises(ValueError, match="family must be one of"):
        _kind(family="nope")
    with pytest.raises(ValueError, match="decoding must be one of"):
        _kind(family="experts", decoding="kv")
    with pytest.raises(ValueError, match="needs a one-line doc"):
        _kind(hyperparameters={"width": (1, "")})
    with pytest.raises(ValueError, match="its adapter decodes with 'kv' but the record declares"):
        _kind(adapter=AttentionAdapter(len, decoding=KVDecoding()))
    with pytest.raises(ValueError, match=r"init_only \['width'\] must be among"):
        _kind(adapter=AttentionAdapter(len, init_only={"width"}))
    with pytest.raises(ValueError, match="not both"):
        AttentionAdapter(len, state=len, layer_carry=len)
    with pytest.raises(ValueError, match=r"\['router'\] are fixed layer_arguments"):
        _kind(family="experts", hyperparameters={"router": ("a", "b")},
              layer_arguments={"router": "top_k"})
    assert _kind(paper=None).missing() == ("paper",)


def test_one_registry_for_every_slot():
    assert {"dot_product", "flash"} <= set(nn.registered_kinds("attention"))
    assert {"mamba2", "lsra"} <= set(nn.registered_kinds("mixer"))
    assert {"dense", "switch", "none"} <= set(nn.registered_kinds("ffn"))
    assert nn.get_kind("ffn", "switch").adapter is nn.MoEFeedForward
    assert nn.get_kind("mixer", "lsra").adapter is nn.LSRA
    assert nn.get_kind("ffn", "dense").adapter is nn.FeedForward
    with pytest.raises(ValueError, match="unknown slot 'nope'"):
        nn.registered_kinds("nope")
    with pytest.raises(ValueError, match="unknown FFN kind 'nope'"):
        nn.get_kind("ffn", "nope")
    with pytest.raises(ValueError, match="'switch' is already registered"):
        nn.register_kind(nn.get_kind("ffn", "switch"))
    with pytest.raises(ValueError, match="must be one registered mixer or FFN kind"):
        nn.implements("dot_product")(nn.FeedForward)
    with pytest.raises(TypeError, match="Spec names no slot"):
        nn.Spec("dense")


def test_no_kind_that_mixes_rows_claims_causal_support():
    for slot, name in ALL:
        kind = nn.get_kind(slot, name)
        assert not (kind.mixes_rows and kind.causal), (slot, name)
    with pytest.raises(ValueError, match="mixes batch rows, so it cannot claim causal"):
        _kind(family="experts", mixes_rows=True)
