"""Packed documents (``segment_ids``) in the delta rules: the gated delta rule's and the DPLR
rule's chunked forms restart at each document, checked against the same rule's per-step
recurrence with segment ids and against each document run alone, outputs and gradients.

One row of five documents (3, 5, 4, 9, 3 positions, then 2 of padding, id 0) in chunks of 4:
documents start inside a chunk (3, 21) and exactly on a chunk's first position (8, 12), one
document spans three chunks, and with groups of 8 positions (``group_positions``) one starts
on a group's first position (8) and one runs across a group edge (16). The padding holds NaN
in every input a ``kv_mask`` masks (the layers zero the block input at padding first, so the
queries are zero there). Each kind's checks are one compiled program. The layers'
bidirectional form (both directions restart at a document's edges) is checked once per rule
family at the end; their causal form is ``tests/test_kinds_packing.py``."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.fast_jit import jit0
from tests.tolerances import EXACT, EXACT_GRAD, assert_close
from xformers_jax import mixers
from xformers_jax.attention import delta_rule_attention
from xformers_jax.attention.linear import (dplr_chunked, dplr_recurrent, gated_delta_chunked,
                                           gated_delta_recurrent)

DOCS = (3, 5, 4, 9, 3)
PAD = 2
CHUNK, GROUP = 4, 8
REAL = sum(DOCS)
L = REAL + PAD
STARTS = tuple(int(s) for s in np.cumsum((0,) + DOCS[:-1]))
SEGMENTS = np.concatenate([np.full(n, i + 1) for i, n in enumerate(DOCS)]
                          + [np.zeros(PAD, int)]).astype(np.int32)
DK, DV, NH = 4, 3, 2


def _unit(x):
    return x / jnp.linalg.norm(x, axis=-1, keepdims=True)


def _inputs(key, shapes, kinds):
    """Random per-position arrays ``[L, ...]`` named by ``shapes``; ``kinds`` says how each is
    drawn: unit rows, a sigmoid, a log-decay (<= 0) or normal."""
    out = {}
    for (name, shape), k in zip(shapes.items(), jax.random.split(key, len(shapes))):
        x = jax.random.normal(k, (L, *shape))
        out[name] = {"unit": _unit, "gate": jax.nn.sigmoid, "decay": lambda a: -jax.nn.softplus(a),
                     "normal": lambda a: a}[kinds.get(name, "normal")](x)
    return out


# name -> (fn(arrays, *, implementation, segment_ids, kv_mask) -> [rows, E], per-position
# shapes, how each is drawn, the per-position arrays a kv_mask does not mask, forms to check).
def _gd_chunked(a, *, implementation, segment_ids=None, kv_mask=None):
    m = jnp.ones((a["k"].shape[0],), bool) if kv_mask is None else kv_mask
    k, v, beta, ld = (jnp.where(m.reshape(-1, *[1] * (x.ndim - 1)), x, 0)
                      for x in (a["k"], a["v"], a["beta"], a["ld"]))
    if implementation == "recurrent":
        return gated_delta_recurrent(a["q"], k, v, beta, ld, segment_ids=segment_ids)
    return gated_delta_chunked(a["q"], k, v, beta, ld, chunk_size=CHUNK, group_positions=GROUP,
                               segment_ids=segment_ids)


def _dplr(a, *, implementation, segment_ids=None, kv_mask=None):
    # The general rule (rates a given); kda runs the delta rule's a = None branch.
    m = jnp.ones((a["k"].shape[0],), bool) if kv_mask is None else kv_mask
    x = {n: jnp.where(m.reshape(-1, *[1] * (a[n].ndim - 1)), a[n], 0)
         for n in ("k", "v", "a", "b", "ld")}
    rates = -(x["a"] * x["b"])
    if implementation == "recurrent":
        return dplr_recurrent(a["q"], x["k"], x["v"], rates, x["b"], x["ld"],
                              segment_ids=segment_ids)
    return dplr_chunked(a["q"], x["k"], x["v"], rates, x["b"], x["ld"], chunk_size=CHUNK,
                        group_positions=GROUP, segment_ids=segment_ids)


def _mixer(fn, names, **kw):
    def run(a, *, implementation, segment_ids=None, kv_mask=None):
        return fn(*(a[n] for n in names), implementation=implementation, chunk_size=CHUNK,
                  segment_ids=segment_ids, kv_mask=kv_mask, **kw)
    return run


def _delta_rule(a, *, implementation, segment_ids=None, kv_mask=None):
    return delta_rule_attention(a["q"], a["k"], a["v"], a["beta"], implementation=implementation,
                                chunk_size=CHUNK, segment_ids=segment_ids, kv_mask=kv_mask)


_QKV = {"q": (DK,), "k": (DK,), "v": (DV,)}
CASES = {
    "gated_delta_chunked": (_gd_chunked, {**_QKV, "beta": (), "ld": ()},
                            {"q": "unit", "k": "unit", "beta": "gate", "ld": "decay"},
                            ("chunked",)),
    "dplr_chunked": (_dplr,
                     {**_QKV, "a": (DK,), "b": (DK,), "ld": (DK,)},
                     {"k": "unit", "a": "gate", "b": "unit", "ld": "decay"}, ("chunked",)),
    "gated_delta": (_mixer(mixers.gated_delta, ("q", "k", "v", "beta", "ld")),
                    {**_QKV, "beta": (), "ld": ()},
                    {"q": "unit", "k": "unit", "beta": "gate", "ld": "decay"},
                    ("chunked",)),
    "kda": (_mixer(mixers.kda, ("q", "k", "v", "beta", "ld")),
            {**_QKV, "beta": (), "ld": (DK,)},
            {"q": "unit", "k": "unit", "beta": "gate", "ld": "decay"}, ("chunked",)),
    "rwkv7": (_mixer(mixers.rwkv7, ("q", "k", "v", "ld", "kappa", "a", "u")),
              {**_QKV, "ld": (DK,), "kappa": (DK,), "a": (DK,), "u": (DK,)},
              {"ld": "decay", "kappa": "unit", "a": "gate"}, ("chunked",)),
    "delta_product": (_mixer(mixers.delta_product, ("q", "k", "v", "beta", "ld")),
                      {"q": (DK,), "k": (NH, DK), "v": (NH, DV), "beta": (NH,), "ld": ()},
                      {"q": "unit", "k": "unit", "beta": "gate", "ld": "decay"},
                      ("chunked",)),
    "delta_rule_attention": (_delta_rule, {**_QKV, "beta": ()}, {}, ("chunked",)),
}
# Arrays that are not per position: rwkv7's bonus u is one per head (its gradient is the sum
# over positions, so over documents).
_SHARED = {"rwkv7": ("u",)}
# The layers zero their input at padding, so the queries (not masked by kv_mask) are zero
# there; every other per-position input holds NaN.
_QUERY = "q"


def _split(name, arrays):
    shared = {n: arrays.pop(n)[0] for n in _SHARED.get(name, ())}
    return arrays, shared


def _run(name, key):
    """(packed outputs and gradients by form, the recurrence with segment ids, each document
    alone): outputs ``[REAL, E]`` and gradients of ``sum(out * w)`` over the real rows."""
    fn, shapes, kinds, forms = CASES[name]
    arrays, shared = _split(name, _inputs(key, shapes, kinds))
    w = jax.random.normal(jax.random.fold_in(key, 1), (REAL, DV))
    pad = jnp.arange(L) >= REAL
    nan = {n: x if n == _QUERY else jnp.where(pad.reshape(-1, *[1] * (x.ndim - 1)), jnp.nan, x)
           for n, x in arrays.items()}
    nan[_QUERY] = jnp.where(pad[:, None], 0.0, arrays[_QUERY])
    seg, kv_mask = jnp.asarray(SEGMENTS), jnp.asarray(SEGMENTS > 0)

    def loss(arrays, shared, ww, **kw):
        out = fn({**arrays, **shared}, **kw)
        return jnp.sum(out[:ww.shape[0]] * ww), out[:ww.shape[0]]

    grad = jax.grad(loss, argnums=(0, 1), has_aux=True)

    def packed(form):
        g, out = grad(nan, shared, w, implementation=form, segment_ids=seg, kv_mask=kv_mask)
        return out, g

    def alone():
        # Each document at the start of its own row (zero-padded to the longest, masked), all
        # rows in one vmap of the recurrence without segment ids.
        n_max = max(DOCS)
        rows = [jnp.arange(n_max) + s for s in STARTS]
        mask = jnp.stack([jnp.arange(n_max) < n for n in DOCS])
        take = lambda x: jnp.stack([  # noqa: E731
            jnp.where(m.reshape(-1, *[1] * (x.ndim - 1)), x[jnp.minimum(r, REAL - 1)], 0)
            for r, m in zip(rows, mask)])
        docs = {k: take(x) for k, x in arrays.items()}
        (g, gs), out = jax.vmap(lambda d, ww, m: grad(
            d, shared, ww, implementation="recurrent", kv_mask=m))(docs, take(w), mask)
        real = lambda x: jnp.concatenate([x[i, :n] for i, n in enumerate(DOCS)])  # noqa: E731
        return real(out), ({k: real(x) for k, x in g.items()},
                           jax.tree.map(lambda x: x.sum(0), gs))

    return {form: packed(form) for form in (*forms, "recurrent")}, alone()


@pytest.mark.parametrize("name", sorted(CASES))
def test_packed_documents_equal_each_document_alone(name):
    runs, (alone_out, (alone_grad, alone_shared)) = jit0(functools.partial(_run, name))(
        jax.random.PRNGKey(sorted(CASES).index(name)))
    for form, (out, (g, gs)) in runs.items():
        what = f"{name} {form} with segment ids"
        assert_close(out, alone_out, EXACT, err_msg=f"{what}: outputs differ from each "
                                                      "document run alone")
        assert_close(out, runs["recurrent"][0], EXACT,
                     err_msg=f"{what}: outputs differ from the recurrence with segment ids")
        real = {k: x[:REAL] for k, x in g.items()}
        assert_close(real, alone_grad, EXACT_GRAD,
                     err_msg=f"{what}: gradients differ from each document run alone")
        assert_close(gs, alone_shared, EXACT_GRAD,
                     err_msg=f"{what}: shared gradients differ from the documents' sum")
        for k, x in g.items():
            # Padding (NaN inputs) gets a zero gradient and sends nothing anywhere.
            np.testing.assert_array_equal(np.asarray(x[REAL:]), 0.0,
                                          err_msg=f"{what}: gradient of {k} at the padding")


def test_without_segment_ids_the_documents_do_interact():
    # The test above is not vacuous: the same row without segment ids carries state across
    # the documents, so the second document's outputs change.
    def run(key):
        fn, shapes, kinds, _ = CASES["gated_delta"]
        a = _inputs(key, shapes, kinds)
        s, n = STARTS[1], DOCS[1]
        return (fn(a, implementation="chunked")[s:s + n],
                fn({k: x[s:s + n] for k, x in a.items()}, implementation="recurrent"))

    packed, alone = jit0(run)(jax.random.PRNGKey(0))
    assert np.max(np.abs(np.asarray(packed) - np.asarray(alone))) > 1e-3


@pytest.mark.parametrize("call", ["gated_delta", "kda", "delta_product", "delta_rule"])
def test_bad_segment_ids_are_refused_naming_the_shape(call):
    x = jnp.zeros((L, DK))
    bad = jnp.ones((L + 1,), jnp.int32)
    calls = {
        "gated_delta": lambda s: mixers.gated_delta(x, x, x, x[:, 0], x[:, 0], segment_ids=s),
        "kda": lambda s: mixers.kda(x, x, x, x[:, 0], x, segment_ids=s),
        "delta_product": lambda s: mixers.delta_product(x, x[:, None], x[:, None], x[:, :1],
                                                        x[:, 0], segment_ids=s),
        "delta_rule": lambda s: delta_rule_attention(x, x, x, x[:, 0], segment_ids=s),
    }
    with pytest.raises(ValueError, match=rf"segment[_ ]ids.*{L}"):
        jax.eval_shape(calls[call], bad)
    with pytest.raises(ValueError, match="segment_ids|segment ids"):
        jax.eval_shape(calls[call], jnp.ones((L,), jnp.float32))


def test_the_bidirectional_layers_restart_at_both_ends_of_a_document():
    # Packing is tested in causal LMs (test_kinds_packing); without ``causal`` the layers also
    # run from the last position, where a document ends rather than starts: the segment ids
    # are flipped with the rest. Outputs and input gradients of a packed row against each
    # document alone in its own row (padded at the end, masked), for one layer on each of the
    # two chunked rules (the scalar gated delta rule and the DPLR rule).
    from xformers_jax.nn._mixer._recurrent import GatedDeltaNet
    from xformers_jax.nn._mixer._recurrent_recent import RWKV7

    docs, length, dim = (3, 6, 5), 16, 8
    seg = np.concatenate([np.full(n, i + 1) for i, n in enumerate(docs)]
                         + [np.zeros(length - sum(docs), int)]).astype(np.int32)
    starts = np.cumsum((0,) + docs[:-1])
    idx = np.stack([np.minimum(np.arange(length) + s, length - 1) for s in starts])
    alone_mask = np.arange(length)[None] < np.asarray(docs)[:, None]

    def run(key):
        x = jax.random.normal(key, (1, length, dim))
        x_alone = jnp.where(alone_mask[..., None], x[0][idx], 0.0)
        out = {}
        for cls in (GatedDeltaNet, RWKV7):
            m = cls(dim, 2, causal=False, max_len=length, key=jax.random.fold_in(key, 1),
                    chunk_size=4)

            def f(x, mask, **kw):
                y = m(x, kv_mask=mask, **kw)
                return jnp.sum(y ** 2), y

            packed = jax.grad(f, has_aux=True)(x, jnp.asarray(seg > 0)[None],
                                               segment_ids=jnp.asarray(seg)[None])
            out[cls.__name__] = (packed, jax.grad(f, has_aux=True)(x_alone, alone_mask))
        return out

    for name, ((g, y), (g_alone, y_alone)) in jit0(run)(jax.random.PRNGKey(9)).items():
        for i, (s, n) in enumerate(zip(starts, docs)):
            what = f"{name} (bidirectional), document at {s}..{s + n - 1}"
            assert_close(y[0, s:s + n], y_alone[i, :n], EXACT, err_msg=f"{what}: outputs")
            assert_close(g[0, s:s + n], g_alone[i, :n], EXACT_GRAD, err_msg=f"{what}: gradients")
