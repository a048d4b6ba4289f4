"""Sequence parallelism end to end, on 8 simulated CPU devices (tests/conftest.py).

Models reach the sequence-parallel forms by themselves when the active mesh splits ``length``
(``fsdp+sequence``): exact attention runs as ring attention (zig-zag load balanced when
causal), the sliding window by halo exchange, linear attention by prefix-state passing (causal)
or one summed state. Loss and gradients equal the one-device run; kinds without such a form
fail when the model is built.
"""

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.tolerances import EXACT, EXACT_GRAD, assert_close
from xformers_jax import attention as A
from xformers_jax import axes as X
from xformers_jax import models, nn, parallel, train
from xformers_jax.attention import _ring

L, DIM, HEADS, HIDDEN, VOCAB = 32, 16, 2, 32, 40
KINDS = {
    "flash": {"block_q": 8, "block_k": 8},
    "local": {"left": 3, "right": 2, "block_q": 8, "block_k": 8},
    "linear": {"chunk_size": 4},
}
_LEVEL0 = {"xla_backend_optimization_level": 0}


def _mesh():
    return parallel.strategy("fsdp+sequence", {"sequence": 4}).mesh()  # fsdp=2 x sequence=4


def _value_and_grad(loss, model):
    params, static = eqx.partition(model, eqx.is_inexact_array)
    run = jax.jit(jax.value_and_grad(lambda p: loss(eqx.combine(p, static))),
                  compiler_options=_LEVEL0)
    return run(params)


def _model(kind, causal):
    spec = nn.AttentionSpec(kind, KINDS[kind])
    key = jax.random.PRNGKey(0)
    if causal:
        hp = dict(KINDS[kind], right=0) if kind == "local" else KINDS[kind]
        return models.CausalLM(VOCAB, DIM, 1, HEADS, HIDDEN, max_len=L,
                           block=dict(spec=nn.AttentionSpec(kind, hp)), key=key)
    return models.EncoderClassifier(3, DIM, 1, HEADS, HIDDEN, vocab_size=VOCAB, max_len=L + 1,
                                block=dict(spec=spec), key=key)


@pytest.mark.parametrize("causal", [True, False], ids=["causal_lm", "encoder"])
@pytest.mark.parametrize("kind", list(KINDS))
def test_fsdp_sequence_equals_one_device(kind, causal):
    model = _model(kind, causal)
    tokens = jax.random.randint(jax.random.PRNGKey(1), (2, L), 1, VOCAB)
    mask = jnp.arange(L)[None] < jnp.array([[L], [L - 7]])  # padding in the encoder

    def loss(m):
        out = m(tokens) if causal else m(tokens, mask=mask)
        return jnp.mean(jax.nn.logsumexp(out, -1))

    ref_loss, ref_grads = _value_and_grad(loss, model)
    mesh = _mesh()
    with parallel.use_mesh(mesh):
        assert X.sequence_shards() == 4
        sharded = jax.device_put(
            eqx.filter(model, eqx.is_inexact_array),
            parallel.param_shardings(eqx.filter(model, eqx.is_inexact_array),
                                     parallel.DEFAULT_PARAM_RULES, mesh))
        got_loss, got_grads = _value_and_grad(loss, eqx.combine(sharded, model))
        # The sequence-parallel form is in the program: neighbours exchange blocks or a state.
        params, static = eqx.partition(model, eqx.is_inexact_array)
        text = jax.jit(lambda p: loss(eqx.combine(p, static))).lower(params).as_text()
    collective = "collective_permute" if kind != "linear" or causal else "all_reduce"
    if kind == "linear" and causal:
        collective = "all_gather"
    assert collective in text, f"{kind}: no {collective} in the sharded program"
    assert_close(got_loss, ref_loss)
    for g, r in zip(jax.tree_util.tree_leaves(got_grads), jax.tree_util.tree_leaves(ref_grads)):
        assert_close(g, r, EXACT_GRAD)


def test_kinds_without_a_sequence_parallel_form_fail_at_build_time():
    model = models.EncoderClassifier(3, DIM, 1, HEADS, HIDDEN, vocab_size=VOCAB, max_len=L,
                                 block=dict(spec=nn.AttentionSpec("nystrom", {"num_landmarks": 4})),
                                 key=jax.random.PRNGKey(0))
    with pytest.raises(ValueError, match="'nystrom' has no sequence-parallel form"):
        nn.check_sequence_parallel(model, 4)
    nn.check_sequence_parallel(model, 1)  # one shard needs nothing
    alibi = models.CausalLM(VOCAB, DIM, 1, HEADS, HIDDEN, max_len=L,
                        block=dict(spec=nn.AttentionSpec("flash"), position=nn.ALiBi(HEADS)),
                        key=jax.random.PRNGKey(0))
    with pytest.raises(ValueError, match="ALiBi adds a score bias"):
        nn.check_sequence_parallel(alibi, 4)
    favor = models.CausalLM(VOCAB, DIM, 1, HEADS, HIDDEN, max_len=L,
                        block=dict(spec=nn.AttentionSpec("performer")), key=jax.random.PRNGKey(0))
    with pytest.raises(ValueError, match="running maximum"):
        nn.check_sequence_parallel(favor, 4)
    # The trainer checks when it builds the model for a `sequence` mesh.
    config = train.base_config("lm")
    config.model.attention = {"kind": "dot_product",
                              "pattern": A.patterns.Local(4, 0)}
    task = train.make_task(config.data, 0)
    with pytest.raises(ValueError, match="ring attention runs the full or causal pattern"):
        train.build_model(config.model, task, jax.random.PRNGKey(0), sequence_shards=8)
    # Under a mesh the module itself refuses rather than computing something else.
    tokens = jnp.ones((2, L), jnp.int32)
    with parallel.use_mesh(_mesh()):
        with pytest.raises(NotImplementedError, match="no sequence-parallel form"):
            jax.eval_shape(model, tokens)


def _work(n, c):
    """Score entries each device computes at each ring step, measured: with q = 0 and one-hot
    values every key a query attends adds a positive entry to its output row."""
    r = _ring._Ring("sequence", n, True, 1.0, None, None)
    q = jnp.zeros((2 * c, 4))
    k = jnp.zeros((2 * c, 4))
    v = jnp.eye(2 * c)
    mask = jnp.ones((2 * c,), bool)
    block = jax.jit(lambda case: _ring._block_forward(r, case, q, k, v, mask))
    work = np.zeros((n, n), int)
    for idx in range(n):
        for s in range(n):
            out, lse = block(_ring._case(r, s, idx))
            weights = jnp.where(jnp.isfinite(lse)[:, None], out * jnp.exp(lse)[:, None], 0.0)
            work[idx, s] = int(jnp.sum(weights > 0.5))
    return work


def test_causal_ring_is_load_balanced_by_the_work_each_device_does():
    n, c = 4, 3
    work = _work(n, c)
    # Every device computes exactly the causal pairs of its zig-zag chunks (i and 2n-1-i) ...
    L_total = 2 * n * c
    assert work.sum() == L_total * (L_total + 1) // 2
    assert np.all(work.sum(1) == work.sum() // n)
    # ... and at every step each does 2c^2 entries (c more on its own diagonal block).
    assert set(np.unique(work)) <= {2 * c * c, 2 * c * c + c}
    # A contiguous split would leave device 0 with its own triangle and device n-1 with n - 1
    # full blocks more: the imbalance the zig-zag layout removes.
    contiguous = [(2 * c) * (2 * c + 1) // 2 + i * (2 * c) ** 2 for i in range(n)]
    assert contiguous[-1] / contiguous[0] > n


@pytest.mark.parametrize("causal", [True, False])
def test_halo_local_attention_equals_the_band(key, causal):
    mesh = parallel.make_mesh({"sequence": 4, "data": -1})
    q, k, v = jax.random.normal(key, (3, 30, 8))  # padded to 32: shards of 8
    mask = jnp.arange(30) % 7 != 5
    left, right = 5, 3
    pattern = A.patterns.Local(left, 0 if causal else right)
    halo = jax.jit(lambda q, k, v: A.halo_local_attention(
        q, k, v, left=left, right=right, causal=causal, kv_mask=mask, mesh=mesh))
    band = lambda q, k, v: A.dot_product_attention(  # noqa: E731
        q, k, v, pattern=pattern, causal=causal, kv_mask=mask)
    assert_close(halo(q, k, v), band(q, k, v), EXACT)
    sq = lambda f: lambda *a: jnp.sum(f(*a) ** 2)  # noqa: E731
    for a, b in zip(jax.grad(sq(halo), (0, 1, 2))(q, k, v), jax.grad(sq(band), (0, 1, 2))(q, k, v)):
        assert_close(a, b, EXACT_GRAD)
    with pytest.raises(ValueError, match="longer than a shard of 8 positions"):
        A.halo_local_attention(q, k, v, left=9, kv_mask=mask, mesh=mesh)


def test_non_causal_sequence_parallel_linear_attention(key):
    mesh = parallel.make_mesh({"sequence": 4, "data": -1})
    q, k, v = jax.random.normal(key, (3, 30, 8))
    mask = jnp.arange(30) < 26
    sp = jax.jit(functools.partial(A.sequence_parallel_linear_attention, causal=False,
                                   kv_mask=mask, mesh=mesh))
    ref = functools.partial(A.linear_attention, causal=False, kv_mask=mask)
    assert_close(sp(q, k, v), ref(q, k, v))
    sq = lambda f: lambda *a: jnp.sum(f(*a) ** 2)  # noqa: E731
    for a, b in zip(jax.grad(sq(sp), (0, 1, 2))(q, k, v), jax.grad(sq(ref), (0, 1, 2))(q, k, v)):
        assert_close(a, b, EXACT_GRAD)
