"""Position schemes: the property each promises, bias callables equal to their dense form
under the exact kernels, and rejection where a scheme does not compose."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import xformers_jax.nn as nn
from tests.tolerances import EXACT, assert_close
from xformers_jax.nn._positions import clipped_distance

B, L, H, DK = 1, 12, 2, 8
KEY = jax.random.PRNGKey(0)


def _qk():
    kq, kk = jax.random.split(KEY)
    return jax.random.normal(kq, (B, L, H, DK)), jax.random.normal(kk, (B, L, H, DK))


def _dense_bias(scheme, q, k, q_pos, k_pos):
    bias = scheme.bias(q, k, q_pos, k_pos, 1.0 / np.sqrt(DK))
    one = jax.tree_util.tree_map(lambda a: a[0, 0], bias)
    return one(jnp.arange(L)[:, None], jnp.arange(L)[None, :])


def _pos(offset=0):
    return jnp.arange(L)[None] + offset


def test_rope_scores_depend_only_on_relative_position():
    q, k = _qk()
    rope = nn.RotaryPositions()

    def scores(offset):
        qr, kr = rope.rotate(q, _pos(offset)), rope.rotate(k, _pos(offset))
        return jnp.einsum("bqhd,bkhd->bhqk", qr, kr)

    assert_close(scores(37), scores(0), EXACT)
    assert not np.allclose(scores(0), jnp.einsum("bqhd,bkhd->bhqk", q, k), atol=1e-3)


RELATIVE_BIASES = [
    lambda: nn.ALiBi(H),
    lambda: nn.T5Bias(H, key=KEY),
    lambda: nn.ShawRelative(DK, 3, key=KEY),
    lambda: nn.DeBERTaRelative(H, DK, 3, key=KEY),
    lambda: nn.TransformerXLRelative(H, DK, 64, key=KEY),
]


@pytest.mark.parametrize("make", RELATIVE_BIASES)
def test_relative_biases_are_shift_invariant(make):
    q, k = _qk()
    scheme = make()
    assert_close(_dense_bias(scheme, q, k, _pos(20), _pos(20)),
                 _dense_bias(scheme, q, k, _pos(0), _pos(0)), EXACT)


def test_alibi_values():
    bias = _dense_bias(nn.ALiBi(H), *_qk(), _pos(), _pos())
    i, j = np.arange(L)[:, None], np.arange(L)[None, :]
    np.testing.assert_allclose(np.asarray(bias), -0.0625 * np.abs(i - j), rtol=1e-6)


def test_t5_buckets():
    rel = jnp.arange(-200, 201)
    b = np.asarray(nn.t5_bucket(rel, bidirectional=True, num_buckets=32, max_distance=128))
    assert b.min() >= 0 and b.max() == 31
    # Exact buckets for |distance| < 8, a separate half for positive distances.
    assert b[200] == 0
    np.testing.assert_array_equal(b[201:208], np.arange(1, 8) + 16)
    np.testing.assert_array_equal(b[193:201][::-1], np.arange(8))
    # Monotone in distance on each side, logarithmic beyond 8, clipped beyond max_distance.
    assert np.all(np.diff(b[201:]) >= 0) and np.all(np.diff(b[:201]) <= 0)
    assert b[200 + 128] == b[400] == 31 and b[200 + 64] < 31
    causal = np.asarray(nn.t5_bucket(rel, bidirectional=False, num_buckets=32, max_distance=128))
    assert np.all(causal[201:] == 0) and causal[0] == 31


def test_shaw_clipping():
    q, k = _qk()
    shaw = nn.ShawRelative(DK, 2, key=KEY)
    bias = np.asarray(_dense_bias(shaw, q, k, _pos(), _pos()))
    # Beyond distance K=2 every key shares the clipped embedding: equal bias along a row.
    np.testing.assert_allclose(bias[9, :7], bias[9, 0])
    expected = np.einsum("d,d->", q[0, 9, 0], shaw.embeddings[2 + 2]) / np.sqrt(DK)
    np.testing.assert_allclose(bias[9, 7], expected, rtol=1e-5)
    np.testing.assert_array_equal(np.asarray(clipped_distance(jnp.array(0), jnp.arange(6), 2)),
                                  [2, 1, 0, 0, 0, 0])


@pytest.mark.parametrize("dk,clamp", [(DK, None), (7, None), (DK, 5), (7, 0)])
def test_transformer_xl_terms_equal_the_paper_at_any_positions(dk, clamp):
    # q_i . R_{i-j} W + u1 . k_j + u2 . R_{i-j} W with R_d = sinusoid(d), read directly from
    # the distance, at positions that restart (packed), jump (padding at 0) and go negative
    # (memory): the rotated form must not assume contiguous positions. Odd Dk: a last sine
    # with no cosine. With clamp_len, R at min(i - j, clamp_len) (negative distances kept).
    from xformers_jax.nn._positions import sinusoid
    kq, kk, ku = jax.random.split(KEY, 3)
    q = jax.random.normal(kq, (B, L, H, dk))
    k = jax.random.normal(kk, (B, L, H, dk))
    xl = nn.TransformerXLRelative(H, dk, 64, clamp_len=clamp, key=KEY)
    xl = eqx.tree_at(lambda p: (p.u1, p.u2), xl, tuple(jax.random.normal(ku, (2, H, dk))))
    q_pos = jnp.array([[40, 41, 42, 43, 0, 1, 2, 3, 4, 0, 0, 0]])
    k_pos = jnp.array([[-5, -4, -3, 9, 10, 11, 0, 1, 2, 3, 4, 0]])
    bias = xl.bias(q, k, q_pos, k_pos, 1.0 / np.sqrt(dk))
    dist = np.asarray(q_pos[0])[:, None] - np.asarray(k_pos[0])[None, :]
    if clamp is not None:
        assert (dist > clamp).any() and (dist <= clamp).any()
        dist = np.minimum(dist, clamp)
    r = np.asarray(sinusoid(jnp.asarray(dist), dk))  # [L, L, dk]
    for h in range(H):
        got = jax.tree_util.tree_map(lambda a, h=h: a[0, h], bias)(
            jnp.arange(L)[:, None], jnp.arange(L)[None, :])
        rw = r @ np.asarray(xl.w_r[h])
        qu = np.asarray(q[0, :, h]) + np.asarray(xl.u2[h])
        want = (np.einsum("id,ijd->ij", qu, rw) + np.asarray(k[0, :, h]) @ np.asarray(xl.u1[h])
                ) / np.sqrt(dk)
        np.testing.assert_allclose(np.asarray(got), want, atol=2e-5, rtol=2e-5)


def test_transformer_xl_clamp_len_must_be_a_distance():
    with pytest.raises(ValueError, match="clamp_len must be None or an integer >= 0, got -1"):
        nn.TransformerXLRelative(H, DK, 64, clamp_len=-1, key=KEY)


@pytest.mark.parametrize("make", RELATIVE_BIASES + [lambda: nn.TUPE(H, DK, 64, key=KEY)])
def test_grouped_kv_heads_bias_equals_repeated_heads(make):
    """A kv head shared by a group of query heads gives each of them the bias it would get
    from its own copy of that kv head (the bias path takes k without copying it)."""
    q, k = _qk()
    scheme = make()
    shared = k[:, :, :1]
    grouped = scheme.bias(q, shared, _pos(), _pos(), 1.0 / np.sqrt(DK))
    copied = scheme.bias(q, jnp.repeat(shared, H, axis=2), _pos(), _pos(), 1.0 / np.sqrt(DK))
    for head in range(H):
        dense = [jax.tree_util.tree_map(lambda a, h=head: a[0, h], b)(
            jnp.arange(L)[:, None], jnp.arange(L)[None, :]) for b in (grouped, copied)]
        assert_close(dense[0], dense[1], EXACT)
    with pytest.raises(ValueError, match="not a multiple"):
        scheme.bias(q, jnp.concatenate([k, k[:, :, :1]], axis=2), _pos(), _pos(), 1.0)


@pytest.mark.parametrize("position", [
    nn.RotaryPositions(), nn.ALiBi(4), nn.T5Bias(4, key=KEY), nn.ShawRelative(8, 3, key=KEY),
    nn.DeBERTaRelative(4, 8, 3, key=KEY), nn.TransformerXLRelative(4, 8, 32, key=KEY),
    nn.TUPE(4, 8, 32, key=KEY),
])
def test_flash_with_position_bias_equals_dense(position):
    x = jax.random.normal(KEY, (2, 20, 32))
    mask = jnp.arange(20)[None] < jnp.array([[20], [13]])
    outs = {}
    for kind, hp in (("dot_product", {}), ("flash", {"block_q": 8, "block_k": 8})):
        m = nn.MultiHeadAttention(32, 4, spec=nn.AttentionSpec(kind, hp), causal=True,
                                  position=position, max_len=32, key=KEY)
        outs[kind] = eqx.filter_jit(lambda m, x: m(x, kv_mask=mask))(m, x)
    assert_close(outs["flash"], outs["dot_product"], EXACT)


def test_input_schemes():
    x = jnp.zeros((1, 6, 8))
    pos = _pos()[:, :6]
    sin = nn.SinusoidalPositions().embed(x, pos)
    np.testing.assert_allclose(sin[0, 3, 0], np.sin(3.0), rtol=1e-6)
    np.testing.assert_allclose(sin[0, 3, 1], np.cos(3.0), rtol=1e-6)
    learned_freq = nn.LearnedSinusoidalPositions(8).embed(x, pos)
    assert_close(learned_freq, sin)  # initialised to the fixed frequencies
    table = nn.LearnedPositions(6, 8, key=KEY)
    assert_close(table.embed(x, pos)[0], table.table)
    assert nn.NoPositions().embed(x, pos) is x
    cpe = nn.ConvPositions(8, 3, key=KEY)
    y = jax.random.normal(KEY, (1, 6, 8))
    # Causal CPE: changing the last input changes no earlier output.
    a = cpe.embed(y, pos, causal=True)
    b = cpe.embed(y.at[:, -1].add(1.0), pos, causal=True)
    assert_close(a[:, :-1], b[:, :-1])


def test_bias_scheme_rejected_by_kernel_kinds():
    with pytest.raises(ValueError, match="additive score bias, which attention kind 'linear'"):
        nn.MultiHeadAttention(32, 4, spec=nn.AttentionSpec("linear"), position=nn.ALiBi(4),
                              key=KEY)
    with pytest.raises(ValueError, match="give it to the model's embedding"):
        nn.MultiHeadAttention(32, 4, position=nn.SinusoidalPositions(), key=KEY)
    with pytest.raises(ValueError, match="not an input position scheme"):
        nn.Embedder(32, vocab_size=10, positions=nn.RotaryPositions(), key=KEY)
    # RoPE composes with kernel kinds.
    m = nn.MultiHeadAttention(32, 4, spec=nn.AttentionSpec("linear"),
                              position=nn.RotaryPositions(), key=KEY)
    assert m(jnp.ones((1, 5, 32))).shape == (1, 5, 32)
