"""The attention registry: specs from configs, complete records, the catalogue, explicit
registration, and non-causal kinds refused in a language model. Every registered kind in the
same encoder and (where causal) the same language model, forward, gradient and jit, is in
``test_kinds_behaviour.py``, whose programs per kind serve its other checks too."""

import pathlib

import jax
import pytest

import xformers_jax.models as models
import xformers_jax.nn as nn
from xformers_jax import attention
from xformers_jax.kinds import AttentionAdapter, Kind
from xformers_jax_experiments.catalogue import catalogue

L, DIM, HEADS, HIDDEN = 16, 16, 2, 32
# Each kind's tiny test hyperparameters (L = max_len = 16, head width 8) are declared with its
# metadata, beside its function (xformers_jax/attention/**/_kinds.py).
ROOT = pathlib.Path(__file__).resolve().parents[1]
KINDS = sorted(nn.registered_kinds("attention"))
CAUSAL_KINDS = [k for k in KINDS if nn.get_kind("attention", k).causal]


def _spec(kind):
    record = nn.get_kind("attention", kind)
    if record.missing():
        pytest.fail(f"registered kind {kind!r} has no test hyperparameters; declare a Kind record "
                    "beside its function")
    if record.adapter.state is not None:
        pytest.skip(f"{kind!r} keeps eqx.nn.State (models take and return `state`): covered by "
                    "tests/test_nn_variants_extra.py")
    return nn.AttentionSpec(kind, record.test_hyperparameters)


@pytest.mark.parametrize("kind", sorted(set(KINDS) - set(CAUSAL_KINDS)))
def test_non_causal_kinds_are_rejected_in_a_language_model(kind):
    with pytest.raises(NotImplementedError, match="does not support causal=True"):
        models.CausalLM(20, DIM, 1, HEADS, HIDDEN, max_len=L, block=dict(spec=_spec(kind)),
                    key=jax.random.PRNGKey(0))


def test_spec_from_config_and_errors():
    spec = nn.AttentionSpec.from_config({"kind": "local", "left": 4})
    assert spec == nn.AttentionSpec("local", {"left": 4}) and hash(spec) == hash(
        nn.AttentionSpec("local", {"left": 4}))
    with pytest.raises(ValueError, match="unknown attention kind 'nope'"):
        nn.AttentionSpec("nope")
    with pytest.raises(ValueError, match="missing 'kind'"):
        nn.AttentionSpec.from_config({"left": 4})
    with pytest.raises(ValueError, match=r"unknown hyperparameters \['window'\]"):
        nn.MultiHeadAttention(32, 4, spec=nn.AttentionSpec("local", {"window": 3}),
                              key=jax.random.PRNGKey(0))


def test_every_kind_has_complete_metadata_and_the_catalogue_is_current():
    # Every kind the library declares is registered from its record, and the record is complete
    # (a kind registered by a user, e.g. the LRA suite's floor, may have none).
    declared = {k.name: k for k in attention.KINDS}
    assert len(declared) == len(attention.KINDS)
    for name, kind in declared.items():
        assert kind.missing() == (), (name, kind.missing())
        assert nn.get_kind("attention", name) is kind
    library = [n for n in KINDS
               if nn.get_kind("attention", n).adapter.attend.__module__.startswith("xformers_jax")]
    assert set(library) == set(declared)
    with open(ROOT / "CATALOGUE.md") as f:
        assert f.read() == catalogue(), ("CATALOGUE.md is stale: run "
                                         "`python -m xformers_jax_experiments.catalogue`")


def test_registration_is_explicit():
    kind = nn.get_kind("attention", "local")
    with pytest.raises(ValueError, match="'local' is already registered"):
        nn.register_kind(kind)
    assert nn.register_kind(kind, replace=True) is kind
    with pytest.raises(TypeError, match="Kind is final"):
        type("Sub", (Kind,), {})
    with pytest.raises(TypeError, match="AttentionAdapter is final"):
        type("Sub", (AttentionAdapter,), {})
