"""Every registered attention kind plugs into the same encoder and (where causal) the same
language model: forward, gradient and jit, parameterised over the one registry.

Each kind is compiled once per model, forward and gradient in one program, at the smallest size
that exercises it (one layer, width 16, two heads of width 8, L = 16). Compiling is the cost
of these tests, so the programs use XLA's backend optimisation level 0 (same numerics up to
rounding, well inside the tolerances)."""

import pathlib

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
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
# Hard-coded Gaussian attention (You et al., 2020) fixes its weights: no query in the path.
QUERY_FREE = {"hardcoded_gaussian"}


def _spec(kind):
    record = nn.get_kind("attention", kind)
    if record.missing():
        pytest.fail(f"registered kind {kind!r} has no test hyperparameters; declare a Kind record "
                    "beside its function")
    if record.adapter.state is not None:
        pytest.skip(f"{kind!r} keeps eqx.nn.State (models take and return `state`): covered by "
                    "tests/test_nn_variants_extra.py")
    return nn.AttentionSpec(kind, record.test_hyperparameters)


def _finite_grads(grads):
    leaves = jax.tree_util.tree_leaves(eqx.filter(grads, eqx.is_inexact_array))
    return leaves and all(bool(jnp.isfinite(g).all()) for g in leaves)


def _value_and_grad(loss, model):
    """``(loss(model) with aux, grads)`` as one program compiled at optimisation level 0."""
    params, static = eqx.partition(model, eqx.is_inexact_array)
    run = jax.jit(jax.value_and_grad(lambda p: loss(eqx.combine(p, static)), has_aux=True),
                  compiler_options={"xla_backend_optimization_level": 0})
    return run(params)


@pytest.mark.parametrize("kind", KINDS)
def test_encoder_classifier_forward_grad_jit(kind):
    key = jax.random.PRNGKey(0)
    model = models.EncoderClassifier(3, DIM, 1, HEADS, HIDDEN, pooling="mean", vocab_size=20,
                                 max_len=L, block=dict(spec=_spec(kind)), key=key)
    tokens = jax.random.randint(key, (2, L), 0, 20)
    mask = jnp.arange(L)[None] < jnp.array([[L], [L - 5]])

    def loss(m):
        logits = m(tokens, mask=mask)
        return jnp.mean(logits ** 2), logits

    (loss, logits), grads = _value_and_grad(loss, model)
    assert logits.shape == (2, 3)
    assert np.isfinite(float(loss)) and _finite_grads(grads)
    # The attention weights receive a gradient: the variant is actually in the path (its
    # values' projection for the kinds whose weights use no query).
    attn = grads.encoder.layers.layers.attn
    w = attn.wv if kind in QUERY_FREE else attn.wq
    assert float(jnp.abs(w).sum()) > 0


@pytest.mark.parametrize("kind", CAUSAL_KINDS)
def test_causal_lm_forward_grad_jit_no_leak(kind):
    key = jax.random.PRNGKey(1)
    model = models.CausalLM(20, DIM, 1, HEADS, HIDDEN, max_len=L, block=dict(spec=_spec(kind)),
                        key=key)
    tokens = jax.random.randint(key, (2, L), 0, 20)
    t = L // 2
    changed = tokens.at[:, t].set((tokens[:, t] + 1) % 20)

    def loss(m):
        logits = m(tokens)
        return jnp.mean(jax.nn.logsumexp(logits, -1)), (logits, m(changed))

    (loss, (a, b)), grads = _value_and_grad(loss, model)
    assert np.isfinite(float(loss)) and _finite_grads(grads)
    # Changing a token in the middle changes no earlier logit (every earlier position, not
    # only the last one's neighbours: a kind that pools or sorts over positions would leak here).
    np.testing.assert_allclose(np.asarray(a[:, :t]), np.asarray(b[:, :t]), atol=1e-5)
    assert not np.allclose(np.asarray(a[:, t]), np.asarray(b[:, t]))


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
