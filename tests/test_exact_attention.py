"""flash_attention and block_sparse_attention against the dense reference."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.fast_jit import jit0
from tests.tolerances import EXACT, EXACT_GRAD, assert_close
from xformers_jax.attention import (block_sparse_attention, dot_product_attention,
                                    flash_attention, multihead)
from xformers_jax.attention.patterns import Causal, Local, Segments

BLOCKS = dict(block_q=16, block_k=8)  # small tiles so every case spans many of them


@pytest.fixture(params=["natural", "transposed"])
def orientation(request, monkeypatch):
    """Runs a test with the backward pass computing tiles in each orientation (large tiles are
    computed transposed, small ones not: see ``kernels._tiled._TRANSPOSE_FROM``), one tile
    per scan step (row gathering, which has no transposed form, is tested on its own below)."""
    from xformers_jax.kernels import _tiled

    monkeypatch.setattr(_tiled, "_TRANSPOSE_FROM", 0 if request.param == "transposed"
                        else 2**62)
    monkeypatch.setattr(_tiled, "_GATHER_MAX_BK", 0)
    return request.param


def _qkv(key, lq, lk, dk=16, dv=None, dtype=jnp.float32):
    kq, kk, kv = jax.random.split(key, 3)
    dv = dv or dk
    return (jax.random.normal(kq, (lq, dk), dtype), jax.random.normal(kk, (lk, dk), dtype),
            jax.random.normal(kv, (lk, dv), dtype))


CASES = {
    "plain": dict(),
    "causal": dict(causal=True),
    "padding": dict(kv_mask="half"),
    "causal+padding": dict(causal=True, kv_mask="half"),
    "segments": dict(segment_ids=True),
    "local": dict(pattern=Local(5, 3)),
    "causal local": dict(causal=True, pattern=Local(7, 0)),
    "array bias": dict(bias="array"),
    "callable bias": dict(bias="callable"),
    "dropout": dict(dropout_rate=0.25),
}


def _materialise(kw, key, lq, lk):
    kw = dict(kw)
    if kw.get("kv_mask") == "half":
        kw["kv_mask"] = jnp.arange(lk) < (lk + 1) // 2
    if kw.get("segment_ids"):
        kw["segment_ids"] = jnp.asarray(np.repeat(np.arange(4), -(-lq // 4))[:lq])
    if kw.get("bias") == "array":
        kw["bias"] = jax.random.normal(key, (lq, lk))
    elif kw.get("bias") == "callable":
        kw["bias"] = lambda i, j: -0.05 * jnp.abs(i - j).astype(jnp.float32)
    if "dropout_rate" in kw:
        kw["key"] = key
    return kw


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("lq,lk,dv", [(37, 37, 16), (21, 45, 24)])
def test_flash_equals_reference(key, case, lq, lk, dv, orientation):
    if case == "segments" and lq != lk:
        pytest.skip("a single segment_ids array is for self-attention (pairs tested below)")
    q, k, v = _qkv(key, lq, lk, dv=dv)
    kw = _materialise(CASES[case], jax.random.fold_in(key, 7), lq, lk)
    out, ref, g_out, g_ref = _against_reference(
        functools.partial(flash_attention, **BLOCKS), kw, q, k, v)
    assert_close(out, ref)
    for a, b in zip(g_out, g_ref):
        assert_close(a, b, EXACT_GRAD)


def _against_reference(flash, kw, q, k, v):
    """``(out, ref, flash's gradients, the reference's)``, the gradients of
    ``sum(sin(attention))`` with respect to q, k, v and an array bias, as one compiled program
    (called eagerly, every operation compiles on its own at every new shape)."""
    array_bias = "bias" in kw and not callable(kw["bias"])
    argnums = (0, 1, 2, 3) if array_bias else (0, 1, 2)

    def run(q, k, v, b):
        extra = dict(kw, bias=b) if array_bias else kw

        def loss(fn, q, k, v, b):
            return jnp.sum(jnp.sin(fn(q, k, v, **(dict(kw, bias=b) if array_bias else kw))))

        return (flash(q, k, v, **extra), dot_product_attention(q, k, v, **extra),
                jax.grad(functools.partial(loss, flash), argnums)(q, k, v, b),
                jax.grad(functools.partial(loss, dot_product_attention), argnums)(q, k, v, b))

    return jit0(run)(q, k, v, kw.get("bias") if array_bias else None)


@pytest.mark.parametrize("case", list(CASES))
def test_row_gathered_tiles_equal_reference(key, case):
    """Small tiles run row-gathered (several key tiles of a query block per scan step, rows
    padded with masked tiles): outputs and gradients still equal the reference, and the
    kernel really gathers here."""
    from xformers_jax.kernels import _tiled

    lq = lk = 45
    q, k, v = _qkv(key, lq, lk, dv=24)
    kw = _materialise(CASES[case], jax.random.fold_in(key, 7), lq, lk)
    pattern = kw.pop("pattern", None)
    causal = kw.get("causal", False)
    layout = (pattern or Local(lq, lk)).layout(lq, lk, 8, 8) if not causal else None
    if layout is not None:
        assert _tiled._gather_width(layout) > 1
    flash = functools.partial(flash_attention, block_q=8, block_k=8)
    out, ref, g_out, g_ref = _against_reference(flash, dict(kw, pattern=pattern), q, k, v)
    assert_close(out, ref)
    for a, b in zip(g_out, g_ref):
        assert_close(a, b, EXACT_GRAD)


def test_row_gathered_callable_bias_with_parameters(key):
    """A callable bias traced at one tile's shape (an explicit broadcast) still runs over a
    row-gathered group, and its closed-over parameter gets the reference's gradient."""
    q, k, v = _qkv(key, 40, 40)
    pattern = Local(12, 12)

    def loss(fn, w):
        bias = lambda i, j: (w[0] * jnp.abs(i - j).astype(jnp.float32)  # noqa: E731
                             + jnp.zeros((i.shape[0], j.shape[1])))  # fixed at trace time
        return jnp.sum(jnp.sin(fn(q, k, v, pattern=pattern, bias=bias)))

    w = jnp.array([-0.1])
    flash = functools.partial(flash_attention, block_q=8, block_k=8)
    val, g = jax.value_and_grad(functools.partial(loss, flash))(w)
    val_ref, g_ref = jax.value_and_grad(functools.partial(loss, dot_product_attention))(w)
    assert_close(val, val_ref)
    assert_close(g, g_ref, EXACT_GRAD)


def test_gather_width_rule():
    """The group size trades padded tiles against scan steps (``_tiled._gather_width``)."""
    from xformers_jax.attention.patterns import BigBird
    from xformers_jax.kernels import _tiled

    assert _tiled._gather_width(Local(256, 256).layout(8192, 8192, 64, 64)) == 5
    big = BigBird(64, num_window_blocks=3, num_global_blocks=2, num_random_blocks=3, seed=0)
    assert _tiled._gather_width(big.layout(8192, 8192, 64, 64)) == 8
    assert _tiled._gather_width(Local(256, 256).layout(8192, 8192, 256, 256)) == 0  # big tiles
    assert _tiled._gather_width(Local(0, 0).layout(64, 64, 8, 8)) == 0  # one tile per row


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("causal", [False, True])
def test_low_precision_inputs(key, dtype, causal, orientation):
    q, k, v = _qkv(key, 40, 40, dtype=dtype)

    def run(q, k, v):  # one compiled program
        out = flash_attention(q, k, v, causal=causal, **BLOCKS)
        ref = dot_product_attention(*(x.astype(jnp.float32) for x in (q, k, v)), causal=causal)
        grads = jax.grad(lambda q: jnp.sum(flash_attention(q, k, v, causal=causal, **BLOCKS)
                                           .astype(jnp.float32)))(q)
        ref_g = jax.grad(lambda q: jnp.sum(dot_product_attention(
            q, k.astype(jnp.float32), v.astype(jnp.float32), causal=causal)))(
            q.astype(jnp.float32))
        return out, ref, grads, ref_g

    out, ref, grads, ref_g = jit0(run)(q, k, v)
    assert out.dtype == dtype
    assert_close(out, ref, EXACT, dtype=dtype)
    assert grads.dtype == dtype
    assert_close(grads, ref_g, EXACT_GRAD, dtype=dtype)


def test_segment_pairs_for_cross_attention(key):
    q, k, v = _qkv(key, 12, 20)
    segs = (jnp.array([0] * 6 + [1] * 6), jnp.array([0] * 5 + [1] * 10 + [2] * 5))
    assert_close(flash_attention(q, k, v, segment_ids=segs, **BLOCKS),
                 dot_product_attention(q, k, v, segment_ids=segs))


def test_callable_bias_gradient_reaches_closed_over_parameters(key, orientation):
    q, k, v = _qkv(key, 33, 33)

    def loss(fn, slope):
        bias = lambda i, j: -slope * jnp.abs(i - j).astype(jnp.float32)  # noqa: E731 (ALiBi)
        return jnp.sum(fn(q, k, v, bias=bias, causal=True) ** 2)

    g_ref = jax.grad(functools.partial(loss, dot_product_attention))(0.3)
    g = jax.grad(functools.partial(loss, functools.partial(flash_attention, **BLOCKS)))(0.3)
    assert abs(float(g_ref)) > 1e-3
    np.testing.assert_allclose(g, g_ref, rtol=1e-4)


@given(
    lq=st.integers(1, 70), lk=st.integers(1, 70), bq=st.sampled_from([8, 16, 32]),
    bk=st.sampled_from([8, 16, 32]), causal=st.booleans(), seed=st.integers(0, 2**16),
    masked=st.booleans(),
)
def test_flash_matches_reference_on_random_shapes(lq, lk, bq, bk, causal, seed, masked):
    key = jax.random.PRNGKey(seed)
    q, k, v = _qkv(key, lq, lk, dk=8)
    kv_mask = jax.random.bernoulli(jax.random.fold_in(key, 1), 0.7, (lk,)) if masked else None
    ref, out = jit0(lambda q, k, v, kv_mask: (  # one program per example's shapes
        dot_product_attention(q, k, v, causal=causal, kv_mask=kv_mask),
        flash_attention(q, k, v, causal=causal, kv_mask=kv_mask, block_q=bq, block_k=bk)))(
        q, k, v, kv_mask)
    assert_close(out, ref)


def test_causal_no_leak(key):
    q, k, v = _qkv(key, 48, 48)
    t = 20
    f = functools.partial(flash_attention, causal=True, **BLOCKS)
    out = f(q, k, v)
    k2 = k.at[t + 1 :].add(10.0)
    v2 = v.at[t + 1 :].add(-7.0)
    np.testing.assert_array_equal(f(q, k2, v2)[: t + 1], out[: t + 1])
    gk, gv = jax.grad(lambda k, v: jnp.sum(f(q, k, v)[: t + 1] ** 2), (0, 1))(k, v)
    assert not np.any(gk[t + 1 :]) and not np.any(gv[t + 1 :])
    assert np.any(gk[: t + 1])


def test_padding_invariance(key):
    q, k, v = _qkv(key, 30, 30)
    mask = jnp.arange(30) < 17
    f = functools.partial(flash_attention, kv_mask=mask, **BLOCKS)
    noise = jax.random.normal(key, (13, 16)) * 100
    out = f(q, k, v)
    out2 = f(q, k.at[17:].set(noise), v.at[17:].set(noise))
    np.testing.assert_allclose(out, out2, atol=1e-6)
    gk = jax.grad(lambda k: jnp.sum(f(q, k, v) ** 2))(k)
    assert not np.any(gk[17:])


@pytest.mark.parametrize("fn", [dot_product_attention,
                                functools.partial(flash_attention, **BLOCKS)])
def test_fully_masked_rows_give_zeros_and_finite_gradients(key, fn):
    q, k, v = _qkv(key, 20, 20)
    segs = (jnp.array([0] * 10 + [5] * 10), jnp.zeros(20, jnp.int32))  # rows 10.. see nothing
    out = fn(q, k, v, segment_ids=segs)
    np.testing.assert_array_equal(out[10:], 0.0)
    assert np.all(np.isfinite(out))
    grads = jax.grad(lambda q, k, v: jnp.sum(fn(q, k, v, segment_ids=segs) ** 2), (0, 1, 2))(q, k, v)
    for g in grads:
        assert np.all(np.isfinite(g))
    np.testing.assert_array_equal(grads[0][10:], 0.0)
    all_masked = fn(q, k, v, kv_mask=jnp.zeros(20, bool))
    np.testing.assert_array_equal(all_masked, 0.0)


def test_return_lse(key):
    q, k, v = _qkv(key, 25, 31)
    mask = jnp.arange(31) < 20
    _, lse = flash_attention(q, k, v, kv_mask=mask, causal=True, return_lse=True, **BLOCKS)
    s = (q @ k.T) / 4.0
    s = jnp.where(mask[None] & (jnp.arange(31)[None] <= jnp.arange(25)[:, None]), s, -jnp.inf)
    np.testing.assert_allclose(lse, jax.nn.logsumexp(s, axis=-1), rtol=1e-5, atol=1e-5)


def test_dropout_is_deterministic_per_key_and_has_the_right_rate(key):
    q, k, v = _qkv(key, 64, 64)
    _, w = dot_product_attention(q, k, v, dropout_rate=0.3, key=key, return_weights=True)
    dropped = float(jnp.mean(w == 0))
    assert 0.25 < dropped < 0.35
    a = flash_attention(q, k, v, dropout_rate=0.3, key=key)
    assert_close(a, flash_attention(q, k, v, dropout_rate=0.3, key=key, block_q=64, block_k=64))
    assert not np.allclose(a, flash_attention(q, k, v, dropout_rate=0.3, key=jax.random.fold_in(key, 1)))


def test_return_weights(key):
    q, k, v = _qkv(key, 10, 14)
    out, w = dot_product_attention(q, k, v, kv_mask=jnp.arange(14) < 9, return_weights=True)
    np.testing.assert_allclose(w.sum(-1), 1.0, rtol=1e-6)
    np.testing.assert_array_equal(w[:, 9:], 0.0)
    assert_close(out, w @ v)


def test_block_sparse_attention_with_a_pattern_and_a_layout(key):
    q, k, v = _qkv(key, 50, 50)
    pattern = Local(6, 6) | Segments((20, 30))
    ref = dot_product_attention(q, k, v, pattern=pattern)
    assert_close(block_sparse_attention(q, k, v, pattern, **BLOCKS), ref)
    layout = pattern.layout(50, 50, 16, 8)
    assert_close(block_sparse_attention(q, k, v, layout), ref)
    with pytest.raises(ValueError, match="later key"):
        block_sparse_attention(q, k, v, layout, causal=True)
    causal_layout = (pattern & Causal()).layout(50, 50, 16, 8)
    assert_close(block_sparse_attention(q, k, v, causal_layout, causal=True),
                 dot_product_attention(q, k, v, pattern=pattern, causal=True))
    with pytest.raises(ValueError, match=r"built for \(lq, lk\) = \(50, 50\)"):
        block_sparse_attention(q[:40], k, v, layout)


def test_composes_with_jit_vmap_grad(key):
    q, k, v = (x.reshape(2, 2, 24, 16).transpose(0, 2, 1, 3)
               for x in _qkv(key, 96, 96))  # [B=2, L=24, H=2, D=16]
    mask = jnp.arange(24)[None, :] < jnp.array([[24], [13]])

    def loss(fn, q, k, v):
        return jnp.sum(multihead(fn)(q, k, v, causal=True, kv_mask=mask) ** 2)

    g = jax.jit(jax.grad(functools.partial(loss, functools.partial(flash_attention, **BLOCKS)),
                         (0, 1, 2)))(q, k, v)
    g_ref = jax.grad(functools.partial(loss, dot_product_attention), (0, 1, 2))(q, k, v)
    for a, b in zip(g, g_ref):
        assert_close(a, b, EXACT_GRAD)
    # vmap over an extra leading axis of the lifted function.
    out = jax.vmap(lambda q: multihead(flash_attention)(q, k, v))(jnp.stack([q, q + 1]))
    assert_close(out[1], multihead(dot_product_attention)(q + 1, k, v))


def test_numpy_masks_under_jit_and_grad(key):
    """A NumPy mask (as a data pipeline hands it over) batched by multihead reaches the tiled
    kernel's custom VJP under jit as a JAX array, not as a raw constant JAX's tracer rejects."""
    q = jax.random.normal(key, (2, 16, 2, 8))
    mask = np.arange(16)[None, :] < np.array([[16], [9]])

    flash = jax.jit(lambda q: multihead(flash_attention)(q, q, q, kv_mask=mask, **BLOCKS))
    g = jax.grad(lambda q: jnp.sum(flash(q) ** 2))(q)  # jit (or a layer scan) inside grad
    dense = lambda q: multihead(dot_product_attention)(q, q, q, kv_mask=jnp.asarray(mask))
    assert_close(g, jax.grad(lambda q: jnp.sum(dense(q) ** 2))(q), EXACT_GRAD)


@pytest.mark.parametrize("fn", [dot_product_attention, flash_attention])
def test_bad_input_names_the_problem_and_shapes(fn):
    q = jnp.zeros((8, 16))
    with pytest.raises(ValueError, match=r"last dimension.*q\(8, 16\), k\(8, 12\)"):
        fn(q, jnp.zeros((8, 12)), jnp.zeros((8, 16)))
    with pytest.raises(ValueError, match=r"same length.*k\(8, 16\), v\(9, 16\)"):
        fn(q, q, jnp.zeros((9, 16)))
    with pytest.raises(ValueError, match=r"rank 2.*\(2, 8, 16\).*multihead"):
        fn(jnp.zeros((2, 8, 16)), q, q)
    with pytest.raises(ValueError, match="kv_mask must be boolean.*float32"):
        fn(q, q, q, kv_mask=jnp.ones(8))
    with pytest.raises(ValueError, match=r"kv_mask must have shape \(Lk,\) = \(8,\)"):
        fn(q, q, q, kv_mask=jnp.ones(9, bool))
    with pytest.raises(ValueError, match="floating point"):
        fn(q.astype(jnp.int32), q, q)
    with pytest.raises(ValueError, match=r"bias must have shape \(Lq, Lk\) = \(8, 8\)"):
        fn(q, q, q, bias=jnp.zeros((8, 9)))
    with pytest.raises(ValueError, match="needs an explicit PRNG `key`"):
        fn(q, q, q, dropout_rate=0.1)
    with pytest.raises(ValueError, match=r"segment ids must have shape \(8,\)"):
        fn(q, q, q, segment_ids=jnp.zeros(7, jnp.int32))


@pytest.mark.parametrize("bad", [0, -16, 2.5, True])
def test_bad_block_sizes(bad):
    q = jnp.zeros((8, 16))
    with pytest.raises(ValueError, match="block_q must be a positive integer"):
        flash_attention(q, q, q, block_q=bad)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the CPU's dispatch")
def test_implementation_dispatch_on_cpu():
    q = jnp.ones((8, 16))
    assert_close(flash_attention(q, q, q, implementation="xla"), dot_product_attention(q, q, q))
    assert_close(flash_attention(q, q, q, implementation=None), dot_product_attention(q, q, q))
    with pytest.raises(NotImplementedError, match="implementation='pallas' cannot run"):
        flash_attention(q, q, q, implementation="pallas")
    with pytest.raises(ValueError, match="implementation must be one of"):
        flash_attention(q, q, q, implementation="cuda")


def test_lse_output_is_differentiable(key, orientation):
    q, k, v = _qkv(key, 25, 31)
    mask = jnp.arange(31) < 20

    def via_flash(q, k, v):
        out, lse = flash_attention(q, k, v, kv_mask=mask, causal=True, return_lse=True, **BLOCKS)
        return jnp.sum(out**2) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0) * 0.7)

    def via_dense(q, k, v):
        s = (q @ k.T) / 4.0
        visible = mask[None] & (jnp.arange(31)[None] <= jnp.arange(25)[:, None])
        lse = jax.nn.logsumexp(jnp.where(visible, s, -jnp.inf), axis=-1)
        out = dot_product_attention(q, k, v, kv_mask=mask, causal=True)
        return jnp.sum(out**2) + jnp.sum(lse * 0.7)

    for a, b in zip(jax.grad(via_flash, (0, 1, 2))(q, k, v), jax.grad(via_dense, (0, 1, 2))(q, k, v)):
        assert_close(a, b, EXACT_GRAD)


def test_module_bias_per_head_under_vmap_jit_and_grad(key, orientation):
    """A pytree bias (an eqx.Module with per-head slopes and an integer leaf) is mapped over heads
    by multihead, and gradients reach its float leaves, as with the dense reference."""
    import equinox as eqx

    class Alibi(eqx.Module):
        slope: jax.Array
        offset: jax.Array  # integer leaf: never differentiated

        def __call__(self, i, j):
            return -self.slope * jnp.abs(i - j + self.offset).astype(jnp.float32)

    q = jax.random.normal(key, (2, 40, 4, 16))
    offsets = jnp.zeros(4, jnp.int32)

    def loss(fn, slopes):
        attn = multihead(fn, kwarg_axes={"bias": "heads"})
        return jnp.sum(attn(q, q, q, bias=Alibi(slopes, offsets), causal=True) ** 2)

    slopes = jnp.array([0.1, 0.2, 0.3, 0.4])
    g = jax.jit(jax.grad(functools.partial(loss, functools.partial(flash_attention, **BLOCKS))))(slopes)
    g_ref = jax.grad(functools.partial(loss, dot_product_attention))(slopes)
    np.testing.assert_allclose(g, g_ref, rtol=1e-4)


def test_default_tiles_are_equal_and_pad_little(key):
    """Past the default tile size, the default tiles are as few as 512 allows and of equal
    size: 4097 tokens (4096 + a CLS token) make 9 tiles of 456 (4104 rows), not 9 of 512."""
    from xformers_jax.attention._exact import DEFAULT_BLOCK_Q, _block

    for length in (8, 100, 512, 513, 1030, 4096, 4097, 65536):
        tile = _block("t", "block_q", None, length, DEFAULT_BLOCK_Q)
        tiles = -(-length // tile)
        assert tile <= DEFAULT_BLOCK_Q and tile % 8 == 0
        assert tiles == -(-length // DEFAULT_BLOCK_Q)
        assert tiles * tile - length < 8 * tiles
    assert _block("t", "block_q", None, 4097, DEFAULT_BLOCK_Q) == 456
    q, k, v = (jax.random.normal(kk, (1030, 16)) for kk in jax.random.split(key, 3))
    assert_close(flash_attention(q, k, v, causal=True),
                 dot_product_attention(q, k, v, causal=True))
