"""The Feedback Transformer (models.FeedbackLM): the scanned form against a position-by-position
reference written from the paper's equations, no leak, gradients, decoding in pieces."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.tolerances import EXACT_GRAD, assert_close
from xformers_jax import models, nn

L, DIM, HEADS, VOCAB, B, LAYERS = 6, 16, 2, 11, 2, 2
HD = DIM // HEADS
_JIT = dict(compiler_options={"xla_backend_optimization_level": 0})


def _model(mem_len=None):
    model = models.FeedbackLM(VOCAB, DIM, LAYERS, HEADS, 2 * DIM, mem_len=mem_len,
                          key=jax.random.key(0))
    # Non-uniform layer weights, so the memory is not a plain mean.
    return eqx.tree_at(lambda m: m.layer_weights, model, jnp.arange(LAYERS + 1.0) * 0.7)


def _reference(model, tokens, mem_len=None):
    """Position by position: m_t = sum_l softmax(w)_l h_t^l; layer l at t attends over the
    past memories (the last mem_len) and its own input."""
    x_all, _ = model.embed(tokens, causal=True)
    w = jax.nn.softmax(model.layer_weights)
    blocks = [jax.tree.map(lambda a, n=n: a[n], model.layers.layers) for n in range(LAYERS)]
    memories = []  # [B, D] per past position
    out = []
    for t in range(tokens.shape[1]):
        x = x_all[:, t:t + 1]
        states = [x]
        past = memories if mem_len is None else memories[-mem_len:] if mem_len else []
        for blk in blocks:
            attn = blk.attn
            h = blk.norms[0](x)
            keys_in = [blk.norms[0](m[:, None]) for m in past] + [h]
            ctx = jnp.concatenate(keys_in, 1)  # [B, n, D]
            q = (h @ attn.wq).reshape(B, HEADS, HD)
            k = (ctx @ attn.wk).reshape(B, -1, HEADS, HD)
            v = (ctx @ attn.wv).reshape(B, -1, HEADS, HD)
            s = jnp.einsum("bhd,bnhd->bhn", q, k) / np.sqrt(HD)
            o = jnp.einsum("bhn,bnhd->bhd", jax.nn.softmax(s, -1), v).reshape(B, 1, DIM)
            x = x + o @ attn.wo
            x = x + blk.ffn(blk.norms[1](x))
            states.append(x)
        memories.append(sum(w[n] * states[n][:, 0] for n in range(LAYERS + 1)))
        out.append(model.final_norm(x) @ model.head)
    return jnp.concatenate(out, 1)


_run = jax.jit(lambda m, t: m(t), **_JIT)
_reference_jit = jax.jit(_reference, static_argnums=2, **_JIT)


@pytest.mark.parametrize("mem_len", [None, 3])
def test_scanned_form_equals_position_by_position_reference(mem_len):
    model = _model(mem_len)
    tokens = jax.random.randint(jax.random.key(1), (B, L), 1, VOCAB)
    assert_close(_run(model, tokens), _reference_jit(model, tokens, mem_len))


def test_no_leak_gradients_and_decoding_in_pieces():
    model = _model()
    tokens = jax.random.randint(jax.random.key(2), (B, L), 1, VOCAB)
    full = _run(model, tokens)
    t = L // 2
    changed = tokens.at[:, t].set(tokens[:, t] % (VOCAB - 1) + 1)
    other = _run(model, changed)
    np.testing.assert_array_equal(np.asarray(full[:, :t]), np.asarray(other[:, :t]))
    assert float(jnp.abs(full[:, t:] - other[:, t:]).max()) > 0
    # The same document fed in two pieces through the cache.
    piece = jax.jit(lambda m, x, c, s: m(x, caches=c, start=s), static_argnums=3, **_JIT)
    a, caches = piece(model, tokens[:, :t], model.init_cache(B, L), 0)
    b, _ = piece(model, tokens[:, t:], caches, t)
    assert_close(jnp.concatenate([a, b], 1), full)
    # Gradients (the memory's layer weights included) equal the reference's.
    def loss(m, f):
        return jnp.sum(jnp.sin(f(m, tokens)))

    g = jax.jit(jax.grad(lambda w: loss(eqx.tree_at(lambda m: m.layer_weights, model, w),
                                        lambda m, x: m(x))), **_JIT)(model.layer_weights)
    want = jax.jit(jax.grad(lambda w: loss(eqx.tree_at(lambda m: m.layer_weights, model, w),
                                           _reference)), **_JIT)(model.layer_weights)
    assert float(jnp.abs(g).min()) > 0
    assert_close(g, want, EXACT_GRAD)
    with pytest.raises(ValueError, match="dot_product"):
        models.FeedbackLM(VOCAB, DIM, 1, HEADS, 32, block=dict(spec=nn.AttentionSpec("linear")),
                      key=jax.random.key(0))


def test_ffn_kinds_without_auxiliary_terms_run_and_experts_are_refused():
    """The step runs the FFN slot by its contract (a product-key memory returns ``(y, {})``);
    a mixture of experts, whose losses the position-by-position scan would drop, is refused
    by name."""
    spec = nn.FFNSpec("product_key", nn.get_kind("ffn", "product_key").test_hyperparameters)
    model = models.FeedbackLM(VOCAB, DIM, 1, HEADS, 32, block=dict(ffn=spec),
                              key=jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(3), (B, L), 1, VOCAB)
    full = _run(model, tokens)
    changed = _run(model, tokens.at[:, L // 2].set(tokens[:, L // 2] % (VOCAB - 1) + 1))
    assert bool(jnp.isfinite(full).all())
    np.testing.assert_array_equal(np.asarray(full[:, :L // 2]), np.asarray(changed[:, :L // 2]))
    with pytest.raises(ValueError, match="'switch' is a mixture of experts"):
        models.FeedbackLM(VOCAB, DIM, 1, HEADS, 32, block=dict(ffn=nn.FFNSpec("switch")),
                          key=jax.random.key(0))
