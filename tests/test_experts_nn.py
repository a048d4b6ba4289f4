"""The FFN slot (``block=dict(ffn=FFNSpec(...))``), the sparse and capacity FFN layers of
``xformers_jax.nn`` and the auxiliary-output path from the scanned stack into the trainer's
loss and logged metrics."""

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import xformers_jax.models as models
import xformers_jax.nn as nn
from tests.tolerances import EXACT, assert_close
from xformers_jax import experts as M
from xformers_jax import train
from xformers_jax.kinds import Kind

L, DIM, HEADS, HIDDEN, VOCAB = 16, 16, 2, 32, 32
# "none" (all-attention blocks' empty FFN) has no parameters: test_all_attention covers it.
KINDS = [k for k in nn.registered_kinds("ffn") if k not in ("dense", "none")]
_jit = dict(compiler_options={"xla_backend_optimization_level": 0})


def _lm(kind, layers=1, scan=True, **hp):
    spec = nn.FFNSpec(kind, {**dict(nn.get_kind("ffn", kind).test_hyperparameters), **hp})
    return models.CausalLM(VOCAB, DIM, layers, HEADS, HIDDEN, max_len=L, block=dict(ffn=spec),
                       stack=dict(scan=scan), key=jax.random.key(0))


def test_metadata_complete_and_spec_errors():
    for name in nn.registered_kinds("ffn"):
        md = nn.get_kind("ffn", name)
        assert md.name == name and callable(md.function) and md.paper.year > 1900
        assert md.time and md.memory and isinstance(md.causal, bool)
        for f in dataclasses.fields(Kind):
            assert hasattr(md, f.name)
    with pytest.raises(ValueError, match="unknown FFN kind 'nope'"):
        nn.FFNSpec("nope")
    with pytest.raises(ValueError, match="missing 'kind'"):
        nn.FFNSpec.from_config({"num_experts": 4})
    # Expert choice over a batch is not causal-safe: a causal model refuses it.
    with pytest.raises(ValueError, match="not causal-safe"):
        _lm("expert_choice")
    with pytest.raises(ValueError, match="priority='token'"):
        _lm("st_moe", mode="capacity")


def _layer(kind, causal):
    spec = nn.FFNSpec(kind, nn.get_kind("ffn", kind).test_hyperparameters)
    return spec.build(DIM, HIDDEN, causal=causal, key=jax.random.key(0))


def _layer_loss(p, static, x, tokens):
    y, aux = eqx.combine(p, static)(x, tokens=tokens)
    return (jnp.sin(y.astype(jnp.float32)) * jnp.arange(DIM)).sum() + sum(
        nn.aux_losses(aux).values()), y


_layer_grad = jax.jit(jax.value_and_grad(_layer_loss, has_aux=True), static_argnums=1, **_jit)


@pytest.mark.parametrize("kind", KINDS)
def test_every_ffn_kind(kind):
    """Forward and gradient under jit; causal kinds: no output before a changed middle token
    moves (the layer routes the whole batch of tokens as one group)."""
    causal = nn.get_kind("ffn", kind).causal
    layer = _layer(kind, causal)
    x = jax.random.normal(jax.random.key(1), (2, L, DIM))
    tokens = jax.random.randint(jax.random.key(2), (2, L), 1, VOCAB)
    params, static = eqx.partition(layer, eqx.is_inexact_array)
    (_, y), grads = _layer_grad(params, static, x, tokens)
    assert all(bool(jnp.isfinite(g).all()) for g in jax.tree.leaves(grads))
    assert any(float(jnp.abs(g).sum()) > 0 for g in jax.tree.leaves(grads))
    mid = L // 2
    x2 = x.at[1, mid].set(-3 * x[1, mid])
    (_, y2), _ = _layer_grad(params, static, x2, tokens.at[1, mid].add(1))
    if causal:
        # Row 1 before the change, and all of row 0, are untouched (row 0 precedes row 1 in
        # the group's order, so capacity priority cannot see it either).
        assert_close(y2[1, :mid], y[1, :mid])
        assert_close(y2[0], y[0])
    assert not np.allclose(y2[1, mid], y[1, mid])


def test_ffn_slot_in_models_bf16():
    tokens = jax.random.randint(jax.random.key(1), (2, L), 1, VOCAB)
    model = _lm("hash")
    f = jax.jit(lambda m, t: m(t, return_aux=True), **_jit)
    out, aux = f(model, tokens)
    bf16 = jax.tree.map(lambda a: a.astype(jnp.bfloat16) if eqx.is_inexact_array(a) else a,
                        model)
    outb, _ = f(bf16, tokens)
    assert outb.dtype == jnp.bfloat16
    assert_close(outb, out, EXACT, dtype=jnp.bfloat16)
    assert set(aux) == set(nn._ffns.MOE_AUX)
    # Hash routing reads token ids: the embedded model passes them through the stack.
    table = model.layers.layers.ffn.hash_table
    assert_close(aux["expert_load"][0],
                 np.bincount(np.asarray(table)[np.asarray(tokens).ravel()], minlength=4) / 32)


def test_moe_layer_equals_reference_and_masks_padding():
    layer = nn.MoEFeedForward(DIM, HIDDEN, num_experts=4, k=2, mode="capacity",
                              capacity_factor=1.0, key=jax.random.key(2))
    x = jax.random.normal(jax.random.key(3), (2, 6, DIM))
    mask = jnp.arange(6)[None] < jnp.array([[6], [4]])
    y, aux = jax.jit(lambda x: layer(x, mask=mask), **_jit)(x)
    xf, mf = x.reshape(12, DIM), mask.reshape(-1)
    r = layer.route(xf, mask=mf)
    _, kept, _ = M.capacity_slots(r, 4, 1.0, mask=mf)
    w = M.ExpertWeights(layer.w1, layer.w2, None)
    assert_close(y.reshape(12, DIM), M.moe_reference(xf, r, w, kept=kept))
    assert_close(aux["load_balancing"], M.load_balancing_loss(r.probs, r.experts, mask=mf))
    n_active = 2 * 10
    assert_close(aux["dropped_fraction"], 1 - kept.sum() / n_active)
    junk = x.at[1, 4:].set(50.0)
    y2, aux2 = jax.jit(lambda x: layer(x, mask=mask), **_jit)(junk)
    assert_close(y2[mask], y[mask])
    assert_close(aux2["router_z"], aux["router_z"])


def test_aux_flows_through_scan_and_into_the_loss():
    model = _lm("switch", layers=2)
    tokens = jax.random.randint(jax.random.key(4), (2, L), 1, VOCAB)
    logits, aux = jax.jit(lambda m: m(tokens, return_aux=True), **_jit)(model)
    assert aux["load_balancing"].shape == (2,) and aux["expert_load"].shape == (2, 4)
    # Per layer by hand: run each block and its FFN on the block's own input.
    x, _ = model.embed(tokens, causal=True)
    dynamic, static = model.layers.per_layer()
    for i in range(2):
        block = eqx.combine(jax.tree.map(lambda a: a[i], dynamic), static)
        h = x + block.attn(block.norms[0](x))
        _, a = block.ffn(block.norms[1](h))
        assert_close(aux["load_balancing"][i], a["load_balancing"])
        assert_close(aux["router_z"][i], a["router_z"])
        x = block(x)
    # The loss adds coefficient * (sum over layers) and logs the statistics.
    c = train.base_config("lm")
    c.model.update(dict(dim=DIM, num_layers=2, num_heads=HEADS, hidden=HIDDEN))
    c.model.ffn.update(dict(kind="switch", num_experts=4))
    c.data.seq_len = L
    task = train.Task(None, None, None, VOCAB, VOCAB, L, False, train.TASKS["lm"])
    m = train.build_model(c.model, task, jax.random.key(0))
    batch = {"inputs": tokens, "targets": jnp.roll(tokens, -1, 1)}
    lf = jax.jit(lambda m, coefs: train.make_loss_fn(task, None, coefs)(m, batch, None), **_jit,
                 static_argnums=1)
    zero, metrics = lf(m, (("load_balancing", 0.0), ("router_z", 0.0)))
    with_aux, _ = lf(m, (("load_balancing", 0.5), ("router_z", 0.25)))
    assert_close(with_aux - zero, 0.5 * metrics["load_balancing"]
                 + 0.25 * metrics["router_z"])
    assert {"tokens_dropped", "max_expert_load"} <= set(metrics)
    # The train step returns them as metrics (what the trainer logs).
    state = train.create_train_state(m, optax.sgd(0.1), jax.random.key(5))
    step = train.make_train_step(train.make_loss_fn(task, None, c.loss), optax.sgd(0.1))
    _, logged = step(state, batch)
    assert {"load_balancing", "router_z", "tokens_dropped"} <= set(logged)


def test_sparse_ffn_inference_gather_equals_masked_dense():
    layer = nn.SparseFeedForward(DIM, HIDDEN, block=8, rank=8, key=jax.random.key(6))
    x = jax.random.normal(jax.random.key(7), (2, 5, DIM))
    y, _ = layer(x, inference=True)
    onehot = jax.nn.one_hot(jnp.argmax(layer.controller(x), -1), 8)
    assert_close(y, layer.dense_masked(x, onehot))
    # Training: a straight-through Gumbel one-hot; the controller gets a gradient.
    g = jax.grad(lambda l: l(x, key=jax.random.key(8))[0].sum())(layer)
    assert float(jnp.abs(g.c1).sum()) > 0
    with pytest.raises(ValueError, match="multiple of block"):
        nn.SparseFeedForward(DIM, 30, block=8, key=jax.random.key(0))


def test_product_key_layer_equals_lookup():
    layer = nn.ProductKeyMemory(DIM, n_keys=8, heads=2, k=4, key_dim=8, key=jax.random.key(9))
    x = jax.random.normal(jax.random.key(10), (2, 3, DIM))
    y, aux = layer(x)
    q = (x.reshape(6, DIM) @ layer.wq).reshape(6, 2, 8)
    want = M.product_key_lookup(q, layer.keys1, layer.keys2, layer.values, 4)
    assert_close(y.reshape(6, DIM), want) and aux == {}


def test_all_attention_equals_reference_causal_and_padding():
    layer = nn.AllAttention(DIM, HEADS, 3, causal=True, key=jax.random.key(11))
    x = jax.random.normal(jax.random.key(12), (2, 6, DIM))
    mask = jnp.arange(6)[None] < jnp.array([[6], [4]])
    run = jax.jit(lambda l, x: l(x, kv_mask=mask), **_jit)
    y = run(layer, x)
    xn, dh = np.asarray(x, np.float64), DIM // HEADS
    want = np.zeros((2, 6, DIM))
    for b in range(2):
        for h in range(HEADS):
            q, k, v = (xn[b] @ np.asarray(w)[:, h] for w in (layer.wq, layer.wk, layer.wv))
            s = np.concatenate([q @ k.T, q @ np.asarray(layer.persistent_k[h]).T], 1)
            s /= np.sqrt(dh)
            ok = np.tril(np.ones((6, 6), bool)) & np.asarray(mask[b])[None]
            s[:, :6] = np.where(ok, s[:, :6], -np.inf)
            p = np.exp(s - s.max(1, keepdims=True))
            p /= p.sum(1, keepdims=True)
            o = p[:, :6] @ v + p[:, 6:] @ np.asarray(layer.persistent_v[h])
            want[b] += o @ np.asarray(layer.wo[h])
    assert_close(y, want)
    changed = run(layer, x.at[:, 3].set(-x[:, 3]))
    assert_close(changed[:, :3], y[:, :3])
    assert not np.allclose(changed[0, 3:], y[0, 3:])
    junk = run(layer, x.at[1, 4:].set(30.0))
    assert_close(junk[mask], y[mask])
    assert nn.FFNSpec("none").build(DIM, HIDDEN, key=jax.random.key(0))(x)[0].sum() == 0
