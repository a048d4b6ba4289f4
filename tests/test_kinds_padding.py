"""Padding content changes nothing, in every kind: NaN, infinities and huge values in padded
keys, values or both (for a mixer or an FFN kind, in its input) change no real output, no
auxiliary output and no gradient at a real position (for attention, none of its own
parameters' gradients either). Each kind is one compiled program, at XLA's backend
optimisation level 0."""

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.fast_jit import jit0
from tests.test_kinds import ALL
from tests.tolerances import EXACT_GRAD, assert_close
from xformers_jax import nn


B, L, DIM, HEADS, HIDDEN, VOCAB = 2, 16, 16, 2, 32, 20
REAL = (11, 13)  # real tokens of the two batch rows in the padding checks
_SPECS = {"attention": ("spec", nn.AttentionSpec), "mixer": ("mixer", nn.MixerSpec),
          "ffn": ("ffn", nn.FFNSpec)}

# Padding content: each case puts one value in the padded positions of the keys, the values or
# both (for a mixer or an FFN kind, of its input); the reference has finite junk there.
POISONS = [("keys", np.nan), ("values", np.nan), ("values", np.inf), ("keys", -np.inf),
           ("values", 1e38), ("both", np.nan), ("both", np.inf)]
_MASK = jnp.arange(L)[None] < jnp.asarray(REAL)[:, None]


def _attend(mha, q, k, v, x, params):
    """The kind's ``attend`` as ``nn.MultiHeadAttention`` calls it (non-causal self attention
    over ``_MASK``) on heads ``q, k, v [B, L, H, D]`` and the block input ``x [B, L, DIM]``
    (for the kinds that take it)."""
    extra = {}
    if mha.carries_between_layers:
        extra["carry"] = mha.init_layer_carry(B, L, 1)
    if mha.adapter.takes_input:
        extra["inputs"] = x
    if mha.state_index is not None:
        extra.update(state=mha.adapter.state(jax.random.PRNGKey(7), mha.spec.resolved,
                                             num_heads=HEADS, head_dim=DIM // HEADS),
                     inference=True)
    out = mha.adapter.attend(q, k, v, params, causal=False, kv_mask=_MASK, q_mask=_MASK,
                             bias=None, key=jax.random.PRNGKey(5), **extra,
                             **mha._call_hyperparameters())
    return out[0] if mha.state_index is not None or mha.carries_between_layers else out


@functools.cache
def _padding_program(slot, name, hp=()):
    """``(inputs, run)``: the kind's inputs with finite junk at padded positions, and
    ``run(inputs) -> (outputs, gradients)`` compiled once: the outputs zeroed at padded
    positions (and an FFN kind's aux outputs), and the gradients of a fixed projection of the
    real outputs with respect to every input and the kind's own parameters."""
    rng = np.random.default_rng(6)
    normal = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)
    key = jax.random.PRNGKey(4)
    if slot == "attention":
        spec = nn.AttentionSpec(name, nn.get_kind(slot, name).test_hyperparameters)
        make = lambda k: nn.MultiHeadAttention(DIM, HEADS, spec=spec, max_len=L, key=k)
        inputs = [normal(B, L, HEADS, DIM // HEADS) for _ in range(3)] + [normal(B, L, DIM)]
        own_of = lambda layer: layer.params  # fixed buffers unwrapped, as the layer passes them

        def apply(layer, inputs, own):
            q, k, v, x = inputs
            return _attend(layer, q, k, v, x, own), {}
    else:
        spec = _SPECS[slot][1](name, {**dict(nn.get_kind(slot, name).test_hyperparameters),
                                      **dict(hp)})
        if slot == "mixer":
            make = lambda k: nn._mixer.make_mixer(spec, DIM, HEADS, causal=False, max_len=L,
                                                  key=k)
        else:
            make = lambda k: spec.build(DIM, HIDDEN, key=k)
        inputs = [normal(B, L, DIM)]
        tokens = jax.random.randint(key, (B, L), 1, VOCAB)
        own_of = lambda layer: layer

        def apply(layer, inputs, own):
            if slot == "mixer":
                return own(inputs[0], kv_mask=_MASK), {}
            return nn._ffns.call_ffn(own, inputs[0], mask=_MASK, tokens=tokens, inference=True)

    cotangent = normal(B, L, DIM)

    def run(inputs):  # the layer is built inside the one compiled program
        layer = make(key)
        params, static = eqx.partition(own_of(layer), eqx.is_inexact_array)

        def loss(inputs, params):
            out, aux = apply(layer, inputs, eqx.combine(params, static))
            real = jnp.where(_MASK.reshape(B, L, *[1] * (out.ndim - 2)), out, 0)
            return (jnp.sum(real.reshape(B, L, -1) * cotangent[..., : real[0, 0].size]),
                    (real, aux))

        return jax.grad(loss, argnums=(0, 1), has_aux=True)(inputs, params)[::-1]

    junk = [jnp.where(_MASK.reshape(B, L, *[1] * (x.ndim - 2)), x, 30 * normal(*x.shape))
            for x in inputs]
    return junk, jit0(run)


def _poison(slot, inputs, where, value):
    """``inputs`` with ``value`` at the padded positions of the keys, values or both."""
    names = {"keys": (1,), "values": (2,), "both": (1, 2, 3)}[where] if slot == "attention" \
        else (0,)
    return [jnp.where(_MASK.reshape(B, L, *[1] * (x.ndim - 2)), x, jnp.asarray(value, x.dtype))
            if i in names else x for i, x in enumerate(inputs)]


# Beside every kind at its test hyperparameters: a recurrence's short convolution on q, k and
# v, whose taps would carry a padded input into the next real positions.
PADDED = [pytest.param(s, n, (), id=f"{s}-{n}") for s, n in ALL] + [
    pytest.param("mixer", "gated_deltanet", (("short_conv", 4),),
                 id="mixer-gated_deltanet-short_conv=4")]


@pytest.mark.parametrize("slot,name,hp", PADDED)
def test_padding_content_changes_nothing_nan_and_inf_included(slot, name, hp):
    junk, run = _padding_program(slot, name, hp)
    (ref, ref_aux), ref_grads = run(junk)
    for where, value in POISONS if slot == "attention" else POISONS[::2]:
        what = f"{slot} kind {name!r}: {value} in the padded {where}"
        (out, aux), grads = run(_poison(slot, junk, where, value))
        assert_close(out, ref, err_msg=f"{what} changed a real output")
        assert_close(aux, ref_aux, err_msg=f"{what} changed an auxiliary output")
        (g_in, g_own), (r_in, r_own) = grads, ref_grads
        for g, r in zip(g_in, r_in):
            m = _MASK.reshape(B, L, *[1] * (g.ndim - 2))
            assert_close(jnp.where(m, g, 0), jnp.where(m, r, 0), EXACT_GRAD,
                         err_msg=f"{what} changed a gradient at a real position")
        if slot == "attention":  # a layer's input projections see its padded input itself
            assert_close(g_own, r_own, EXACT_GRAD,
                         err_msg=f"{what} changed a parameter's gradient")
