"""The sparse, delta-rule and routing kinds (their adapters in xformers_jax/attention/**/_kinds.py):
references against other registry kinds, delta-rule decoding, and routing attention's
eqx.nn.State through attention, blocks and scanned stacks (the generic registry tests in
test_kinds_behaviour.py cover forward, gradient, jit and causal no-leak for the stateless ones)."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import xformers_jax.models as models
import xformers_jax.nn as nn
from tests.tolerances import assert_close
from xformers_jax.attention import patterns as P

D, H, L = 16, 4, 16
KEY = jax.random.PRNGKey(0)
X = jax.random.normal(jax.random.PRNGKey(1), (2, L, D))
MASK = jnp.arange(L)[None] < jnp.array([[L], [L - 5]])
ROUTING = nn.AttentionSpec("routing", {"num_clusters": 2, "window": 4})


def _mha(kind, hp, **kw):
    return nn.MultiHeadAttention(D, H, spec=nn.AttentionSpec(kind, hp), max_len=L, key=KEY, **kw)


def _valid_rows(a, b):
    """Compare only the real query rows of the padded batch element."""
    m = np.asarray(MASK)
    return np.asarray(a)[m], np.asarray(b)[m]


# --- references: each new kind equals an existing one where they coincide -------------------

@pytest.mark.parametrize("causal", [False, True])
def test_per_head_with_one_pattern_equals_block_sparse(causal):
    heads = P.PerHead((P.Local(2, 2),) * H)
    a = _mha("per_head_block_sparse", {"heads": heads, "block_q": 8, "block_k": 8},
             causal=causal)
    b = _mha("block_sparse", {"pattern": P.Local(2, 2), "block_q": 8, "block_k": 8},
             causal=causal)
    assert_close(*_valid_rows(a(X, kv_mask=MASK), b(X, kv_mask=MASK)))


def test_sparse_transformer_heads_split_the_patterns():
    spec = {"stride": 4, "block_q": 8, "block_k": 8}
    mha = _mha("per_head_block_sparse", spec, causal=True)
    q, k, v = mha.project(X, None)
    out = mha.adapter.attend(q, k, v, None, causal=True, kv_mask=None, bias=None, key=None,
                             **spec)
    blocks = {"block_q": 8, "block_k": 8}
    local = _mha("block_sparse", {"pattern": P.Strided(4, "local"), **blocks}, causal=True)
    strided = _mha("block_sparse", {"pattern": P.Strided(4, "strided"), **blocks}, causal=True)
    for ref, heads in ((local, slice(0, 2)), (strided, slice(2, 4))):
        o = ref.adapter.attend(q, k, v, None, causal=True, kv_mask=None, bias=None, key=None,
                               pattern=ref.spec.hyperparameters["pattern"], block_q=8, block_k=8)
        assert_close(out[:, :, heads], o[:, :, heads])
    with pytest.raises(ValueError, match="PerHead has 2 patterns but the module has 4 heads"):
        _mha("per_head_block_sparse", {"heads": P.PerHead.sparse_transformer(2, 4)})


@pytest.mark.parametrize("causal", [False, True])
def test_axial_rows_equal_block_local(causal):
    # Raster order over (4, 4): attending along the last axis is attending within blocks of 4.
    a = _mha("axial", {"shape": (4, 4), "axis": 1}, causal=causal)
    b = _mha("block_sparse", {"pattern": P.BlockLocal(4)}, causal=causal)
    assert_close(*_valid_rows(a(X, kv_mask=MASK), b(X, kv_mask=MASK)))


def test_axial_classifier_on_pixels_and_bad_shape():
    model = models.EncoderClassifier(3, D, 1, H, 32, pooling="mean", input_dim=3, max_len=L,
                                 block=dict(spec=nn.AttentionSpec("axial", {"shape": (4, 4)})),
                                 key=KEY)
    pixels = jax.random.uniform(KEY, (2, L, 3))
    grads = eqx.filter_grad(lambda m: jnp.sum(m(pixels) ** 2))(model)
    assert float(jnp.abs(grads.encoder.layers.layers.attn.wq).sum()) > 0
    with pytest.raises(ValueError, match=r"shape \(4, 4\) must be positive sizes whose product "
                                         r"is the length 12"):
        model(pixels[:, :12])


@pytest.mark.parametrize("causal", [False, True])
def test_longformer_with_tied_global_projections_equals_its_pattern(causal):
    hp = {"window": 2, "global_tokens": (0, 5), "block_q": 8, "block_k": 8}
    a = _mha("longformer", hp, causal=causal)
    # With Q_g, K_g, V_g equal to Q, K, V, the global rows are ordinary pattern rows.
    a = eqx.tree_at(lambda m: m.variant_params, a, (a.wq, a.wk, a.wv))
    b = _mha("block_sparse", {"pattern": P.Longformer(2, 1, (0, 5)), "block_q": 8, "block_k": 8},
             causal=causal)
    assert_close(*_valid_rows(a(X, kv_mask=MASK), b(X, kv_mask=MASK)))
    # Separate global projections change the global rows only.
    c = _mha("longformer", hp, causal=causal)(X)
    d = a(X)
    rows = np.array([i not in (0, 5) for i in range(L)])
    np.testing.assert_allclose(np.asarray(c)[:, rows], np.asarray(d)[:, rows], atol=1e-5)
    assert not np.allclose(np.asarray(c)[:, ~rows], np.asarray(d)[:, ~rows])


def test_etc_with_tied_projections_equals_global_plus_band_pattern():
    g, r = 2, 2
    a = _mha("etc", {"num_global": g, "radius": r})
    a = eqx.tree_at(lambda m: m.variant_params, a, (a.wq, a.wk, a.wv))
    # Global rows see everything; a long token sees the global tokens and |i - j| <= r.
    i, j = np.arange(L)[:, None], np.arange(L)[None]
    allowed = (i < g) | (j < g) | ((i >= g) & (j >= g) & (np.abs(i - j) <= r))
    b = _mha("dot_product", {})  # the same key: the same wq, wk, wv, wo as `a`
    q, k, v = b.project(X, None)
    dense = jax.vmap(lambda q2, k2, v2: _masked_dense(q2, k2, v2, allowed), in_axes=1, out_axes=1)
    ref = b.output(jax.vmap(dense)(q, k, v))
    assert_close(a(X), ref)
    with pytest.raises(ValueError, match="self attention only"):
        a(X, context=X)
    with pytest.raises(ValueError, match=r"num_global=16 must be in \[1, 16\)"):
        _mha("etc", {"num_global": L, "radius": r})(X)


def _masked_dense(q, k, v, allowed):
    s = (q @ k.T) / np.sqrt(q.shape[-1])
    return jax.nn.softmax(jnp.where(allowed, s, -jnp.inf), -1) @ v


# --- delta rule ---------------------------------------------------------------------------------

def test_delta_rule_decoding_equals_teacher_forcing():
    model = models.CausalLM(20, D, 1, H, 32, max_len=L, key=KEY,
                        block=dict(spec=nn.AttentionSpec("delta_rule", {"chunk_size": 4}),
                                   num_kv_heads=2))
    tokens = jax.random.randint(KEY, (2, L), 0, 20)

    @eqx.filter_jit
    def run(m):
        forced, grads = eqx.filter_value_and_grad(lambda m: jnp.sum(m(tokens) ** 2))(m)
        return m(tokens), m.prefill(tokens, m.init_cache(2, L))[0], grads

    forced, cached, grads = run(model)
    assert_close(cached, forced)
    # The write strength is a learned parameter: it gets a gradient.
    assert float(jnp.abs(grads.layers.layers.attn.variant_params["w"]).sum()) > 0


# --- routing: state through attention, block, scanned stack -------------------------------------

def test_routing_attention_updates_its_state():
    mha, state = eqx.nn.make_with_state(nn.MultiHeadAttention)(D, H, spec=ROUTING, max_len=L,
                                                               key=KEY)
    before = state.get(mha.state_index)
    out, carry = eqx.filter_jit(lambda m, s: m(X, kv_mask=MASK, carry=nn.Carry(state=s)))(
        mha, state)
    state = carry.state
    after = state.get(mha.state_index)
    assert out.shape == X.shape and bool(jnp.isfinite(out).all())
    assert not np.allclose(np.asarray(after.state.sums), np.asarray(before.state.sums))
    assert float(after.commitment_loss) > 0
    # Inference freezes the centroids.
    _, frozen = mha(X, carry=nn.Carry(state=state), inference=True)
    np.testing.assert_array_equal(np.asarray(frozen.state.get(mha.state_index).state.sums),
                                  np.asarray(after.state.sums))
    with pytest.raises(ValueError, match="keeps state; build the model with eqx.nn.make_with_"):
        mha(X)


def test_routing_block_unstacked_threads_state_with_power_norm():
    block, state = eqx.nn.make_with_state(nn.TransformerBlock)(D, H, 32, spec=ROUTING,
                                                               norm="power", max_len=L, key=KEY)
    norm0 = np.asarray(state.get(block.norms[0].index))
    sums0 = np.asarray(state.get(block.attn.state_index).state.sums)
    y, carry = eqx.filter_jit(lambda b, s: b(X, nn.Carry(state=s), kv_mask=MASK))(block, state)
    new = carry.state
    assert y.shape == X.shape and bool(jnp.isfinite(y).all())
    # Both the norm's running statistic and the centroids moved, in the one State.
    assert not np.allclose(np.asarray(new.get(block.norms[0].index)), norm0)
    assert not np.allclose(np.asarray(new.get(block.attn.state_index).state.sums), sums0)


@pytest.mark.parametrize("causal", [False, True])
def test_routing_models_scan_equals_unrolled_with_per_layer_state(causal):
    def make(scan):
        if causal:
            return eqx.nn.make_with_state(models.CausalLM)(20, D, 2, H, 32, max_len=L, key=KEY,
                                                       block=dict(spec=ROUTING),
                                                       stack=dict(scan=scan))
        return eqx.nn.make_with_state(models.EncoderClassifier)(
            3, D, 2, H, 32, pooling="mean", vocab_size=20, max_len=L, key=KEY,
            block=dict(spec=ROUTING), stack=dict(scan=scan))

    tokens = jax.random.randint(KEY, (2, L), 0, 20)
    mask = None if causal else MASK

    def layers(m):
        return (m.layers if causal else m.encoder.layers).layers

    @eqx.filter_jit
    def train_step(m, s):
        def loss(m):
            out, s2 = m(tokens, mask=mask, state=s)
            return jnp.mean(out ** 2) + 0.1 * nn.routing_commitment_loss(m, s2), (out, s2)
        return eqx.filter_value_and_grad(loss, has_aux=True)(m)

    model, state = make(True)
    (loss, (out, new)), grads = train_step(model, state)
    value = new.get(layers(model).attn.state_index)
    assert value.state.sums.shape == (2, H, 2, D // H)  # [layers, heads, clusters, dk]
    # Each layer routes its own inputs: the two layers' states differ.
    assert not np.allclose(np.asarray(value.state.sums[0]), np.asarray(value.state.sums[1]))
    assert np.isfinite(float(loss)) and float(jnp.abs(layers(grads).attn.wq).sum()) > 0
    # The unrolled loop slices and restacks the same per-layer state.
    unrolled, state_u = make(False)
    out_u, new_u = eqx.filter_jit(lambda m, s: m(tokens, mask=mask, state=s))(unrolled, state_u)
    assert_close(out_u, out)
    assert_close(new_u.get(layers(unrolled).attn.state_index).state.sums, value.state.sums)
    if causal:
        changed = tokens.at[:, -1].set((tokens[:, -1] + 1) % 20)
        # Under jit the state is flattened, so one State serves both calls.
        logits = eqx.filter_jit(lambda m, s, t: m(t, state=s)[0])
        a, b = logits(model, state, tokens), logits(model, state, changed)
        np.testing.assert_allclose(np.asarray(a[:, :-1]), np.asarray(b[:, :-1]), atol=1e-5)


def test_routing_stack_rejects_sharing_and_missing_state():
    make = lambda k: nn.TransformerBlock(D, H, 32, spec=ROUTING, max_len=L, key=k)  # noqa: E731
    with pytest.raises(ValueError, match="needs sharing='none' and reversible=False"):
        nn.LayerStack(make, 2, sharing="all", key=KEY)
    stack = nn.LayerStack(make, 2, key=KEY)
    with pytest.raises(ValueError, match="keeps state"):
        stack(X)
