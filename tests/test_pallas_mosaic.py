"""The Hopper (Mosaic GPU) flash forward, ``pallas_kernels._gpu_mosaic``.

On the CPU: the closed-form block walk against the planner (every layout the kernel accepts
is its band exactly; the blocks a CTA visits are the tiles its rows see; the unmasked run is
full for every row), an emulation of the kernel's three loops in NumPy against the dense
softmax, the lowering of forward and gradient for CUDA, the Triton fallback (interpret mode)
and dispatch by kernel name. On a Hopper GPU (``XFORMERS_JAX_TEST_PLATFORM=cuda``): the
compiled kernel against the XLA path, outputs and gradients.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels
from pallas_kernels import _gpu_mosaic as M
from pallas_kernels._common import PallasAttention
from tests.tolerances import assert_close
from xformers_jax import kernels
from xformers_jax.attention import (
    alibi_score,
    block_sparse_attention,
    flash_attention,
    flex_attention,
    multihead,
    soft_cap_score,
)
from xformers_jax.attention import patterns as P

ON_GPU = jax.default_backend() == "gpu"
BAND_PATTERNS = [P.Full(), P.Causal(), P.Local(200, 0), P.Local(130, 70)]
LENGTHS = [256, 1000]


def _plan(pattern, L):
    return kernels.plan(pattern.layout(L, L, M.BLOCK_Q, M.BLOCK_K), M.BLOCK_Q, M.BLOCK_K)


def _static(plan, band, d=64):
    return M._Static(lq=plan.nq * M.BLOCK_Q, lk=plan.lk, nk=plan.nk, left=band[0],
                     right=band[1], d=d, scale=d ** -0.5, dtype="bfloat16")


@pytest.mark.parametrize("L", LENGTHS)
@pytest.mark.parametrize("pattern", BAND_PATTERNS, ids=repr)
def test_band_is_the_whole_mask(pattern, L):
    plan = _plan(pattern, L)
    band = M.whole_band(plan)
    assert band is not None
    i, j = np.arange(L)[:, None], np.arange(L)[None, :]
    np.testing.assert_array_equal(M._band_mask(np.arange(L), np.arange(L), band, L),
                                  pattern.mask(i, j, L, L))


def test_non_band_layouts_are_refused():
    layout = P.Causal().layout(512, 512, 128, 128)
    kinds = np.array(layout.kinds)
    kinds[3, 0] = kernels.EMPTY  # a hole left of the diagonal: no band describes it
    holed = kernels.BlockLayout(512, 512, 128, 128, kinds, layout.mask_index,
                                layout.partial_masks)
    assert M.whole_band(kernels.plan(holed, 128, 128)) is None


@pytest.mark.parametrize("L", LENGTHS)
@pytest.mark.parametrize("pattern", BAND_PATTERNS, ids=repr)
def test_block_walk_matches_the_tiles(pattern, L):
    """The run a CTA walks holds every tile any of its 128 rows sees (padded rows included),
    and the unmasked part of it only tiles that every row sees whole."""
    plan = _plan(pattern, L)
    st = _static(plan, M.whole_band(plan))
    cols = np.arange(plan.nk * M.BLOCK_K)
    for a in range(plan.nq):
        rows = np.arange(a * M.BLOCK_Q, (a + 1) * M.BLOCK_Q)
        seen = M._band_mask(rows, cols, (st.left, st.right), L)
        per_block = seen.reshape(len(rows), plan.nk, M.BLOCK_K)
        any_seen = np.flatnonzero(per_block.any(axis=(0, 2)))
        all_seen = np.flatnonzero(per_block.all(axis=(0, 2)))
        first, n, f_lo, full_n = M.ranges_host(st, a * M.BLOCK_Q)
        walked = np.arange(first, first + n)
        assert set(any_seen) <= set(walked), (a, any_seen, walked)
        assert set(walked) <= set(range(plan.nk))
        np.testing.assert_array_equal(np.arange(f_lo, f_lo + full_n), all_seen)


def _emulate(st, q, k, v):
    """The kernel's algorithm in NumPy (float64): per CTA the masked, unmasked and masked loops
    of base-2 online softmax over the closed-form run, each warpgroup's 64 rows on its own."""
    out = np.zeros_like(q)
    lse = np.full(q.shape[0], -np.inf)
    c = st.scale / np.log(2.0)
    for a in range(st.lq // M.BLOCK_Q):
        first, n, f_lo, full_n = M.ranges_host(st, a * M.BLOCK_Q)
        for wg in range(M.COMPUTE_WGS):
            r = a * M.BLOCK_Q + wg * M.ROWS_PER_WG + np.arange(M.ROWS_PER_WG)
            m = np.full(len(r), -np.inf)
            l = np.zeros(len(r))
            acc = np.zeros((len(r), q.shape[1]))
            for t in range(n):
                cols = (first + t) * M.BLOCK_K + np.arange(M.BLOCK_K)
                s = q[r] @ k[cols].T * c
                masked = not (f_lo - first <= t < f_lo - first + full_n)
                if masked:
                    s = np.where(M._band_mask(r, cols, (st.left, st.right), st.lk), s, -np.inf)
                m_new = np.maximum(m, s.max(axis=1))
                shift = np.where(m_new == -np.inf, 0.0, m_new) if masked else m_new
                alpha = np.exp2(m - shift)
                p = np.exp2(s - shift[:, None])
                acc = acc * alpha[:, None] + p @ v[cols]
                l = l * alpha + p.sum(axis=1)
                m = m_new
            seen = l > 0
            out[r] = np.where(seen[:, None], acc / np.where(seen, l, 1.0)[:, None], 0.0)
            lse[r] = np.where(seen, m * np.log(2.0) + np.log(np.where(seen, l, 1.0)), -np.inf)
    return out, lse


@pytest.mark.parametrize("pattern,L", [(P.Causal(), 1000), (P.Local(130, 70), 700),
                                       (P.Full(), 300)], ids=repr)
def test_emulated_kernel_equals_softmax(pattern, L):
    plan = _plan(pattern, L)
    st = _static(plan, M.whole_band(plan), d=16)
    rng = np.random.default_rng(0)
    lq_p, lk_p = plan.nq * M.BLOCK_Q, plan.nk * M.BLOCK_K
    q = rng.normal(size=(lq_p, 16)) * 3  # large logits: the shifts matter
    k = rng.normal(size=(lk_p, 16)) * 3
    v = rng.normal(size=(lk_p, 16))
    out, lse = _emulate(st, q, k, v)
    s = q[:L] @ k[:L].T * st.scale
    mask = pattern.mask(np.arange(L)[:, None], np.arange(L)[None, :], L, L)
    s = np.where(mask, s, -np.inf)
    ref_lse = np.log(np.exp(s - s.max(1, keepdims=True)).sum(1)) + s.max(1)
    ref = np.exp(s - ref_lse[:, None]) @ v[:L]
    np.testing.assert_allclose(out[:L], ref, rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(lse[:L], ref_lse, rtol=1e-10, atol=1e-10)


def _lowered(pattern, L, D, grad, extra=()):
    kernel = PallasAttention("pallas_gpu_mosaic", "gpu", M, extra=extra)
    layout = pattern.layout(L, L, M.BLOCK_Q, M.BLOCK_K)

    def one(q, k, v):
        return kernel(q, k, v, layout, scale=D ** -0.5)[0]

    fwd = jax.vmap(jax.vmap(one, in_axes=(1, 1, 1), out_axes=1))
    f = fwd
    if grad:
        f = jax.grad(lambda q, k, v: fwd(q, k, v).astype(jnp.float32).sum(), argnums=(0, 1, 2))
    x = jax.ShapeDtypeStruct((2, L, 3, D), jnp.bfloat16)
    return jax.jit(f).trace(x, x, x).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("pattern,L,D,grad", [(P.Causal(), 1000, 128, True),
                                              (P.Local(200, 0), 512, 64, False)], ids=repr)
def test_lowers_for_cuda(pattern, L, D, grad):
    """Forward (and gradient: the dq and dk/dv kernels) lower for CUDA on this machine: one
    Mosaic GPU launch per kernel for all batch rows and heads (the vmaps folded into its
    grid), no Triton kernel."""
    text = _lowered(pattern, L, D, grad)
    assert text.count("custom_call @mosaic_gpu") == (3 if grad else 1)
    assert "__gpu$xla.gpu.triton" not in text


@pytest.mark.parametrize("tiles", [(128, 2), (64, 3), "reversed"])
def test_backward_tiles_lower(tiles):
    """The backward's other streamed tiles (``BWD_TILES``, for measuring) and the query tiles
    launched last to first (``REVERSED_Q``) lower for CUDA."""
    extra = (M.REVERSED_Q,) if tiles == "reversed" else ((M.BWD_TILES, *tiles),)
    text = _lowered(P.Causal(), 700, 64, True, extra=extra)
    assert text.count("custom_call @mosaic_gpu") == 3


def test_triton_backward_on_request():
    """The ``TRITON_BACKWARD`` option keeps the Triton backward kernels after this forward
    (the benchmark's comparison)."""
    text = _lowered(P.Causal(), 512, 64, True, extra=(M.TRITON_BACKWARD,))
    assert text.count("custom_call @mosaic_gpu") == 1
    assert "__gpu$xla.gpu.triton" in text


def _bwd_static(pattern, L, d=16, block=M.BWD_BLOCK):
    plan = _plan(pattern, L)
    band = M.whole_band(plan)
    lp = -(-L // M.BWD_HELD) * M.BWD_HELD
    return M._BwdStatic(lq=lp, lk=lp, lq_real=L, lk_real=L, left=band[0], right=band[1], d=d,
                        scale=d ** -0.5, dtype="bfloat16", block=block)


@pytest.mark.parametrize("block", [64, 128])
@pytest.mark.parametrize("L", LENGTHS)
@pytest.mark.parametrize("pattern", BAND_PATTERNS, ids=repr)
def test_backward_walks_match_the_tiles(pattern, L, block):
    """The dq kernel's walk over key blocks and the dk/dv kernel's over query blocks hold
    every block any of the CTA's 128 rows sees, and their unmasked runs only blocks every row
    sees whole (padded query rows see nothing in the dk/dv kernel)."""
    st = _bwd_static(pattern, L, block=block)
    b = st.block
    i_all, j_all = np.arange(st.lq), np.arange(st.lk)
    seen = M._band_mask(i_all, j_all, (st.left, st.right), L)
    # Padded keys: their dk/dv are computed and dropped, so the walk may count them as seen.
    seen_by_keys = M._band_mask(i_all, j_all, (st.left, st.right), st.lk) & (i_all < L)[:, None]
    for fn, vis in ((M.dq_walk, seen), (M.dkv_walk, seen_by_keys.T)):
        for a in range(vis.shape[0] // M.BWD_HELD):
            rows = vis[a * M.BWD_HELD:(a + 1) * M.BWD_HELD].reshape(M.BWD_HELD, -1, b)
            any_seen = np.flatnonzero(rows.any(axis=(0, 2)))
            all_seen = np.flatnonzero(rows.all(axis=(0, 2)))
            first, n, f_lo, full_n = M.walk_host(fn, st, a * M.BWD_HELD)
            assert set(any_seen) <= set(range(first, first + n)), (fn, a)
            np.testing.assert_array_equal(np.arange(f_lo, f_lo + full_n), all_seen)


def _emulate_backward(st, q, k, v, d_out, lse, delta):
    """The dq and dk/dv kernels' loops in NumPy (float64): the walks, the masks of the masked
    steps only, probabilities from the saved lse in base 2."""
    c = st.scale / np.log(2.0)
    lse2 = np.where(np.isfinite(lse), lse, np.inf) / np.log(2.0)
    dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
    blk, held = st.block, M.BWD_HELD
    for a in range(st.lq // held):
        first, n, f_lo, full_n = M.walk_host(M.dq_walk, st, a * held)
        r = a * held + np.arange(held)
        for t in range(n):
            cols = (first + t) * blk + np.arange(blk)
            s = q[r] @ k[cols].T * c
            if not (f_lo - first <= t < f_lo - first + full_n):
                keep = M._band_mask(r, cols, (st.left, st.right), st.lk_real)
                s = np.where(keep, s, -np.inf)
            p = np.exp2(s - lse2[r, None])
            ds = p * (d_out[r] @ v[cols].T - delta[r, None])
            dq[r] += ds @ k[cols] * st.scale
    for a in range(st.lk // held):
        first, n, f_lo, full_n = M.walk_host(M.dkv_walk, st, a * held)
        cols = a * held + np.arange(held)
        for t in range(n):
            r = (first + t) * blk + np.arange(blk)
            s = k[cols] @ q[r].T * c
            if not (f_lo - first <= t < f_lo - first + full_n):
                keep = M._band_mask(r, cols, (st.left, st.right), st.lk).T & (r < st.lq_real)
                s = np.where(keep, s, -np.inf)
            p = np.exp2(s - lse2[None, r])
            ds = p * (v[cols] @ d_out[r].T - delta[None, r])
            dv[cols] += p @ d_out[r]
            dk[cols] += ds @ q[r] * st.scale
    return dq, dk, dv


@pytest.mark.parametrize("pattern,L,block", [(P.Causal(), 1000, 64), (P.Local(130, 70), 700, 64),
                                             (P.Full(), 300, 64), (P.Causal(), 1000, 128)],
                         ids=repr)
def test_emulated_backward_equals_softmax_gradients(pattern, L, block):
    st = _bwd_static(pattern, L, block=block)
    rng = np.random.default_rng(1)
    q, k = (rng.normal(size=(st.lq, 16)) * 3 for _ in range(2))
    v, d_out = (rng.normal(size=(st.lq, 16)) for _ in range(2))
    q[L:] = k[L:] = v[L:] = d_out[L:] = 0.0  # the wrapper's padding
    mask = pattern.mask(np.arange(L)[:, None], np.arange(L)[None, :], L, L)
    _, lse, ref, delta = _reference(q[:L], k[:L], v[:L], d_out[:L], mask, st.scale)
    pad = lambda x, value: np.concatenate([x, np.full(st.lq - L, value)])  # noqa: E731
    got = _emulate_backward(st, q, k, v, d_out, pad(lse, np.inf), pad(delta, 0.0))
    for g, want in zip(got, ref):
        np.testing.assert_allclose(g[:L], want, rtol=1e-9, atol=1e-9)


def test_fallbacks_run_the_triton_forward():
    """Interpret mode (this CPU) takes the Triton forward (in interpret mode too), key masks
    included: equal to the XLA path."""
    kernel = PallasAttention("pallas_gpu_mosaic", "gpu", M, interpret=True)
    rng = np.random.default_rng(1)
    L, D = 200, 32
    q, k, v = (jnp.asarray(rng.normal(size=(L, D)), jnp.float32) for _ in range(3))
    kv_mask = jnp.arange(L) < 150
    layout = P.Causal().layout(L, L, 128, 128)
    out, lse = kernel(q, k, v, layout, kv_mask=kv_mask, scale=D ** -0.5)
    ref, ref_lse = flash_attention(q, k, v, causal=True, kv_mask=kv_mask, return_lse=True,
                                   implementation="xla")
    assert_close(out, ref)
    assert_close(lse, ref_lse)


def test_dispatch_by_name():
    names = [k.name for k in pallas_kernels.kernels_for("flash_attention")]
    assert "pallas_gpu_mosaic" in names
    q = jnp.ones((128, 64), jnp.bfloat16)
    if not ON_GPU:
        with pytest.raises(NotImplementedError, match="pallas_gpu_mosaic.*runs on backend"):
            flash_attention(q, q, q, implementation="pallas_gpu_mosaic")
    with pytest.raises(ValueError, match="registered kernel's name"):
        flash_attention(q, q, q, implementation="pallas_gpu_nope")


def _packed(L, rng):
    """Three documents and a key mask: ``(segment ids, key mask)``. The first key and three
    random ones are masked out, so the first query sees no key (its output is 0, its
    log-sum-exp -inf)."""
    seg = np.repeat(np.arange(3), [L // 3, L // 4, L - L // 3 - L // 4])
    valid = np.ones(L, bool)
    valid[[0, *rng.choice(np.arange(1, L), 3, replace=False)]] = False
    return seg, valid


CAP = 5.0  # Gemma's soft-cap, small enough to bend the scores of these inputs


def _reference(q, k, v, d_out, mask, scale, cap=None, sink=None):
    """Softmax attention in float64 over ``mask`` (with ``cap``: of the soft-capped scores
    ``cap tanh(s / cap)``; with ``sink``: a logit with no value in every row's softmax):
    ``(out, lse, (dq, dk, dv), delta)``."""
    raw = q @ k.T * scale
    s = np.where(mask, raw if cap is None else cap * np.tanh(raw / cap), -np.inf)
    seen = mask.any(1)  # a row that sees no key: out 0, lse -inf
    mx = np.where(seen[:, None], s, 0.0).max(1, keepdims=True)
    lse = np.where(seen, np.log(np.exp(s - mx).sum(1)) + mx[:, 0], -np.inf)
    if sink is not None:  # every row sees the sink: lse = log(exp(sink) + sum exp(s))
        lse, seen = np.logaddexp(lse, sink), np.ones_like(seen)
    p = np.where(seen[:, None], np.exp(s - np.where(seen, lse, 0.0)[:, None]), 0.0)
    out = p @ v
    delta = (d_out * out).sum(1)
    ds = p * (d_out @ v.T - delta[:, None])
    if cap is not None:
        ds = ds * (1 - np.tanh(raw / cap) ** 2)
    return out, lse, (ds @ k * scale, ds.T @ q * scale, p.T @ d_out), delta


def _rel(got, want):
    return np.linalg.norm(np.asarray(got, np.float64) - want) / np.linalg.norm(want)


@pytest.mark.parametrize("sink", [None, 1.5])
def test_interpreted_forward_with_documents_key_mask_and_soft_cap(sink):
    """The forward kernel in Mosaic GPU's interpreter (its schedule barrier skipped there),
    causal over three packed documents with keys masked out (``_codes``) and Gemma's
    soft-cap as flex attention's score function, with and without a sink logit (the row that
    sees no key then has out 0 and lse the sink), against float64: outputs and log-sum-exp."""
    L, D = 256, 64
    plan = _plan(P.Causal(), L)
    band = M.whole_band(plan)
    st = M._Static(lq=L, lk=L, nk=plan.nk, left=band[0], right=band[1], d=D, scale=D ** -0.5,
                   dtype="bfloat16", codes=True, score=soft_cap_score(CAP),
                   sink=sink is not None)
    rng = np.random.default_rng(2)
    q, k, v = (jnp.asarray(rng.normal(size=(1, L, D)) * 2, jnp.bfloat16) for _ in range(3))
    seg, valid = _packed(L, rng)
    codes = M._codes(jnp.asarray(valid), (jnp.asarray(seg), jnp.asarray(seg)), L, L)
    with M.interpreted():
        out, lse = M._kernel_call(st, 1)(
            q, k, v, *(c[None] for c in codes),
            *([jnp.full((1, 1, 1), sink, jnp.float32)] if sink is not None else []))
    i, j = np.arange(L)[:, None], np.arange(L)[None, :]
    mask = (j <= i) & (seg[:, None] == seg[None, :]) & valid[None, :]
    f64 = lambda x: np.asarray(x[0], np.float64)  # noqa: E731
    want, want_lse, _, _ = _reference(f64(q), f64(k), f64(v), f64(v), mask, st.scale, CAP,
                                      sink)
    assert _rel(out[0], want) < 1e-2
    np.testing.assert_allclose(np.asarray(lse[0]), want_lse, rtol=1e-5, atol=1e-5)


def _sparse_layout(L, rng, causal):
    """A random block layout of 128 x 128 tiles (about 40% kept, the diagonal from the third
    block on, none in the second row: a query block that sees no key), with ``causal`` only
    the tiles below the diagonal kept and the diagonal tiles causal."""
    from xformers_jax.kernels import EMPTY, FULL, PARTIAL, BlockLayout

    t = M.BLOCK_Q
    n = -(-L // t)
    kinds = np.where(rng.random((n, n)) < 0.4, FULL, EMPTY).astype(np.int8)
    kinds[1, :] = EMPTY  # a query block that sees no key
    kinds[np.arange(2, n), np.arange(2, n)] = FULL
    masks = np.zeros((0, t, t), bool)
    index = np.full((n, n), -1, np.int32)
    if causal:
        kinds = np.where(np.tri(n, n, -1, dtype=bool), kinds, EMPTY).astype(np.int8)
        kinds[np.arange(2, n), np.arange(2, n)] = PARTIAL
        index = np.where(kinds == PARTIAL, 0, -1).astype(np.int32)
        masks = np.tri(t, t, dtype=bool)[None]
    return BlockLayout(L, L, t, t, kinds, index, masks)


@pytest.mark.parametrize("L,causal,packed", [(400, True, False), (450, False, False),
                                             (512, False, True)])
def test_interpreted_forward_walks_listed_blocks(L, causal, packed):
    """A block-sparse layout (no band) in the forward kernel, run in Mosaic GPU's interpreter:
    each query block visits its listed key blocks (``listed_walk``: the causal diagonal and
    tiles past the last key masked, the others whole) and nothing else; outputs and
    log-sum-exp against float64 over the layout's dense mask (an empty query block included:
    out 0, lse -inf), with packed rows and a key mask on top; the causal layout with its
    query tiles launched last to first (``REVERSED_Q``)."""
    rng = np.random.default_rng(L)
    layout = _sparse_layout(L, rng, causal)
    plan = kernels.plan(layout, M.BLOCK_Q, M.BLOCK_K)
    assert M.whole_band(plan) is None
    band, listed = M.listed_walk(plan)
    lq = plan.nq * M.BLOCK_Q
    st = M._Static(lq=lq, lk=L, nk=plan.nk, left=band[0], right=band[1], d=64,
                   scale=64 ** -0.5, dtype="bfloat16", codes=packed, listed=listed,
                   reversed_q=causal)
    q = jnp.asarray(rng.normal(size=(1, lq, 64)), jnp.bfloat16)
    k, v = (jnp.asarray(rng.normal(size=(1, plan.nk * M.BLOCK_K, 64)), jnp.bfloat16)
            for _ in range(2))
    mask = layout.dense()[:L, :L]
    codes = ()
    if packed:
        seg, valid = _packed(L, rng)
        q_code, k_code = M._codes(jnp.asarray(valid), (jnp.asarray(seg), jnp.asarray(seg)), L, L)
        codes = (kernels.pad_to(q_code, lq, 0, -1)[None],
                 kernels.pad_to(k_code, plan.nk * M.BLOCK_K, 0, -2)[None])
        mask = mask & (seg[:, None] == seg[None, :]) & valid[None, :]
    with M.interpreted():
        out, lse = M._kernel_call(st, 1)(q, k, v, *codes, jnp.asarray(listed, jnp.int32))
    f64 = lambda x: np.asarray(x[0, :L], np.float64)  # noqa: E731
    want, want_lse, _, _ = _reference(f64(q), f64(k), f64(v), f64(v), mask, st.scale, None)
    assert not mask[M.BLOCK_Q:2 * M.BLOCK_Q].any()
    assert _rel(out[0, :L], want) < 1e-2
    np.testing.assert_allclose(np.asarray(lse[0, :L]), want_lse, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("L,causal,tiles", [(400, True, (64, 2)), (330, False, (128, 3))])
def test_interpreted_backward_walks_listed_blocks(L, causal, tiles):
    """The dq and dk/dv kernels on a block-sparse layout (``listed_walks``: each dq CTA's key
    blocks and each dk/dv CTA's query blocks read from tables, the causal diagonal and the
    tiles past the last key or query masked), run in Mosaic GPU's interpreter against the
    softmax's gradients in float64 over the layout's dense mask (a query block that sees no
    key included), at the default tiles (the dq kernel's query tiles launched last to first,
    ``REVERSED_Q``) and at 128-row tiles in three stages."""
    D = 64
    lp = -(-L // M.BWD_HELD) * M.BWD_HELD
    rng = np.random.default_rng(L + 1)
    layout = _sparse_layout(L, rng, causal)
    band, dq_rows, dkv_rows = M.listed_walks(layout, tiles[0])
    assert (len(dq_rows), len(dkv_rows)) == (lp // M.BWD_HELD,) * 2
    st = M._BwdStatic(lq=lp, lk=lp, lq_real=L, lk_real=L, left=band[0], right=band[1], d=D,
                      scale=D ** -0.5, dtype="bfloat16", block=tiles[0], stages=tiles[1],
                      listed=(dq_rows, dkv_rows), reversed_q=causal)
    q, k, v, d_out = _backward_inputs(L, lp, D, rng)
    mask = layout.dense()[:L, :L]
    walks = [jnp.asarray(rows, jnp.int32) for rows in st.listed]
    _check_interpreted_backward(st, L, (q, k, v, d_out), mask, None, walks)


@pytest.mark.parametrize("sparse", [True, False])
def test_sparse_layouts_lower_to_the_mosaic_kernels(sparse, monkeypatch):
    """A block-sparse layout lowers for CUDA to the three Mosaic kernels (their listed
    walks; Mosaic GPU's lowering reads the walks' tables from global memory), no Triton;
    ``XFORMERS_JAX_MOSAIC_SPARSE=0`` (``MOSAIC_SPARSE``) keeps it all on Triton."""
    monkeypatch.setattr(M, "MOSAIC_SPARSE", sparse)
    L, D = 600, 64
    layout = _sparse_layout(L, np.random.default_rng(1), True)
    kernel = PallasAttention("pallas_gpu_mosaic", "gpu", M)

    def one(q, k, v):
        return kernel(q, k, v, layout, scale=D ** -0.5)[0]

    heads = jax.vmap(jax.vmap(one, in_axes=(1, 1, 1), out_axes=1))
    f = jax.grad(lambda q, k, v: heads(q, k, v).astype(jnp.float32).sum(), argnums=(0, 1, 2))
    x = jax.ShapeDtypeStruct((2, L, 3, D), jnp.bfloat16)
    text = jax.jit(f).trace(x, x, x).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("custom_call @mosaic_gpu") == (3 if sparse else 0)
    assert ("__gpu$xla.gpu.triton" in text) != sparse


def test_listed_walk_refuses_other_partial_tiles():
    """A partial tile whose mask is not the band (here a random one) keeps the Triton
    forward."""
    from xformers_jax.kernels import EMPTY, PARTIAL, BlockLayout

    t = M.BLOCK_Q
    kinds = np.full((2, 2), EMPTY, np.int8)
    kinds[0, 1] = PARTIAL
    masks = np.random.default_rng(0).random((1, t, t)) < 0.5
    layout = BlockLayout(2 * t, 2 * t, t, t, kinds, np.where(kinds == PARTIAL, 0, -1), masks)
    assert M.listed_walk(kernels.plan(layout, t, t)) is None


def _backward_inputs(L, lp, d, rng):
    """``q, k, v, d_out`` ``bf16[1, lp, d]``: normal draws (times 2) on the first ``L`` rows,
    zeros on the padding."""
    x = [np.where(np.arange(lp)[:, None] < L, rng.normal(size=(lp, d)) * 2, 0.0)
         for _ in range(4)]
    return tuple(jnp.asarray(a[None], jnp.bfloat16) for a in x)


def _check_interpreted_backward(st, L, inputs, mask, cap, extra):
    """The dq and dk/dv kernels of ``st`` in Mosaic GPU's interpreter on ``inputs`` (and the
    kernels' ``extra`` inputs: codes or walks) against float64 gradients over ``mask``."""
    q, k, v, d_out = inputs
    lp = q.shape[1]
    f64 = lambda a: np.asarray(a[0, :L], np.float64)  # noqa: E731
    _, lse, want, delta = _reference(f64(q), f64(k), f64(v), f64(d_out), mask, st.scale, cap)
    lse = np.where(np.isfinite(lse), lse, np.inf)  # backward_stats: +inf where nothing seen
    stats = [jnp.asarray(np.concatenate([a, np.full(lp - L, fill)])[None], jnp.float32)
             for a, fill in ((lse, np.inf), (delta, 0.0))]
    with M.interpreted():
        dq = M._dq_call(st, 1)(q, k, v, d_out, *stats, *extra)
        dk, dv = M._dkv_call(st, 1)(q, k, v, d_out, *stats, *extra)
    for name, got, ref in zip(("dq", "dk", "dv"), (dq, dk, dv), want):
        err = _rel(got[0, :L], ref)
        assert err < 1e-2, (name, err)  # bf16 operands and outputs


@pytest.mark.parametrize("pattern,L,tiles,packed", [(P.Causal(), 256, (64, 2), True),
                                                    (P.Local(100, 30), 200, (128, 3), False)],
                         ids=repr)
def test_interpreted_backward_equals_the_gradients(pattern, L, tiles, packed):
    """The dq and dk/dv kernels themselves, run in Mosaic GPU's interpreter on this CPU (its
    warpgroups, barriers, shared memory and TMA copies simulated; the matrix products as
    plain dots), against the softmax's gradients in float64: the walks, masks, padding,
    statistics and the copy/barrier protocol, at the default tiles over three packed
    documents with keys masked out and Gemma's soft-cap as the score function (its
    derivative taken in the tile), and at 128-row tiles in three stages."""
    D = 64
    lp = -(-L // M.BWD_HELD) * M.BWD_HELD
    band = M.whole_band(_plan(pattern, L))
    st = M._BwdStatic(lq=lp, lk=lp, lq_real=L, lk_real=L, left=band[0], right=band[1], d=D,
                      scale=D ** -0.5, dtype="bfloat16", block=tiles[0], stages=tiles[1],
                      codes=packed, score=soft_cap_score(CAP) if packed else None)
    rng = np.random.default_rng(L)
    q, k, v, d_out = _backward_inputs(L, lp, D, rng)
    i, j = np.arange(L)[:, None], np.arange(L)[None, :]
    mask = pattern.mask(i, j, L, L)
    codes = ()
    if packed:
        seg, valid = _packed(L, rng)
        mask = mask & (seg[:, None] == seg[None, :]) & valid[None, :]
        q_code, k_code = M._codes(jnp.asarray(valid), (jnp.asarray(seg), jnp.asarray(seg)), L,
                                  L)
        codes = tuple(kernels.pad_to(c, lp, 0, fill)[None]
                      for c, fill in ((q_code, -1), (k_code, -2)))
    _check_interpreted_backward(st, L, (q, k, v, d_out), mask, CAP if packed else None, codes)


def test_score_functions_these_kernels_apply():
    """Elementwise score functions of the scores and positions run in the Mosaic kernels;
    functions that capture arrays (ALiBi's slopes) or read the head index do not."""
    from pallas_kernels._common import Flex

    def flex(fn, counts=(0, 0, 0)):
        return Flex(None, None, False, counts, (), fn)

    cap = soft_cap_score(CAP)
    assert M.mosaic_score(flex(cap)) is cap
    assert M.mosaic_score(flex(lambda s, b, h, i, j: s - 0.1 * jnp.abs(i - j))) is not None
    assert M.mosaic_score(flex(alibi_score(jnp.ones(4)), (0, 1, 0))) is None
    assert M.mosaic_score(flex(lambda s, b, h, i, j: s + h)) is None
    assert M.mosaic_score(flex(lambda s, b, h, i, j: s - s.max(1, keepdims=True))) is None


@pytest.mark.parametrize("score,mosaic", [("soft-cap", True), ("by head", False),
                                          ("sink", True), ("soft-cap and sink", True)])
def test_flex_lowers_to_the_mosaic_kernels(score, mosaic):
    """Flex attention with Gemma's soft-cap, with a sink per head (GPT-OSS's), or both lowers
    for CUDA to the three Mosaic kernels; with a bias that reads the head index, to the
    Triton ones."""
    L, D = 512, 64
    layout = P.Causal().layout(L, L, M.BLOCK_Q, M.BLOCK_K)
    kernel = PallasAttention("pallas_gpu_mosaic", "gpu", M)
    fn = {"soft-cap": soft_cap_score(CAP), "sink": None, "soft-cap and sink": soft_cap_score(CAP),
          "by head": lambda s, b, h, i, j: s - 0.01 * h * jnp.abs(i - j)}[score]
    sinks = jnp.linspace(-1.0, 1.0, 3) if "sink" in score else None

    def one(q, k, v, h, sink):
        return kernel(q, k, v, layout, scale=D ** -0.5, score_mod=fn, index=(0, h),
                      sink=sink)[0]

    heads = jax.vmap(one, in_axes=(1, 1, 1, 0, None if sinks is None else 0), out_axes=1)
    f = jax.grad(lambda q, k, v: jax.vmap(heads, in_axes=(0, 0, 0, None, None))(
        q, k, v, jnp.arange(3), sinks).astype(jnp.float32).sum(), argnums=(0, 1, 2))
    x = jax.ShapeDtypeStruct((2, L, 3, D), jnp.bfloat16)
    text = jax.jit(f).trace(x, x, x).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("custom_call @mosaic_gpu") == (3 if mosaic else 0)
    assert ("__gpu$xla.gpu.triton" in text) != mosaic


def test_packed_rows_lower_to_the_mosaic_kernels():
    """Key masks and segment ids run in the Mosaic kernels (forward, dq, dk/dv) when lowered
    for CUDA, not the Triton ones; ``XFORMERS_JAX_MOSAIC_MASKS=0`` (``MOSAIC_MASKS``) keeps
    them on Triton."""
    L, D = 700, 64
    layout = P.Causal().layout(L, L, M.BLOCK_Q, M.BLOCK_K)
    kernel = PallasAttention("pallas_gpu_mosaic", "gpu", M)

    def lowered():
        def one(q, k, v, seg, valid):
            return kernel(q, k, v, layout, scale=D ** -0.5, kv_mask=valid,
                          segments=(seg, seg))[0]

        heads = jax.vmap(one, in_axes=(1, 1, 1, None, None), out_axes=1)
        f = jax.grad(lambda *a: jax.vmap(heads)(*a).astype(jnp.float32).sum(),
                     argnums=(0, 1, 2))
        x = jax.ShapeDtypeStruct((2, L, 3, D), jnp.bfloat16)
        ids = jax.ShapeDtypeStruct((2, L), jnp.int32)
        valid = jax.ShapeDtypeStruct((2, L), jnp.bool_)
        return jax.jit(f).trace(x, x, x, ids, valid).lower(
            lowering_platforms=("cuda",)).as_text()

    text = lowered()
    assert text.count("custom_call @mosaic_gpu") == 3
    assert "__gpu$xla.gpu.triton" not in text
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(M, "MOSAIC_MASKS", False)
        text = lowered()
    assert "custom_call @mosaic_gpu" not in text


@pytest.mark.skipif(not ON_GPU, reason="needs a Hopper GPU")
@pytest.mark.parametrize("causal,L,D,window,packed", [
    (False, 2048, 64, None, False), (True, 1000, 128, None, False),
    (True, 2048, 128, None, False), (True, 1536, 64, 300, False), (True, 1000, 64, None, True),
    (True, 2048, 128, None, True), (True, 1000, 64, None, "soft-cap"),
    (True, 2048, 128, None, "soft-cap"), (True, 1000, 64, None, "sink")])
def test_compiled_kernel_equals_xla(causal, L, D, window, packed):
    """bf16 inputs, 2 x 4 heads with 2 key/value heads (GQA): outputs and gradients against
    the XLA path in float32 on the same inputs; ``packed``: three documents per row
    (segment ids) and a key mask; ``"soft-cap"``: flex attention with Gemma's soft-cap as its
    score function (applied in the Mosaic kernels' tiles); ``"sink"``: flex attention with a
    sink logit."""
    ks = jax.random.split(jax.random.PRNGKey(L + D), 4)
    q = jax.random.normal(ks[0], (2, L, 4, D), jnp.bfloat16)
    k, v = (jax.random.normal(kk, (2, L, 2, D), jnp.bfloat16) for kk in ks[1:3])
    d_out = jax.random.normal(ks[3], (2, L, 4, D), jnp.float32)
    pattern = None if window is None else P.Local(window, 0)
    lifted = multihead(flash_attention)

    extra = {}
    if packed == "soft-cap":
        lifted = multihead(flex_attention)
        extra = dict(score_mod=soft_cap_score(CAP))
    elif packed == "sink":
        lifted = multihead(flex_attention)
        extra = dict(sink=jnp.float32(1.5))
    elif packed:
        seg, valid = _packed(L, np.random.default_rng(L))
        extra = dict(segment_ids=jnp.asarray(np.stack([seg, seg[::-1]]), jnp.int32),
                     kv_mask=jnp.asarray(np.stack([valid, valid[::-1]])))

    def loss(impl, dtype):
        def f(q, k, v):
            kw = dict(causal=causal) if pattern is None else dict(pattern=pattern)
            kw.update(extra)
            out = lifted(q.astype(dtype), k.astype(dtype), v.astype(dtype), implementation=impl,
                         **kw)
            return (out.astype(jnp.float32) * d_out).sum(), out
        return jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True))

    (_, out), grads = loss("pallas_gpu_mosaic", jnp.bfloat16)(q, k, v)
    (_, ref), ref_grads = loss("xla", jnp.float32)(q, k, v)
    err = lambda a, b: float(jnp.linalg.norm(a.astype(jnp.float32) - b)
                             / jnp.linalg.norm(b))
    assert bool(jnp.isfinite(out.astype(jnp.float32)).all())
    assert err(out, ref) < 1e-2, err(out, ref)
    for g, r in zip(grads, ref_grads):
        assert err(g, r) < 2e-2, err(g, r)


@pytest.mark.skipif(not ON_GPU, reason="needs a Hopper GPU")
@pytest.mark.parametrize("tiles", [(128, 2), (128, 3)])
def test_compiled_backward_tiles_equal_xla(tiles):
    """The backward's other streamed tiles (``BWD_TILES``; 128 rows were 12% faster than the
    default 64 at D = 64, 8K, on an H200) compiled: gradients against the XLA path in
    float32, causal, L = 1000 (a partial last tile)."""
    L, D = 1000, 64
    ks = jax.random.split(jax.random.PRNGKey(7), 4)
    q, k, v = (jax.random.normal(kk, (2, L, 3, D), jnp.bfloat16) for kk in ks[:3])
    d_out = jax.random.normal(ks[3], (2, L, 3, D), jnp.float32)
    kernel = PallasAttention("pallas_gpu_mosaic", "gpu", M, extra=((M.BWD_TILES, *tiles),))
    layout = P.Causal().layout(L, L, M.BLOCK_Q, M.BLOCK_K)
    heads = jax.vmap(jax.vmap(lambda q, k, v: kernel(q, k, v, layout, scale=D ** -0.5)[0],
                              in_axes=(1, 1, 1), out_axes=1))
    xla = multihead(lambda q, k, v: flash_attention(q, k, v, causal=True, implementation="xla"))

    def grads(fn, dtype):
        f = lambda q, k, v: (fn(*(x.astype(dtype) for x in (q, k, v))).astype(jnp.float32)  # noqa: E731
                             * d_out).sum()
        return jax.jit(jax.grad(f, argnums=(0, 1, 2)))(q, k, v)

    for g, r in zip(grads(heads, jnp.bfloat16), grads(xla, jnp.float32)):
        err = float(jnp.linalg.norm(g.astype(jnp.float32) - r) / jnp.linalg.norm(r))
        assert err < 2e-2, err


@pytest.mark.skipif(not ON_GPU, reason="needs a Hopper GPU")
@pytest.mark.parametrize("L,causal", [(1000, True), (2048, False)])
def test_compiled_sparse_layout_equals_xla(L, causal):
    """A random block-sparse layout (the Mosaic kernels' listed walks) compiled: outputs and
    gradients against the XLA path in float32, GQA."""
    ks = jax.random.split(jax.random.PRNGKey(L), 4)
    q = jax.random.normal(ks[0], (2, L, 4, 64), jnp.bfloat16)
    k, v = (jax.random.normal(kk, (2, L, 2, 64), jnp.bfloat16) for kk in ks[1:3])
    d_out = jax.random.normal(ks[3], (2, L, 4, 64), jnp.float32)
    layout = _sparse_layout(L, np.random.default_rng(L), causal)
    lifted = multihead(block_sparse_attention)

    def loss(impl, dtype):
        def f(q, k, v):
            out = lifted(*(x.astype(dtype) for x in (q, k, v)), layout, implementation=impl)
            return (out.astype(jnp.float32) * d_out).sum(), out
        return jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True))

    (_, out), grads = loss("pallas_gpu_mosaic", jnp.bfloat16)(q, k, v)
    (_, ref), ref_grads = loss("xla", jnp.float32)(q, k, v)
    err = lambda a, b: float(jnp.linalg.norm(a.astype(jnp.float32) - b)  # noqa: E731
                             / jnp.linalg.norm(b))
    assert err(out, ref) < 1e-2, err(out, ref)
    for g, r in zip(grads, ref_grads):
        assert err(g, r) < 2e-2, err(g, r)
