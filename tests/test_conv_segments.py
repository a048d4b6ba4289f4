"""Packed documents (``segment_ids``) through the long convolutions: the divide-and-conquer
convolution against the dense masked Toeplitz definition, S4D, H3, Hyena and LSRA's
lightweight convolution against each document alone and against their own recurrent forms
(outputs and gradients), and the refusals of the kinds whose method cannot keep documents apart
(log-linear attention's absolute Fenwick buckets, gMLP's absolute position weights).

Rows have documents starting inside a leaf block of the convolution's tree and exactly on a
block edge, documents longer than a block, and NaN in the padding (segment id 0). One compiled
program per test."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.fast_jit import jit0
from tests.tolerances import EXACT_GRAD, assert_close
from xformers_jax import mixers, nn
from xformers_jax.attention.linear import num_levels
from xformers_jax.mixers._document_conv import document_convolve


def _segments(docs, length):
    """``int32[L]``: documents of the given sizes (ids 1, 2, ...), then padding (0)."""
    ids = np.concatenate([np.full(n, i + 1) for i, n in enumerate(docs)]
                         + [np.zeros(length - sum(docs), int)])
    return jnp.asarray(ids.astype(np.int32))


def _starts(docs):
    return np.cumsum((0,) + tuple(docs[:-1]))


def _nan_padded(x, seg):
    return jnp.where((seg == 0).reshape(-1, *[1] * (x.ndim - 1)), jnp.nan, x)


def _dense_convolve(u, kernel, seg):
    """The definition: ``y[t] = sum_{s <= t, seg[s] = seg[t] != 0} kernel[..., t - s] u[s]``,
    as an ``[L, L]`` masked Toeplitz matrix per channel (u ``[L, C]``, kernel ``[C, L]``)."""
    length = u.shape[0]
    t = np.arange(length)
    lag = t[:, None] - t[None, :]
    same = (lag >= 0) & (seg[:, None] == seg[None, :]) & (seg[None, :] != 0)
    toeplitz = jnp.where(same, jnp.take(kernel, np.clip(lag, 0, length - 1), axis=-1), 0)
    return jnp.einsum("cts,sc->tc", toeplitz, jnp.where((seg != 0)[:, None], u, 0))


# (length, documents): a row of L = 37 (not a power of two: the tree pads it to 64; documents
# crossing many block edges, one starting exactly on the edge at 8, one of a single position),
# the packing test's row, and L = 80 with a boundary on the block edge 64.
ROWS = [(37, (3, 5, 20, 1, 6)), (16, (5, 7, 3)), (80, (20, 44, 9))]


@pytest.mark.parametrize("length,docs", ROWS)
def test_the_document_convolution_is_the_masked_toeplitz_product(length, docs):
    seg = _segments(docs, length)
    k = jax.random.split(jax.random.PRNGKey(length), 3)
    u = _nan_padded(jax.random.normal(k[0], (length, 3)), seg)
    kernel = jax.random.normal(k[1], (3, length))
    w = jax.random.normal(k[2], (length, 3))  # a loss's cotangent, zero at no position

    def run(u, kernel):
        fast = functools.partial(document_convolve, segment_ids=seg)
        dense = functools.partial(_dense_convolve, seg=seg)
        loss = lambda f: lambda u, h: jnp.sum(w * f(u, h))  # noqa: E731
        return ((fast(u, kernel), jax.grad(loss(fast), (0, 1))(u, kernel)),
                (dense(u, kernel), jax.grad(loss(dense), (0, 1))(u, kernel)))

    (y, grads), (y_ref, grads_ref) = jit0(run)(u, kernel)
    assert np.isfinite(np.asarray(y)).all() and np.isfinite(np.asarray(grads[1])).all()
    assert_close(y, y_ref, err_msg=f"outputs, L={length}, documents {docs}")
    # The input's gradient at padding is zero in both (its NaN never reaches an output).
    assert_close(grads, grads_ref, EXACT_GRAD, err_msg="gradients w.r.t. u and the kernel")


def test_one_document_is_the_plain_fft_convolution():
    # One document over the whole row (not a power of two: the tree pads it): the row's FFT.
    k = jax.random.split(jax.random.PRNGKey(3), 2)
    u, kernel = jax.random.normal(k[0], (45, 2)), jax.random.normal(k[1], (2, 45))
    y, plain = jit0(lambda u, h: (mixers.causal_convolve(u, h, jnp.ones((45,), jnp.int32)),
                                  mixers.causal_convolve(u, h)))(u, kernel)
    assert_close(y, plain)


def test_broadcast_kernels_and_bad_segment_ids():
    # H3's per-head kernel [H, 1, 1, L] over [L, H, P, P] outer products, as without ids.
    seg = _segments((5, 7, 3), 16)
    k = jax.random.split(jax.random.PRNGKey(4), 2)
    u, kernel = jax.random.normal(k[0], (16, 2, 3, 3)), jax.random.normal(k[1], (2, 1, 1, 16))
    conv = functools.partial(document_convolve, segment_ids=seg)
    w = jax.random.normal(jax.random.PRNGKey(5), (16, 2, 3, 3))

    def run(u, kernel):
        # The same operator per channel: 9 copies of each head's kernel, summed in the gradient.
        wide = lambda u, h: conv(u.reshape(16, -1), jnp.repeat(h.reshape(2, 16), 9, 0))  # noqa: E731
        loss = lambda f: lambda u, h: jnp.sum(w.reshape(16, -1) * f(u, h).reshape(16, -1))  # noqa: E731
        return ((conv(u, kernel).reshape(16, -1), jax.grad(loss(conv), (0, 1))(u, kernel)),
                (wide(u, kernel), jax.grad(loss(wide), (0, 1))(u, kernel)))

    (y, grads), (y_wide, grads_wide) = jit0(run)(u, kernel)
    assert_close(y, y_wide)
    assert_close(grads, grads_wide, EXACT_GRAD, err_msg="gradients w.r.t. u and the kernel")
    with pytest.raises(ValueError, match=r"segment_ids must be int\[L\] = \[16\]"):
        mixers.causal_convolve(u, kernel, seg[:8])


# -- the kinds: each document alone, and the fast form against the recurrent one ---------------

_DOCS, _L = (20, 44, 9), 80  # boundaries inside a leaf (20), on a block edge (64), padding
_SEG = _segments(_DOCS, _L)


def _alone(f, arrays, docs=_DOCS):
    """``f`` on each document's slice of ``arrays`` (sequence axis 0)."""
    return [f(*(a[s:s + n] for a in arrays)) for s, n in zip(_starts(docs), docs)]


def _assert_documents(packed, alone, what, docs=_DOCS):
    for (s, n), one in zip(zip(_starts(docs), docs), alone):
        assert_close(packed[s:s + n], one, err_msg=f"{what}: document at {s}..{s + n - 1}")


def _s4d_system(key, h=3, n=4):
    k = jax.random.split(key, 4)
    a = -0.5 + 1j * jnp.pi * jnp.broadcast_to(jnp.arange(n, dtype=jnp.float32), (h, n))
    c = jax.random.normal(k[0], (h, n)) + 1j * jax.random.normal(k[1], (h, n))
    c_rev = jax.random.normal(k[2], (h, n)) + 1j * jax.random.normal(k[3], (h, n))
    return jnp.full((h,), 0.1), a, jnp.ones((h, n), jnp.complex64), c, c_rev


@pytest.mark.parametrize("bidirectional", [False, True])
def test_s4d_packs_in_both_forms(bidirectional):
    dt, a, b, c, c_rev = _s4d_system(jax.random.PRNGKey(5))
    k = jax.random.split(jax.random.PRNGKey(6), 3)
    d = jax.random.normal(k[0], (3,))
    u = _nan_padded(jax.random.normal(k[1], (_L, 3)), _SEG)
    w = jax.random.normal(k[2], (_L, 3)) * (_SEG > 0)[:, None]
    rev = c_rev if bidirectional else None

    def run(u, c_re):
        out = {}
        for form in ("fft", "recurrent"):
            s4d = functools.partial(mixers.s4d, dt=dt, a=a, b=b, d=d, c_reverse=rev,
                                    implementation=form)

            def loss(u, c_re, s4d=s4d):  # C's real part: a real argument to differentiate
                y = s4d(u, c=c_re + 1j * c.imag, kv_mask=_SEG > 0, segment_ids=_SEG)
                return jnp.sum(w * y), y

            out[form] = jax.grad(loss, (0, 1), has_aux=True)(u, c_re)
        alone = _alone(lambda u: mixers.s4d(u, dt, a, b, c, d, c_reverse=rev), (u,))
        return out, alone

    out, alone = jit0(run)(u, c.real)
    _assert_documents(out["fft"][1], alone, "s4d fft")
    assert_close(out["fft"][1], out["recurrent"][1], err_msg="fft against recurrent")
    assert_close(out["fft"][0], out["recurrent"][0], EXACT_GRAD,
                 err_msg="gradients w.r.t. u and Re C: fft against recurrent")


def test_h3_packs_in_both_forms():
    dt, a, b, c, _ = _s4d_system(jax.random.PRNGKey(7), h=2, n=2)
    k = jax.random.split(jax.random.PRNGKey(8), 6)
    q, kk, v = (_nan_padded(jax.random.normal(key, (_L, 2, 2)), _SEG) for key in k[:3])
    shift = jax.random.normal(k[3], (2, 2, 3))
    d = jax.random.normal(k[4], (2,))
    w = jax.random.normal(k[5], (_L, 2, 2)) * (_SEG > 0)[:, None, None]

    def run(q, kk, v, shift):
        out = {}
        for form in ("fft", "recurrent"):
            h3 = functools.partial(mixers.h3, dt=dt, a=a, b=b, c=c, d=d, implementation=form)

            def loss(kk, shift, h3=h3):
                y = h3(q, kk, v, shift, kv_mask=_SEG > 0, segment_ids=_SEG)
                return jnp.sum(w * y), y

            out[form] = jax.grad(loss, (0, 1), has_aux=True)(kk, shift)
        alone = _alone(lambda q, kk, v: mixers.h3(q, kk, v, shift, dt, a, b, c, d), (q, kk, v))
        return out, alone

    out, alone = jit0(run)(q, kk, v, shift)
    _assert_documents(out["fft"][1], alone, "h3 fft")
    assert_close(out["fft"][1], out["recurrent"][1], err_msg="fft against recurrent")
    assert_close(out["fft"][0], out["recurrent"][0], EXACT_GRAD,
                 err_msg="gradients w.r.t. k and the shift taps: fft against recurrent")


def test_hyena_packs():
    # Its filters are indexed by distance (each document alone sees their first taps) and its
    # short convolution has 3 taps, so two positions of each document read across the boundary
    # unless it stays inside.
    order, dim = 2, 3
    k = jax.random.split(jax.random.PRNGKey(9), 5)
    u = _nan_padded(jax.random.normal(k[0], (_L, (order + 1) * dim)), _SEG)
    short_w = jax.random.normal(k[1], (3, (order + 1) * dim))
    short_b = jax.random.normal(k[2], ((order + 1) * dim,))
    filters = jax.random.normal(k[3], (order, dim, _L)) / 4
    bias = jax.random.normal(k[4], (order, dim))
    hyena = functools.partial(mixers.hyena, short_w=short_w, short_b=short_b, bias=bias)

    def run(u, filters):
        def loss(f):
            y = hyena(u, filters=f, kv_mask=_SEG > 0, segment_ids=_SEG)
            return jnp.sum(y * (_SEG > 0)[:, None]), y

        grad, packed = jax.grad(loss, has_aux=True)(filters)
        return packed, grad, [hyena(u[s:s + n], filters=filters[..., :n])
                              for s, n in zip(_starts(_DOCS), _DOCS)]

    packed, grad, alone = jit0(run)(u, filters)
    _assert_documents(packed, alone, "hyena")
    assert np.isfinite(np.asarray(grad)).all(), "NaN padding reached the filters' gradient"


@pytest.mark.parametrize("causal", [True, False])
def test_the_lightweight_convolution_stays_inside_documents(causal):
    docs, length = (5, 7, 3), 16
    seg = _segments(docs, length)
    k = jax.random.split(jax.random.PRNGKey(10), 2)
    x = jax.random.normal(k[0], (1, length, 4))
    kernel = jax.random.normal(k[1], (2, 5))
    conv = functools.partial(mixers.lightweight_conv, kernel=kernel, causal=causal)
    packed, alone = jit0(lambda x: (conv(x, mask=seg[None] > 0, segment_ids=seg[None])[0],
                                    _alone(lambda x: conv(x[None])[0], (x[0],), docs)))(x)
    _assert_documents(packed, alone, f"lightweight conv causal={causal}", docs)


# -- the kinds that cannot pack say why --------------------------------------------------------

@pytest.mark.parametrize("name,reason", [
    ("loglinear_linear", "Fenwick-tree buckets .* absolute position"),
    ("loglinear_mamba2", "Fenwick-tree buckets .* absolute position"),
    ("gmlp", r"weights W\[i, j\] are per absolute position pair"),
    ("amlp", r"weights W\[i, j\] are per absolute position pair")])
def test_the_refusal_names_the_reason(name, reason):
    kind = nn.get_kind("mixer", name)
    block = {"mixer": nn.MixerSpec(name, dict(kind.test_hyperparameters))}
    model = jax.eval_shape(lambda: nn.TransformerBlock(16, 2, 32, causal=True,
                                                       key=jax.random.PRNGKey(0), **block))
    with pytest.raises(ValueError, match=f"mixer '{name}' does not honour segment ids: .*{reason}"):
        nn.check_segments([model])


def test_log_linear_levels_move_with_the_document_offset():
    # Why log-linear attention is refused: the same document, alone and at offset 5 behind
    # keys that contribute nothing (k = 0), gets other level weights (the Fenwick buckets of
    # (5 + t) XOR (5 + s) are not those of t XOR s), so other outputs.
    n, offset = 6, 5
    k = jax.random.split(jax.random.PRNGKey(11), 4)
    q, kk, v = (jax.random.normal(key, (n, 4)) for key in k[:3])
    lam = jax.random.uniform(k[3], (offset + n, num_levels(offset + n)))
    pad = lambda x: jnp.concatenate([jnp.zeros((offset, x.shape[1])), x])  # noqa: E731
    f = functools.partial(mixers.loglinear_linear, implementation="parallel")
    alone, shifted = jit0(lambda: (f(q, kk, v, lam[offset:, :num_levels(n)]),
                                   f(pad(q), pad(kk), pad(v), lam)[offset:]))()
    # The first token reads only itself (level 0) either way; later ones differ.
    assert_close(shifted[0], alone[0])
    assert np.abs(np.asarray(shifted[1:] - alone[1:])).max() > 1e-2


def test_bidirectional_layers_pack():
    # The encoder forms run each operator a second time from the end: the segment ids are
    # flipped with the inputs, so each document is still alone in both directions.
    docs, length, dim = (5, 7, 3), 16, 8
    seg = _segments(docs, length)
    x = jax.random.normal(jax.random.PRNGKey(12), (1, length, dim))

    def make(name, key):
        hp = dict(nn.get_kind("mixer", name).test_hyperparameters)
        return nn.MixerSpec(name, hp).build(dim, 2, causal=False, max_len=length, key=key)

    def run(key):
        out = {}
        for name in ("s4d", "h3", "hyena", "lsra"):
            layer = make(name, key)
            packed = layer(x, kv_mask=seg[None] > 0, segment_ids=seg[None])[0]
            out[name] = packed, _alone(lambda x: layer(x[None])[0], (x[0],), docs)
        return out

    for name, (packed, alone) in jit0(run)(jax.random.PRNGKey(13)).items():
        _assert_documents(packed, alone, f"bidirectional {name}", docs)


def test_lsra_packs_as_its_attention_branch_does():
    lsra = nn.get_kind("mixer", "lsra")
    assert lsra.segment_problem(lsra.resolve({"spec": "flash"})) is None
    # Linformer's length projection mixes every position (other documents too).
    assert "its attention branch: attention kind 'linformer': its projections" in \
        lsra.segment_problem(lsra.resolve({"spec": nn.AttentionSpec("linformer")}))
