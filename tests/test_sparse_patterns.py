"""Fixed and combined sparse patterns: definitions against the papers' index formulas (as
written by Fournier et al., 2021, "A Practical Survey on Faster and Lighter Transformers"),
block-sparse attention against the dense masked reference, causal behaviour, per-head use,
axial attention and external global tokens."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.tolerances import EXACT, EXACT_GRAD, assert_close
from xformers_jax.attention import (axial_attention, axial_shift, block_sparse_attention,
                                    dot_product_attention, etc_attention, flash_attention,
                                    longformer_attention, pattern_tile,
                                    per_head_block_sparse_attention)
from xformers_jax.attention import patterns as P
from xformers_jax.attention.patterns import Pattern

L_ODD = 61

# (pattern, length) for every sparse pattern in attention.patterns.
PATTERNS = [
    (P.Dilated(3, 2, 2), L_ODD),
    (P.Strided(5), L_ODD),
    (P.Fixed(6, 2), L_ODD),
    (P.Global((0, 17, 40)), L_ODD),
    (P.Random(3, seed=1), L_ODD),
    (P.Random(2, seed=1, block=8), L_ODD),
    (P.BlockLocal(9), L_ODD),
    (P.Star(), L_ODD),
    (P.Cascade(1, 2, 3), L_ODD),
    (P.LogSparse(), L_ODD),
    (P.LogSparse(local=2), L_ODD),
    (P.LogSparse(subsequence=16), L_ODD),
    (P.BlockBERT(3, 1), L_ODD),
    (P.Longformer(3, 2, (0, 30)), L_ODD),
    (P.BigBird(8, 3, 2, 2, seed=3), L_ODD),
    (P.ImageLocal1D(8, 6), L_ODD),
    (P.ImageLocal2D(8, 8, (2, 4), (1, 2)), 64),
    (P.BPTree(30, k=1), P.BPTree(30, k=1).length),
]
IDS = [repr(p) for p, _ in PATTERNS]


def _qkv(key, lq, lk=None, d=8, dtype=jnp.float32):
    kq, kk, kv = jax.random.split(key, 3)
    lk = lk or lq
    return (jax.random.normal(kq, (lq, d), dtype), jax.random.normal(kk, (lk, d), dtype),
            jax.random.normal(kv, (lk, d), dtype))


# -- definitions against the formulas of the seeds (brute force, straight from the text) ------

def _brute(fn, lq, lk=None):
    lk = lk or lq
    return np.array([[bool(fn(i, j)) for j in range(lk)] for i in range(lq)])


def test_strided_and_fixed_membership():
    n, s, c = 40, 6, 2
    # Child et al., 2019, strided, in the bidirectional form of Fournier et al., 2021:
    # (i + s) > j > (i - s) or (i - j) mod s = 0.
    want = _brute(lambda i, j: (i + s) > j > (i - s) or (i - j) % s == 0, n)
    np.testing.assert_array_equal(P.Strided(s).dense(n, n), want)
    # fixed: floor(j / s) = floor(i / s) or (j mod s) >= (s - c).
    want = _brute(lambda i, j: j // s == i // s or j % s >= s - c, n)
    np.testing.assert_array_equal(P.Fixed(s, c).dense(n, n), want)
    # The two halves of the factorised heads (Child et al., 2019) make up the whole.
    st = P.PerHead.sparse_transformer(4, s, "strided")
    assert st.patterns[:2] == (P.Strided(s, "local"),) * 2
    np.testing.assert_array_equal(st.dense(n, n)[0] | st.dense(n, n)[3], P.Strided(s).dense(n, n))
    fx = P.PerHead.sparse_transformer(4, s, "fixed", c)
    np.testing.assert_array_equal(fx.dense(n, n)[1] | fx.dense(n, n)[2], P.Fixed(s, c).dense(n, n))


def test_star_membership():
    # Star-Transformer (Guo et al., 2019), as indexed by Fournier et al., 2021: i = 0 sees
    # everything; otherwise j = 0 or i - 1 <= j <= i + 1.
    want = _brute(lambda i, j: i == 0 or j == 0 or i - 1 <= j <= i + 1, 23)
    np.testing.assert_array_equal(P.Star().dense(23, 23), want)


@pytest.mark.parametrize("b,m,layer,size", [(1, 2, 0, 1), (1, 2, 1, 3), (1, 2, 2, 7), (1, 2, 3, 15), (2, 3, 1, 11)])
def test_cascade_window_sizes(b, m, layer, size):
    # Cascade Transformer (Wang et al., 2020; Fournier et al., 2021, Fig. 12): 2 * b * m**l - 1
    # connections at layer l (b=1, m=2, l=2 gives 7).
    p = P.Cascade(b, m, layer)
    assert p.connections == size
    n = 64
    counts = p.dense(n, n).sum(1)
    assert counts[n // 2] == size  # an interior row has the whole window
    np.testing.assert_array_equal(p.dense(n, n), _brute(lambda i, j: abs(i - j) <= (size - 1) // 2, n))


def _logsparse_set(i, n):
    # LogSparse (Li et al., 2019), the index set as written by Fournier et al., 2021:
    # {i - 2^floor(log2 i), ..., i - 2^0, i, i + 2^0, ..., i + 2^floor(log2(n - i))},
    # kept within the sequence.
    out = {i}
    if i >= 1:
        out |= {i - 2**k for k in range(int(math.floor(math.log2(i))) + 1)}
    out |= {i + 2**k for k in range(int(math.floor(math.log2(n - i))) + 1)}
    return {j for j in out if 0 <= j < n}


def test_logsparse_index_set_and_variants():
    n = 50
    want = np.zeros((n, n), bool)
    for i in range(n):
        want[i, sorted(_logsparse_set(i, n))] = True
    np.testing.assert_array_equal(P.LogSparse().dense(n, n), want)
    assert P.LogSparse().dense(1024, 1024).sum(1).max() <= 2 * 11 + 1  # O(log n) keys per query
    # Variant 1: a dense local window of k, then the exponential steps resume.
    k = 3
    want_local = _brute(lambda i, j: abs(i - j) <= k or (abs(i - j) - k) in {2**t for t in range(8)}, n)
    np.testing.assert_array_equal(P.LogSparse(local=k).dense(n, n), want_local)
    # Variant 2: LogSparse within each subsequence.
    s = 16
    want_sub = np.zeros((n, n), bool)
    for start in range(0, n, s):
        m = min(s, n - start)
        for i in range(m):
            for j in _logsparse_set(i, m):
                want_sub[start + i, start + j] = True
    np.testing.assert_array_equal(P.LogSparse(subsequence=s).dense(n, n), want_sub)


def test_blockbert_permutations_eq14():
    n, nb = 12, 3
    for shift, perm in ((0, (1, 2, 3)), (1, (2, 3, 1)), (2, (3, 1, 2))):
        # Eq 14 with 1-based positions and blocks: pi(floor((i-1) n_b / n + 1)) = floor((j-1) n_b / n + 1).
        def ok(i0, j0):
            i, j = i0 + 1, j0 + 1
            return perm[math.floor((i - 1) * nb / n + 1) - 1] == math.floor((j - 1) * nb / n + 1)

        np.testing.assert_array_equal(P.BlockBERT(nb, shift).dense(n, n), _brute(ok, n))
    heads = P.PerHead.blockbert(5, nb)
    assert [p.shift for p in heads.patterns] == [0, 1, 2, 0, 1]
    assert len(heads.groups()) == 3


def test_bigbird_counts_per_row():
    block, w, g, r, n = 8, 3, 2, 3, 160  # 20 blocks
    p = P.BigBird(block, w, g, r, seed=5)
    blocks = p.blocks(n, n)
    nb = blocks.shape[0]
    glob = {0, nb - 1}
    for b in range(nb):
        if b in glob:
            assert blocks[b].all()
            continue
        window = {c for c in range(b - 1, b + 2) if 0 <= c < nb}
        assert window | glob <= set(np.flatnonzero(blocks[b]))
        assert blocks[b].sum() == len(window | glob) + r  # exactly r random blocks besides
    assert blocks[:, sorted(glob)].all()
    # Every position of a block row has the same keys: block granularity.
    d = p.dense(n, n)
    np.testing.assert_array_equal(d[::block], np.repeat(blocks, block, 1))


def test_dilated_longformer_imagelocal_membership():
    n = 45
    np.testing.assert_array_equal(
        P.Dilated(2, 3, 3).dense(n, n),
        _brute(lambda i, j: (j - i) % 3 == 0 and -2 <= (j - i) // 3 <= 3, n))
    np.testing.assert_array_equal(
        P.Longformer(2, 2, (0, 7)).dense(n, n),
        _brute(lambda i, j: (abs(i - j) <= 4 and (i - j) % 2 == 0) or i in (0, 7) or j in (0, 7), n))
    # Image Transformer (Parmar et al., 2018): a query block of l_q positions sees itself and
    # the l_m positions before it.
    lq_, lm = 8, 5
    np.testing.assert_array_equal(
        P.ImageLocal1D(lq_, lm).dense(n, n),
        _brute(lambda i, j: i // lq_ * lq_ - lm <= j < i // lq_ * lq_ + lq_, n))


def test_imagelocal2d_against_pixels():
    h, w, (qh, qw), (mh, mw) = 8, 12, (2, 4), (2, 1)
    p = P.ImageLocal2D(h, w, (qh, qw), (mh, mw))
    # Generation order: query blocks in raster order, pixels in raster order inside a block.
    order = [(br * qh + r, bc * qw + c) for br in range(h // qh) for bc in range(w // qw)
             for r in range(qh) for c in range(qw)]
    assert [tuple(map(int, p.pixel(i))) for i in range(h * w)] == order

    def ok(i, j):
        (ri, ci), (rj, cj) = order[i], order[j]
        top, left = ri // qh * qh, ci // qw * qw
        return top - mh <= rj < top + qh and left - mw <= cj < left + qw + mw

    np.testing.assert_array_equal(p.dense(h * w, h * w), _brute(ok, h * w))
    # The decoder form only looks back in generation order.
    assert (P.ImageLocal2D(h, w, (qh, qw), (mh, mw)) & P.Causal()).causal_safe


def test_bptree_structure():
    p = P.BPTree(16, k=1)
    assert p.length == 16 + 8 + 4 + 2 + 1
    d = p.dense(p.length, p.length)
    # Token 5 (ancestors 2, 1, 0, 0 at levels 1..4): neighbours 4, 6 and, per level, the
    # ancestor's neighbours: level 1 nodes 1, 3; level 2 node 0 (1 is its own ancestor's
    # neighbour 0 and 2); level 3 node 1; level 4 none besides itself.
    offsets = {1: 16, 2: 24, 3: 28, 4: 30}
    want = {4, 5, 6, offsets[1] + 1, offsets[1] + 3, offsets[2] + 0, offsets[2] + 2,
            offsets[3] + 1}
    assert set(np.flatnonzero(d[5])) == want
    # A span node sees itself and its two children.
    assert set(np.flatnonzero(d[offsets[2] + 1])) == {offsets[2] + 1, offsets[1] + 2, offsets[1] + 3}
    # Information reaches every token from every token in levels + 1 = 5 hops (down the tree
    # from a span node), and not in one.
    reach = np.linalg.matrix_power(d.astype(np.int64), 5)[:16, :16] > 0
    assert reach.all() and not d[:16, :16].all()


# -- seeds ------------------------------------------------------------------------------------

@pytest.mark.parametrize("make", [lambda s: P.Random(3, seed=s), lambda s: P.Random(2, seed=s, block=4),
                                  lambda s: P.BigBird(4, 3, 2, 2, seed=s)])
def test_seeded_patterns_reproducible_and_different(make):
    n = 96
    a, b, c = make(0).dense(n, n), make(0).dense(n, n), make(1).dense(n, n)
    np.testing.assert_array_equal(a, b)
    assert (a != c).any()


def test_random_keys_per_query():
    d = P.Random(5, seed=2).dense(40, 33)
    assert (d.sum(1) == 5).all()
    db = P.Random(2, seed=2, block=4).dense(40, 40)
    assert (db.sum(1) == 8).all()


# -- layouts ----------------------------------------------------------------------------------

@pytest.mark.parametrize("pattern,n", PATTERNS, ids=IDS)
def test_layout_dense_equals_pattern_dense(pattern, n):
    want = pattern.dense(n, n)
    for bq, bk in ((8, 8), (16, 8), (7, 5)):
        layout = pattern.layout(n, n, bq, bk)
        np.testing.assert_array_equal(layout.dense(), want)
        # The closed forms are never wrong about a tile (the generic scan is the truth).
        exact = Pattern.block_kinds(pattern, n, n, bq, bk)
        fast = pattern.block_kinds(n, n, bq, bk)
        assert ((fast == P.EMPTY) <= (exact == P.EMPTY)).all()
        assert ((fast == P.FULL) <= (exact == P.FULL)).all()


def test_block_sparsity_is_real():
    n = 4096
    assert P.Local(256, 256).layout(n, n, 128, 128).density < 0.2
    assert P.BigBird(64).layout(n, n, 64, 64).num_nonempty < 64 * 10
    # A band of 3 tiles per row, plus the global token's tile row and column.
    assert P.Longformer(64, 1, (0,)).layout(n, n, 128, 128).num_nonempty <= 3 * 32 + 2 * 32


def test_default_tiles_follow_the_pattern(key):
    """Without block_q/block_k a pattern is tiled at the size that skips what it leaves out:
    BigBird at its own block, a band at a tile near its width, the full and causal patterns at
    the 512 default (the sizes measured fastest at L=8192 on the 2-core CPU; see
    ``_exact._TILE_COST``)."""
    n = 4096
    assert pattern_tile(P.BigBird(64), n, n) == 64
    assert pattern_tile(P.Local(256, 256), n, n) == 256
    assert pattern_tile(P.Local(128, 128), n, n) == 128
    assert pattern_tile(P.Full(), n, n) == 512
    assert pattern_tile(P.Causal(), n, n) == 512
    assert pattern_tile(P.BigBird(64), 100, 100) == 512  # one tile covers everything
    # The default path: a narrow band at L=600 is tiled at 64, not as two 304-row tiles, and
    # the result is the reference's.
    band, lq = P.Local(20, 0), 600
    assert pattern_tile(band & P.Causal(), lq, lq) == 64
    q, k, v = _qkv(key, lq)
    ref = dot_product_attention(q, k, v, pattern=band, causal=True)
    assert_close(flash_attention(q, k, v, pattern=band, causal=True), ref, EXACT)
    assert_close(block_sparse_attention(q, k, v, band, causal=True), ref, EXACT)


# -- attention through the patterns ---------------------------------------------------------

def _sparse_fn(pattern, causal, kv_mask):
    """Jitted ``(out, grads of sum(out * w))``: one compilation serves every check below."""

    def f(q, k, v, w):
        fn = lambda q, k, v: block_sparse_attention(q, k, v, pattern, causal=causal, kv_mask=kv_mask,
                                                    block_q=16, block_k=8)
        out = fn(q, k, v)
        return out, jax.grad(lambda q, k, v: (fn(q, k, v) * w).sum(), argnums=(0, 1, 2))(q, k, v)

    return jax.jit(f)


@pytest.mark.parametrize("pattern,n", PATTERNS, ids=IDS)
def test_block_sparse_equals_dense_reference_and_causal_no_leak(pattern, n, key):
    q, k, v = _qkv(key, n)
    w = jnp.cos(jnp.arange(n * v.shape[1]).reshape(n, -1))
    pad = 5
    kv_mask = jnp.arange(n) < n - pad
    for causal in (False,) if pattern.encoder_only else (False, True):
        f = _sparse_fn(pattern, causal, kv_mask)
        out, grads = f(q, k, v, w)
        # The reference runs eagerly: its primitives are cached across patterns.
        ref = lambda q, k, v: dot_product_attention(q, k, v, pattern=pattern, causal=causal, kv_mask=kv_mask)
        assert_close(out, ref(q, k, v), EXACT)
        ref_grads = jax.grad(lambda q, k, v: (ref(q, k, v) * w).sum(), argnums=(0, 1, 2))(q, k, v)
        for a, b in zip(grads, ref_grads):
            assert np.isfinite(np.asarray(a)).all()
            assert_close(a, b, EXACT_GRAD)
        # Padding: masked keys change nothing and get zero gradient.
        out_pad, _ = f(q, k.at[n - pad:].set(100.0), v.at[n - pad:].set(-100.0), w)
        assert_close(out_pad, out, EXACT)
        np.testing.assert_array_equal(np.asarray(grads[1][n - pad:]), 0.0)
        if causal:
            # No leak: perturbing the future changes no earlier output and gets zero gradient.
            t = n // 2
            out2, _ = f(q, k.at[t + 1:].add(3.0), v.at[t + 1:].add(-2.0), w)
            np.testing.assert_array_equal(np.asarray(out2[: t + 1]), np.asarray(out[: t + 1]))
            _, (_, gk, gv) = f(q, k, v, w.at[t + 1:].set(0.0))
            np.testing.assert_array_equal(np.asarray(gk[t + 1:]), 0.0)
            np.testing.assert_array_equal(np.asarray(gv[t + 1:]), 0.0)
            assert (pattern & P.Causal()).causal_safe


@pytest.mark.parametrize("pattern", [P.Star(), P.BlockBERT(2), P.BigBird(8), P.BPTree(8),
                                     P.BigBird(8) | P.Local(1, 0)])
def test_encoder_only_patterns_refuse_causal(pattern, key):
    n = pattern.length if isinstance(pattern, P.BPTree) else 32
    q, k, v = _qkv(key, n)
    with pytest.raises(NotImplementedError, match="encoder-only"):
        block_sparse_attention(q, k, v, pattern, causal=True)
    with pytest.raises(NotImplementedError, match="encoder-only"):
        dot_product_attention(q, k, v, pattern=pattern, causal=True)


def test_bf16_and_vmap(key):
    q, k, v = _qkv(key, 48, dtype=jnp.bfloat16)
    p = P.BigBird(8, seed=1)
    out = block_sparse_attention(q, k, v, p, block_q=8, block_k=8)
    assert out.dtype == jnp.bfloat16
    ref = dot_product_attention(q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32), pattern=p)
    assert_close(out, ref, EXACT, dtype=jnp.bfloat16)
    qb, kb, vb = (jnp.stack([x, x * 0.5]).astype(jnp.float32) for x in (q, k, v))
    outs = jax.vmap(lambda a, b, c: block_sparse_attention(a, b, c, p, block_q=8, block_k=8))(qb, kb, vb)
    assert_close(outs[1], dot_product_attention(qb[1], kb[1], vb[1], pattern=p), EXACT)


def test_bad_hyperparameters():
    with pytest.raises(ValueError, match="stride"):
        P.Strided(0)
    with pytest.raises(ValueError, match="c=5 must not exceed stride=4"):
        P.Fixed(4, 5)
    with pytest.raises(ValueError, match="num_window_blocks must be odd"):
        P.BigBird(8, num_window_blocks=2)
    with pytest.raises(ValueError, match="must tile the image"):
        P.ImageLocal2D(8, 8, (3, 4), (1, 1))
    with pytest.raises(ValueError, match="height \\* width = 64"):
        P.ImageLocal2D(8, 8, (2, 4), (1, 1)).dense(60, 60)
    with pytest.raises(ValueError, match="BPTree.length"):
        P.BPTree(8).dense(8, 8)


# -- per-head patterns ----------------------------------------------------------------------

@pytest.mark.parametrize("heads", [P.PerHead.sparse_transformer(4, 5), P.PerHead.blockbert(4, 3),
                                   P.PerHead((P.Local(3, 0), P.LogSparse(), P.Local(3, 0)))])
def test_per_head_equals_reference(heads, key):
    n, h = 45, heads.num_heads
    kq, kk, kv = jax.random.split(key, 3)
    q, k, v = (jax.random.normal(x, (n, h, 8)) for x in (kq, kk, kv))
    causal = heads.causal_safe or all(not p.encoder_only for p in heads.patterns)
    out = per_head_block_sparse_attention(q, k, v, heads, causal=causal, block_q=8, block_k=8)
    for i, p in enumerate(heads.patterns):
        assert_close(out[:, i], dot_product_attention(q[:, i], k[:, i], v[:, i], pattern=p, causal=causal), EXACT)
    with pytest.raises(ValueError, match=f"{h + 1} patterns but"):
        per_head_block_sparse_attention(q, k, v, P.PerHead((P.Star(),) * (h + 1)))


# -- axial attention ------------------------------------------------------------------------

@pytest.mark.parametrize("shape,axis", [((4, 6), 0), ((4, 6), 1), ((3, 4, 5), 1)])
@pytest.mark.parametrize("causal", [False, True])
def test_axial_equals_masked_dense(shape, axis, causal, key):
    n = math.prod(shape)
    q, k, v = _qkv(key, n)
    coords = np.stack(np.unravel_index(np.arange(n), shape), 1)
    others = [a for a in range(len(shape)) if a != axis % len(shape)]
    same_line = (coords[:, None, others] == coords[None, :, others]).all(-1)
    if causal:
        same_line &= coords[None, :, axis] <= coords[:, None, axis]
    kv_mask = jnp.arange(n) % 7 != 3
    # -inf, not a large negative number: a query whose only key is padded must see nothing.
    bias = jnp.where(jnp.asarray(same_line), 0.0, -jnp.inf)
    out = axial_attention(q, k, v, shape=shape, axis=axis, causal=causal, kv_mask=kv_mask)
    ref = dot_product_attention(q, k, v, bias=bias, kv_mask=kv_mask)
    assert_close(out, ref, EXACT)
    g = jax.grad(lambda q: axial_attention(q, k, v, shape=shape, axis=axis, causal=causal).sum())(q)
    assert np.isfinite(np.asarray(g)).all()


def test_axial_raster_decoder_is_causal(key):
    # Axial Transformer decoder (Ho et al., 2019): shift down, unmasked row + masked column
    # attention (context from the rows above), then shift right and masked row attention:
    # pixel (r, c) depends on rows < r and on (r, < c) only.
    shape, d = (4, 5), 4
    n = math.prod(shape)
    x = jax.random.normal(key, (n, d))

    def decoder(x):
        h = axial_shift(x, shape=shape, axis=0)
        h = h + axial_attention(h, h, h, shape=shape, axis=1)
        h = h + axial_attention(h, h, h, shape=shape, axis=0, causal=True)
        h = h + axial_shift(x, shape=shape, axis=1)
        return axial_attention(h, h, h, shape=shape, axis=1, causal=True)

    jac = jax.jacobian(lambda x: decoder(x).sum(-1))(x)  # [n, n, d]
    dep = np.abs(np.asarray(jac)).sum(-1) > 0
    assert not np.triu(dep, k=0).any()  # nothing depends on itself or a later pixel
    assert dep[n - 1, : n - 1].all()  # and the last pixel sees all earlier ones
    with pytest.raises(ValueError, match="product is the length"):
        axial_attention(x, x, x, shape=(4, 6), axis=0)


# -- global tokens that are not a mask --------------------------------------------------------

def test_etc_attention_equals_reference(key):
    n, g, r, d = 37, 3, 4, 8
    ks = jax.random.split(key, 8)
    q, k, v = (jax.random.normal(x, (n, d)) for x in ks[:3])
    qg, kg, vg = (jax.random.normal(x, (g, d)) for x in ks[3:6])
    k_l2g, k_g2l = jax.random.normal(ks[6], (g, d)), jax.random.normal(ks[7], (n, d))
    kv_mask = jnp.arange(n) < n - 2
    out, out_g = etc_attention(q, k, v, qg, kg, vg, radius=r, k_local_to_global=k_l2g,
                               k_global_to_local=k_g2l, kv_mask=kv_mask, block_q=8, block_k=8)
    # l2g + l2l: one softmax over [global keys; local keys in the radius].
    band = np.abs(np.arange(n)[:, None] - np.arange(n)[None, :]) <= r
    allowed = np.concatenate([np.ones((n, g), bool), band], 1)
    mask = jnp.concatenate([jnp.ones(g, bool), kv_mask])
    ref = dot_product_attention(q, jnp.concatenate([k_l2g, k]), jnp.concatenate([vg, v]),
                                kv_mask=mask, bias=jnp.where(jnp.asarray(allowed), 0.0, -1e30))
    assert_close(out, ref, EXACT)
    ref_g = dot_product_attention(qg, jnp.concatenate([kg, k_g2l]), jnp.concatenate([vg, v]), kv_mask=mask)
    assert_close(out_g, ref_g, EXACT)
    with pytest.raises(NotImplementedError, match="causal"):
        etc_attention(q, k, v, qg, kg, vg, radius=r, causal=True)


@pytest.mark.parametrize("causal", [False, True])
def test_longformer_separate_global_projections(causal, key):
    n, d, tokens = 41, 8, (0, 20)
    ks = jax.random.split(key, 6)
    q, k, v, qg, kg, vg = (jax.random.normal(x, (n, d)) for x in ks)
    out = longformer_attention(q, k, v, qg, kg, vg, window=3, dilation=2, global_tokens=tokens,
                               causal=causal, block_q=8, block_k=8)
    ref = dot_product_attention(q, k, v, pattern=P.Longformer(3, 2, tokens), causal=causal)
    for t in tokens:
        ref = ref.at[t].set(dot_product_attention(qg, kg, vg, causal=causal)[t])
    assert_close(out, ref, EXACT)
