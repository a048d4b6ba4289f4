"""Routers, router losses, capacity and dropless dispatch, the grouped matmul and product-key
memory of ``xformers_jax.experts``, against small numpy references written from the papers."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.tolerances import EXACT, EXACT_GRAD, assert_close
from xformers_jax import experts as M

T, D, H, E = 12, 8, 16, 4
_jit = functools.partial(jax.jit, compiler_options={"xla_backend_optimization_level": 0})


def _setup(seed=0, gated=False):
    k = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(k[0], (T, D))
    wr = jax.random.normal(k[1], (D, E))
    w = M.init_expert_weights(k[2], E, D, H, gated=gated)
    return x, wr, w


def _np_topk(logits, k, renorm):
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    idx = np.argsort(-p, axis=-1, kind="stable")[:, :k]
    g = np.take_along_axis(p, idx, -1)
    if k > 1 and renorm:
        g = g / g.sum(-1, keepdims=True)
    return p, idx, g


@pytest.mark.parametrize("k,renorm", [(1, True), (2, True), (2, False)])
def test_top_k_route_matches_numpy(k, renorm):
    x, wr, _ = _setup()
    logits = M.router_logits(x, wr)
    r = M.top_k_route(logits, k, renormalize=renorm)
    p, idx, g = _np_topk(np.asarray(logits), k, renorm)
    np.testing.assert_array_equal(np.asarray(r.experts), idx)
    assert_close(r.gates, g)
    assert_close(r.probs, p)
    if k == 2 and renorm:
        assert_close(r.gates.sum(-1), np.ones(T))


def test_gshard_random_second_and_jitter():
    x, wr, _ = _setup()
    logits = M.router_logits(x, wr)
    r = M.top_k_route(logits, 2, second_policy="random", key=jax.random.key(1))
    kept2 = np.asarray(r.gates[:, 1]) > 0
    assert 0 < kept2.sum() < T  # some second choices skipped, some kept
    u = np.asarray(jax.random.uniform(jax.random.key(1), (T, 1)))[:, 0]
    full = M.top_k_route(logits, 2)
    np.testing.assert_array_equal(kept2, u < np.minimum(1, 2 * np.asarray(full.gates[:, 1])))
    # Without a key (inference) every slot is kept; jitter changes logits only with a key.
    assert (np.asarray(M.top_k_route(logits, 2, second_policy="random").gates) > 0).all()
    assert_close(M.router_logits(x, wr, jitter=0.1), logits)
    j = M.router_logits(x, wr, jitter=0.1, key=jax.random.key(2))
    assert not np.allclose(j, logits)
    ratio = np.asarray(j) / np.asarray(logits)
    assert np.isfinite(ratio).all()


def _np_slots(experts, gates, mask, e, cf, priority):
    t, k = experts.shape
    c = int(np.ceil(cf * (mask.sum() if mask is not None else t) * k / e))
    order = ([(j, i) for j in range(k) for i in range(t)] if priority == "choice"
             else [(i, j) for i in range(t) for j in range(k)])
    count = np.zeros(e, int)
    kept = np.zeros((t, k), bool)
    for a, b in order:
        i, j = (b, a) if priority == "choice" else (a, b)
        if gates[i, j] == 0 or (mask is not None and not mask[i]):
            continue
        if count[experts[i, j]] < c:
            kept[i, j] = True
        count[experts[i, j]] += 1
    return kept, c


@pytest.mark.parametrize("priority", ["choice", "token"])
@pytest.mark.parametrize("cf", [0.5, 1.0])
def test_capacity_slots_match_numpy(priority, cf):
    x, wr, _ = _setup(1)
    r = M.top_k_route(M.router_logits(x, wr), 2)
    mask = np.arange(T) < 10
    pos, kept, c_static = M.capacity_slots(r, E, cf, priority=priority, mask=jnp.asarray(mask))
    want, c = _np_slots(np.asarray(r.experts), np.asarray(r.gates), mask, E, cf, priority)
    np.testing.assert_array_equal(np.asarray(kept), want)
    assert c == int(np.ceil(cf * 10 * 2 / E)) and c_static == int(np.ceil(cf * T * 2 / E))
    assert want.sum() < 2 * 10  # something is dropped at these capacities


def test_losses_match_numpy_and_perfect_balance():
    x, wr, _ = _setup(2)
    logits = M.router_logits(x, wr)
    r = M.top_k_route(logits, 2)
    p, idx, _ = _np_topk(np.asarray(logits), 2, True)
    f = np.stack([(idx == i).sum() / T for i in range(E)])
    assert_close(M.load_balancing_loss(r.probs, r.experts), E * (f * p.mean(0)).sum())
    lse = np.log(np.exp(np.asarray(logits, np.float64)).sum(-1))
    assert_close(M.router_z_loss(logits), (lse ** 2).mean())
    # Perfect balance: uniform probabilities, each expert chosen k/E of the time -> k.
    for k in (1, 2):
        experts = (np.arange(T)[:, None] + np.arange(k)[None]) % E
        uniform = jnp.full((T, E), 1.0 / E)
        assert_close(M.load_balancing_loss(uniform, jnp.asarray(experts)), float(k))
    # Padding is excluded: the padded rows' content changes nothing.
    mask = jnp.arange(T) < 8
    junk = r.probs.at[8:].set(0.9)
    assert_close(M.load_balancing_loss(junk, r.experts, mask=mask),
                 M.load_balancing_loss(r.probs, r.experts, mask=mask))
    load = M.expert_load(r.experts, E)
    assert_close(load, f / 2)


@_jit
def _all_modes(x, wr, w, cf):
    del cf
    r = M.top_k_route(M.router_logits(x, wr), 2)
    ref = M.moe_reference(x, r, w)
    dl = M.moe_dropless(x, r, w)
    dd = M.moe_dropless(x, r, w, backend="dense")
    dr = M.moe_dropless(x, r, w, backend="ragged_dot")
    cap, kept = M.moe_capacity(x, r, w, capacity_factor=1.0)
    ref_kept = M.moe_reference(x, r, w, kept=kept)
    big, kept_big = M.moe_capacity(x, r, w, capacity_factor=float(E))
    return ref, dl, dd, cap, ref_kept, big, kept_big, kept, dr


@pytest.mark.parametrize("gated", [False, True])
def test_dispatch_modes_equal_reference(gated):
    x, wr, w = _setup(3, gated)
    ref, dl, dd, cap, ref_kept, big, kept_big, kept, dr = _all_modes(x, wr, w, 1.0)
    assert_close(dl, ref)
    assert_close(dd, ref)
    assert_close(dr, ref)
    assert_close(cap, ref_kept)
    assert not np.asarray(kept).all()  # capacity 1.0 drops something here
    assert np.asarray(kept_big).all()  # a large capacity drops nothing and equals dropless
    assert_close(big, dl)


def _loss(mode, x, wr, w):
    r = M.top_k_route(M.router_logits(x, wr), 2)
    if mode == "ref":
        y = M.moe_reference(x, r, w, kept=M.capacity_slots(r, E, 1.0)[1])
    elif mode == "ref_all":
        y = M.moe_reference(x, r, w)
    elif mode == "capacity":
        y = M.moe_capacity(x, r, w, capacity_factor=1.0)[0]
    else:
        y = M.moe_dropless(x, r, w)
    return (jnp.sin(y) * jnp.arange(D)).sum()


@_jit
def _grads(x, wr, w):
    g = lambda m: jax.grad(functools.partial(_loss, m), argnums=(0, 1, 2))(x, wr, w)  # noqa
    return g("ref"), g("capacity"), g("ref_all"), g("dropless")


def test_dispatch_gradients_equal_reference():
    x, wr, w = _setup(4)
    ref, cap, ref_all, dl = _grads(x, wr, w)
    for a, b in ((cap, ref), (dl, ref_all)):
        for ga, gb in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
            assert_close(ga, gb, EXACT_GRAD)
    assert float(jnp.abs(dl[1]).sum()) > 0  # the router gets a gradient through the gates


def test_grouped_matmul_backends_agree_and_zero_tail():
    k = jax.random.split(jax.random.key(5), 2)
    x = jax.random.normal(k[0], (10, 6))
    w = jax.random.normal(k[1], (3, 6, 5))
    sizes = jnp.array([3, 0, 4], jnp.int32)  # rows 7..9 belong to no group
    want = np.concatenate([np.asarray(x[:3] @ w[0]), np.asarray(x[3:7] @ w[2]), np.zeros((3, 5))])
    for backend in M.grouped_matmul_backends():
        assert_close(M.grouped_matmul(x, w, sizes, backend=backend), want, err_msg=backend)
    # Tiles of 2 rows: groups straddle tiles and get padded.
    assert_close(M._grouped._tiled(x, w, sizes, tile=2), want)
    gw, gd = _jit(lambda w: [jax.grad(lambda w: M.grouped_matmul(  # noqa: E731
        x, w, sizes, backend=b).sum())(w) for b in ("tiled", "dense")])(w)
    assert_close(gw, gd, EXACT_GRAD)
    with pytest.raises(ValueError, match="backend"):
        M.grouped_matmul(x, w, sizes, backend="nope")
    with pytest.raises(ValueError, match=r"w \[G, k, n\]"):
        M.grouped_matmul(x, w[:, :4], sizes)


@pytest.mark.parametrize("merge", [1, 3])
def test_block_matmul_runs_of_tiles_equal_dense(merge):
    # Tiles of 2 rows; groups of 7, 0, 12 and 1 rows pad to 4, 0, 6 and 1 tiles, so with runs
    # of 3 tiles there are merged runs (groups 0 and 2), leftover single tiles (groups 0 and
    # 3) and unused tiles at the end of the static bound.
    from xformers_jax.experts import _grouped as G
    sizes = jnp.array([7, 0, 12, 1], jnp.int32)
    k = jax.random.split(jax.random.key(6), 3)
    x = jax.random.normal(k[0], (24, 5))
    w = jax.random.normal(k[1], (4, 5, 3))
    cot = jax.random.normal(k[2], (24, 3))
    dense = lambda x, w: G._dense(x, w, sizes)  # noqa: E731
    tiled = lambda x, w: G._tiled(x, w, sizes, tile=2, merge=merge)  # noqa: E731
    assert_close(_jit(tiled)(x, w), dense(x, w))
    grads = [_jit(jax.grad(lambda x, w, f=f: (f(x, w) * cot).sum(), argnums=(0, 1)))(x, w)
             for f in (tiled, dense)]
    assert_close(grads[0], grads[1], EXACT_GRAD)
    runs = G._runs(*G.block_layout(sizes, 24, 2)[1:3], 4, merge)
    if merge == 3:
        assert [int(r[2]) for r in runs] == [3, 2]  # runs of 3 tiles: 1 + 2; single tiles: 1 + 1


@pytest.mark.parametrize("merge,gated,act", [(1, False, "gelu"), (3, True, "gelu"),
                                              (3, False, "relu")])
def test_block_mlp_equals_the_mlp_of_block_matmuls(merge, gated, act):
    # The fused expert MLP (both matmuls per run, activation recomputed in the backward)
    # against the MLP built from block_matmul per weight, and against the dense form, on the
    # layout of the test above: merged runs, leftover tiles and unused tiles (0 out, 0 da).
    from xformers_jax.experts import _grouped as G
    sizes = jnp.array([7, 0, 12, 1], jnp.int32)
    k = jax.random.split(jax.random.key(7), 5)
    w = M.init_expert_weights(k[0], 4, 5, 6, gated=gated)
    w = jax.tree.map(lambda a: a * 2.0, w)  # larger pre-activations: relu's kink is crossed
    pstarts, tile_group, n_used, n_tiles = G.block_layout(sizes, 24, 2)
    used_rows = np.repeat(np.asarray(tile_group < 4) & (np.arange(n_tiles) < int(n_used)), 2)
    x = jax.random.normal(k[1], (n_tiles * 2, 5)) * used_rows[:, None]
    cot = jax.random.normal(k[2], (n_tiles * 2, 5))
    fn = M._dispatch.ACTIVATIONS[act]

    def fused(x, w):
        return G.block_mlp(x, w.w1, w.w2, w.w_gate, tile_group, n_used, fn, 2, merge)

    def unfused(x, w):
        per = lambda a, wi: G.block_matmul(a, wi, tile_group, n_used, 2, merge)  # noqa
        return M._dispatch._mlp(x, w.w1, w.w2, w.w_gate, act, per)

    loss = lambda f: jax.grad(lambda x, w: (f(x, w) * cot).sum(), argnums=(0, 1))  # noqa
    out, ref = _jit(fused)(x, w), _jit(unfused)(x, w)
    assert_close(out, ref)
    assert not np.asarray(out)[~used_rows].any() and np.asarray(out)[used_rows].any()
    got, want = _jit(loss(fused))(x, w), _jit(loss(unfused))(x, w)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert_close(a, b, EXACT_GRAD)
    assert not np.asarray(got[0])[~used_rows].any()
    assert len(jax.tree.leaves(got[1])) == (3 if gated else 2)
    # bf16 inputs and weights: bf16 gradients (weight gradients accumulated in float32).
    bf = lambda t: jax.tree.map(lambda a: a.astype(jnp.bfloat16), t)  # noqa: E731
    got_bf = _jit(loss(fused))(bf(x), bf(w))
    assert all(a.dtype == jnp.bfloat16 for a in jax.tree.leaves(got_bf))
    assert_close(got_bf, want, EXACT_GRAD, dtype=jnp.bfloat16)


@functools.partial(_jit, static_argnums=(3, 4))
def _masked_run(x, wr, w, mode, n, mask):
    r = M.top_k_route(M.router_logits(x[:n], wr), 2, mask=mask[:n])
    return M.moe_ffn(x[:n], r, w, mode=mode, capacity_factor=1.0, mask=mask[:n])[0]


def test_padding_changes_no_real_output():
    x, wr, w = _setup(6)
    mask = jnp.arange(T) < 9
    junk = x.at[9:].set(100.0)
    for mode in M._dispatch.MODES:
        full = _masked_run(x, wr, w, mode, T, mask)
        assert_close(_masked_run(junk, wr, w, mode, T, mask)[:9], full[:9])
        # The padded amount: the same 9 real tokens with fewer padded rows.
        assert_close(_masked_run(x, wr, w, mode, 10, mask)[:9], full[:9])


def test_token_priority_is_causal():
    x, wr, w = _setup(7)

    def run(x):
        r = M.top_k_route(M.router_logits(x, wr), 2)
        return M.moe_capacity(x, r, w, capacity_factor=0.75, priority="token")[0]

    changed = x.at[6].set(-x[6] * 3)
    a, b = run(x), run(changed)
    assert_close(a[:6], b[:6])
    assert not np.allclose(a[6:], b[6:])


def test_expert_choice_matches_numpy():
    x, wr, w = _setup(8)
    logits = M.router_logits(x, wr)
    ec = M.expert_choice_route(logits, 2.0)
    p = np.asarray(jax.nn.softmax(logits))
    c = M.expert_choice_capacity(T, E, 2.0)
    assert c == 6 and ec.tokens.shape == (E, c)
    want = np.zeros((T, D))
    for e in range(E):
        top = np.argsort(-p[:, e], kind="stable")[:c]
        np.testing.assert_array_equal(np.sort(np.asarray(ec.tokens[e])), np.sort(top))
        for t in top:
            h = np.asarray(jax.nn.gelu(x[t] @ w.w1[e]))
            want[t] += p[t, e] * (h @ np.asarray(w.w2[e]))
    assert_close(M.expert_choice_ffn(x, ec, w), want)
    mask = jnp.arange(T) < 8
    ecm = M.expert_choice_route(logits, 2.0, mask=mask)
    sel = np.asarray(ecm.tokens)[np.asarray(ecm.gates) > 0]
    assert (sel < 8).all() and (np.asarray(ecm.gates) > 0).sum(1).max() == 4  # ceil(2*8/4)


def test_hash_and_prototype_routes():
    table = M.balanced_hash_table(256, 6, seed=3)
    counts = np.bincount(table, minlength=6)
    assert counts.max() - counts.min() <= 1
    ids = jnp.array([0, 5, 255, 5])
    r = M.hash_route(ids, table, 6)
    np.testing.assert_array_equal(np.asarray(r.experts[:, 0]), table[[0, 5, 255, 5]])
    assert_close(r.gates, np.ones((4, 1)))
    # Ids past the table (a larger vocabulary) wrap around instead of all taking its last entry.
    wide = jnp.arange(256, 256 + 64)
    got = np.asarray(jax.jit(lambda i: M.hash_route(i, table, 6).experts[:, 0])(wide))
    np.testing.assert_array_equal(got, table[np.arange(64)])
    x, wr, _ = _setup(9)
    logits = M.router_logits(x, wr)
    pr = M.prototype_route(logits, 2)
    lg = np.asarray(logits).reshape(T, 2, 2)
    pg = np.exp(lg) / np.exp(lg).sum(-1, keepdims=True)
    np.testing.assert_array_equal(np.asarray(pr.experts), pg.argmax(-1) + [0, 2])
    assert_close(pr.gates, pg.max(-1))
    assert_close(pr.probs.sum(-1), np.ones(T))


def test_bf16_and_bad_inputs():
    x, wr, w = _setup(10)
    xb = x.astype(jnp.bfloat16)
    r, y, ref = _jit(lambda xb, x: (lambda r: (r, M.moe_dropless(xb, r, w),  # noqa: E731
                                              M.moe_reference(x, r, w)))(
        M.top_k_route(M.router_logits(xb, wr), 2)))(xb, x)
    assert r.probs.dtype == jnp.float32
    assert y.dtype == jnp.bfloat16
    assert_close(y, ref, EXACT, dtype=jnp.bfloat16)
    with pytest.raises(ValueError, match=r"k must be in \[1, 4\]"):
        M.top_k_route(r.logits, 5)
    with pytest.raises(ValueError, match=r"\[tokens, dim\]"):
        M.moe_dropless(x[None], r, w)
    with pytest.raises(ValueError, match="mode"):
        M.moe_ffn(x, r, w, mode="sideways")
    with pytest.raises(ValueError, match="priority"):
        M.capacity_slots(r, E, 1.0, priority="random")
    with pytest.raises(ValueError, match="groups"):
        M.prototype_route(r.logits, 3)


def _pkm_setup(n=6, heads=2, dk=8, dv=5, t=7):
    k = jax.random.split(jax.random.key(11), 4)
    return (jax.random.normal(k[0], (t, heads, dk)), jax.random.normal(k[1], (heads, n, dk // 2)),
            jax.random.normal(k[2], (heads, n, dk // 2)), jax.random.normal(k[3], (n * n, dv)))


@pytest.mark.parametrize("n", [6, 16])  # 16: rows reordered before top_k (_largest_first)
def test_product_keys_equal_brute_force(n):
    q, k1, k2, v = _pkm_setup(n=n)
    kk = 3
    n = k1.shape[1]
    full_keys = np.concatenate([np.repeat(np.asarray(k1), n, 1), np.tile(np.asarray(k2), (1, n, 1))],
                               -1)  # [H, n^2, dk]: slot i*n+j has key [K1_i, K2_j]
    scores = np.einsum("thd,hnd->thn", np.asarray(q), full_keys)
    top = np.argsort(-scores, -1, kind="stable")[..., :kk]
    s, slots = _jit(M.product_key_topk, static_argnums=3)(q, k1, k2, kk)
    np.testing.assert_array_equal(np.sort(np.asarray(slots), -1), np.sort(top, -1))
    assert_close(s, np.take_along_axis(scores, top, -1))
    assert (np.diff(np.asarray(s), axis=-1) <= 0).all()  # in decreasing order
    sv = np.take_along_axis(scores, top, -1)
    wts = np.exp(sv - sv.max(-1, keepdims=True))
    wts /= wts.sum(-1, keepdims=True)
    want = np.einsum("thk,thkv->tv", wts, np.asarray(v)[top])
    lookup, gv = _jit(lambda v: jax.value_and_grad(  # noqa: E731
        lambda v: (M.product_key_lookup(q, k1, k2, v, kk) * np.arange(5)).sum())(v))(v)
    assert_close(lookup, (want * np.arange(5)).sum())
    # The value table's gradient touches only the selected rows.
    touched = np.flatnonzero(np.abs(np.asarray(gv)).sum(-1))
    np.testing.assert_array_equal(touched, np.unique(top))
    assert len(touched) < v.shape[0]
    # Every gradient (through the softmax weights to q and the sub-keys, and into the values)
    # equals the lookup written as one gather of the [T, H, k, dv] rows.
    def gathered(q, k1, k2, v):
        sc, sl = M.product_key_topk(q, k1, k2, kk)
        return jnp.einsum("thk,thkv->tv", jax.nn.softmax(sc, -1), v[sl])

    loss = lambda f: lambda *a: (f(*a) * jnp.arange(5.0)).sum()  # noqa: E731
    got = _jit(jax.grad(loss(lambda *a: M.product_key_lookup(*a, kk)), argnums=(0, 1, 2, 3)))(
        q, k1, k2, v)
    assert_close(got, _jit(jax.grad(loss(gathered), argnums=(0, 1, 2, 3)))(q, k1, k2, v),
                 EXACT_GRAD)

    # ... and the brute force over all n^2 keys, differentiated at the selected slots (no
    # product-key code on this path).
    def brute(q, k1, k2, v):
        keys = jnp.concatenate([jnp.repeat(k1, n, 1), jnp.tile(k2, (1, n, 1))], -1)
        sc = jnp.take_along_axis(jnp.einsum("thd,hnd->thn", q, keys), top, -1)
        return jnp.einsum("thk,thkv->tv", jax.nn.softmax(sc, -1), v[top])

    assert_close(got, _jit(jax.grad(loss(brute), argnums=(0, 1, 2, 3)))(q, k1, k2, v),
                 EXACT_GRAD)
    with pytest.raises(ValueError, match=rf"values must be \[n\^2 = {n * n}"):
        M.product_key_lookup(q, k1, k2, v[:30], kk)
