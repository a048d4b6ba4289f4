"""Every kind's record against its behaviour: a record that claims causal support gives the
logits of a prefix equal to those positions of a longer run, one that claims decoding
``prefill`` + ``decode_step`` equal to one forward call, and every kind keeps batch rows
independent (or says ``Kind.mixes_rows``). Padding content is in ``test_kinds_padding.py``."""

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.fast_jit import jit0
from tests.test_kinds import ALL
from tests.tolerances import assert_close
from xformers_jax import models, nn


# -- the records against behaviour --------------------------------------------------------------
#
# A record that claims causal support must give the logits of a prefix equal to those positions
# of a longer run; one that claims decoding, ``prefill`` + ``decode_step`` equal to one forward
# call; every kind, outputs of one batch row independent of the others (a kind that couples the
# rows says so with ``Kind.mixes_rows``, and no such kind may claim causal support). Each
# kind is one compiled program per check family, at the test hyperparameters' size
# (L = max_len = 16), at XLA's backend optimisation level 0.

B, L, PREFIX, DIM, HEADS, HIDDEN, VOCAB = 2, 16, 11, 16, 2, 32, 20
_SPECS = {"attention": ("spec", nn.AttentionSpec), "mixer": ("mixer", nn.MixerSpec),
          "ffn": ("ffn", nn.FFNSpec)}
# Beside each kind at its test hyperparameters, the configurations of shared layers that claim
# more than the kind's defaults: capacity dispatch with token priority, which the library
# recommends for causal MoE. A case is (slot, name, hyperparameters over the test ones).
CASES = [(s, n, ()) for s, n in ALL] + [
    ("ffn", "switch", (("capacity_factor", 1.0), ("mode", "capacity"))),
    ("ffn", "st_moe", (("mode", "capacity"), ("priority", "token")))]
CAUSAL = [c for c in CASES if nn.get_kind(*c[:2]).causal]
DECODES = [c for c in CAUSAL if nn.get_kind(*c[:2]).decoding is not None]
def _cases(cases):
    return [pytest.param(*c, id="-".join([c[0], c[1]] + [f"{k}={v}" for k, v in c[2]]))
            for c in cases]


def _model(cls, slot, name, hp, *args, **kw):
    """``(model, state)``: a one-layer ``cls`` with ``name`` in ``slot`` at its test
    hyperparameters updated by ``hp`` (state is None unless the kind keeps ``eqx.nn.State``),
    initialised as one compiled program."""
    field, spec = _SPECS[slot]
    block = {field: spec(name, {**dict(nn.get_kind(slot, name).test_hyperparameters), **dict(hp)})}

    def make(key):
        m = functools.partial(cls, *args, DIM, 1, HEADS, HIDDEN, max_len=L, block=block,
                              key=key, **kw)
        if slot == "attention" and nn.get_kind(slot, name).adapter.state is not None:
            return eqx.nn.make_with_state(m)()
        return m(), None

    return jit0(make)(jax.random.PRNGKey(1))


def _call(model, state, tokens, mask=None):
    if state is None:
        return model(tokens, mask=mask)
    leaves, tree = jax.tree_util.tree_flatten(state)  # each call from its own copy
    return model(tokens, mask=mask, state=jax.tree_util.tree_unflatten(tree, leaves))[0]


_TOKENS = jax.random.randint(jax.random.PRNGKey(2), (B, L), 0, VOCAB)
# Row 0 replaced by other tokens: row 1's outputs must not move.
_OTHER_ROWS = _TOKENS.at[0].set(jax.random.randint(jax.random.PRNGKey(3), (L,), 0, VOCAB))


@functools.cache
def _causal_runs(slot, name, hp):
    """One compiled program per causal kind, in ``models.CausalLM``: ``{"full", "rows",
    "prefix", "decode"}`` logits (``decode``: the exception, if decoding cannot be traced)."""
    record = nn.get_kind(slot, name)
    model, state = _model(models.CausalLM, slot, name, hp, VOCAB)

    def forward(m, s):
        out = {"full": _call(m, s, _TOKENS), "rows": _call(m, s, _OTHER_ROWS)}
        if record.fixed_length:  # parameters sized by max_len: the prefix padded to it
            mask = jnp.broadcast_to(jnp.arange(L) < PREFIX, (B, L))
            out["prefix"] = _call(m, s, _TOKENS, mask)[:, :PREFIX]
        else:
            out["prefix"] = _call(m, s, _TOKENS[:, :PREFIX])
        return out

    def decode(m):  # prefill a prompt, then one decoding step per token
        logits, caches = m.prefill(_TOKENS[:, :PREFIX], m.init_cache(B, L))

        def step(caches, t):
            out, caches = m.decode_step(_TOKENS[:, t], caches, t)
            return caches, out

        _, rest = jax.lax.scan(step, caches, jnp.arange(PREFIX, L))
        return jnp.concatenate([logits, jnp.moveaxis(rest, 0, 1)], axis=1)

    if record.decoding is None:
        return jax.tree.map(np.asarray, jit0(forward)(model, state))
    try:
        out = jit0(lambda m, s: {**forward(m, s), "decode": decode(m)})(model, state)
    except Exception as e:  # noqa: BLE001  reported by the decoding check alone
        return {**jax.tree.map(np.asarray, jit0(forward)(model, state)), "decode": e}
    return jax.tree.map(np.asarray, out)


@functools.cache
def _encoder_runs(slot, name, hp):
    model, state = _model(models.EncoderClassifier, slot, name, hp, 3, pooling="mean",
                          vocab_size=VOCAB)
    return jax.tree.map(np.asarray, jit0(lambda m, s: {
        "full": _call(m, s, _TOKENS), "rows": _call(m, s, _OTHER_ROWS)})(model, state))


@pytest.mark.parametrize("slot,name,hp", _cases(CASES))
def test_rows_are_independent(slot, name, hp):
    kind = nn.get_kind(slot, name)
    if kind.mixes_rows:
        pytest.skip(f"{name} mixes batch rows by design (Kind.mixes_rows; refused in causal "
                    "models)")
    runs = _causal_runs(slot, name, hp) if kind.causal else _encoder_runs(slot, name, hp)
    assert not np.allclose(runs["rows"][0], runs["full"][0])
    assert_close(runs["rows"][1], runs["full"][1],
                 err_msg=f"{slot} kind {name!r}: changing batch row 0 changed row 1")


@pytest.mark.parametrize("slot,name,hp", _cases(CAUSAL))
def test_prefix_logits_equal_the_longer_run(slot, name, hp):
    runs = _causal_runs(slot, name, hp)
    assert_close(runs["prefix"], runs["full"][:, :PREFIX],
                 err_msg=f"{slot} kind {name!r}: the logits of a {PREFIX}-token prefix differ "
                         f"from those positions of a {L}-token run")


@pytest.mark.parametrize("slot,name,hp", _cases(DECODES))
def test_decoding_equals_the_forward_pass(slot, name, hp):
    runs = _causal_runs(slot, name, hp)
    if isinstance(runs["decode"], Exception):
        raise runs["decode"]
    assert_close(runs["decode"], runs["full"],
                 err_msg=f"{slot} kind {name!r}: prefill + decode_step differ from the forward "
                         "pass")
