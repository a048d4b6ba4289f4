"""Padding changes nothing: for every registered attention kind, padding content and padding
amount change no output at a real position and no gradient reaching a real token's parameters,
and (causal kinds) no token changes an earlier output.

Model level, over the one registry, inside ``models.EncoderClassifier`` with ``mask=``:

(a) junk tokens in the padded positions change no logit (nor the state update of a kind that
    keeps state);
(b) the same real tokens padded to another length (and put in another batch row) give the same
    logits (kinds whose parameters fix the length, ``Kind.fixed_length``, and that take no
    shorter sequence are tested at their length, with the rows swapped);
(c) changing a token in the middle of a causal language model changes no earlier logit: in
    ``test_kinds_behaviour.py::test_causal_lm_forward_grad_jit_no_leak``, which already compiles
    every stateless causal kind's ``models.CausalLM``, and here for the kinds that keep state.

Each kind is one compiled forward program, at XLA's backend optimisation level 0 as in
``test_kinds_behaviour.py``: where the logits are the same function of the parameters whatever the
padding, so are their gradients (compiling every kind's backward twice more would double this
file's time). Gradients are checked at the function level, for the kinds that compute
statistics over queries (clustered, improved clustered, Nystromformer, ProbSparse, routing,
Funnel): outputs and gradients at real positions are unchanged by junk and by the padded
length, padded positions get zero outputs and gradients, and each kind configured to be exact
equals dense attention on the real tokens.
"""

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import xformers_jax.attention as A
import xformers_jax.models as models
import xformers_jax.nn as nn
from tests.tolerances import EXACT, EXACT_GRAD, assert_close

DIM, HEADS, HIDDEN, VOCAB = 16, 2, 32, 20
SHORT, LONG = 16, 24        # the two padded lengths (test hyperparameters are sized for 16)
REAL = np.array([11, 13])   # real tokens of the two batch rows
KINDS = sorted(nn.registered_kinds("attention"))
CAUSAL_KINDS = [k for k in KINDS if nn.get_kind("attention", k).causal]
_LEVEL0 = {"xla_backend_optimization_level": 0}


def _spec(kind):
    record = nn.get_kind("attention", kind)
    if record.missing():
        pytest.fail(f"registered kind {kind!r} has no test hyperparameters; declare a Kind record "
                    "beside its function")
    return nn.AttentionSpec(kind, record.test_hyperparameters), record.fixed_length


def _build(cls, *args, kind, max_len, key, **kw):
    """``(model, state)``: a one-layer model of ``kind`` (state is None unless the kind keeps
    ``eqx.nn.State``, e.g. routing)."""
    spec, _ = _spec(kind)
    make = functools.partial(cls, *args, max_len=max_len, block=dict(spec=spec), key=key, **kw)
    if nn.get_kind("attention", kind).adapter.state is None:
        return make(), None
    return eqx.nn.make_with_state(make)()


def _padded(real_tokens, length, junk_seed):
    """``(tokens int[B, length], mask bool[B, length])``: each row's real tokens, then junk."""
    rng = np.random.default_rng(junk_seed)
    tokens = rng.integers(0, VOCAB, (len(REAL), length))
    mask = np.arange(length)[None] < REAL[:, None]
    tokens = np.where(mask, np.pad(real_tokens, ((0, 0), (0, length - real_tokens.shape[1]))),
                      tokens)
    return jnp.asarray(tokens, jnp.int32), jnp.asarray(mask)


def _close(a, b, err_msg, table=EXACT):
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
        assert_close(x, y, table, err_msg=err_msg)


def _encoder(kind):
    """``(model, state, lengths)``: the kind's encoder and the two padded lengths it is tested
    at. A kind whose parameters fix the length (``Kind.fixed_length``) is built for LONG and
    tested at SHORT and LONG when it takes both (Linformer's and the Synthesizer's parameters
    are cut to the length), else built and tested at SHORT only."""
    make = functools.partial(_build, models.EncoderClassifier, 3, DIM, 1, HEADS, HIDDEN,
                             pooling="mean", vocab_size=VOCAB, kind=kind,
                             key=jax.random.PRNGKey(0))

    def runs_at(length):  # traced abstractly: nothing is initialised or compiled
        tokens, mask = _padded(np.zeros((len(REAL), REAL.max()), int), length, 0)

        def call():
            model, state = make(max_len=LONG)
            return model(tokens, mask=mask) if state is None else model(tokens, mask=mask,
                                                                        state=state)
        try:
            jax.eval_shape(call)
        except ValueError:  # the shape check of a length-sized parameter
            return False
        return True

    if _spec(kind)[1] and not (runs_at(SHORT) and runs_at(LONG)):
        return (*make(max_len=SHORT), (SHORT, SHORT))
    return (*make(max_len=LONG), (SHORT, LONG))


@pytest.mark.parametrize("kind", KINDS)
def test_encoder_padding_content_and_amount_change_nothing(kind):
    model, state, (short, long) = _encoder(kind)
    real = np.random.default_rng(0).integers(0, VOCAB, (len(REAL), REAL.max()))
    # (a) as one batch: the two rows with one junk, then the same rows with another.
    junk = [jnp.concatenate(a) for a in zip(_padded(real, short, 1), _padded(real, short, 2))]
    # (b) at another length, with the batch rows swapped: an example's logits depend neither
    # on how much padding follows it nor on its row in the batch.
    longer = [a[::-1] for a in _padded(real, long, 3)]

    @functools.partial(jax.jit, compiler_options=_LEVEL0)
    def run(model, state):
        if state is None:
            return [(model(tokens, mask=mask), None) for tokens, mask in (junk, longer)]
        outs = []
        for tokens, mask in (junk, longer):  # each call from its own copy of the state
            leaves, tree = jax.tree_util.tree_flatten(state)
            outs.append(model(tokens, mask=mask, state=jax.tree_util.tree_unflatten(tree, leaves)))
        return outs

    (out, new), (out_b, new_b) = run(model, state)
    n = len(REAL)
    assert np.all(np.isfinite(np.asarray(out)))
    assert_close(out[n:], out[:n], EXACT, err_msg=f"{kind}: junk in the padding changed the logits")
    what = ("padding to another length (rows swapped)" if long > short else
            "swapping the batch rows (its parameters fix the length)")
    assert_close(out_b[::-1], out[:n], EXACT, err_msg=f"{kind}: {what} changed the logits")
    if new is not None:  # the variant's state update (routing's centroids) ignores padding too
        # The batch of (a) holds both junks, that of (b) one copy: the same mean update.
        _close(new_b, new, f"{kind}: padding changed the variant's state update")


@pytest.mark.parametrize("kind", [k for k in CAUSAL_KINDS
                                  if nn.get_kind("attention", k).adapter.state])
def test_stateful_causal_lm_middle_token_changes_no_earlier_logit(kind):
    # (c) for the kinds test_kinds_behaviour.py skips (they keep eqx.nn.State, e.g. routing).
    model, state = _build(models.CausalLM, VOCAB, DIM, 1, HEADS, HIDDEN, kind=kind, max_len=SHORT,
                          key=jax.random.PRNGKey(1))
    tokens = jax.random.randint(jax.random.PRNGKey(2), (1, SHORT), 0, VOCAB)
    t = SHORT // 2
    both = jnp.concatenate([tokens, tokens.at[:, t].set((tokens[:, t] + 1) % VOCAB)])
    logits = np.asarray(jax.jit(lambda m, s: m(both, state=s)[0], compiler_options=_LEVEL0)(
        model, state))
    np.testing.assert_array_equal(logits[0, :t], logits[1, :t],
                                  err_msg=f"{kind}: a token changed an earlier logit")
    assert not np.allclose(logits[0, t], logits[1, t])


# --- function level: the variants that compute statistics over queries -----------------------

N, D = 17, 8             # real tokens, head width
LENGTHS = (N, 24, 32)    # unpadded, then padded with junk to two lengths
_KEY = jax.random.PRNGKey(3)
_STATE = A.init_routing_state(jax.random.PRNGKey(4), 2, D)
_CONV = A.init_nystrom_conv(_KEY, 3)


def _routing(q, k, v, state=None, **kw):
    out, aux = A.routing_attention(q, k, v, _STATE if state is None else state, **kw)
    return out, aux.state, aux.commitment_loss


# name -> (approximate form, exact form or None, whether it offers causal). Every function
# returns its output first (routing also its state update and commitment loss). The exact forms
# are exact softmax attention by construction: one query per cluster, top-k keys covering all
# keys, every query active, one cluster whose window holds every token, no pooling.
FUNCTIONS = {
    "clustered": (
        functools.partial(A.clustered_attention, num_clusters=4, key=_KEY),
        functools.partial(A.clustered_attention, num_clusters=N, bits=63, key=_KEY), False),
    "improved_clustered": (
        functools.partial(A.improved_clustered_attention, num_clusters=3, topk=5, key=_KEY),
        functools.partial(A.improved_clustered_attention, num_clusters=3, topk=32, key=_KEY),
        False),
    "nystrom": (
        lambda q, k, v, **kw: A.nystrom_attention(q, k, v, _CONV, num_landmarks=4, **kw),
        None, False),  # its exact limit (landmarks = tokens) is test_lowrank.py's
    "probsparse": (functools.partial(A.probsparse_attention, factor=1.0, key=_KEY),
                   functools.partial(A.probsparse_attention, factor=50.0, key=_KEY), False),
    "routing": (functools.partial(_routing, window=4),
                functools.partial(_routing, window=N, state=A.init_routing_state(_KEY, 1, D)),
                True),
    "funnel": (functools.partial(A.funnel_attention, stride=3),
               functools.partial(A.funnel_attention, stride=1), False),
}


def _as_tuple(out):
    return out if isinstance(out, tuple) else (out,)


def _function_inputs():
    """``(q, k, v, mask)`` for each of LENGTHS: the same N real tokens, then junk."""
    rng = np.random.default_rng(7)
    real = rng.standard_normal((3, N, D)).astype(np.float32)
    out = []
    for length in LENGTHS:
        junk = 30 * rng.standard_normal((3, length - N, D)).astype(np.float32)
        q, k, v = (jnp.asarray(np.concatenate([r, j])) for r, j in zip(real, junk))
        out.append((q, k, v, jnp.arange(length) < N))
    return out


@functools.partial(jax.jit, static_argnames=("name",), compiler_options=_LEVEL0)
def _function_runs(name, inputs, cotangent):
    """Per input: the outputs and the gradients of ``<cotangent, out[:N]>`` w.r.t. q, k, v;
    and the exact form's output on the first padded input."""
    approx, exact, _ = FUNCTIONS[name]

    def run(q, k, v, mask):
        def f(q, k, v):
            return _as_tuple(approx(q, k, v, kv_mask=mask if mask.shape[0] > N else None))
        out, vjp = jax.vjp(f, q, k, v)
        ct = (jnp.zeros_like(out[0]).at[: cotangent.shape[0]].set(cotangent),) + tuple(
            jax.tree_util.tree_map(jnp.zeros_like, out[1:]))
        return out, vjp(ct)

    q, k, v, mask = inputs[1]
    exact_out = None if exact is None else _as_tuple(exact(q, k, v, kv_mask=mask))[0]
    return [run(*x) for x in inputs], exact_out


@pytest.mark.parametrize("name", sorted(FUNCTIONS))
def test_function_padding_content_and_amount_change_nothing(name):
    # The real tokens alone, then padded with junk to 24 and with other junk to 32: content
    # and amount of padding at once (a dependence on either would show).
    inputs = _function_inputs()
    rows = -(-N // 3) if name == "funnel" else N  # Funnel pools the queries by 3
    cotangent = jnp.asarray(np.random.default_rng(8).standard_normal((rows, D)), jnp.float32)
    runs, exact = _function_runs(name, inputs, cotangent)
    (ref, ref_grads), padded = runs[0], runs[1:]
    for length, (out, grads) in zip(LENGTHS[1:], padded):
        what = f"{name}: junk padding to length {length}"
        assert_close(out[0][:rows], ref[0], err_msg=f"{what} changed a real output")
        assert not np.any(np.asarray(out[0][rows:])), f"{what}: a padded query's output is not 0"
        for extra, extra_ref in zip(out[1:], ref[1:]):  # routing's state and loss
            _close(extra, extra_ref, f"{what} changed routing's state update")
        for g, g_ref in zip(grads, ref_grads):
            assert_close(g[:N], g_ref, EXACT_GRAD, err_msg=f"{what} changed a real gradient")
            assert not np.any(np.asarray(g[N:])), f"{what}: a padded token has a gradient"
    if exact is not None:  # configured to be exact, on the padded input: dense attention
        q, k, v, _ = inputs[0]
        assert_close(exact[:N], A.dot_product_attention(q, k, v),
                     err_msg=f"{name}: the exact form is not dense attention on the real tokens")
        assert not np.any(np.asarray(exact[N:]))


@pytest.mark.parametrize("name", sorted(FUNCTIONS))
def test_function_causal_no_leak_or_clear_error(name):
    fn, _, offers_causal = FUNCTIONS[name]
    q, k, v, _ = _function_inputs()[0]
    if not offers_causal:
        with pytest.raises(NotImplementedError, match="does not support causal=True"):
            fn(q, k, v, causal=True)
        return
    t = N // 2
    changed = [x.at[t].set(-x[t]) for x in (q, k, v)]
    f = jax.jit(lambda q, k, v: _as_tuple(fn(q, k, v, causal=True))[0],
                compiler_options=_LEVEL0)
    a, b = np.asarray(f(q, k, v)), np.asarray(f(*changed))
    if name in _REORDERS:
        # A later token's cluster moves earlier queries to other slots of the sorted chunks:
        # the same keys, summed in another order (differences of ~1e-7 on AVX-512 matmul
        # kernels); a leak changes outputs by orders of magnitude more.
        np.testing.assert_allclose(a[:t], b[:t], rtol=1e-6, atol=1e-6,
                                   err_msg=f"{name}: a token changed an earlier output")
    else:
        np.testing.assert_array_equal(a[:t], b[:t], err_msg=f"{name}: a token changed an "
                                      "earlier output")
    assert not np.allclose(a[t], b[t])


# Causal kinds whose chunking depends on every token (routing sorts by cluster), so a later
# token may change the order in which an earlier output's terms are summed.
_REORDERS = ("routing",)


def test_q_mask_defaults_and_errors():
    q, k, v, mask = _function_inputs()[1]
    f = jax.jit(functools.partial(A.nystrom_attention, num_landmarks=4),
                compiler_options=_LEVEL0)
    # Self-attention (Lq == Lk): q_mask defaults to kv_mask.
    assert_close(f(q, k, v, kv_mask=mask), f(q, k, v, kv_mask=mask, q_mask=mask))
    # Cross attention of equal lengths: an explicit all-True q_mask keeps every query.
    every = jnp.ones_like(mask)
    out = f(q, k, v, kv_mask=mask, q_mask=every)
    assert np.all(np.any(np.asarray(out)[N:] != 0, axis=1))
    with pytest.raises(ValueError, match="q_mask must be boolean"):
        A.nystrom_attention(q, k, v, num_landmarks=4, q_mask=mask.astype(jnp.int32))
    with pytest.raises(ValueError, match=r"q_mask must have shape \(Lq,\) = \(24,\)"):
        A.probsparse_attention(q, k, v, key=_KEY, q_mask=mask[:5])


def test_cross_attention_takes_an_explicit_q_mask():
    # Clustered queries over a context: the module passes the padded queries' q_mask, so junk
    # in them changes no real row (they shape no cluster), and their rows are zero.
    spec = nn.AttentionSpec("clustered", {"num_clusters": 3})
    mha = nn.MultiHeadAttention(DIM, HEADS, spec=spec, key=jax.random.PRNGKey(0))
    rng = np.random.default_rng(9)
    x, junk = (jnp.asarray(rng.standard_normal((2, SHORT, DIM)), jnp.float32) for _ in range(2))
    context = jnp.asarray(rng.standard_normal((2, 12, DIM)), jnp.float32)
    q_mask = jnp.arange(SHORT)[None] < jnp.asarray(REAL)[:, None]
    kv_mask = jnp.arange(12)[None] < jnp.array([[12], [9]])
    f = jax.jit(lambda x: mha(x, context, kv_mask=kv_mask, q_mask=q_mask),
                compiler_options=_LEVEL0)
    out, out_junk = f(x), f(jnp.where(q_mask[..., None], x, 10 * junk))
    m = np.asarray(q_mask)
    assert_close(np.asarray(out_junk)[m], np.asarray(out)[m])
    assert not np.any(np.asarray(out)[~m])
    with pytest.raises(ValueError, match=r"q_mask must be bool\[B, Lq\]"):
        mha(x, context, kv_mask=kv_mask, q_mask=q_mask[:, :4])
