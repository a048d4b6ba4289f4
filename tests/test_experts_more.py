"""BASE layers' balanced assignment against scipy's exact linear assignment, GLaM's MoE in
every other layer against the unrolled blocks, and Scaling Transformers' sparse QKV against
its equations."""

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import xformers_jax.models as models
import xformers_jax.nn as nn
from tests.tolerances import EXACT, assert_close
from xformers_jax import experts as M

_jit = functools.partial(jax.jit, compiler_options={"xla_backend_optimization_level": 0})
_assign = _jit(M.balanced_assignment, static_argnames=("eps",))


def _optimal(scores, cap):
    """The exact balanced assignment: scipy on the expanded [T, E * cap] matrix."""
    lsa = pytest.importorskip("scipy.optimize").linear_sum_assignment
    t, e = scores.shape
    expanded = np.repeat(scores, cap, axis=1)  # column e * cap + j: slot j of expert e
    rows, cols = lsa(expanded, maximize=True)
    out = np.empty(t, np.int64)
    out[rows] = cols // cap
    return out


def test_balanced_assignment_equals_scipy():
    t, e = 32, 8
    scores = np.asarray(jax.random.normal(jax.random.key(t), (t, e)) * 2.0, np.float64)
    got = np.asarray(_assign(jnp.asarray(scores, jnp.float32), eps=1e-5))
    assert (np.bincount(got, minlength=e) == t // e).all()  # exactly T / E each
    want = _optimal(scores, t // e)
    total = lambda a: scores[np.arange(t), a].sum()  # noqa: E731
    assert total(got) >= total(want) - t * 1e-5 - 1e-4  # the epsilon-optimality bound
    np.testing.assert_array_equal(got, want)
    # Greedy routing would not be balanced here: the solve is doing the work.
    assert np.bincount(scores.argmax(1), minlength=e).max() > t // e


def test_balanced_assignment_padding_and_route():
    t, e = 24, 4
    scores = jax.random.normal(jax.random.key(5), (t, e))
    mask = jnp.arange(t) < 18  # 18 real tokens: ceil(18 / 4) = 5 slots per expert
    got = np.asarray(_assign(scores, mask=mask, eps=1e-5))
    real = got[:18]
    assert np.bincount(real, minlength=e).max() <= 5
    np.testing.assert_array_equal(real, _optimal(np.asarray(scores[:18], np.float64), 5))
    junk = np.asarray(_assign(scores.at[18:].set(40.0), mask=mask, eps=1e-5))
    np.testing.assert_array_equal(junk[:18], real)  # the padded rows change nothing
    r = M.base_route(scores, balanced=False, mask=mask)
    np.testing.assert_array_equal(r.experts[:, 0], np.argmax(np.asarray(scores), 1))
    assert_close(r.gates[:18, 0], jax.nn.sigmoid(scores.max(1))[:18])
    assert float(jnp.abs(r.gates[18:]).sum()) == 0
    with pytest.raises(ValueError, match="eps > 0"):
        M.balanced_assignment(scores, eps=0.0)


def test_base_layer_trains_balanced_and_refuses_causal():
    dim, hidden, e = 8, 16, 4
    layer = nn.MoEFeedForward(dim, hidden, num_experts=e, router="base", key=jax.random.key(1))
    x = jax.random.normal(jax.random.key(2), (2, 8, dim))

    @_jit
    def run(layer, x):
        y, aux = layer(x, key=jax.random.key(3))
        xf = x.reshape(16, dim)
        logits = M.router_logits(xf, layer.w_router)
        r, rg = M.base_route(logits), M.base_route(logits, balanced=False)
        w = M.ExpertWeights(layer.w1, layer.w2, None)
        # The router learns through the sigmoid gate; the assignment carries no gradient.
        g = jax.grad(lambda l: (l(x, key=jax.random.key(3))[0] ** 2).sum())(layer)
        yi = layer(x, inference=True)[0]  # inference: greedy top-1
        return (y, aux, r.experts, M.moe_reference(xf, r, w), g.w_router, yi,
                M.moe_reference(xf, rg, w))

    y, aux, experts, want, g_router, yi, want_greedy = run(layer, x)
    assert (np.bincount(np.asarray(experts[:, 0]), minlength=e) == 4).all()
    assert_close(y.reshape(16, dim), want)
    assert float(aux["load_balancing"]) == 0 and float(aux["dropped_fraction"]) == 0
    assert_close(aux["expert_load"], np.full(e, 0.25))
    assert float(jnp.abs(g_router).sum()) > 0
    assert_close(yi.reshape(16, dim), want_greedy)
    with pytest.raises(ValueError, match="not causal-safe"):
        nn.MoEFeedForward(dim, hidden, router="base", causal=True, key=jax.random.key(0))


def test_moe_every_other_layer_equals_unrolled_blocks():
    """GLaM's setting: FFNSpec(every=2) gives layers 1 and 3 the experts, 0 and 2 the dense
    FFN; the scanned model equals the blocks run one by one, aux has one row per MoE layer,
    (BlockCycle.decode and init_cache run the blocks' own: not re-tested here, for time)."""
    vocab, dim, length = 32, 16, 8
    spec = nn.FFNSpec("st_moe", dict(num_experts=4), every=2)
    model = models.CausalLM(vocab, dim, 4, 2, 32, max_len=length, block=dict(ffn=spec),
                        key=jax.random.key(0))
    assert model.layers.num_layers == 2
    tokens = jax.random.randint(jax.random.key(1), (2, length), 0, vocab)

    @_jit
    def run(model, tokens):
        logits, aux = model(tokens, return_aux=True)
        # The same layers unrolled: each unit's blocks one by one.
        x, _ = model.embed(tokens, causal=True)
        dynamic, static = model.layers.per_layer()
        per_layer = []
        for i in range(2):
            unit = eqx.combine(jax.tree.map(lambda a: a[i], dynamic), static)
            for block in unit.blocks:
                x, c = block(x, nn.Carry())
                a = c.aux
                if a:
                    per_layer.append(a)
        return logits, aux, model.final_norm(x) @ model.head, per_layer

    logits, aux, want, per_layer = run(model, tokens)
    assert aux["load_balancing"].shape == (2,) and aux["expert_load"].shape == (2, 4)
    assert_close(logits, want)
    assert len(per_layer) == 2
    for i, a in enumerate(per_layer):
        assert_close(aux["load_balancing"][i], a["load_balancing"])
        assert_close(aux["router_z"][i], a["router_z"])
    unit = model.layers.layers
    assert [type(b.ffn).__name__ for b in unit.blocks] == ["FeedForward", "MoEFeedForward"]
    # The config switch: "every" inside model.ffn.
    assert nn.FFNSpec.from_config(dict(kind="gshard", every=2)).every == 2
    with pytest.raises(ValueError, match="not a multiple of 2"):
        models.CausalLM(vocab, dim, 3, 2, 32, block=dict(ffn=spec), key=jax.random.key(0))
    with pytest.raises(ValueError, match="single block needs every=1"):
        nn.TransformerBlock(dim, 2, 32, ffn=spec, key=jax.random.key(0))


def _np_sparse_qkv(layer, x, mask):
    """Sparse QKV attention from its equations, in float64 loops over positions and
    modules (Jaszczur et al., 2021, section 3.2)."""
    x = np.asarray(x, np.float64)
    b, length, d = x.shape
    dm, em = np.asarray(layer.d_mult, np.float64), np.asarray(layer.e_mult, np.float64)
    s, m = dm.shape[1], em.shape[1]
    z = np.einsum("bti,is,im->btsm", x, dm, em) + np.asarray(layer.b_mult)
    z *= np.asarray(mask)[:, :, None, None]
    outs = []
    for w, bias in zip(layer.kernels, layer.biases):
        w = np.asarray(w, np.float64)
        f_len, f_mod = w.shape[:2]
        out = np.zeros((b, length, s, m)) + np.asarray(bias)
        for t in range(length):
            for j in range(s):
                for a in range(f_len):
                    for c in range(f_mod):
                        tt, jj = t - (f_len - 1) + a, j - (f_mod - 1) // 2 + c
                        if 0 <= tt and 0 <= jj < s:
                            out[:, t, j] += z[:, tt, jj] @ w[a, c]
        outs.append(out.reshape(b, length, layer.num_heads, -1))
    q, k, v = outs
    dh = q.shape[-1]
    sc = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(dh)
    ok = np.tril(np.ones((length, length), bool))[None, None] & np.asarray(mask)[:, None, None]
    sc = np.where(ok, sc, -np.inf)
    p = np.exp(sc - sc.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    o = np.einsum("bhqk,bkhd->bqhd", p, v).reshape(b, length, d)
    return o @ np.asarray(layer.wo, np.float64)


def test_sparse_qkv_attention_equals_its_equations():
    dim, length = 16, 6
    layer = nn.SparseQKVAttention(dim, 2, modules=4, causal=True, key=jax.random.key(4))
    x = jax.random.normal(jax.random.key(5), (2, length, dim))
    mask = jnp.arange(length)[None] < jnp.array([[6], [4]])

    @_jit
    def run(layer, x):
        y = layer(x, kv_mask=mask)
        return y, jax.grad(lambda l: (l(x, kv_mask=mask) ** 2).sum())(layer)

    y, g = run(layer, x)
    assert_close(y[mask], _np_sparse_qkv(layer, x, mask)[np.asarray(mask)])
    # Causal: a change at position 3 moves nothing before it; padding changes no real output.
    moved = run(layer, x.at[:, 3].set(-2 * x[:, 3]))[0]
    assert_close(moved[:, :3], y[:, :3])
    assert not np.allclose(moved[0, 3:], y[0, 3:])
    junk = run(layer, x.at[1, 4:].set(30.0))[0]
    assert_close(junk[mask], y[mask])
    leaves = jax.tree.leaves(g)
    assert all(bool(jnp.isfinite(a).all()) for a in leaves)
    assert float(jnp.abs(g.d_mult).sum()) > 0 and float(jnp.abs(g.kernels[2]).sum()) > 0
    bf = jax.tree.map(lambda a: a.astype(jnp.bfloat16) if eqx.is_inexact_array(a) else a, layer)
    yb = _jit(lambda l, x: l(x, kv_mask=mask))(bf, x.astype(jnp.bfloat16))
    assert yb.dtype == jnp.bfloat16
    assert_close(yb[mask], y[mask], EXACT, dtype=jnp.bfloat16)
    # The multiplicative layer expresses a permutation: D = ones, E = a permutation's columns.
    perm = np.random.default_rng(0).permutation(dim)
    z = M.multiplicative_dense(x, jnp.ones((dim, 1)), jnp.eye(dim)[:, perm])
    assert_close(z[..., 0, :], x[..., perm])
    with pytest.raises(ValueError, match="modules"):
        nn.SparseQKVAttention(dim, 2, modules=3, key=jax.random.key(0))
