"""Charformer's GBST against a numpy reference written per position from the paper's steps
(convolution, block means, scores, softmax over block sizes, calibration, down-sampling),
with padding; the causal form (prefix block means) with no-leak; the reduction to the
convolution with one block size; gradients; errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from xformers_jax.models import GBST
from tests.fast_jit import jit0
from tests.tolerances import assert_close

B, L, D, M = 2, 11, 8, 3


def _ref(g, x, mask, causal):
    x = np.asarray(x, np.float64)
    mask = np.asarray(mask)
    conv, w = np.asarray(g.conv, np.float64), np.asarray(g.score, np.float64)
    kk = conv.shape[0]
    left = kk - 1 if causal else (kk - 1) // 2
    outs, masks = [], []
    for bi in range(B):
        n = int(mask[bi].sum())           # real bytes come first
        xb = x[bi, :n]
        h = np.zeros_like(xb)
        for i in range(n):
            for j in range(kk):
                src = i - left + j
                if 0 <= src < n:
                    h[i] += conv[j] * xb[src]
        blocks = np.zeros((n, M, D))
        for bsz in range(1, M + 1):
            for i in range(n):
                start = (i // bsz) * bsz
                stop = i + 1 if causal else min(start + bsz, n)
                blocks[i, bsz - 1] = h[start:stop].mean(0)
        logits = blocks @ w
        p = np.exp(logits - logits.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        if g.calibrate:
            s = p @ p.T
            a = np.exp(s - s.max(-1, keepdims=True))
            p = (a / a.sum(-1, keepdims=True)) @ p
        y = np.einsum("lm,lmd->ld", p, blocks)
        r = g.downsample
        pooled = [y[i:i + r].mean(0) for i in range(0, n, r)]
        outs.append(np.stack(pooled))
        masks.append(len(pooled))
    return outs, masks


def _inputs():
    x = jax.random.normal(jax.random.PRNGKey(0), (B, L, D))
    lengths = jnp.array([L, L - 4])
    return x, jnp.arange(L)[None] < lengths[:, None]


@pytest.mark.parametrize("causal", [False, True])
def test_matches_reference_with_padding(causal):
    kw = dict(causal=True) if causal else dict(calibrate=True, downsample=2)
    g = GBST(D, max_block=M, key=jax.random.PRNGKey(1), **kw)
    x, mask = _inputs()
    x = jnp.where(mask[..., None], x, 5.0)             # junk in the padding
    run = jit0(lambda g, x, m: g(x, mask=m))
    y, out_mask = run(g, x, mask)
    ref, counts = _ref(g, x, mask, causal)
    for bi in range(B):
        assert_close(y[bi, :counts[bi]], ref[bi])
        assert int(out_mask[bi].sum()) == counts[bi]
        assert float(jnp.abs(y[bi, counts[bi]:]).max(initial=0.0)) == 0.0
    if causal:
        t = 5
        moved, _ = run(g, x.at[:, t].add(1.0), mask)
        np.testing.assert_allclose(np.asarray(moved[:, :t]), np.asarray(y[:, :t]), atol=1e-6)
        assert float(jnp.abs(moved[:, t:] - y[:, t:]).max()) > 1e-4


def test_one_block_size_is_the_convolution_and_gradients():
    g = GBST(D, max_block=1, conv_size=3, key=jax.random.PRNGKey(2))
    x, _ = _inputs()
    y, _ = jit0(lambda g, x: g(x))(g, x)
    xp = np.pad(np.asarray(x), ((0, 0), (1, 1), (0, 0)))
    assert_close(y, sum(xp[:, j:j + L] * np.asarray(g.conv[j]) for j in range(3)))
    g3 = GBST(D, max_block=M, calibrate=True, key=jax.random.PRNGKey(3))
    grads = jit0(jax.grad(lambda m: jnp.sum(jnp.sin(m(x)[0]))))(g3)
    assert float(jnp.abs(grads.score).min()) > 0 and bool(jnp.all(jnp.isfinite(grads.conv)))
    with pytest.raises(ValueError, match="causal=True cannot calibrate"):
        GBST(D, causal=True, downsample=2, key=jax.random.PRNGKey(0))
    with pytest.raises(ValueError, match="inputs must be"):
        g(jnp.zeros((1, 4, D + 1)))
