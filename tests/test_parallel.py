"""xformers_jax.parallel on 8 simulated CPU devices (tests/conftest.py).

Strategies are checked on a tiny self-contained Equinox model (2 layers of causal attention +
MLP): loss and gradients under each mesh equal the single-device run, and parameters, optimizer
state and outputs carry the intended shardings.
"""

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from tests.tolerances import EXACT_GRAD, assert_close
from xformers_jax import parallel as par
from xformers_jax.attention import flash_attention, linear_attention, multihead
from xformers_jax.attention._ring import zigzag_order

B, L, E, H, K, M = 8, 32, 16, 8, 4, 32
A = par.axes


# ---------------------------------------------------------------------------- the toy model

class Layer(eqx.Module):
    wq: jax.Array = A.param(A.EMBED, A.HEADS, A.KV)
    wk: jax.Array = A.param(A.EMBED, A.HEADS, A.KV)
    wv: jax.Array = A.param(A.EMBED, A.HEADS, A.KV)
    wo: jax.Array = A.param(A.HEADS, A.KV, A.EMBED)
    w1: jax.Array = A.param(A.EMBED, A.MLP)
    w2: jax.Array = A.param(A.MLP, A.EMBED)

    def __init__(self, key):
        ks = jax.random.split(key, 6)
        n = lambda k, s: jax.random.normal(k, s) / np.sqrt(s[0])  # noqa: E731
        self.wq, self.wk, self.wv = (n(k, (E, H, K)) for k in ks[:3])
        self.wo = n(ks[3], (H, K, E)) / np.sqrt(K)
        self.w1, self.w2 = n(ks[4], (E, M)), n(ks[5], (M, E))

    def __call__(self, x):
        c = par.constrain
        q, k, v = (c(jnp.einsum("ble,ehk->blhk", x, w), (A.BATCH, A.LENGTH, A.HEADS, A.KV))
                   for w in (self.wq, self.wk, self.wv))
        # Ring attention is flash attention without a mesh or a `sequence` axis.
        a = multihead(functools.partial(par.ring_attention, causal=True))(q, k, v)
        x = c(x + jnp.einsum("blhk,hke->ble", a, self.wo), (A.BATCH, A.LENGTH, A.EMBED))
        h = c(jax.nn.gelu(x @ self.w1), (A.BATCH, A.LENGTH, A.MLP))
        return c(x + h @ self.w2, (A.BATCH, A.LENGTH, A.EMBED))


class Model(eqx.Module):
    layers: list

    def __call__(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


OPT = optax.adam(1e-2)


def loss_fn(model, x, y):
    return jnp.mean((model(x) - y) ** 2)


def _data(key):
    kx, ky, km = jax.random.split(key, 3)
    model = Model([Layer(k) for k in jax.random.split(km, 2)])
    return model, jax.random.normal(kx, (B, L, E)), jax.random.normal(ky, (B, L, E))


def _step(model, opt_state, x, y):
    loss, grads = jax.value_and_grad(loss_fn)(model, x, y)
    updates, opt_state = OPT.update(grads, opt_state, model)
    return optax.apply_updates(model, updates), opt_state, loss, grads


def _sharded_step(st, mesh):
    """The train step jitted with in/out shardings from the strategy's rules."""
    model, x, _ = _data(jax.random.PRNGKey(0))
    p_sh = par.param_shardings(model, st.param_rules, mesh)
    o_sh = par.optimizer_shardings(OPT, OPT.init(model), p_sh, mesh)
    b_sh = par.logical_sharding((A.BATCH, A.LENGTH, A.EMBED), st.compute_rules, mesh, x.shape)
    rep = NamedSharding(mesh, P())
    jitted = jax.jit(_step, in_shardings=(p_sh, o_sh, b_sh, b_sh),
                     out_shardings=(p_sh, o_sh, rep, p_sh))

    def run(model, opt_state, x, y):
        with par.use_mesh(mesh, st.compute_rules, st.param_rules):
            return jitted(model, opt_state, x, y)

    return run, p_sh, o_sh, b_sh


@pytest.fixture(scope="module")
def single_device():
    model, x, y = _data(jax.random.PRNGKey(0))
    return model, x, y, jax.jit(_step)(model, OPT.init(model), x, y)


EXPECTED_WQ = {  # the intended sharding of wq [embed, heads, kv] per strategy
    "data": P(None, None, None),
    "fsdp": P("fsdp", None, None),
    "tensor": P(None, "tensor", None),
    "sequence": P(None, None, None),
    "data+tensor": P(None, "tensor", None),
    "data+sequence": P(None, None, None),
}
SIZES = {"data+tensor": {"tensor": 2}, "data+sequence": {"sequence": 4}}


@pytest.mark.parametrize("name", list(EXPECTED_WQ))
def test_strategy_matches_single_device(name, single_device):
    model, x, y, (ref_model, _, ref_loss, ref_grads) = single_device
    st = par.strategy(name, SIZES.get(name))
    mesh = st.mesh()
    run, p_sh, o_sh, b_sh = _sharded_step(st, mesh)
    params = jax.device_put(model, p_sh)
    opt_state = jax.device_put(OPT.init(model), o_sh)
    new_model, new_opt, loss, grads = run(params, opt_state, jax.device_put(x, b_sh),
                                          jax.device_put(y, b_sh))
    assert_close(loss, ref_loss)
    for g, r in zip(jax.tree_util.tree_leaves(grads), jax.tree_util.tree_leaves(ref_grads)):
        assert_close(g, r, EXACT_GRAD)
    wq = new_model.layers[0].wq
    assert wq.sharding.is_equivalent_to(NamedSharding(mesh, EXPECTED_WQ[name]), 3)
    mu = new_opt[0].mu.layers[0].wq  # Adam's first moment follows its parameter
    assert mu.sharding.is_equivalent_to(wq.sharding, 3)
    if name == "fsdp":  # each device holds 1/8 of the parameters and of the optimizer state
        assert wq.addressable_shards[0].data.size * 8 == wq.size
        assert mu.addressable_shards[0].data.size * 8 == mu.size
    # Outputs carry the compute sharding: batch over data/fsdp, length over sequence.
    with par.use_mesh(mesh, st.compute_rules, st.param_rules):
        out = jax.jit(lambda m, x: m(x))(params, jax.device_put(x, b_sh))
    assert out.sharding.is_equivalent_to(b_sh, 3)
    assert_close(out, model(x))
    assert_close(new_model.layers[1].w2, ref_model.layers[1].w2, EXACT_GRAD)


def test_checkpoint_restores_onto_other_meshes(tmp_path, single_device):
    model, x, y, _ = single_device
    st_a = par.strategy("data+tensor", {"tensor": 2})  # (4, 2)
    mesh_a = st_a.mesh()
    run_a, p_a, o_a, b_a = _sharded_step(st_a, mesh_a)
    m1, o1, _, _ = run_a(jax.device_put(model, p_a), jax.device_put(OPT.init(model), o_a), x, y)
    par.save_checkpoint(str(tmp_path / "ckpt"), (m1, o1))
    m2_ref, o2_ref, loss_ref, _ = run_a(m1, o1, x, y)

    like = (model, OPT.init(model))
    st_b = par.strategy("data+tensor", {"tensor": 4})  # (2, 4)
    mesh_b = st_b.mesh()
    run_b, p_b, o_b, _ = _sharded_step(st_b, mesh_b)
    mb, ob = par.restore_checkpoint(str(tmp_path / "ckpt"), like, (p_b, o_b))
    assert mb.layers[0].wq.sharding.is_equivalent_to(NamedSharding(mesh_b, P(None, "tensor", None)), 3)
    m2_b, _, loss_b, _ = run_b(mb, ob, x, y)

    m1_single, o1_single = par.restore_checkpoint(str(tmp_path / "ckpt"), like)
    assert len(m1_single.layers[0].wq.devices()) == 1
    m2_s, _, loss_s, _ = jax.jit(_step)(m1_single, o1_single, x, y)
    for loss in (loss_b, loss_s):
        assert_close(loss, loss_ref)
    for m in (m2_b, m2_s):
        for a, b in zip(jax.tree_util.tree_leaves(m), jax.tree_util.tree_leaves(m2_ref)):
            assert_close(a, b, EXACT_GRAD)


# ---------------------------------------------------------------------------- ring attention

def _seq_mesh(n=8):
    return par.make_mesh({"sequence": n, "data": -1})


def _qkv(key, lq, lk, d=16, dtype=jnp.float32):
    kq, kk, kv = jax.random.split(key, 3)
    return tuple(jax.random.normal(k, (n, d), dtype) for k, n in ((kq, lq), (kk, lk), (kv, lk)))


def _sq(fn):
    return lambda *a: jnp.sum(fn(*a).astype(jnp.float32) ** 2)


# 37 causal on 4 devices: padded to 40, 8 zig-zag chunks of 5 (odd shard lengths).
@pytest.mark.parametrize("causal,length,n", [(True, 37, 4), (False, 64, 8)])
def test_ring_attention_equals_flash(key, causal, length, n):
    mesh = _seq_mesh(n)
    q, k, v = _qkv(key, length, length)
    mask = jnp.arange(length) % 5 != 3
    ring = jax.jit(lambda q, k, v: par.ring_attention(q, k, v, causal=causal, kv_mask=mask, mesh=mesh))
    flash = lambda q, k, v: flash_attention(q, k, v, causal=causal, kv_mask=mask)  # noqa: E731
    assert_close(ring(q, k, v), flash(q, k, v))
    g_ring = jax.jit(jax.grad(_sq(ring), argnums=(0, 1, 2)))(q, k, v)
    g_flash = jax.grad(_sq(flash), argnums=(0, 1, 2))(q, k, v)
    for a, b in zip(g_ring, g_flash):
        assert_close(a, b, EXACT_GRAD)
    # Masked keys have no influence on any output or gradient.
    k2 = jnp.where(mask[:, None], k, 100.0)
    assert_close(ring(q, k2, v), ring(q, k, v))
    assert not jnp.any(g_ring[1][~mask])


def test_ring_attention_causal_no_leak_cross_and_bf16(key):
    mesh = _seq_mesh(4)
    q, k, v = _qkv(key, 32, 32)
    f = jax.jit(lambda q, k, v: par.ring_attention(q, k, v, causal=True, mesh=mesh))
    g = jax.grad(lambda k: jnp.sum(f(q, k, v)[:20]))(k)
    assert not jnp.any(g[20:])
    np.testing.assert_array_equal(f(q, k.at[25].add(3.0), v)[:25], f(q, k, v)[:25])
    qc, kc, vc = _qkv(key, 24, 40)  # cross attention: Lq != Lk
    assert_close(par.ring_attention(qc, kc, vc, mesh=mesh), flash_attention(qc, kc, vc))
    qb, kb, vb = (x.astype(jnp.bfloat16) for x in (q, k, v))
    out = par.ring_attention(qb, kb, vb, causal=True, mesh=mesh)
    assert out.dtype == jnp.bfloat16
    assert_close(out, flash_attention(qb, kb, vb, causal=True))
    with pytest.raises(ValueError, match="causal=True needs Lq == Lk"):
        par.ring_attention(qc, kc, vc, causal=True, mesh=mesh)


def test_ring_attention_multihead_and_no_mesh(key):
    q, k, v = (x.reshape(2, 16, 1, 16) for x in _qkv(key, 32, 32))
    ring = multihead(functools.partial(par.ring_attention, causal=True))
    with par.use_mesh(_seq_mesh(4)):
        sharded = jax.jit(ring)(q, k, v)
    assert_close(sharded, multihead(functools.partial(flash_attention, causal=True))(q, k, v))
    assert_close(ring(q, k, v), sharded)  # no mesh: flash attention


def test_zigzag_order():
    perm = np.asarray(zigzag_order(8, 2))
    np.testing.assert_array_equal(perm, [0, 1, 6, 7, 2, 3, 4, 5])
    with pytest.raises(ValueError, match="not divisible by 2n"):
        zigzag_order(10, 4)


# ------------------------------------------------ sequence-parallel causal linear attention

@pytest.mark.parametrize("extra", [{"gate_logits": True}, {"log_decay": -0.2, "chunk_size": 4}])
def test_sequence_parallel_linear_attention(key, extra):
    mesh = _seq_mesh(4)
    q, k, v = _qkv(key, 37, 37, d=8)
    kw = dict(extra, kv_mask=jnp.arange(37) < 33)
    if kw.pop("gate_logits", False):
        kw["gate_logits"] = jax.random.normal(key, (37,))
    sp = jax.jit(lambda q, k, v: par.sequence_parallel_linear_attention(q, k, v, mesh=mesh, **kw))
    ref = lambda q, k, v: linear_attention(q, k, v, causal=True, **kw)  # noqa: E731
    assert_close(sp(q, k, v), ref(q, k, v))
    for a, b in zip(jax.grad(_sq(sp), argnums=(0, 1, 2))(q, k, v),
                    jax.grad(_sq(ref), argnums=(0, 1, 2))(q, k, v)):
        assert_close(a, b, EXACT_GRAD)


def test_sequence_parallel_linear_attention_rejects_log_space_maps(key):
    q, k, v = _qkv(key, 16, 16, d=8)
    proj = jax.random.normal(key, (8, 8))
    with pytest.raises(NotImplementedError, match="running maximum"):
        par.sequence_parallel_linear_attention(q, k, v, proj, feature_map="favor_positive",
                                               mesh=_seq_mesh(4))


# ---------------------------------------------------------------------------- rules, meshes

def test_rules_resolution():
    mesh = par.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    rules = par.DEFAULT_COMPUTE_RULES
    assert par.logical_to_spec((A.BATCH, A.LENGTH, A.EMBED), rules, mesh) == P(("data", "fsdp"), None, None)
    # A mesh axis is used once per array; a size that does not divide falls through.
    two = ((A.HEADS, A.TENSOR), (A.MLP, A.TENSOR))
    assert par.logical_to_spec((A.HEADS, A.MLP), two, mesh) == P("tensor", None)
    assert par.logical_to_spec((A.HEADS,), two, mesh, shape=(3,)) == P(None)
    # Size-1 axes drop out: the same rules on a data-only mesh leave heads replicated.
    assert par.logical_to_spec((A.HEADS,), two, par.make_mesh({"data": -1})) == P(None)
    with pytest.raises(ValueError, match="do not match the shape"):
        par.logical_to_spec((A.HEADS,), two, mesh, shape=(4, 4))


class _Renamed(eqx.Module):
    """``Layer``'s query projection under another attribute name, declared alike."""

    query_projection: jax.Array = A.param(A.EMBED, A.HEADS, A.KV)
    other: jax.Array  # undeclared: replicated


def test_parameters_declare_their_axes_where_they_are_defined():
    model, _, _ = _data(jax.random.PRNGKey(0))
    names = A.declared_axes(model)
    assert tuple(names.layers[1].wo) == (A.HEADS, A.KV, A.EMBED)
    assert par.path_string(jax.tree_util.tree_flatten_with_path(model)[0][0][0]) == "layers/0/wq"
    # The sharding follows the declaration, not the attribute's name or path.
    mesh = par.make_mesh({"fsdp": 4, "tensor": 2})
    wq = model.layers[0].wq
    renamed = _Renamed(wq, jnp.ones((E, M)))
    got = par.param_shardings(renamed, par.DEFAULT_PARAM_RULES, mesh)
    want = par.param_shardings(model, par.DEFAULT_PARAM_RULES, mesh).layers[0].wq
    assert got.query_projection == want
    assert want.spec == P("fsdp", "tensor", None)
    assert got.other.spec == P(None, None)
    # A layer stack's leading axis is named `layers` (never split).
    stacked = jax.tree_util.tree_map(lambda x: jnp.stack([x, x]), renamed)
    assert tuple(A.declared_axes(stacked).query_projection) == (A.LAYERS, A.EMBED, A.HEADS,
                                                                A.KV)
    assert par.param_shardings(stacked, par.DEFAULT_PARAM_RULES, mesh).query_projection.spec \
        == P(None, "fsdp", "tensor", None)
    with pytest.raises(ValueError, match="declares 3 axes"):
        A.declared_axes(_Renamed(jnp.ones((E, H)), jnp.ones((E, M))))
    with pytest.raises(ValueError, match="unknown logical axes"):
        A.param("embedding")


def test_no_mesh_is_a_no_op_and_mesh_errors():
    x = jnp.ones((4, 4))
    assert par.constrain(x, (A.BATCH, A.EMBED)) is x
    assert par.active() is None
    assert par.resolve_mesh_shape({"data": -1, "tensor": 2}, 8)["data"] == 4
    with pytest.raises(ValueError, match="unknown axes"):
        par.make_mesh({"model": 8})
    with pytest.raises(ValueError, match="at most one axis may be -1"):
        par.make_mesh({"data": -1, "tensor": -1})
    with pytest.raises(ValueError, match="use 4 devices but 8"):
        par.make_mesh({"data": 4})
    with pytest.raises(ValueError, match="unknown"):
        par.strategy("pipeline")
    assert par.strategy("single").mesh_shape["data"] == 1


def test_multihost_single_process():
    assert par.initialize_from_env({}) is False
    mesh = par.make_mesh({"data": -1})
    sh = NamedSharding(mesh, P("data"))
    assert par.process_batch_slice(sh, (16, 3)) == slice(0, 16)
    rows = np.arange(48.0).reshape(16, 3)
    arr = par.global_batch(rows[par.process_batch_slice(sh, rows.shape)], sh, rows.shape)
    assert arr.sharding == sh
    np.testing.assert_array_equal(np.asarray(arr), rows)
