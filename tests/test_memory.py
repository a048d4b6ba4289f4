"""Segment-level recurrence (xformers_jax.nn._memory): Transformer-XL and ERNIE-Doc memories,
the Compressive Transformer's compression functions and reconstruction loss."""

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.tolerances import EXACT, EXACT_GRAD, assert_close
from xformers_jax import models, nn
from xformers_jax.nn._positions import sinusoid

L, DIM, HEADS, VOCAB, B = 8, 16, 2, 13, 2
HD = DIM // HEADS
_JIT = dict(compiler_options={"xla_backend_optimization_level": 0})


def _model(memory=None, layers=2, kind="dot_product", max_len=4 * L):
    position = nn.TransformerXLRelative(HEADS, HD, max_len, key=jax.random.key(3))
    # Non-zero u, v so that the biases are exercised.
    position = eqx.tree_at(lambda p: (p.u1, p.u2), position,
                           (0.3 * jax.random.normal(jax.random.key(4), (HEADS, HD)),
                            0.3 * jax.random.normal(jax.random.key(5), (HEADS, HD))))
    block = dict(position=position, spec=nn.AttentionSpec(kind))
    if memory is not None:
        block["memory"] = memory
    return models.CausalLM(VOCAB, DIM, layers, HEADS, 2 * DIM, positions=nn.NoPositions(),
                       max_len=max_len, block=block, key=jax.random.key(0))


def _jit(f):
    """``jax.jit`` at XLA's lowest optimisation level over a function of pytrees of modules
    (compiles fast; the numerics do not need the optimiser)."""
    def on_arrays(arrays, static):
        return f(*eqx.combine(arrays, static))

    jitted = jax.jit(on_arrays, static_argnums=1, **_JIT)

    def run(*args):
        arrays, static = eqx.partition(args, eqx.is_array)
        return jitted(arrays, static)

    return run


@_jit
def _segments(model, tokens, memory):
    """Runs the segments of ``tokens [B, S * L]`` one after another; (logits, memory)."""
    outs = []
    for s in range(tokens.shape[1] // L):
        logits, memory = model(tokens[:, s * L:(s + 1) * L], memory=memory)
        outs.append(logits)
    return jnp.concatenate(outs, 1), memory


_plain = _jit(lambda model, tokens: model(tokens))

# Shared by most tests: one XL model (training memory L, evaluation memory 2L), its plain twin
# (same parameters: the memory has none and draws no key of the others).
XL = _model(nn.XLMemory(L, eval_mem_len=2 * L))
PLAIN = _model()


def _tokens(seed, n=3 * L):
    return jax.random.randint(jax.random.key(seed), (B, n), 1, VOCAB)


# -- Transformer-XL --------------------------------------------------------------------------


def test_memory_attention_matches_brute_force_relative_indexing():
    # One layer's attention over [memory; segment] against numpy with explicit relative
    # positions: key j of the concatenation is at position j - M, so the distance is
    # i - (j - M). An off-by-M shift (the classic bug) fails this.
    m_len = 5
    attn = jax.tree.map(lambda a: a[0], XL.layers.layers).attn
    rng = np.random.default_rng(0)
    h = jnp.asarray(rng.normal(size=(B, L, DIM)), jnp.float32)
    ctx = jnp.asarray(rng.normal(size=(B, m_len, DIM)), jnp.float32)
    ctx_mask = np.array([[False, True, True, True, True], [True] * 5])
    out = _jit(nn.memory_attention)(attn, h, ctx, jnp.asarray(ctx_mask))

    pos = attn.position
    table = np.asarray(sinusoid(jnp.arange(-20, 21), HD))  # row d + 20: distance d
    full = np.concatenate([np.asarray(ctx), np.asarray(h)], 1)
    q = (np.asarray(h) @ np.asarray(attn.wq)).reshape(B, L, HEADS, HD)
    k = (full @ np.asarray(attn.wk)).reshape(B, m_len + L, HEADS, HD)
    v = (full @ np.asarray(attn.wv)).reshape(B, m_len + L, HEADS, HD)
    o = np.zeros((B, L, HEADS, HD))
    for b in range(B):
        for hh in range(HEADS):
            w_r = np.asarray(pos.w_r[hh])
            u, vb = np.asarray(pos.u1[hh]), np.asarray(pos.u2[hh])
            s = np.full((L, m_len + L), -np.inf)
            for i in range(L):
                for j in range(m_len + L):
                    if j > i + m_len or (j < m_len and not ctx_mask[b, j]):
                        continue
                    r = table[i - (j - m_len) + 20] @ w_r
                    s[i, j] = (q[b, i, hh] @ k[b, j, hh] + (q[b, i, hh] + vb) @ r
                               + u @ k[b, j, hh]) / np.sqrt(HD)
            p = np.exp(s - s.max(-1, keepdims=True))
            o[b, :, hh] = (p / p.sum(-1, keepdims=True)) @ v[b, :, hh]
    want = o.reshape(B, L, DIM) @ np.asarray(attn.wo)
    assert_close(out, want)


def test_xl_equals_plain_transformer_over_the_segments_it_remembers():
    # From an empty memory, segment 2 with memory M >= L sees exactly what a plain causal model
    # over [segment 1; segment 2] sees, in every layer: outputs equal. With the evaluation
    # memory (2L) segment 3 also matches the plain model over all three segments; with the
    # training memory (L) it does not.
    tokens = _tokens(1)
    want = _plain(PLAIN, tokens)
    got, memory = _segments(XL, tokens, XL.init_memory(B))
    assert memory.mem.shape == (2, B, L, DIM) and bool(memory.mask.all())
    assert_close(got[:, :2 * L], want[:, :2 * L])
    assert float(jnp.abs(got[:, 2 * L:] - want[:, 2 * L:]).max()) > 1e-3
    long, memory = _segments(XL, tokens, XL.init_memory(B, inference=True))
    assert memory.mem.shape == (2, B, 2 * L, DIM)
    assert_close(long, want)


@pytest.mark.slow
def test_flash_attention_takes_the_memory_too():
    xl, plain = _model(nn.XLMemory(L), layers=1, kind="flash"), _model(layers=1, kind="flash")
    tokens = _tokens(2, 2 * L)
    got, _ = _segments(xl, tokens, xl.init_memory(B))
    assert_close(got, _plain(plain, tokens))


def test_memory_zero_is_the_plain_model():
    xl = _model(nn.XLMemory(0), layers=1)
    tokens = _tokens(3, L)
    got, memory = _segments(xl, tokens, xl.init_memory(B))
    assert memory.mem.shape[2] == 0
    assert_close(got, _plain(_model(layers=1), tokens))


def test_no_gradient_flows_into_the_memory():
    # The gradient through two segments equals the gradient of segment 2 with segment 1's
    # memory as a constant: nothing flows back into the memory.
    xl = _model(nn.XLMemory(L), layers=1)
    tokens = _tokens(4, 2 * L)

    def two_segments(model, memory):
        _, memory = model(tokens[:, :L], memory=memory)
        return model(tokens[:, L:], memory=memory)[0].sum()

    _, fixed = _segments(xl, tokens[:, :L], xl.init_memory(B))

    def memory_constant(model, memory):
        return model(tokens[:, L:], memory=memory)[0].sum()

    g1 = _jit(eqx.filter_grad(two_segments))(xl, xl.init_memory(B))
    g2 = _jit(eqx.filter_grad(memory_constant))(xl, fixed)
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2)):
        assert_close(a, b, EXACT_GRAD)


def test_no_leak_across_segment_boundaries():
    # Changing a middle token of segment 2 changes nothing before it (segment 1 included) and
    # changes segment 3 through the memory.
    tokens = _tokens(5)
    t = L + L // 2
    changed = tokens.at[:, t].set((tokens[:, t] % (VOCAB - 1)) + 1)
    a, _ = _segments(XL, tokens, XL.init_memory(B))
    b, _ = _segments(XL, changed, XL.init_memory(B))
    np.testing.assert_array_equal(np.asarray(a[:, :t]), np.asarray(b[:, :t]))
    assert float(jnp.abs(a[:, 2 * L:] - b[:, 2 * L:]).max()) > 0


def test_ernie_doc_enhanced_recurrence():
    # Layer n's memory is layer n's own output on the previous segment: the last layer's
    # memory, through the final norm and head, gives the last segment's logits. No leak.
    model = _model(nn.XLMemory(L, same_layer=True))
    tokens = _tokens(6)
    got, memory = _segments(model, tokens, model.init_memory(B))
    h = model.final_norm(memory.mem[-1])
    assert_close(h @ model.head, got[:, 2 * L:])
    t = L + 3
    changed = tokens.at[:, t].set((tokens[:, t] % (VOCAB - 1)) + 1)
    other, _ = _segments(model, changed, model.init_memory(B))
    np.testing.assert_array_equal(np.asarray(got[:, :t]), np.asarray(other[:, :t]))
    assert float(jnp.abs(got[:, 2 * L:] - other[:, 2 * L:]).max()) > 0


def test_retrospective_feed_second_pass_starts_from_the_skimming_memory():
    model = _model(nn.XLMemory(L, same_layer=True))
    tokens = _tokens(15)
    got, _ = _jit(lambda m, t: models.retrospective_feed(m, t, segment_len=L))(model, tokens)
    _, skim = _segments(model, tokens, model.init_memory(B))
    want, _ = _segments(model, tokens, skim)
    assert_close(got, want)
    # The first segment now depends on the last one (which a single pass never lets it see).
    changed = tokens.at[:, -1].set(tokens[:, -1] % (VOCAB - 1) + 1)
    other, _ = _jit(lambda m, t: models.retrospective_feed(m, t, segment_len=L))(model, changed)
    assert float(jnp.abs(other[:, :L] - got[:, :L]).max()) > 0
    with pytest.raises(ValueError, match="multiple of"):
        models.retrospective_feed(model, tokens[:, :L + 1], segment_len=L)


@_jit
def _masked_segments(model, tokens, mask, memory):
    l1, memory = model(tokens[:, :L], mask=mask, memory=memory)
    l2, _ = model(tokens[:, L:], memory=memory)
    return l1, l2


def test_padding_in_a_segment_changes_no_real_output():
    xl = _model(nn.XLMemory(L), layers=1)
    tokens = _tokens(7, 2 * L)
    mask = jnp.ones((B, L), bool).at[:, -3:].set(False)
    junk = tokens.at[:, L - 3:L].set(1)
    a1, a2 = _masked_segments(xl, tokens, mask, xl.init_memory(B))
    b1, b2 = _masked_segments(xl, junk, mask, xl.init_memory(B))
    assert_close(a1[:, :L - 3], b1[:, :L - 3])
    assert_close(a2, b2)


def test_bf16_reset_and_errors():
    xl = _model(nn.XLMemory(L), layers=1)
    tokens = _tokens(8, L)
    f32, memory = _segments(xl, tokens, xl.init_memory(B))
    policy = nn.Policy(compute=jnp.bfloat16)
    bf, mem = _jit(lambda m, t, s: policy(lambda m_: m_(t, memory=s), m))(
        xl, tokens, xl.init_memory(B))
    assert_close(bf, f32, EXACT, dtype=jnp.bfloat16)
    assert mem.mem.dtype == jnp.float32
    # An emptied memory row gives the output of a fresh memory.
    reset = nn.reset_memory(memory, jnp.asarray([True, False]))
    assert not bool(reset.mask[:, 0].any()) and bool(reset.mask[:, 1].all())
    again, _ = _segments(xl, tokens, reset)
    assert_close(again[0], f32[0])
    assert float(jnp.abs(again[1] - f32[1]).max()) > 0
    with pytest.raises(ValueError, match="exactly when the block has a memory"):
        xl(tokens)
    linear = nn.MultiHeadAttention(DIM, HEADS, spec=nn.AttentionSpec("linear"), causal=True,
                                   key=jax.random.key(0))
    with pytest.raises(ValueError, match="cannot attend to a memory"):
        nn.memory_attention(linear, jnp.zeros((B, L, DIM)), jnp.zeros((B, 2, DIM)),
                            jnp.ones((B, 2), bool))
    attn = jax.tree.map(lambda a: a[0], xl.layers.layers).attn
    with pytest.raises(ValueError, match="does not match the segment"):
        nn.memory_attention(attn, jnp.zeros((B, L, DIM)), jnp.zeros((B, 2, DIM + 1)),
                            jnp.ones((B, 2), bool))
    with pytest.raises(ValueError, match="mem_len"):
        nn.XLMemory(-1)
    with pytest.raises(ValueError, match="causal self-attention"):
        nn.TransformerBlock(DIM, HEADS, 32, memory=nn.XLMemory(2), key=jax.random.key(0))


# -- Compressive Transformer ------------------------------------------------------------------


def _np_compress(kind, x, rate, w=None, bias=None, usage=None):
    b, n, d = x.shape
    out = np.zeros((b, n // rate, d))
    for bb in range(b):
        for i in range(n // rate):
            group = x[bb, i * rate:(i + 1) * rate]
            if kind == "mean":
                out[bb, i] = group.mean(0)
            elif kind == "max":
                out[bb, i] = group.max(0)
            elif kind == "conv":
                out[bb, i] = sum(group[t] @ w[t] for t in range(rate)) + bias
            elif kind == "dilated_conv":
                acc = bias.copy()
                for t in range(rate):
                    src = i * rate + rate - 1 - 2 * (rate - 1 - t)
                    if src >= 0:
                        acc = acc + x[bb, src] @ w[t]
                out[bb, i] = acc
        if kind == "most_used":
            keep = np.sort(np.argsort(-usage[bb], kind="stable")[:n // rate])
            out[bb] = x[bb, keep]
    return out


@pytest.mark.parametrize("kind", ["mean", "max", "conv", "dilated_conv", "most_used"])
def test_compression_functions_match_numpy(kind):
    rng = np.random.default_rng(1)
    rate, n = 3, 12
    x = rng.normal(size=(B, n, 4)).astype(np.float32)
    w = rng.normal(size=(rate, 4, 4)).astype(np.float32)
    bias = rng.normal(size=(4,)).astype(np.float32)
    usage = rng.permutation(B * n).reshape(B, n).astype(np.float32)
    got, mask = nn.compress(kind, jnp.asarray(x), jnp.ones((B, n), bool), rate, jnp.asarray(w),
                            jnp.asarray(bias), jnp.asarray(usage))
    assert_close(got, _np_compress(kind, x, rate, w, bias, usage))
    assert mask.shape == (B, n // rate) and bool(mask.all())


def test_compression_errors():
    with pytest.raises(ValueError, match="multiple of the compression rate"):
        nn.compress("mean", jnp.zeros((1, 5, 2)), jnp.ones((1, 5), bool), 2)
    with pytest.raises(ValueError, match="compression must be one of"):
        nn.compress("median", jnp.zeros((1, 4, 2)), jnp.ones((1, 4), bool), 2)
    with pytest.raises(ValueError, match="rate"):
        nn.CompressiveMemory(DIM, 4, 4, 0, key=jax.random.key(0))


def _compressive(compression, rate=2, layers=2):
    return _model(functools.partial(nn.CompressiveMemory, DIM, L, L, rate,
                                    compression=compression), layers=layers)


def test_reconstruction_loss_is_zero_for_identity_compression():
    model = _compressive("mean", rate=1, layers=1)
    tokens = _tokens(11, 3 * L)
    _, memory = _segments(model, tokens, model.init_memory(B))
    assert bool(memory.cmask.all())
    assert float(nn.memory_aux_loss(memory)) == 0.0
    # A real compression reconstructs imperfectly.
    lossy = _compressive("mean", rate=2, layers=1)
    _, memory = _segments(lossy, tokens, lossy.init_memory(B))
    assert float(nn.memory_aux_loss(memory)) > 0.0


def test_reconstruction_loss_trains_the_compression_and_nothing_else():
    model = _compressive("conv", layers=1)
    tokens = _tokens(12, 2 * L)
    _, memory = _segments(model, tokens[:, :L], model.init_memory(B))

    def aux(m):
        return nn.memory_aux_loss(m(tokens[:, L:], memory=memory)[1])

    grads = _jit(eqx.filter_grad(aux))(model)
    flat = jax.tree_util.tree_flatten_with_path(grads)[0]
    compression = [v for p, v in flat if "memory" in jax.tree_util.keystr(p)]
    others = [v for p, v in flat if "memory" not in jax.tree_util.keystr(p)]
    assert compression and all(float(jnp.abs(v).max()) > 0 for v in compression)
    assert others and all(float(jnp.abs(v).max()) == 0 for v in others)


def test_compressive_memory_fills_and_is_attended():
    # One layer: XL's context then reaches one memory back, the compressed memory further.
    model = _compressive("max", layers=1)
    tokens = _tokens(13, 3 * L)
    got, memory = _segments(model, tokens, model.init_memory(B))
    assert memory.cmem.shape == (1, B, L, DIM)
    # After 3 segments, M = L holds segment 3's inputs, and segments 1-2 (2L, rate 2) fill the
    # compressed memory of L slots.
    assert bool(memory.cmask.all()) and bool(memory.mask.all())
    # Segment 3's outputs depend on segment 1 only through the compressed memory.
    changed = tokens.at[:, 1].set((tokens[:, 1] % (VOCAB - 1)) + 1)
    other, _ = _segments(model, changed, model.init_memory(B))
    assert float(jnp.abs(other[:, 2 * L:] - got[:, 2 * L:]).max()) > 0
    xl = _model(nn.XLMemory(L), layers=1)
    a, _ = _segments(xl, tokens, xl.init_memory(B))
    b, _ = _segments(xl, changed, xl.init_memory(B))
    assert_close(a[:, 2 * L:], b[:, 2 * L:])  # XL with M = L has forgotten segment 1


def test_generate_continues_across_segments_with_the_memory():
    # Greedy generation from a prompt of 1.5 segments to 3 full segments: every generated
    # token is the argmax of the teacher-forced segment-by-segment logits before it (the
    # memory carried across both boundaries), and the prompt is kept.
    prompt = _tokens(14, L + 3)
    out = _jit(lambda m, p: models.generate_with_memory(m, p, 2 * L - 3, segment_len=L,
                                                    inference=False))(XL, prompt)
    np.testing.assert_array_equal(np.asarray(out[:, :L + 3]), np.asarray(prompt))
    logits, _ = _segments(XL, out, XL.init_memory(B))
    np.testing.assert_array_equal(np.asarray(jnp.argmax(logits[:, L + 2:-1], -1)),
                                  np.asarray(out[:, L + 3:]))


@_jit
def _fed_one_by_one(model, tokens, memory):
    """Logits of ``tokens`` fed one token at a time through the segment cache."""
    cache = models._memory_lm._segment_cache(model, memory, L)
    _, logits = jax.lax.scan(lambda c, t: models._memory_lm._memory_decode_step(model, t, c)[::-1],
                             cache, tokens.T)
    return jnp.moveaxis(logits, 0, 1)


@pytest.mark.parametrize("which", ["xl", "compressive"])
def test_incremental_decoding_equals_the_parallel_forward_token_by_token(which):
    # The segment cache (keys/values kept, the segment shifted into the memory when full)
    # across two segment boundaries gives the segment-by-segment forward's logits at every
    # position: XL at its longer evaluation memory, and a compressive memory whose update
    # compresses at the second boundary.
    model = XL if which == "xl" else _compressive("conv", layers=1)
    tokens = _tokens(15, 3 * L)
    memory = model.init_memory(B, inference=True)
    want, _ = _segments(model, tokens, memory)
    assert_close(_fed_one_by_one(model, tokens, memory), want)


def test_with_eval_memory_sets_the_evaluation_length_only():
    short = nn.with_eval_memory(XL, 0)
    assert short.init_memory(B, inference=True).mem.shape[2] == 0
    assert short.init_memory(B).mem.shape[2] == XL.init_memory(B).mem.shape[2] == L
    # The same as a model built with that evaluation length (the same parameters).
    built = _model(nn.XLMemory(L, eval_mem_len=L // 2))
    tokens = _tokens(16, 2 * L)
    half = nn.with_eval_memory(XL, L // 2)
    got, _ = _segments(half, tokens, half.init_memory(B, inference=True))
    want, _ = _segments(built, tokens, built.init_memory(B, inference=True))
    assert_close(got, want)
    with pytest.raises(ValueError, match="eval_mem_len"):
        nn.with_eval_memory(XL, -1)
