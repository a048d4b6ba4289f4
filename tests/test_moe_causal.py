"""Capacity routing in causal models ("sequence" groups: a running capacity per row) and token
ids wherever the FFN slot runs (encoder with its CLS position, cached decoding, the memory
path): training, scoring a prefix and decoding agree, rows stay independent, and hash routing
reads the real ids."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import xformers_jax.models as models
import xformers_jax.nn as nn
from tests.fast_jit import jit0
from tests.tolerances import assert_close
from xformers_jax import experts as M

B, L, DIM, HEADS, HIDDEN, VOCAB, E = 3, 12, 16, 2, 32, 32, 4

# Every FFN kind that claims causal and decoding and routes with a capacity, in its causal
# configuration (k > 1 claims slots token by token).
CAPACITY = {
    "switch": {},
    "gshard": {"priority": "token"},
    "st_moe": {"priority": "token"},
    "hash": {},
    "prototype": {"groups": 2, "priority": "token"},
}


def _sequential(experts, gates, mask, e, cf, length):
    """The running capacity token by token: expert ``x`` takes token ``t`` of a row iff fewer
    than ``ceil(cf * n_t * k / E)`` earlier assignments of the row went to it."""
    t_all, k = experts.shape
    kept = np.zeros((t_all, k), bool)
    for b in range(t_all // length):
        count, n = np.zeros(e, int), 0
        for t in range(length):
            i = b * length + t
            n += int(mask[i])
            cap = int(np.ceil(cf * n * k / e))
            for j in range(k):
                x = experts[i, j]
                if mask[i] and gates[i, j] != 0 and count[x] < cap:
                    kept[i, j], count[x] = True, count[x] + 1
    return kept


@pytest.mark.parametrize("cf", [0.5, 1.25])
def test_sequence_capacity_equals_the_sequential_rule_and_resumes_from_its_state(cf):
    logits = 3 * jax.random.normal(jax.random.key(0), (B * L, E))
    mask = jax.random.uniform(jax.random.key(1), (B * L,)) < 0.8  # holes anywhere
    r = M.top_k_route(logits, 2, mask=mask)
    pos, kept, c, state = jit0(lambda r, m: M.sequence_capacity_slots(
        r, E, cf, length=L, mask=m))(r, mask)
    want = _sequential(np.asarray(r.experts), np.asarray(r.gates), np.asarray(mask), E, cf, L)
    np.testing.assert_array_equal(np.asarray(kept), want)
    assert 0 < want.sum() < np.asarray(r.gates != 0).sum()  # the capacity binds: a real test
    slots = np.asarray(r.experts * c + pos)[want]
    assert len(set(slots.tolist())) == len(slots) and (np.asarray(pos)[want] < c).all()
    np.testing.assert_array_equal(np.asarray(state.seen), np.asarray(mask).reshape(B, L).sum(1))
    # Split each row at 5: the second part from the first part's state decides the same.
    rows = lambda a, s: a.reshape(B, L, *a.shape[1:])[:, s].reshape(-1, *a.shape[1:])  # noqa
    part = lambda s: M.Routing(*(rows(a, s) for a in r))  # noqa: E731
    _, k1, _, st1 = M.sequence_capacity_slots(part(slice(0, 5)), E, cf, length=5,
                                              mask=rows(mask, slice(0, 5)))
    _, k2, _, st2 = M.sequence_capacity_slots(part(slice(5, L)), E, cf, length=L - 5,
                                              mask=rows(mask, slice(5, L)), state=st1)
    got = np.concatenate([np.asarray(k1).reshape(B, 5, 2), np.asarray(k2).reshape(B, L - 5, 2)],
                         1)
    np.testing.assert_array_equal(got.reshape(-1, 2), want)
    np.testing.assert_array_equal(np.asarray(st2.counts), np.asarray(state.counts))


def _lm(kind, **hp):
    params = {**dict(nn.get_kind("ffn", kind).test_hyperparameters), "mode": "capacity",
              "capacity_factor": 1.0, **CAPACITY[kind], **hp}
    return models.CausalLM(VOCAB, DIM, 2, HEADS, HIDDEN, max_len=L,
                           block=dict(ffn=nn.FFNSpec(kind, params)), key=jax.random.key(0))


@jit0
def _runs(model, tokens, changed):
    """The forward, its dropped fraction, the forward with one token changed, each row run
    alone, a prefix of 7, and prefill of 5 followed by one decode step per remaining token."""
    logits, aux = model(tokens, return_aux=True)
    logits_p, caches = model.prefill(tokens[:, :5], model.init_cache(B, L))

    def step(caches, t):
        out, caches = model.decode_step(tokens[:, t], caches, t)
        return caches, out

    _, steps = jax.lax.scan(step, caches, jnp.arange(5, L))
    decoded = jnp.concatenate([logits_p, jnp.moveaxis(steps, 0, 1)], 1)
    alone = jax.lax.map(lambda row: model(row[None])[0], tokens)
    return (logits, aux["dropped_fraction"], model(changed), alone, model(tokens[:, :7]),
            decoded)


@pytest.mark.parametrize("kind", sorted(CAPACITY))
def test_capacity_kinds_in_a_causal_lm_keep_rows_prefixes_and_decoding(kind):
    model = _lm(kind)
    tokens = jax.random.randint(jax.random.key(1), (B, L), 0, VOCAB)
    changed = tokens.at[0, 9].set((tokens[0, 9] + 7) % VOCAB)
    logits, dropped, other, alone, prefix, decoded = _runs(model, tokens, changed)
    assert float(dropped.max()) > 0  # the capacity drops assignments: the checks bind
    # Row 0's token 9 moves nothing in the other rows, nor row 0 before it; every row scores
    # alone as in the batch.
    assert_close(other[1:], logits[1:])
    assert_close(other[0, :9], logits[0, :9])
    assert not np.allclose(other[0, 9], logits[0, 9])
    assert_close(alone, logits)
    # A prefix scores as the same positions of the longer run.
    assert_close(prefix, logits[:, :7])
    # prefill + one decoding step per token equal the forward call.
    assert_close(decoded, logits)


def test_generate_with_capacity_routing_follows_the_forward():
    model = _lm("st_moe")
    prompt = jax.random.randint(jax.random.key(2), (B, 4), 0, VOCAB)
    out = jit0(lambda m, p: m.generate(p, L - 4))(model, prompt)
    np.testing.assert_array_equal(np.asarray(jnp.argmax(model(out)[:, 3:-1], -1)),
                                  np.asarray(out[:, 4:]))


def test_batch_groups_are_refused_in_causal_models_and_kept_elsewhere():
    with pytest.raises(ValueError, match="capacity_group='batch'.*not causal-safe"):
        _lm("switch", capacity_group="batch")
    with pytest.raises(ValueError, match="priority='token'"):
        _lm("st_moe", priority="choice")
    with pytest.raises(ValueError, match="capacity_group must be one of"):
        _lm("switch", capacity_group="rows")
    spec = nn.FFNSpec("switch", {"num_experts": E, "mode": "capacity"})
    assert spec.build(DIM, HIDDEN, causal=True, key=jax.random.key(0)).capacity_group == \
        "sequence"
    assert spec.build(DIM, HIDDEN, key=jax.random.key(0)).capacity_group == "batch"
    # A bidirectional layer asked for 'sequence' groups keeps rows apart.
    layer = nn.FFNSpec("switch", {"num_experts": E, "mode": "capacity", "capacity_factor": 1.0,
                                  "capacity_group": "sequence"}).build(DIM, HIDDEN,
                                                                       key=jax.random.key(0))
    x = jax.random.normal(jax.random.key(3), (2, L, DIM))
    run = jit0(lambda layer, x: layer(x))
    y, _ = run(layer, x)
    y2, _ = run(layer, x.at[0].set(-x[0]))
    assert_close(y2[1], y[1])


# -- token ids wherever the FFN slot runs --------------------------------------------------------

HASH = nn.FFNSpec("hash", {"num_experts": E})


def _hash_load(table, ids, mask=None):
    """The expert load hash routing must report for these ids (real tokens only)."""
    ids = np.asarray(ids).ravel()
    keep = np.ones(ids.shape, bool) if mask is None else np.asarray(mask).ravel()
    return np.bincount(np.asarray(table)[ids[keep]], minlength=E) / keep.sum()


def test_hash_routing_in_an_encoder_reads_the_ids_and_routes_cls_as_id_0():
    model = models.EncoderClassifier(3, DIM, 1, HEADS, HIDDEN, vocab_size=VOCAB, max_len=L + 1,
                                     block=dict(ffn=HASH), key=jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(4), (B, L), 1, VOCAB)
    mask = jnp.arange(L)[None] < jnp.array([[L], [L - 3], [5]])
    _, aux = jit0(lambda m, t: m(t, mask=mask, return_aux=True))(model, tokens)
    table = model.encoder.layers.layers.ffn.hash_table
    ids = jnp.concatenate([jnp.full((B, 1), nn.CLS_TOKEN_ID), tokens], 1)
    with_cls = jnp.concatenate([jnp.ones((B, 1), bool), mask], 1)
    assert_close(aux["expert_load"][0], _hash_load(table, ids, with_cls))
    # Not what the ids without the CLS offset would give (the check can tell them apart).
    assert not np.allclose(aux["expert_load"][0], _hash_load(table, tokens[:, :L], mask))


def test_hash_routing_decodes_with_the_step_ids():
    model = models.CausalLM(VOCAB, DIM, 2, HEADS, HIDDEN, max_len=L, block=dict(ffn=HASH),
                            key=jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(5), (B, L), 0, VOCAB)
    f = jit0(lambda m, t: (m(t), m(jnp.zeros_like(t)), m.prefill(t, m.init_cache(B, L))[0]))
    forward, zeros, cached = f(model, tokens)
    assert_close(cached, forward)
    assert not np.allclose(zeros[:, 1:], forward[:, 1:])  # the ids matter here


def _memory_path(ffn, seed):
    """A one-layer memory LM with ``ffn`` over two segments of ``L`` tokens: ``(logits of
    the two segment calls, the first call's aux, logits fed token by token through the
    segment cache across the boundary)``."""
    from xformers_jax.models._memory_lm import _memory_decode_step, _segment_cache
    model = models.CausalLM(VOCAB, DIM, 1, HEADS, HIDDEN, max_len=3 * L,
                            positions=nn.NoPositions(),
                            block=dict(ffn=ffn, memory=nn.XLMemory(L)), key=jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(seed), (B, 2 * L), 0, VOCAB)

    @jit0
    def run(model, tokens):
        memory = model.init_memory(B)
        (first, memory), aux = model(tokens[:, :L], memory=memory, return_aux=True)
        second, _ = model(tokens[:, L:], memory=memory)
        cache = _segment_cache(model, model.init_memory(B), L)
        _, fed = jax.lax.scan(lambda c, t: _memory_decode_step(model, t, c)[::-1], cache,
                              tokens.T)
        return jnp.concatenate([first, second], 1), aux, jnp.moveaxis(fed, 0, 1)

    return model, tokens, *run(model, tokens)


def test_hash_routing_on_the_memory_path_reads_the_ids():
    model, tokens, forward, aux, fed = _memory_path(HASH, 6)
    table = model.layers.layers.ffn.hash_table
    assert_close(aux["expert_load"][0], _hash_load(table, tokens[:, :L]))
    # Token by token through the segment cache (across the boundary) as the segment calls.
    assert_close(fed, forward)


def test_capacity_counts_restart_with_each_segment_on_the_memory_path():
    spec = nn.FFNSpec("switch", {"num_experts": E, "mode": "capacity", "capacity_factor": 1.0})
    _, _, forward, aux, fed = _memory_path(spec, 7)
    assert float(aux["dropped_fraction"][0]) > 0
    assert_close(fed, forward)
