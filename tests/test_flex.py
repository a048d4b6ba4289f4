"""Flex attention (``attention.flex_attention``): every score and mask function against the
dense reference written here, which applies the same function to the materialised ``[Lq, Lk]``
score matrix; outputs and gradients (q, k, v and the captured parameters) in float32 to 1e-5,
causal and with padded keys. Then the existing kinds written through it against their current
forms, the layouts derived from mask functions, and the rules for masks of traced arrays."""

import functools

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

from xformers_jax import nn
from xformers_jax.attention import (
    alibi_score,
    block_sparse_attention,
    flash_attention,
    flex_attention,
    multihead,
    prefix_lm_mask,
    relative_bias_score,
    soft_cap_score,
    streaming_mask,
)
from xformers_jax.attention import patterns as P
from xformers_jax.attention.patterns import MaskMod, document_mask

from .fast_jit import jit0
from .tolerances import assert_close

F32 = dict(atol=1e-5, rtol=1e-5)
L, D, TILE, H = 40, 8, 16, 2  # 40 = two and a half tiles: a padded last tile of each kind


def _close(a, b, msg=""):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), err_msg=msg, **F32)


def dense_flex(q, k, v, *, score_mod=None, mask_fn=None, sink=None, causal=False,
               kv_mask=None, b=0, h=0):
    """The definition: materialise ``s``, apply ``score_mod``, mask, softmax with the sink
    logit in the denominator, times ``v``."""
    lq, lk = q.shape[0], k.shape[0]
    if kv_mask is not None:  # padded keys' content must reach nothing (0 * nan is nan)
        k = jnp.where(kv_mask[:, None], k, 0.0)
        v = jnp.where(kv_mask[:, None], v, 0.0)
    s = jnp.einsum("qd,kd->qk", q, k, precision="highest") / np.sqrt(q.shape[1])
    i, j = jnp.arange(lq)[:, None], jnp.arange(lk)[None, :]
    if score_mod is not None:
        s = score_mod(s, b, h, i, j)
    keep = jnp.ones((lq, lk), bool)
    if mask_fn is not None:
        keep &= mask_fn(b, h, i, j)
    if causal:
        keep &= j <= i
    if kv_mask is not None:
        keep &= kv_mask[None, :]
    s = jnp.where(keep, s, -jnp.inf)
    m = s.max(-1, keepdims=True)
    if sink is not None:
        m = jnp.maximum(m, sink)
    m = jax.lax.stop_gradient(jnp.where(jnp.isfinite(m), m, 0.0))
    e = jnp.where(keep, jnp.exp(s - m), 0.0)
    z = e.sum(-1, keepdims=True)
    if sink is not None:
        z = z + jnp.exp(sink - m)
    return jnp.einsum("qk,kd->qd", e / jnp.where(z == 0, 1.0, z), v, precision="highest")


def _qkv(seed=0, lq=L, lk=L):
    ks = jax.random.split(jax.random.PRNGKey(seed), 3)
    return (jax.random.normal(ks[0], (lq, D)), jax.random.normal(ks[1], (lk, D)),
            jax.random.normal(ks[2], (lk, D)))


def _t5_bucket(rel):
    return nn.t5_bucket(rel, bidirectional=True, num_buckets=8, max_distance=16)


_DOCS = np.repeat(np.arange(4), [7, 13, 16, 4])  # 4 documents across tile edges
_SLOPES = jnp.asarray([0.25, 0.0625])
_TABLE = 0.3 * jax.random.normal(jax.random.PRNGKey(7), (H, 8))

# name: (score_mod(params) | None, mask for flex, mask_fn for the reference, params)
CASES = {
    "soft_cap": (lambda p: soft_cap_score(1.5), None, None, {}),
    "alibi": (lambda p: alibi_score(p["slopes"]), None, None, {"slopes": _SLOPES}),
    "t5": (lambda p: relative_bias_score(p["table"], _t5_bucket), None, None,
           {"table": _TABLE}),
    "gated": (lambda p: (lambda s, b, h, i, j: s * jax.nn.sigmoid(p["gate"][h])), None, None,
              {"gate": jnp.asarray([0.3, -1.2])}),
    "prefix_lm": (None, prefix_lm_mask(9), lambda b, h, i, j: (j < 9) | (j <= i), {}),
    "streaming": (None, streaming_mask(5, 3), lambda b, h, i, j: (j < 3) | ((j >= i - 5) & (
        j <= i)), {}),
    "document": (None, document_mask(_DOCS),
                 lambda b, h, i, j: jnp.asarray(_DOCS)[i] == jnp.asarray(_DOCS)[j], {}),
    "longformer": (None, P.Longformer(4, global_tokens=(0, 17)), lambda b, h, i, j: jnp.asarray(
        P.Longformer(4, global_tokens=(0, 17)).dense(L, L))[i, j], {}),
    "bigbird": (None, P.BigBird(8, 1, 1, 1, seed=3), lambda b, h, i, j: jnp.asarray(
        P.BigBird(8, 1, 1, 1, seed=3).dense(L, L))[i, j], {}),
    "soft_cap_window_sink": (lambda p: soft_cap_score(2.0), P.Local(6, 6),
                             lambda b, h, i, j: jnp.abs(i - j) <= 6, {"sink": jnp.float32(0.7)}),
    "sink": (None, None, None, {"sink": jnp.float32(-0.4)}),
}


@pytest.mark.parametrize("causal,padded", [(True, True), (False, False)])
@pytest.mark.parametrize("name", sorted(CASES))
def test_equals_the_dense_definition_outputs_and_gradients(name, causal, padded):
    make_score, mask, mask_fn, params = CASES[name]
    causal = causal and name != "bigbird"  # encoder only: refused with causal=True
    q, k, v = _qkv()
    kv_mask = jnp.arange(L) < 33 if padded else None
    head = 1

    def run(impl, q, k, v, params):
        score_mod = make_score(params) if make_score else None
        sink = params.get("sink")
        if impl == "flex":
            return flex_attention(q, k, v, score_mod=score_mod, mask_mod=mask, sink=sink,
                                  causal=causal, kv_mask=kv_mask, head_index=head,
                                  block_q=TILE, block_k=TILE)
        return dense_flex(q, k, v, score_mod=score_mod, mask_fn=mask_fn, sink=sink,
                          causal=causal, kv_mask=kv_mask, h=head)

    w = jnp.cos(jnp.arange(L * D, dtype=jnp.float32)).reshape(L, D)

    def loss(impl, *a):
        return jnp.sum(run(impl, *a) * w)

    args = (q, k, v, params)
    out = jit0(functools.partial(run, "flex"))(*args)
    ref = run("dense", *args)
    _close(out, ref, name)
    grads = jit0(jax.grad(functools.partial(loss, "flex"), argnums=(0, 1, 2, 3)))(*args)
    ref_grads = jax.grad(functools.partial(loss, "dense"), argnums=(0, 1, 2, 3))(*args)
    for what, g, r in zip(("dq", "dk", "dv", "d_params"), grads, ref_grads):
        for path, a, b in zip(jax.tree_util.tree_leaves_with_path(g), jax.tree.leaves(g),
                              jax.tree.leaves(r)):
            assert np.abs(np.asarray(b)).max() > 0 or what != "d_params", (name, path)
            _close(a, b, f"{name} {what} {jax.tree_util.keystr(path[0])}")


def test_head_and_batch_index_through_multihead():
    """``b`` and ``h`` reach both functions when multihead maps them; a mask of ``h`` has no
    static layout and is evaluated in-tile."""
    bsz, lq = 2, 24
    ks = jax.random.split(jax.random.PRNGKey(1), 3)
    q, k, v = (jax.random.normal(kk, (bsz, lq, H, D)) for kk in ks)
    windows = jnp.asarray([2, 5])
    offsets = jnp.asarray([0.5, -1.0])
    mask = MaskMod(lambda b, h, i, j: jnp.abs(i - j) <= windows[h])
    score = lambda s, b, h, i, j: s + offsets[b]
    assert not mask.is_static()
    out = jit0(lambda q, k, v: multihead(flex_attention)(
        q, k, v, score_mod=score, mask_mod=mask, head_index=jnp.arange(H),
        batch_index=jnp.arange(bsz), block_q=8, block_k=8))(q, k, v)
    for bi in range(bsz):
        for hi in range(H):
            ref = dense_flex(q[bi, :, hi], k[bi, :, hi], v[bi, :, hi], score_mod=score,
                             mask_fn=mask.fn, b=bi, h=hi)
            _close(out[bi, :, hi], ref, f"b={bi} h={hi}")


# -- the existing kinds through flex, equal to their current forms --------------------------


def test_existing_kinds_equal_their_current_forms():
    bsz, lq = 1, 40
    ks = jax.random.split(jax.random.PRNGKey(2), 3)
    q, k, v = (jax.random.normal(kk, (bsz, lq, H, D)) for kk in ks)
    one = (q[0, :, 0], k[0, :, 0], v[0, :, 0])
    tiles = dict(block_q=TILE, block_k=TILE)
    # causal, sliding window, Longformer and BigBird patterns: flex with the pattern as mask.
    assert_close(flex_attention(*one, causal=True, **tiles),
                 flash_attention(*one, causal=True, **tiles), err_msg="causal")
    assert_close(flex_attention(*one, mask_mod=P.Local(5, 0), causal=True, **tiles),
                 block_sparse_attention(*one, P.Local(5, 0), causal=True, **tiles),
                 err_msg="sliding window")
    for pat in (P.Longformer(4, global_tokens=(0, 17)), P.BigBird(8, 1, 1, 1, seed=3)):
        assert_close(flex_attention(*one, mask_mod=pat, **tiles),
                     block_sparse_attention(*one, pat, **tiles), err_msg=repr(pat))
    # prefix LM as a mask function against the same mask as a union of patterns.
    assert_close(flex_attention(*one, mask_mod=prefix_lm_mask(9), **tiles),
                 block_sparse_attention(*one, P.KeyPadding(9) | P.Causal(), **tiles),
                 err_msg="prefix lm")
    # ALiBi and T5 as score functions against nn's bias schemes on flash attention.
    pos = jnp.broadcast_to(jnp.arange(lq), (bsz, lq))
    scale = 1 / np.sqrt(D)
    t5 = nn.T5Bias(H, 8, 16, key=jax.random.PRNGKey(3))
    for scheme, score in (
            (nn.ALiBi(H), alibi_score(nn.ALiBi(H).slopes.value)),
            (t5, relative_bias_score(t5.table, functools.partial(
                nn.t5_bucket, bidirectional=True, num_buckets=8, max_distance=16)))):
        bias = scheme.bias(q, k, pos, pos, scale)
        current = multihead(flash_attention, kwarg_axes={"bias": "batch_heads"})(
            q, k, v, causal=True, bias=bias, **tiles)
        through = multihead(flex_attention)(q, k, v, score_mod=score, causal=True,
                                            head_index=jnp.arange(H), **tiles)
        assert_close(through, current, err_msg=type(scheme).__name__)


# -- block masks from mask functions ----------------------------------------------------------


def test_mask_function_layouts_equal_the_patterns_and_are_cached():
    mod = prefix_lm_mask(20)
    same = P.KeyPadding(20) | P.Causal()
    for tiles in ((16, 16), (8, 32)):
        got, want = mod.layout(100, 100, *tiles), same.layout(100, 100, *tiles)
        np.testing.assert_array_equal(got.kinds, want.kinds)
        np.testing.assert_array_equal(got.dense(), want.dense())
    assert mod.layout(100, 100, 16, 16) is mod.layout(100, 100, 16, 16)
    assert prefix_lm_mask(20).layout(100, 100, 16, 16) is mod.layout(100, 100, 16, 16)
    # document ids key the cache by content; tiles between documents are empty.
    docs = np.repeat(np.arange(4), 16)
    lay = (document_mask(docs) & P.Causal()).layout(64, 64, 16, 16)
    assert lay is (document_mask(docs.copy()) & P.Causal()).layout(64, 64, 16, 16)
    np.testing.assert_array_equal(lay.kinds, np.diag([1, 1, 1, 1]))
    # | and & between mask functions and patterns.
    even = MaskMod(lambda b, h, i, j: (i + j) % 2 == 0)
    i, j = np.arange(30)[:, None], np.arange(30)[None, :]
    np.testing.assert_array_equal((even | P.Local(2, 2)).dense(30, 30),
                                  ((i + j) % 2 == 0) | (np.abs(i - j) <= 2))
    np.testing.assert_array_equal((even & mod).dense(30, 30),
                                  ((i + j) % 2 == 0) & ((j < 20) | (j <= i)))
    np.testing.assert_array_equal((even | MaskMod(lambda b, h, i, j: i == 0)).dense(30, 30),
                                  ((i + j) % 2 == 0) | (i == 0))


def test_masks_of_traced_arrays_are_evaluated_in_tile():
    q, k, v = _qkv(3)
    docs = jnp.asarray(_DOCS)
    ref = flash_attention(q, k, v, causal=True, segment_ids=docs)

    @jit0
    def traced(q, k, v, docs):
        mask = document_mask(docs)
        assert not mask.is_static()
        return flex_attention(q, k, v, mask_mod=P.Causal() & mask, block_q=TILE, block_k=TILE)

    assert_close(traced(q, k, v, docs), ref)
    with pytest.raises(ValueError, match="cannot be part of a union"):
        jax.jit(lambda d: flex_attention(q, k, v, mask_mod=P.Local(2, 2) | document_mask(d)))(
            docs)


def test_bad_arguments_and_pallas_are_refused_by_name():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="sink must be a float scalar"):
        flex_attention(q, k, v, sink=jnp.zeros(2))
    with pytest.raises(ValueError, match="mask_mod must be a callable"):
        flex_attention(q, k, v, mask_mod=3)
    # On this CPU no Pallas kernel runs: the refusal names each kernel and why.
    with pytest.raises(NotImplementedError, match="pallas_gpu_mosaic: runs on backend 'gpu'"):
        flex_attention(q, k, v, score_mod=soft_cap_score(2.0), implementation="pallas")


# -- the backward's transposed tiles (128 x 256: not row-gathered) -------------------------

_ROWS = 0.1 * jax.random.normal(jax.random.PRNGKey(9), (512,))

TRANSPOSED = {
    # Elementwise: evaluated on the transposed tile as it lies (traced there a second time).
    "alibi_soft_cap": (lambda p: lambda s, b, h, i, j: 4.0 * jnp.tanh(
        (s - p["slopes"][h] * (i - j)) / 4.0), {"slopes": _SLOPES}, True),
    # A gather from a table by h and by relative position.
    "t5": (lambda p: relative_bias_score(p["table"], _t5_bucket), {"table": _TABLE}, True),
    # Reads q_idx's column: not orientation-free, so the tile is turned round for it.
    "row_bias": (lambda p: lambda s, b, h, i, j: s + p["rows"][i[:, 0]][:, None],
                 {"rows": _ROWS}, False),
}


@pytest.mark.parametrize("name", sorted(TRANSPOSED))
def test_score_functions_on_the_transposed_backward_tiles(name):
    from xformers_jax.kernels._tiled import _gather_width, _orientation_free, _transposed

    make, params, free = TRANSPOSED[name]
    assert _orientation_free(make(params)) == free
    lq = 300  # three 128-row and two 256-key tiles, the last of each padded
    layout = P.Causal().layout(lq, lq, 128, 256)
    assert _transposed(layout, _gather_width(layout))
    q, k, v = _qkv(4, lq, lq)
    kv_mask = jnp.arange(lq) < 150
    w = jnp.sin(jnp.arange(lq * D, dtype=jnp.float32)).reshape(lq, D)

    def loss(impl, q, k, v, p):
        if impl == "flex":
            out = flex_attention(q, k, v, score_mod=make(p), causal=True, kv_mask=kv_mask,
                                 head_index=1, block_q=128, block_k=256)
        else:
            out = dense_flex(q, k, v, score_mod=make(p), causal=True, kv_mask=kv_mask, h=1)
        return jnp.sum(out * w)

    args = (q, k, v, params)
    got = jit0(jax.value_and_grad(functools.partial(loss, "flex"), (0, 1, 2, 3)))(*args)
    want = jit0(jax.value_and_grad(functools.partial(loss, "dense"), (0, 1, 2, 3)))(*args)
    _close(got[0], want[0], name)
    for what, g, r in zip(("dq", "dk", "dv", "d_params"), got[1], want[1]):
        for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(r)):
            _close(a, b, f"{name} {what}")


# -- tiles skipped from traced segment ids (packed rows) -----------------------------------


@pytest.mark.parametrize("lq,bq,bk", [(40, TILE, TILE), (300, 128, 256)])
def test_traced_segment_ids_equal_the_definition(lq, bq, bk):
    """Document ids known only at run time (the trainer's packed rows): the kernel skips the
    tiles whose id ranges cannot meet; outputs and gradients equal the definition, documents
    across tile edges, a padded last tile, causal. At 16 x 16 tiles the backward is
    row-gathered, at 128 x 256 transposed."""
    q, k, v = _qkv(5, lq, lq)
    sizes = [7, 13, 16, 4] if lq == 40 else [90, 10, 140, 60]
    ids = jnp.asarray(np.repeat(np.arange(4), sizes), jnp.int32)
    w = jnp.sin(jnp.arange(lq * D, dtype=jnp.float32)).reshape(lq, D)

    def loss(impl, q, k, v, ids):
        if impl == "flex":
            out = flex_attention(q, k, v, causal=True, segment_ids=ids, block_q=bq, block_k=bk)
        else:
            out = dense_flex(q, k, v, mask_fn=lambda b, h, i, j: ids[i] == ids[j], causal=True)
        return jnp.sum(out * w)

    got = jit0(jax.value_and_grad(functools.partial(loss, "flex"), (0, 1, 2)))(q, k, v, ids)
    want = jax.value_and_grad(functools.partial(loss, "dense"), (0, 1, 2))(q, k, v, ids)
    _close(got[0], want[0])
    for what, a, b in zip(("dq", "dk", "dv"), got[1], want[1]):
        _close(a, b, what)


def test_traced_segment_ids_per_row_under_multihead():
    """Rows of a batch with different packings (each loop runs the most steps any row
    needs): outputs and gradients equal the definition with each row's own ids."""
    bsz, lq = 2, 48
    ks = jax.random.split(jax.random.PRNGKey(11), 3)
    q, k, v = (jax.random.normal(kk, (bsz, lq, H, D)) for kk in ks)
    ids = jnp.asarray(np.stack([np.repeat(np.arange(3), [16, 16, 16]),
                                np.repeat(np.arange(2), [5, 43])]), jnp.int32)
    w = jnp.cos(jnp.arange(q.size, dtype=jnp.float32)).reshape(q.shape)

    def flex(q, k, v):
        return multihead(flex_attention)(q, k, v, causal=True, segment_ids=ids, block_q=TILE,
                                         block_k=TILE)

    def dense(q, k, v):
        return jnp.stack([jnp.stack([dense_flex(
            q[r, :, hh], k[r, :, hh], v[r, :, hh], causal=True,
            mask_fn=lambda b, h, i, j, r=r: ids[r][i] == ids[r][j]) for hh in range(H)], 1)
            for r in range(bsz)])

    def value_and_grads(f):
        return jit0(jax.value_and_grad(lambda *a: jnp.sum(f(*a) * w), (0, 1, 2)))(q, k, v)

    got, want = value_and_grads(flex), value_and_grads(dense)
    _close(got[0], want[0])
    for what, a, b in zip(("dq", "dk", "dv"), got[1], want[1]):
        _close(a, b, what)


def test_a_skipped_tile_is_not_computed():
    """Four documents of one tile each, no static layout (every query tile lists every key
    tile): the keys and values of document 2 are NaN. Its own queries see them, but every
    other query tile skips its tile, so their outputs and gradients stay finite and equal to
    a clean run's (computed, the tile would give ``0 * nan``: NaN)."""
    lq = 4 * TILE
    q, k, v = _qkv(6, lq, lq)
    ids = jnp.asarray(np.repeat(np.arange(4), TILE), jnp.int32)
    poison = (ids == 2)[:, None]
    others = np.asarray(ids != 2)

    def loss(q, k, v, ids):
        out = flex_attention(q, k, v, segment_ids=ids, block_q=TILE, block_k=TILE)
        return jnp.sum(jnp.where(poison, 0.0, out * jnp.cos(out))), out

    run = jit0(jax.value_and_grad(loss, (0, 1, 2), has_aux=True))
    (_, clean), g_clean = run(q, k, v, ids)
    (_, dirty), g_dirty = run(q, jnp.where(poison, jnp.nan, k), jnp.where(poison, jnp.nan, v),
                              ids)
    np.testing.assert_array_equal(np.asarray(dirty)[others], np.asarray(clean)[others])
    for what, a, b in zip(("dq", "dk", "dv"), g_dirty, g_clean):
        assert np.all(np.isfinite(np.asarray(a)[others])), what
        np.testing.assert_array_equal(np.asarray(a)[others], np.asarray(b)[others], what)


def _whole_transposes(jaxpr, shape) -> int:
    """Transposes producing ``shape`` outside any loop of ``jaxpr`` (nested calls included)."""
    n = 0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in ("while", "scan"):
            continue
        if eqn.primitive.name == "transpose" and eqn.outvars[0].aval.shape == shape:
            n += 1
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            n += _whole_transposes(sub, shape)
    return n


def test_sparse_layouts_walk_their_tiles_without_moving_all_keys():
    """Packed documents (each key tile used by one or two query tiles) are walked in the
    forward with a while loop: under ``multihead`` no transpose of the whole K or V to
    ``[H, L, D]`` precedes the walk (a scan's batching puts one there, which cost the
    documents' forward more time than its tiles); the result equals the scan's bit for bit.
    Causal flash (each key tile used by many) keeps the scan and its up-front transposes."""
    from xformers_jax.kernels import _tiled

    lq = 8 * TILE
    ks = jax.random.split(jax.random.PRNGKey(8), 3)
    q, k, v = (jax.random.normal(kk, (1, lq, H, D)) for kk in ks)
    docs = document_mask(np.repeat(np.arange(4), 2 * TILE)) & P.Causal()

    def documents(q, k, v):  # a new function each time: nothing cached from another trace
        return multihead(lambda q, k, v: flex_attention(q, k, v, mask_mod=docs, block_q=TILE,
                                                        block_k=TILE))(q, k, v)

    causal = multihead(lambda q, k, v: flash_attention(q, k, v, causal=True, block_q=TILE,
                                                       block_k=TILE))
    whole = (H, lq, D)
    assert _tiled._walk_by_while(docs.layout(lq, lq, TILE, TILE))
    assert _whole_transposes(jax.make_jaxpr(lambda *a: documents(*a))(q, k, v).jaxpr,
                             whole) == 0
    assert _whole_transposes(jax.make_jaxpr(causal)(q, k, v).jaxpr, whole) >= 2
    walked = jit0(lambda *a: documents(*a))(q, k, v)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_tiled, "_WHILE_MAX_USES", 0.0)
        assert _whole_transposes(jax.make_jaxpr(lambda *a: documents(*a))(q, k, v).jaxpr,
                                 whole) >= 2
        scanned = jit0(lambda *a: documents(*a))(q, k, v)
    np.testing.assert_array_equal(np.asarray(walked), np.asarray(scanned))


def _max_operands(jaxpr, producers=None) -> list:
    """The primitive producing the operand of each ``reduce_max`` in ``jaxpr`` (nested)."""
    made = {}
    out = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "reduce_max":
            out.append(made.get(eqn.invars[0]))
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            out += _max_operands(sub)
        for o in eqn.outvars:
            made[o] = eqn.primitive.name
    return out


def test_a_positive_final_scale_is_taken_out_of_the_row_maximum():
    """Gemma's soft-cap ``c * tanh(s / c)``: the forward takes each tile's row maximum of
    ``tanh(s / c)`` and scales it by ``c`` (equal bit for bit: rounding is monotone), so the
    maximum reads the ``tanh`` XLA writes out anyway rather than a copy of the tile scaled by
    ``c``; outputs equal the plain path's bit for bit. Only a last multiply by a positive
    literal qualifies."""
    from xformers_jax.kernels import _tiled

    ks = jax.random.split(jax.random.PRNGKey(11), 3)
    q, k, v = (3.0 * jax.random.normal(kk, (2 * TILE + 5, D)) for kk in ks)
    cap = soft_cap_score(2.0)

    def run(q, k, v):
        return flex_attention(q, k, v, score_mod=cap, causal=True, block_q=TILE, block_k=TILE)

    ops = _max_operands(jax.make_jaxpr(lambda *a: run(*a))(q, k, v).jaxpr)
    assert "tanh" in ops and set(ops) <= {"tanh", "jit"}, ops  # jit: where(), masked tiles
    got = jit0(lambda *a: run(*a))(q, k, v)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_tiled, "_positive_scale", lambda *a: None)
        assert "mul" in _max_operands(jax.make_jaxpr(lambda *a: run(*a))(q, k, v).jaxpr)
        plain = jit0(lambda *a: run(*a))(q, k, v)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(plain))
    for fn in (lambda s, b, h, i, j: -2.0 * jnp.tanh(s), lambda s, b, h, i, j: 2.0 * s + 1.0,
               lambda s, b, h, i, j: s * jnp.float32(jnp.inf)):
        assert _tiled._positive_scale(fn, TILE, TILE, [], []) is None
