"""Packed rows on the one causal scan (``segment_ids``): the state restarts at each document.

For the scan's forms (chunked, with one and several groups; recurrent; parallel), with one
decay per step and one per key feature, and for the recurrences on it (``retention``, ``gla``,
``ssd``, ``hgrn2``, ``mlstm``, ``linear_attention`` and Performer): each document of a packed
row gives, outputs and gradients, what it gives alone, and the chunked form agrees with the
recurrent one. The row has boundaries inside a chunk and exactly on a chunk edge, documents
longer than a chunk, and padding (id 0) holding NaN. The layers' plumbing (the bidirectional
runs, Mamba-2's short convolution) is checked on a non-causal layer; the causal one-layer
models are ``test_kinds_packing``'s."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.fast_jit import jit0
from tests.tolerances import EXACT, EXACT_GRAD, assert_close
from xformers_jax import mixers as M
from xformers_jax.attention import linear as LA

CHUNK = 4
# Documents of 3, 5, 9 and 5 tokens, then 2 of padding: boundaries at 3 (inside chunk 0), 8
# (on a chunk edge), 17 (inside chunk 4, after a document of two chunks and more) and 22.
DOCS = (3, 5, 9, 5)
L = 24
SEG = np.concatenate([np.full(n, i + 1) for i, n in enumerate(DOCS)]
                     + [np.zeros(L - sum(DOCS))]).astype(np.int32)
STARTS = np.cumsum((0,) + DOCS[:-1])
REAL = SEG > 0


def _rand(seed, *shape):
    return jax.random.normal(jax.random.PRNGKey(seed), shape)


def _per_document(fn, *arrays):
    """``fn(*arrays)`` on each document alone, concatenated (padding rows: zeros)."""
    outs = [fn(*(a[s:s + n] for a in arrays)) for s, n in zip(STARTS, DOCS)]
    out = jnp.concatenate(outs)
    return jnp.concatenate([out, jnp.zeros((L - sum(DOCS), *out.shape[1:]), out.dtype)])


def _value_and_grads(fn, arrays, weight):
    """``fn(*arrays)`` on the real rows and the gradients of ``sum(out * weight)`` there."""
    def loss(*a):
        return jnp.sum(jnp.where(REAL[:, None], fn(*a) * weight, 0.0))

    grads = jax.grad(loss, tuple(range(len(arrays))))(*arrays)
    return jnp.where(REAL[:, None], fn(*arrays), 0.0), grads


def _real_rows(tree):
    return jax.tree.map(lambda g: jnp.where(REAL.reshape(-1, *[1] * (g.ndim - 1)), g, 0.0),
                        tree)


def _check_packed(candidates, reference, arrays, weight, what, reference_arrays=None):
    """Outputs and gradients of each of ``candidates`` (name -> function, with segment ids)
    and of ``reference`` (e.g. each document run by itself) agree on the real rows; all in
    one compiled program."""
    def run(arrays, reference_arrays, weight):
        got = {n: _value_and_grads(f, arrays, weight) for n, f in candidates.items()}
        return got, _value_and_grads(reference, reference_arrays, weight)

    ref_arrays = arrays if reference_arrays is None else reference_arrays
    got, (want, want_g) = jit0(run)(arrays, ref_arrays, weight)
    for name, (out, grads) in got.items():
        assert_close(out, want, err_msg=f"{what}, {name}: outputs")
        assert_close(_real_rows(grads), _real_rows(want_g), EXACT_GRAD,
                     err_msg=f"{what}, {name}: gradients")


def _scan_inputs(per_feature):
    m, e = 3, 2
    ld_shape = (L, m) if per_feature else (L,)
    return (_rand(0, L, m), _rand(1, L, m), _rand(2, L, e),
            -jax.nn.softplus(_rand(3, *ld_shape))), _rand(4, L, e)


FORMS = {
    "chunked": lambda *a, segment_ids=None: LA.causal_chunked(*a, CHUNK, segment_ids=segment_ids),
    # 8 positions per group: three groups, the state carried between them by the group scan.
    "chunked_groups": lambda *a, segment_ids=None: LA.causal_chunked(
        *a, CHUNK, group_positions=8, segment_ids=segment_ids),
    # Chunks of 5 in groups of 2: the last chunk is padded, and so is the last group (by a
    # whole chunk); boundaries fall inside chunks.
    "chunked_padded": lambda *a, segment_ids=None: LA.causal_chunked(
        *a, 5, group_positions=10, segment_ids=segment_ids),
    "recurrent": LA.causal_recurrent,
    "parallel": LA.causal_parallel,
}


@pytest.mark.parametrize("per_feature", [False, True], ids=["ld[L]", "ld[L,M]"])
def test_the_scan_restarts_at_each_document(per_feature):
    arrays, weight = _scan_inputs(per_feature)
    seg = jnp.asarray(SEG)
    forms = {n: functools.partial(f, segment_ids=seg) for n, f in FORMS.items()}
    _check_packed(forms, functools.partial(_per_document, LA.causal_recurrent), arrays,
                  weight, f"{'per-feature' if per_feature else 'per-step'} decays")
    # And against the recurrent form with segment ids (a second reference).
    _check_packed({"chunked": forms["chunked"]}, forms["recurrent"], arrays, weight,
                  "chunked against recurrent")


def test_segments_need_one_id_per_position():
    arrays, _ = _scan_inputs(False)
    with pytest.raises(ValueError, match=r"segment_ids must be int\[24\]"):
        LA.causal_chunked(*arrays, CHUNK, segment_ids=jnp.ones((L - 1,), jnp.int32))
    with pytest.raises(ValueError, match="segment_ids must be int"):
        LA.causal_recurrent(*arrays, segment_ids=jnp.ones((L,), jnp.float32))


# --- the recurrences on the scan: packed (chunked), alone, recurrent with segments ----------

def _mixer_case(name):
    dk, dv = 4, 3
    q, k, v = _rand(10, L, dk), _rand(11, L, dk) / 2, _rand(12, L, dv)
    if name == "retention":
        return functools.partial(M.retention, log_gamma=jnp.log(0.9)), (q, k, v)
    if name == "gla":
        return M.gla, (q, k, v, jax.nn.log_sigmoid(_rand(13, L, dk) + 2) / 4)
    if name == "ssd":
        dt = jax.nn.softplus(_rand(14, L))
        return (lambda x, dt, b, c, **kw: M.ssd(x, dt, -1.5, b, c, **kw)), (v, dt, k, q)
    if name == "hgrn2":
        return M.hgrn2, (q, v, jax.nn.log_sigmoid(_rand(15, L, dk) + 1))
    # mLSTM: a huge input gate in the first document raises the stabiliser to ~200, which
    # must restart from 0 at the second (carried on, it would scale the second document's
    # keys by exp(-200), to 0 in float32, and its step down would be a log-decay of ~ +200).
    i_logits = _rand(16, L).at[1].set(200.0)
    return M.mlstm, (q, k, v, i_logits, _rand(17, L) + 2)


MIXERS = ["retention", "gla", "ssd", "hgrn2", "mlstm"]


# Which argument is the query (its padded rows are the caller's to zero: a query reaches its own
# output only, but 0 * NaN in the backward pass of any form would poison the others).
QUERY = {"retention": 0, "gla": 0, "ssd": 3, "hgrn2": 0, "mlstm": 0}


def _with_nan_padding(arrays, query=0):
    """NaN in the padded rows of every array but the query."""
    return tuple(a if i == query else jnp.where(REAL.reshape(-1, *[1] * (a.ndim - 1)), a,
                                                jnp.nan) for i, a in enumerate(arrays))


@pytest.mark.parametrize("name", MIXERS)
def test_each_document_of_a_packed_recurrence_is_as_alone(name):
    fn, arrays = _mixer_case(name)
    seg, real = jnp.asarray(SEG), jnp.asarray(REAL)
    weight = _rand(20, L, 3)
    forms = {form: functools.partial(fn, kv_mask=real, segment_ids=seg, implementation=form,
                                     chunk_size=CHUNK) for form in ("chunked", "parallel",
                                                                    "recurrent")}
    alone = functools.partial(_per_document, functools.partial(fn, implementation="recurrent"))
    _check_packed(forms, alone, _with_nan_padding(arrays, QUERY[name]), weight,
                  f"{name}: packed against alone", reference_arrays=arrays)
    _check_packed({"chunked": forms["chunked"], "parallel": forms["parallel"]},
                  forms["recurrent"], arrays, weight, f"{name}: against the recurrent form")


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
def test_linear_attention_reads_its_own_document(causal):
    q, k, v = _rand(30, L, 4), _rand(31, L, 4), _rand(32, L, 3)
    seg, real = jnp.asarray(SEG), jnp.asarray(REAL)
    kw = {"causal": causal, "chunk_size": CHUNK}
    packed = functools.partial(LA.linear_attention, kv_mask=real, segment_ids=seg, **kw)
    alone = functools.partial(_per_document, functools.partial(LA.linear_attention, **kw))
    _check_packed({"chunked": packed}, alone, _with_nan_padding((q, k, v)), _rand(33, L, 3),
                  "elu", reference_arrays=(q, k, v))


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
def test_performer_stabiliser_restarts_at_each_document(causal):
    # One projection row of norm 20 and a first-document key along it: log phi reaches ~200
    # there, so a running maximum carried into the next documents would scale their keys by
    # exp(-200), to 0 in float32 (and without causal, one maximum per document).
    proj = LA.init_random_projection(jax.random.PRNGKey(40), 8, 4).at[0].set(
        jnp.array([20.0, 0, 0, 0]))
    q, k, v = _rand(41, L, 4), _rand(42, L, 4) / 2, _rand(43, L, 3)
    k = k.at[1].set(jnp.array([40.0, 0, 0, 0]))  # scaled by sqrt(0.25): 20 along row 0
    seg, real = jnp.asarray(SEG), jnp.asarray(REAL)
    kw = {"causal": causal, "chunk_size": CHUNK, "scale": 0.25}

    def packed(q, k, v):
        return LA.performer_attention(q, k, v, proj, kv_mask=real, segment_ids=seg, **kw)

    def one(q, k, v):
        return LA.performer_attention(q, k, v, proj, **kw)

    _check_packed({"chunked": packed}, functools.partial(_per_document, one), (q, k, v),
                  _rand(44, L, 3), f"performer, causal={causal}")


# --- the layers' plumbing: bidirectional runs and Mamba-2's convolution -------------------------

@pytest.mark.parametrize("layer", ["GLA", "Mamba2"])
def test_a_bidirectional_layer_keeps_documents_apart(layer):
    from xformers_jax.nn._mixer import _recurrent

    def run(key):
        cls = getattr(_recurrent, layer)
        kw = {"state_size": 4} if layer == "Mamba2" else {}
        mixer = cls(8, 2, causal=False, max_len=L, key=key, chunk_size=CHUNK, **kw)
        x = jax.random.normal(jax.random.fold_in(key, 1), (1, L, 8))
        packed = mixer(x, kv_mask=jnp.asarray(REAL)[None],
                       segment_ids=jnp.asarray(SEG)[None])[0]
        alone = [mixer(x[:, s:s + n])[0] for s, n in zip(STARTS, DOCS)]
        return packed, alone

    packed, alone = jit0(run)(jax.random.PRNGKey(50))
    for i, (s, n) in enumerate(zip(STARTS, DOCS)):
        assert_close(packed[s:s + n], alone[i], EXACT,
                     err_msg=f"{layer}: document {i + 1} of the packed row")
