"""Decoding: cached logits equal teacher-forced logits position by position (softmax, local
and linear attention), and generate uses them (greedy, temperature, top-k)."""

import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import xformers_jax.models as models
import xformers_jax.nn as nn
from tests.tolerances import EXACT, assert_close

L = 12
CASES = {
    "dot_product": (nn.AttentionSpec("dot_product"), nn.KVCache),
    "flash": (nn.AttentionSpec("flash", {"block_q": 8, "block_k": 8}), nn.KVCache),
    "local": (nn.AttentionSpec("local", {"left": 3}), nn.KVCache),
    "linear": (nn.AttentionSpec("linear", {"chunk_size": 4}), nn.RecurrentCache),
    "performer": (nn.AttentionSpec("performer", {"num_features": 16, "chunk_size": 4}),
                  nn.RecurrentCache),
}


def _lm(spec, key, **block):
    return models.CausalLM(20, 32, 2, 4, 64, max_len=L, block=dict(spec=spec, **block), key=key)


@pytest.mark.parametrize("name", sorted(CASES))
def test_cached_logits_equal_teacher_forced(name):
    spec, cache_type = CASES[name]
    key = jax.random.PRNGKey(0)
    model = _lm(spec, key, num_kv_heads=2)
    tokens = jax.random.randint(key, (2, L), 0, 20)

    @eqx.filter_jit
    def both(m):
        return m(tokens), m.prefill(tokens, m.init_cache(2, L))

    forced, (cached, caches) = both(model)
    # One cache per layer, each its own buffers.
    assert isinstance(caches, tuple) and len(caches) == 2
    assert all(isinstance(c, cache_type) for c in caches)
    assert_close(cached, forced, EXACT)


def test_tied_embeddings_are_the_output_layer():
    """``tie_embeddings``: no head of its own; the logits (forward, at chosen positions and
    cached) are those of an untied model whose head is the embedding table transposed, and
    the table's gradient gathers both uses."""
    key = jax.random.PRNGKey(4)
    tied = models.CausalLM(20, 32, 2, 4, 64, max_len=L, tie_embeddings=True, key=key)
    assert tied.head is None
    untied = eqx.tree_at(lambda m: m.head, _lm(nn.AttentionSpec("dot_product"), key),
                         tied.embed.table.T, is_leaf=lambda x: x is None)
    untied = eqx.tree_at(lambda m: (m.embed, m.layers, m.final_norm), untied,
                         (tied.embed, tied.layers, tied.final_norm))
    tokens = jax.random.randint(key, (2, L), 0, 20)
    forced = tied(tokens)
    assert_close(forced, untied(tokens), EXACT)
    at = jnp.array([[1, 5], [0, 11]])
    assert_close(tied(tokens, logits_at=at), jnp.take_along_axis(forced, at[..., None], 1),
                 EXACT)
    cached, _ = eqx.filter_jit(lambda m: m.prefill(tokens, m.init_cache(2, L)))(tied)
    assert_close(cached, forced, EXACT)

    def loss(m):
        return m(tokens).sum()

    g_tied = eqx.filter_grad(loss)(tied).embed.table
    g_untied = eqx.filter_grad(loss)(untied)
    assert_close(g_tied, g_untied.embed.table + g_untied.head.T, EXACT)


def test_local_cache_evicts_to_the_window():
    model = _lm(nn.AttentionSpec("local", {"left": 3}), jax.random.PRNGKey(0))
    caches = model.init_cache(2, 100)
    # Ring buffers of window + 1 slots per layer, whatever the length to generate.
    assert [c.k.shape for c in caches] == [(2, 4, 4, 8)] * 2


def test_rope_and_alibi_decode():
    key = jax.random.PRNGKey(2)
    tokens = jax.random.randint(key, (2, L), 0, 20)
    for position in (nn.RotaryPositions(), nn.ALiBi(4)):
        model = models.CausalLM(20, 32, 2, 4, 64, max_len=L, positions=nn.NoPositions(),
                            block=dict(position=position), key=key)
        cached, _ = eqx.filter_jit(lambda m: m.prefill(tokens, m.init_cache(2, L)))(model)
        assert_close(cached, model(tokens), EXACT)


def test_generate_greedy_matches_argmax_of_forward():
    key = jax.random.PRNGKey(3)
    model = _lm(nn.AttentionSpec("dot_product"), key)
    prompt = jax.random.randint(key, (2, 4), 0, 20)
    out = eqx.filter_jit(lambda m: m.generate(prompt, 5))(model)
    assert out.shape == (2, 9)
    np.testing.assert_array_equal(np.asarray(out[:, :4]), np.asarray(prompt))
    # Each generated token is the argmax of the teacher-forced logits of what precedes it.
    logits = model(out)
    np.testing.assert_array_equal(np.asarray(jnp.argmax(logits[:, 3:-1], -1)),
                                  np.asarray(out[:, 4:]))


def test_generate_top_k_sampling():
    key = jax.random.PRNGKey(4)
    model = _lm(nn.AttentionSpec("linear", {"chunk_size": 4}), key)
    prompt = jax.random.randint(key, (8, 3), 0, 20)
    gen = eqx.filter_jit(lambda m, k: m.generate(prompt, 4, key=k, top_k=1, temperature=0.5))
    out = gen(model, jax.random.PRNGKey(5))
    # top_k=1 sampling is greedy.
    np.testing.assert_array_equal(np.asarray(out), np.asarray(model.generate(prompt, 4)))
    gen2 = eqx.filter_jit(lambda m, k: m.generate(prompt, 4, key=k, top_k=3, temperature=2.0))
    a, b = gen2(model, jax.random.PRNGKey(6)), gen2(model, jax.random.PRNGKey(7))
    assert a.shape == (8, 7) and not np.array_equal(np.asarray(a), np.asarray(b))
    logits = model(a)
    top3 = jax.lax.top_k(logits[:, 2:-1], 3)[1]
    assert bool((top3 == a[:, 3:, None]).any(-1).all())


def test_non_decodable_kind_has_no_cache():
    model = models.EncoderClassifier(2, 32, 1, 4, 64, vocab_size=10, key=jax.random.PRNGKey(0))
    with pytest.raises(ValueError, match="only causal self-attention decodes"):
        model.encoder.layers.init_cache(1, 8)
    lm = models.CausalLM(20, 32, 1, 4, 64, max_len=L, positions=nn.ConvPositions(
        32, key=jax.random.PRNGKey(0)), key=jax.random.PRNGKey(0))
    with pytest.raises(NotImplementedError, match="CPE"):
        lm.init_cache(1, 8)


def test_performer_feature_redraw():
    model = _lm(nn.AttentionSpec("performer", {"num_features": 16}), jax.random.PRNGKey(0))
    old = model.layers.layers.attn.variant_params.value  # a fixed buffer (axes.Buffer)
    new_model = nn.redraw_random_features(model, jax.random.PRNGKey(9))
    new = new_model.layers.layers.attn.variant_params.value
    assert new.shape == old.shape == (2, 16, 8)
    assert not np.allclose(np.asarray(new), np.asarray(old))
    assert not np.allclose(np.asarray(new[0]), np.asarray(new[1]))
    # Everything else is untouched.
    assert_close(new_model.head, model.head, EXACT)


def test_generate_updates_its_caches_in_place():
    """``generate`` is compiled with ``models.decode_compiler_options()``: on XLA:CPU the
    compiled program copies no key/value cache (shape ``[B, Hkv, C, D]``) beyond filling the
    empty caches once, where the default copy insertion copies every layer's cache in the
    decoding loops."""
    if jax.default_backend() != "cpu":
        pytest.skip("the copies are XLA:CPU's")
    from xformers_jax.models import _lm

    model = models.CausalLM(20, 16, 2, 2, 32, max_len=L, key=jax.random.PRNGKey(0))
    prompt = jnp.zeros((1, 3), jnp.int32)
    params, static = eqx.partition(model, eqx.is_array)
    hlo = _lm._generate_jit(static).lower(
        params, prompt, None, max_new_tokens=L - 3, temperature=1.0, top_k=None,
        dtype=jnp.float32).compile().as_text()
    copies = re.findall(rf"= f32\[1,2,{L},8\]\S* copy\(", hlo)
    assert len(copies) <= 4, f"{len(copies)} copies of a layer's cache (2 layers x k, v: 4)"


def test_a_decoding_step_writes_each_layers_cache_in_place():
    """One buffer per layer (``LayerStack.init_cache``), compiled as a server compiles its step
    (cache donated, ``models.decode_compiler_options()``): the step's temporaries hold no
    layer's keys, so no layer's cache is copied. A stack of the caches on a leading layer axis
    sliced per layer (the layout before) needed two layers' keys and values of temporaries, as
    does this one without the options (XLA:CPU's copy insertion)."""
    if jax.default_backend() != "cpu":
        pytest.skip("the copies are XLA:CPU's")
    model = models.CausalLM(20, 16, 2, 2, 32, max_len=L, key=jax.random.PRNGKey(0))
    caches = jax.eval_shape(lambda: model.init_cache(1, 2048))
    step = jax.jit(lambda m, c: m.decode_step(jnp.zeros((1,), jnp.int32), c, 5),
                   donate_argnums=1, compiler_options=models.decode_compiler_options())
    temp = step.lower(model, caches).compile().memory_analysis().temp_size_in_bytes
    keys = models.cache_bytes(caches[0].k)  # one layer's keys: [1, 2, 2048, 8] float32
    assert temp < keys, f"{temp} bytes of temporaries: a layer's cache ({keys} bytes) copied"


def _weight_ops(hlo: str, shape: str) -> list[str]:
    """The instructions of the compiled program's own computations (not inside a fusion)
    that produce an array of ``shape`` (``"24,40"``; with a leading 1 too) other than by
    passing one along (parameter, get-tuple-element, bitcast)."""
    found = []
    for comp in hlo.split("\n\n"):
        head = comp.strip().split("\n", 1)[0]
        if "fused" in head or "fusion" in head.split("(", 1)[0]:
            continue
        found += [op for op in re.findall(rf"= f32\[(?:1,)?{shape}\]\S* ([\w-]+)\(", comp)
                  if op not in ("parameter", "get-tuple-element", "bitcast")]
    return found


def test_generate_slices_each_layers_parameters_once():
    """``generate`` splits the stacked parameters into layers once (``CausalLM.for_decoding``),
    before its prefill and sampling loops: a layer's FFN weight ``[24, 40]`` is made twice
    in the whole program (2 layers), where slicing it inside the loops' steps made it in
    every loop (6)."""
    if jax.default_backend() != "cpu":
        pytest.skip("the instruction count is XLA:CPU's")
    from xformers_jax.models import _lm

    model = models.CausalLM(20, 24, 2, 2, 40, max_len=L, key=jax.random.PRNGKey(0))
    params, static = eqx.partition(model, eqx.is_array)
    hlo = _lm._generate_jit(static).lower(
        params, jnp.zeros((1, 3), jnp.int32), None, max_new_tokens=L - 3, temperature=1.0,
        top_k=None, dtype=jnp.float32).compile().as_text()
    made = _weight_ops(hlo, "24,40")
    assert len(made) <= 2, f"a layer's weight [24, 40] made {len(made)} times: {made}"


def test_a_decoding_step_copies_no_layers_parameters():
    """A step of ``CausalLM.for_decoding()`` (as a server compiles it: cache donated,
    ``models.decode_compiler_options()``) reads each layer's parameters where they lie: its
    temporaries are smaller than one layer's parameters. Sliced out of the stacked
    ``[layers, ...]`` arrays inside the step, every layer's parameters were copied."""
    if jax.default_backend() != "cpu":
        pytest.skip("the copies are XLA:CPU's")
    model = models.CausalLM(20, 64, 2, 2, 256, max_len=L, key=jax.random.PRNGKey(0))
    view = model.for_decoding()
    caches = jax.eval_shape(lambda: view.init_cache(1, 16))
    step = jax.jit(lambda m, c: m.decode_step(jnp.zeros((1,), jnp.int32), c, 5),
                   donate_argnums=1, compiler_options=models.decode_compiler_options())
    temp = step.lower(view, caches).compile().memory_analysis().temp_size_in_bytes
    layer = models.cache_bytes(eqx.filter(model.layers.layers, eqx.is_array)) // 2
    assert temp < layer, f"{temp} bytes of temporaries: a layer's parameters ({layer}) copied"


@pytest.mark.parametrize("what", ["universal", "every_other_ffn", "shared_attention"])
def test_stacks_that_vary_by_layer_decode_as_their_forward(what):
    """Per-layer caches through the stacks whose layers differ at decoding: the Universal
    Transformer's timestep embedding per layer, units of two blocks (``FFNSpec(every=2)``:
    a cache per unit holding each block's) and ALBERT's shared attention; the decoding layout
    (``for_decoding``: each layer's parameters split out, shared ones one array) decodes and
    runs forward as the stacked model."""
    key = jax.random.PRNGKey(5)
    if what == "universal":
        model = models.CausalLM(20, 32, 3, 4, 64, max_len=L, key=key,
                                stack={"universal": True})
    elif what == "shared_attention":
        model = models.CausalLM(20, 32, 3, 4, 64, max_len=L, key=key,
                                stack={"sharing": "attention"})
    else:
        model = models.CausalLM(20, 32, 4, 4, 64, max_len=L, key=key,
                                block={"ffn": nn.FFNSpec("product_key", every=2)})
    tokens = jax.random.randint(key, (2, L), 0, 20)
    view = model.for_decoding()
    forced, (cached, caches), (split, _), split_forced = eqx.filter_jit(
        lambda m, v: (m(tokens), m.prefill(tokens, m.init_cache(2, L)),
                      v.prefill(tokens, v.init_cache(2, L)), v(tokens)))(model, view)
    assert len(caches) == model.layers.num_layers
    assert_close(cached, forced, EXACT)
    assert_close(split, cached, EXACT)
    assert_close(split_forced, forced, EXACT)
    blocks = view.layers.layers
    assert len(blocks) == model.layers.num_layers and view.for_decoding() is view
    if what != "every_other_ffn":  # shared: the same array in every layer, not copies
        assert blocks[0].attn.wq is blocks[-1].attn.wq


def test_causal_lm_input_positions_by_name():
    """``positions="none"``: the tokens enter as their embeddings alone (the token mixers'
    papers add no positions), teacher-forced and cached decoding still agree, and the
    sinusoids' default changes the logits; an unknown scheme is refused, naming the choices."""
    from xformers_jax.train import model_config

    task = type("T", (), dict(vocab_size=20, seq_len=L))()
    key = jax.random.PRNGKey(2)
    tokens = jax.random.randint(key, (2, L), 0, 20)

    def build(**c):
        config = model_config("causal_lm", dim=32, num_layers=2, num_heads=4, hidden=64, **c)
        return models.get_model("causal_lm").build(config, task, key)

    bare, default = build(positions="none"), build()
    x, _ = bare.embed(tokens, causal=True)
    assert_close(x, bare.embed.table[tokens], EXACT)
    forced = bare(tokens)
    cached, _ = eqx.filter_jit(lambda m: m.prefill(tokens, m.init_cache(2, L)))(bare)
    assert_close(cached, forced, EXACT)
    assert not np.allclose(forced, default(tokens), atol=1e-3)
    with pytest.raises(ValueError, match=re.escape(
            "causal_lm: positions must be one of ['none', 'sinusoidal'], got 'rope'")):
        build(positions="rope")


def test_causal_lm_scales_token_embeddings_by_sqrt_dim():
    """``scale_embeddings`` (Vaswani et al. 2017, section 3.4): the looked-up token embeddings
    times sqrt(dim), then the sinusoids; the table (the tied output layer) unchanged; cached
    decoding equals the teacher-forced logits."""
    from xformers_jax.nn import sinusoid
    from xformers_jax.train import model_config

    task = type("T", (), dict(vocab_size=20, seq_len=L))()
    key = jax.random.PRNGKey(3)
    tokens = jax.random.randint(key, (2, L), 0, 20)

    def build(**c):
        config = model_config("causal_lm", dim=32, num_layers=2, num_heads=4, hidden=64,
                              tie_embeddings=True, **c)
        return models.get_model("causal_lm").build(config, task, key)

    plain, scaled = build(), build(scale_embeddings=True)
    assert_close(scaled.embed.table, plain.embed.table, EXACT)  # same draw, unscaled table
    x, _ = scaled.embed(tokens, causal=True)
    positions = jnp.broadcast_to(jnp.arange(L), tokens.shape)
    assert_close(x, scaled.embed.table[tokens] * np.sqrt(32) + sinusoid(positions, 32), EXACT)
    assert_close(scaled.output_weights(), plain.embed.table.T, EXACT)
    forced = scaled(tokens)
    cached, _ = eqx.filter_jit(lambda m: m.prefill(tokens, m.init_cache(2, L)))(scaled)
    assert_close(cached, forced, EXACT)
    assert not np.allclose(forced, plain(tokens), atol=1e-3)
