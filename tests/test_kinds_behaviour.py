"""Every kind's record against its behaviour: a record that claims causal support gives the
logits of a prefix equal to those positions of a longer run, one that claims decoding
``prefill`` + ``decode_step`` equal to one forward call, and every kind keeps batch rows
independent (or says ``Kind.mixes_rows``); every stateless attention kind trains in the same
encoder and (where causal) the same language model: forward, gradient and jit, and no token
changes an earlier logit. Padding content is in ``test_kinds_padding.py``.

Compiling is the cost of these tests: each kind compiles one program per model, which returns
every quantity the checks of that model compare."""

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
# recommends for causal MoE; the recurrences' short convolution on q, k and v (one case per
# way a layer builds it: the shared projections, mLSTM's tuple state, DeltaProduct's own
# projections). A case is (slot, name, hyperparameters over the test ones).
CASES = [(s, n, ()) for s, n in ALL] + [
    ("ffn", "switch", (("capacity_factor", 1.0), ("mode", "capacity"))),
    ("ffn", "st_moe", (("mode", "capacity"), ("priority", "token"))),
    ("mixer", "gated_deltanet", (("short_conv", 4),)),
    ("mixer", "mlstm", (("short_conv", 3),)),
    ("mixer", "delta_product", (("short_conv", 4),))]
CAUSAL = [c for c in CASES if nn.get_kind(*c[:2]).causal]
DECODES = [c for c in CAUSAL if nn.get_kind(*c[:2]).decoding is not None]
# Hard-coded Gaussian attention (You et al., 2020) fixes its weights: no query in the path.
QUERY_FREE = {"hardcoded_gaussian"}


def _trains(slot, name, hp):
    """Whether the model programs of this case also compute a loss's gradient: every
    attention kind at its test hyperparameters, except those that keep ``eqx.nn.State``
    (covered by tests/test_nn_variants_extra.py)."""
    return (slot == "attention" and hp == ()
            and nn.get_kind(slot, name).adapter.state is None)


ATTENTION = [c for c in CASES if c[0] == "attention" and c[2] == ()]


def _cases(cases):
    return [pytest.param(*c, id="-".join([c[0], c[1]] + [f"{k}={v}" for k, v in c[2]]))
            for c in cases]


def _run(f, cls, slot, name, hp, *args, **kw):
    """``f(model, state)`` as NumPy arrays, for a one-layer ``cls`` with ``name`` in ``slot``
    at its test hyperparameters updated by ``hp`` (state is None unless the kind keeps
    ``eqx.nn.State``): the model is built inside the one compiled program that runs ``f``."""
    field, spec = _SPECS[slot]
    block = {field: spec(name, {**dict(nn.get_kind(slot, name).test_hyperparameters), **dict(hp)})}

    def make(key):
        m = functools.partial(cls, *args, DIM, 1, HEADS, HIDDEN, max_len=L, block=block,
                              key=key, **kw)
        if slot == "attention" and nn.get_kind(slot, name).adapter.state is not None:
            return eqx.nn.make_with_state(m)()
        return m(), None

    return jax.tree.map(np.asarray, jit0(lambda key: f(*make(key)))(jax.random.PRNGKey(1)))


def _call(model, state, tokens, mask=None):
    if state is None:
        return model(tokens, mask=mask)
    leaves, tree = jax.tree_util.tree_flatten(state)  # each call from its own copy
    return model(tokens, mask=mask, state=jax.tree_util.tree_unflatten(tree, leaves))[0]


_TOKENS = jax.random.randint(jax.random.PRNGKey(2), (B, L), 0, VOCAB)
# Row 0 replaced by other tokens: row 1's outputs must not move.
_OTHER_ROWS = _TOKENS.at[0].set(jax.random.randint(jax.random.PRNGKey(3), (L,), 0, VOCAB))
# The token in the middle changed: no earlier logit may move.
MIDDLE = L // 2
_CHANGED = _TOKENS.at[:, MIDDLE].set((_TOKENS[:, MIDDLE] + 1) % VOCAB)
# The encoder's second row padded (5 positions).
_PADDED = jnp.arange(L)[None] < jnp.array([[L], [L - 5]])


def _value_and_grad(model, loss):
    """``((loss(model), aux), gradient)`` with respect to the model's floating arrays."""
    params, static = eqx.partition(model, eqx.is_inexact_array)
    return jax.value_and_grad(lambda p: loss(eqx.combine(p, static)), has_aux=True)(params)


@functools.cache
def _causal_runs(slot, name, hp):
    """One compiled program per causal kind, in ``models.CausalLM``: ``{"full", "rows",
    "prefix", "decode"}`` logits (``decode``: the exception, if decoding cannot be traced)."""
    record = nn.get_kind(slot, name)

    def forward(m, s):
        if _trains(slot, name, hp):  # the full run differentiated
            def loss(m):
                logits = m(_TOKENS)
                return jnp.mean(jax.nn.logsumexp(logits, -1)), logits

            (loss, full), grads = _value_and_grad(m, loss)
            out = {"full": full, "loss": loss, "grads": grads, "changed": m(_CHANGED)}
        else:
            out = {"full": _call(m, s, _TOKENS)}
        out["rows"] = _call(m, s, _OTHER_ROWS)
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

    def run(f):
        return _run(f, models.CausalLM, slot, name, hp, VOCAB)

    if record.decoding is None:
        return run(forward)
    try:
        return run(lambda m, s: {**forward(m, s), "decode": decode(m)})
    except Exception as e:  # noqa: BLE001  reported by the decoding check alone
        return {**run(forward), "decode": e}


@functools.cache
def _encoder_runs(slot, name, hp):
    """One compiled program per kind in ``models.EncoderClassifier``: ``{"full", "rows"}``
    logits for a non-causal kind (a causal one's rows are checked in the language model),
    and for an attention kind ``"loss"``, ``"logits"`` and ``"grads"`` of a padded batch."""
    def run(m, s):
        out = {}
        if not nn.get_kind(slot, name).causal:
            out.update(full=_call(m, s, _TOKENS), rows=_call(m, s, _OTHER_ROWS))
        if _trains(slot, name, hp):
            def loss(m):
                logits = m(_TOKENS, mask=_PADDED)
                return jnp.mean(logits ** 2), logits

            (out["loss"], out["logits"]), out["grads"] = _value_and_grad(m, loss)
        return out

    return _run(run, models.EncoderClassifier, slot, name, hp, 3, pooling="mean",
                vocab_size=VOCAB)


def _finite_grads(grads):
    leaves = jax.tree_util.tree_leaves(grads)
    return leaves and all(np.isfinite(g).all() for g in leaves)


def _skip_stateful(slot, name, hp):
    if not _trains(slot, name, hp):
        pytest.skip(f"{name!r} keeps eqx.nn.State (models take and return `state`): covered by "
                    "tests/test_nn_variants_extra.py")


@pytest.mark.parametrize("slot,name,hp", _cases(ATTENTION))
def test_encoder_classifier_forward_grad_jit(slot, name, hp):
    _skip_stateful(slot, name, hp)
    runs = _encoder_runs(slot, name, hp)
    assert runs["logits"].shape == (B, 3)
    assert np.isfinite(runs["loss"]) and _finite_grads(runs["grads"])
    # The attention weights receive a gradient: the variant is actually in the path (its
    # values' projection for the kinds whose weights use no query).
    attn = runs["grads"].encoder.layers.layers.attn
    w = attn.wv if name in QUERY_FREE else attn.wq
    assert np.abs(w).sum() > 0


@pytest.mark.parametrize("slot,name,hp", _cases([c for c in ATTENTION if c in CAUSAL]))
def test_causal_lm_forward_grad_jit_no_leak(slot, name, hp):
    _skip_stateful(slot, name, hp)
    runs = _causal_runs(slot, name, hp)
    assert np.isfinite(runs["loss"]) and _finite_grads(runs["grads"])
    # Changing a token in the middle changes no earlier logit (every earlier position, not
    # only the last one's neighbours: a kind that pools or sorts over positions would leak here).
    a, b = runs["full"], runs["changed"]
    np.testing.assert_allclose(a[:, :MIDDLE], b[:, :MIDDLE], atol=1e-5)
    assert not np.allclose(a[:, MIDDLE], b[:, MIDDLE])


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
