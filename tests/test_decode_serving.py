"""Serving (``models.Server``, ``prefill_rows``/``step_rows``): rows of different lengths equal
each row alone; continuous batching equals decoding each request alone (greedy and sampled,
per-request keys) for every kind that decodes; a paged cache gives the dense cache's logits
and never reads a freed page; a reused prefix equals recomputing it; cache bytes per sequence.

Models are one layer, dim 16, at the kinds' test hyperparameters; each kind compiles the
server's step and a batch-of-one decoding step (XLA level 0, conftest)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.fast_jit import build, jit0
from tests.test_kinds_behaviour import DECODES, _cases
from tests.tolerances import assert_close
from xformers_jax import models, nn

VOCAB, DIM, HEADS, HIDDEN, MAX_LEN = 20, 16, 2, 32, 24
_FIELDS = {"attention": ("spec", nn.AttentionSpec), "mixer": ("mixer", nn.MixerSpec),
           "ffn": ("ffn", nn.FFNSpec)}
# (prompt length, tokens to generate): different lengths, so that requests join and leave.
SHAPES = [(5, 4), (2, 7), (9, 2), (3, 5), (6, 3)]


@functools.cache
def _model(slot, name, hp=(), layers=1, **kw):
    field, spec = _FIELDS[slot]
    hp = {**dict(nn.get_kind(slot, name).test_hyperparameters), **dict(hp)}
    return build(lambda key: models.CausalLM(VOCAB, DIM, layers, HEADS, HIDDEN, max_len=MAX_LEN,
                                             block={field: spec(name, hp)}, key=key, **kw), 0)


def _requests(keyed=False, shapes=SHAPES, seed=0):
    rng = np.random.default_rng(seed)
    return [models.Request(rng.integers(0, VOCAB, p).astype(np.int32), n,
                           jax.random.PRNGKey(100 + i) if keyed else None)
            for i, (p, n) in enumerate(shapes)]


_DECODE_ONE = jit0(lambda m, tok, caches, t: m.decode_step(tok, caches, t))


def _alone(model, request, temperature=1.0):
    """A request decoded on its own, batch of one, with the model's ``decode_step`` and the
    sampling rule of ``CausalLM.generate`` (token ``i`` from ``split(key, n)[i]``): tokens and
    the logits each was chosen from."""
    step = _DECODE_ONE
    caches = model.init_cache(1, MAX_LEN)
    for t, tok in enumerate(request.prompt):
        logits, caches = step(model, jnp.asarray([tok]), caches, t)
    keys = None if request.key is None else jax.random.split(request.key, request.max_new_tokens)
    out, seen = [], []
    for i in range(request.max_new_tokens):
        seen.append(np.asarray(logits[0]))
        tok = nn.pick_token(logits, None if keys is None else keys[i], temperature=temperature)
        out.append(int(tok[0]))
        logits, caches = step(model, tok.astype(jnp.int32), caches, len(request.prompt) + i)
    return np.asarray(out), np.stack(seen)


def _assert_served_alone(model, requests, served, what):
    for i, (r, (tokens, logits)) in enumerate(zip(requests, served)):
        want_tokens, want_logits = _alone(model, r)
        assert_close(logits, want_logits, err_msg=f"{what}: request {i}'s logits")
        np.testing.assert_array_equal(tokens, want_tokens, err_msg=f"{what}: request {i}")


# -- one interface: rows of different lengths ---------------------------------------------------

@pytest.mark.parametrize("slot,name", [("attention", "dot_product"), ("mixer", "retnet"),
                                       ("attention", "local"), ("attention", "path")])
def test_prefill_rows_of_different_lengths_equal_each_row_alone(slot, name):
    """Shorter rows wait (their caches held) while the longest is fed: exact attention, a
    recurrent state, a window's ring buffer (wrapped: ``left`` 3, 7 tokens) and PaTH, whose
    step rewrites every cached key."""
    model = _model(slot, name)
    lengths = np.array([3, 7, 1])
    prompts = np.random.default_rng(1).integers(0, VOCAB, (3, 7)).astype(np.int32)
    prompts[0, 3:] = prompts[2, 1:] = 19  # padding, never read
    logits, caches = jit0(models.prefill_rows, static_argnums=3)(
        model, jnp.asarray(prompts), jnp.asarray(lengths), MAX_LEN)
    nxt = jnp.asarray([4, 5, 6])
    after, _ = jit0(models.step_rows)(model, caches, nxt, jnp.asarray(lengths))
    # Each row alone: its prompt and next token, then anything (causal: never read).
    rows = np.full((3, 8), 7, np.int32)
    for b, n in enumerate(lengths):
        rows[b, :n], rows[b, n] = prompts[b, :n], nxt[b]
    full = jit0(lambda m, t: m(t))(model, jnp.asarray(rows))
    for b, n in enumerate(lengths):
        assert_close(logits[b], full[b, n - 1], err_msg=f"row {b}: prefill logits")
        assert_close(after[b], full[b, n], err_msg=f"row {b}: the step after the prefill")


def test_an_idle_row_costs_its_step_no_pass_over_its_cache():
    """``step_rows`` with rows not active, compiled as the server's step (caches donated,
    ``models.decode_compiler_options()``), needs less than one row's keys of temporaries
    more than the step of every row (``active=None``): keeping an idle row's cache makes no
    copy of the caches. Selecting the old caches leaf by leaf kept them alive beside the new
    ones: a copy of every row's cache. (Compiled with XLA:CPU's fusion emitters, its
    default, which conftest turns off to compile faster: without them the batched write of
    every row's slot is not done in place at all.)"""
    if jax.default_backend() != "cpu":
        pytest.skip("the copies are XLA:CPU's")
    model = _model("attention", "dot_product").for_decoding()
    caches = jax.eval_shape(lambda: models.init_rows(model, 3, 512))

    def temporaries(hold):
        step = jax.jit(lambda m, c, active: models.step_rows(
            m, c, jnp.zeros((3,), jnp.int32), jnp.full((3,), 5), active if hold else None),
            donate_argnums=1, compiler_options={**models.decode_compiler_options(),
                                                "xla_cpu_use_fusion_emitters": True})
        compiled = step.lower(model, caches, jnp.ones((3,), bool)).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    extra = temporaries(True) - temporaries(False)
    row = models.cache_bytes(caches[0].k) // 3
    assert extra < row, f"holding idle rows took {extra} bytes more: a row's keys ({row}) copied"


# -- continuous batching = one by one, every kind that decodes ----------------------------------

# Every attention kind and mixer that decodes, and the FFN kinds that keep a decoding state
# (capacity routing's per-row expert counts); the other FFN kinds decode statelessly beside
# exact attention, which the attention cases cover.
SERVED = [c for c in DECODES if c[0] != "ffn" or dict(c[2]).get("mode") == "capacity"]


@pytest.mark.parametrize("slot,name,hp", _cases(SERVED))
def test_continuous_batching_equals_decoding_each_request_alone(slot, name, hp):
    """Five requests of different lengths on two slots; each request's logits equal the
    teacher-forced forward pass over its own prompt and generated tokens (one compiled
    forward over the requests as rows padded to ``MAX_LEN``; causal: padding is never read)."""
    model = _model(slot, name, hp)
    requests = _requests()
    served, stats = models.Server(model, num_slots=2, max_len=MAX_LEN).run(
        requests, record_logits=True)
    assert stats.steps < sum(p + n - 1 for p, n in SHAPES)  # side by side, not one by one
    rows = np.zeros((len(requests), MAX_LEN), np.int32)
    for i, (r, (tokens, _)) in enumerate(zip(requests, served)):
        rows[i, :len(r.prompt) + len(tokens)] = np.concatenate([r.prompt, tokens])
    mask = None
    if nn.get_kind(slot, name).fixed_length:  # sized by max_len: the rest masked out
        mask = jnp.asarray(np.arange(MAX_LEN) < np.array(
            [len(r.prompt) + r.max_new_tokens - 1 for r in requests])[:, None])
    full = np.asarray(jit0(lambda m, t, k: m(t, mask=k))(model, jnp.asarray(rows), mask))
    for i, (r, (tokens, logits)) in enumerate(zip(requests, served)):
        p, n = len(r.prompt), r.max_new_tokens
        assert_close(logits, full[i, p - 1:p - 1 + n],
                     err_msg=f"{slot} kind {name!r}: request {i} served with others vs alone")
        np.testing.assert_array_equal(tokens, full[i, p - 1:p - 1 + n].argmax(-1))


def test_requests_served_together_equal_the_models_own_decoding_alone():
    """Against ``decode_step`` on a batch of one (the path ``CausalLM.generate`` takes)."""
    model = _model("attention", "dot_product")
    requests = _requests()
    served, _ = models.Server(model, num_slots=2, max_len=MAX_LEN).run(requests,
                                                                       record_logits=True)
    _assert_served_alone(model, requests, served, "continuous batching")


def test_sampled_requests_equal_generate_alone_with_their_keys():
    model = _model("attention", "dot_product")
    requests = _requests(keyed=True)
    served, _ = models.Server(model, num_slots=3, max_len=MAX_LEN).run(requests,
                                                                        temperature=0.7)
    greedy, _ = models.Server(model, num_slots=3, max_len=MAX_LEN).run(_requests())
    assert any(not np.array_equal(a, b) for a, b in zip(served, greedy)), \
        "sampling drew the greedy tokens for every request"
    r = requests[1]  # generate itself, once (it compiles per prompt and output length)
    want = model.generate(jnp.asarray(r.prompt)[None], r.max_new_tokens, key=r.key,
                          temperature=0.7)[0, len(r.prompt):]
    np.testing.assert_array_equal(served[1], np.asarray(want))
    for i, r in enumerate(requests):  # the same rule, with decode_step on a batch of one
        np.testing.assert_array_equal(served[i], _alone(model, r, 0.7)[0],
                                      err_msg=f"request {i}")


def test_lockstep_gives_the_same_tokens_in_more_steps():
    model = _model("attention", "dot_product")
    requests = _requests()
    # One prompt token a step: with chunks as long as these prompts every request would take
    # a step or two under either policy.
    server = models.Server(model, num_slots=2, max_len=MAX_LEN, prefill_chunk=1)
    cont, c = server.run(requests)
    lock, lk = server.run(requests, policy="lockstep")
    for a, b in zip(cont, lock):
        np.testing.assert_array_equal(a, b)
    assert c.steps < lk.steps
    with pytest.raises(ValueError, match="policy"):
        server.run(requests, policy="fifo")


def test_an_idle_slot_keeps_its_cache_while_a_later_request_runs_on():
    # Slot 1's request holds 19 positions when it ends; slot 0's, admitted at step 2, runs
    # 23 steps more: slot 1 idles 6 steps, which would take it to position 24, past the
    # cache's capacity (MAX_LEN), were it stepped on.
    model = _model("attention", "dot_product")
    requests = _requests(shapes=[(2, 1), (10, 10), (4, 20)])
    served, _ = models.Server(model, num_slots=2, max_len=MAX_LEN).run(requests,
                                                                       record_logits=True)
    _assert_served_alone(model, requests, served, "an idle slot beside a long request")


# -- chunked prefill ----------------------------------------------------------------------------

CHUNKED = [("attention", "dot_product", None), ("attention", "local", None),
           ("mixer", "retnet", None), ("attention", "dot_product", 4), ("attention", "local", 4)]


@pytest.mark.parametrize("slot,name,page_size", CHUNKED,
                         ids=[f"{n}-{'paged' if p else 'dense'}" for _, n, p in CHUNKED])
def test_chunked_prefill_equals_token_by_token(slot, name, page_size):
    """Prompts fed 3 tokens a step (several chunks, a last partial one, beside requests
    generating) give the logits, tokens and caches of feeding them one token a step, in fewer
    steps: exact, windowed (its ring buffer, its pages sliding out within a chunk) and
    recurrent kinds."""
    model = _model(slot, name, layers=2) if page_size else _model(slot, name)
    requests = _requests(shapes=SHAPES + [(11, 3)])
    kw = dict(num_slots=2, max_len=MAX_LEN, page_size=page_size,
              poison_freed=page_size is not None)
    one, chunked = (models.Server(model, prefill_chunk=c, **kw) for c in (1, 3))
    want, ws = one.run(requests, record_logits=True)
    got, gs = chunked.run(requests, record_logits=True)
    for i, ((a, la), (b, lb)) in enumerate(zip(want, got)):
        assert np.isfinite(lb).all(), f"request {i} read a freed (NaN) page"
        assert_close(lb, la, err_msg=f"{name}: chunked vs token-by-token logits, request {i}")
        np.testing.assert_array_equal(b, a, err_msg=f"{name}: request {i}")
    assert gs.processed == ws.processed and gs.steps < ws.steps
    if page_size and name == "local":
        return  # a window's pages are not kept as a prefix
    # The cache after an 11-token prompt: 3 chunks and a partial one against 11 steps.
    prompt = requests[-1].prompt
    a, b = one.add_prefix(prompt), chunked.add_prefix(prompt)
    if page_size is None:
        for x, y in zip(jax.tree_util.tree_leaves(a.cache), jax.tree_util.tree_leaves(b.cache)):
            if jnp.issubdtype(x.dtype, jnp.integer):  # positions, indices
                np.testing.assert_array_equal(y, x)
            else:
                assert_close(y, x, err_msg=f"{name}: the cache after a chunked prompt")
        return
    # every layer's keys and values: [pages, P, Hkv, D] each
    for pool_a, pool_b in zip(jax.tree_util.tree_leaves(one.pool),
                              jax.tree_util.tree_leaves(chunked.pool)):
        held = [p[np.asarray(pages)].reshape(-1, *p.shape[2:])[:len(prompt)]
                for p, pages in ((pool_a, a.pages), (pool_b, b.pages))]
        assert_close(held[1], held[0], err_msg=f"{name}: the pages after a chunked prompt")


# -- the paged cache ------------------------------------------------------------------------------

PAGED = [("dot_product", ()), ("local", ()), ("block_sparse", ()), ("dot_product", "rotary")]


@pytest.mark.parametrize("name,extra", PAGED, ids=["-".join([n, *(e and [e])]) for n, e in PAGED])
def test_paged_cache_equals_the_dense_cache_and_never_reads_a_freed_page(name, extra):
    model = _model("attention", name, layers=2)
    if extra == "rotary":
        model = build(lambda key: models.CausalLM(
            VOCAB, DIM, 2, HEADS, HIDDEN, max_len=MAX_LEN, key=key,
            block={"spec": nn.AttentionSpec(name), "position": nn.RotaryPositions(DIM // HEADS)}),
            0)
    requests = _requests(shapes=SHAPES + [(11, 9), (4, 12)])
    dense, _ = models.Server(model, num_slots=3, max_len=MAX_LEN).run(requests,
                                                                      record_logits=True)
    # Pages of 4 tokens; freed pages are filled with NaN: a read of one would show.
    server = models.Server(model, num_slots=3, max_len=MAX_LEN, page_size=4,
                           poison_freed=True)
    paged, stats = server.run(requests, record_logits=True)
    for i, ((a, la), (b, lb)) in enumerate(zip(dense, paged)):
        assert np.isfinite(lb).all(), f"request {i} read a freed (NaN) page"
        assert_close(lb, la, err_msg=f"{name}: paged vs dense logits, request {i}")
        np.testing.assert_array_equal(b, a)
    # Pages were freed and handed out again (the pool holds fewer than were allocated).
    allocated = sum(-(-(p + n) // 4) for p, n in SHAPES + [(11, 9), (4, 12)])
    assert stats.peak_pages < allocated
    assert server.pool_pages.in_use == 0, "pages still held after every request ended"
    assert 1.0 <= stats.page_fill < 2.0


def test_a_paged_cache_refuses_kinds_without_a_key_value_cache():
    with pytest.raises(ValueError, match="paged cache needs every layer"):
        models.Server(_model("attention", "linear"), num_slots=2, max_len=MAX_LEN, page_size=4)


def test_page_pool_runs_out_clearly_and_counts_references():
    pool = models.PagePool(3, 4)
    a, b = pool.allocate(), pool.allocate()
    assert {a, b} == {1, 2} and pool.in_use == 2
    with pytest.raises(RuntimeError, match="out of pages"):
        pool.allocate()
    pool.share(a)
    pool.release(a)
    assert pool.in_use == 2  # still held by its sharer
    pool.release(a)
    assert pool.in_use == 1 and pool.allocate() == a


# -- prefix reuse -----------------------------------------------------------------------------

@pytest.mark.parametrize("slot,name,page_size", [("attention", "dot_product", None),
                                                 ("attention", "dot_product", 4),
                                                 ("mixer", "gated_deltanet", None)])
def test_a_reused_prefix_equals_recomputing_it(slot, name, page_size):
    model = _model(slot, name, layers=2) if page_size else _model(slot, name)
    rng = np.random.default_rng(3)
    shared = rng.integers(0, VOCAB, 6).astype(np.int32)  # a page and a half of 4
    tails = [rng.integers(0, VOCAB, n).astype(np.int32) for n in (1, 3, 5)]
    plain = [models.Request(np.concatenate([shared, t]), n) for t, n in zip(tails, (5, 2, 4))]
    server = models.Server(model, num_slots=2, max_len=MAX_LEN, page_size=page_size,
                           poison_freed=page_size is not None)
    want, _ = server.run(plain, record_logits=True)
    prefix = server.add_prefix(shared)
    reused = [r._replace(prefix=prefix) for r in plain]
    got, stats = server.run(reused, record_logits=True)
    for i, ((a, la), (b, lb)) in enumerate(zip(want, got)):
        assert_close(lb, la, err_msg=f"request {i}: logits with the reused prefix")
        np.testing.assert_array_equal(b, a)
    assert stats.processed == sum(len(r.prompt) - len(shared) + r.max_new_tokens - 1
                                  for r in plain)  # the prefix was not fed again
    if page_size:
        assert server.pool_pages.in_use == 2  # the prefix's own pages, until released
        server.release_prefix(prefix)
        assert server.pool_pages.in_use == 0
    with pytest.raises(ValueError, match="does not start with its prefix"):
        server.run([models.Request(np.concatenate([shared[::-1], tails[0]]), 2, None, prefix)])


# -- bytes ------------------------------------------------------------------------------------

def test_cache_bytes_per_sequence_grow_only_for_exact_attention():
    def per_seq(slot, name):
        m = _model(slot, name)
        return [models.sequence_cache_bytes(m, n) for n in (16, 64)]

    exact = per_seq("attention", "dot_product")
    assert exact[1] > 3 * exact[0]
    for slot, name in [("attention", "local"), ("attention", "performer"), ("mixer", "mamba")]:
        a, b = per_seq(slot, name)
        assert a == b > 0, f"{name}: state bytes change with the context"
    # One layer: keys and values [16, heads, head_dim] in float32, positions int32[16], index.
    assert exact[0] == 2 * 16 * DIM * 4 + 16 * 4 + 4


def test_a_paged_sequence_holds_whole_pages_of_its_tokens():
    model = _model("attention", "dot_product", layers=2)
    server = models.Server(model, num_slots=2, max_len=MAX_LEN, page_size=4)
    page = 2 * 2 * 4 * DIM * 4  # layers x (keys, values) x 4 tokens x heads * head_dim x f32
    assert [server.bytes_per_sequence(n) for n in (1, 4, 5, 9)] == [page, page, 2 * page,
                                                                    3 * page]
    assert models.Server(model, num_slots=2, max_len=MAX_LEN).bytes_per_sequence(1) == \
        models.sequence_cache_bytes(model, MAX_LEN)


@pytest.mark.parametrize("left", [None, 6], ids=["exact", "window"])
def test_the_paged_step_reads_pages_in_place_as_the_dense_cache(left):
    """The paged step's attention (``nn._attention._paged_one_query``: the table's pages a few
    at a time, online softmax) equals one softmax over the same keys gathered densely
    (``_one_query``), with the table's pages shuffled in the pool, several pages per
    iteration and several iterations, a window starting mid-page, and every slot the query
    may not see (past its length, other sequences' pages, before its window) NaN."""
    from xformers_jax.nn._attention import _one_query, _paged_one_query

    rng = np.random.default_rng(0)
    n, p, hkv, h, d, m = 10, 4, 2, 4, 8, 6
    k_pages = rng.normal(size=(n, p, hkv, d)).astype(np.float32)
    v_pages = rng.normal(size=(n, p, hkv, d)).astype(np.float32)
    table = rng.permutation(np.arange(1, n))[:m].astype(np.int32)
    q = rng.normal(size=(h, d)).astype(np.float32)
    k_t, v_t = (rng.normal(size=(hkv, d)).astype(np.float32) for _ in range(2))
    pos = np.arange(m * p)
    f = jax.jit(_paged_one_query, static_argnums=6, static_argnames="slots")
    for t in (0, 1, 5, 13, 23):
        seen = (pos < t) & (pos >= (0 if left is None else t - left))
        kp, vp = k_pages.copy(), v_pages.copy()
        for page in set(range(n)) - set(table[:-(-t // p)]):
            kp[page], vp[page] = np.nan, np.nan
        held = table[pos // p], pos % p
        for a in (kp, vp):
            a[held[0][~seen], held[1][~seen]] = np.nan
        admitted = functools.partial(_admitted, t=t, left=left)
        got = f(q, kp, vp, table, 0 if left is None else max(t - left, 0), t,
                admitted, (k_t, v_t, True), slots=8)
        dense_k = np.where(seen[:, None, None], kp[held[0], held[1]], 0).transpose(1, 0, 2)
        dense_v = np.where(seen[:, None, None], vp[held[0], held[1]], 0).transpose(1, 0, 2)
        want = _one_query(q[None], dense_k[None], dense_v[None], seen[None],
                          new=(k_t[None], v_t[None], jnp.ones((), bool)))[0]
        assert np.isfinite(got).all(), f"t={t}: a slot not seen was read"
        assert_close(got, want, err_msg=f"t={t}, window {left}: paged vs dense")


def _admitted(pos, *, t, left):
    ok = pos < t
    return ok if left is None else ok & (pos >= t - left)
