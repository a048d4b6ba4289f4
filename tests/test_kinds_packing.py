"""Packed rows (several documents in one row, ``segment_ids``) against each document alone.

Every kind whose record says it honours segment ids (``Kind.segments``, at its test
hyperparameters and the shared-layer configurations of ``test_kinds_behaviour.CASES``) gives,
in a one-layer ``models.CausalLM``, each document of a packed row the logits of that document
run alone; every other kind is refused by name when a model holding it is asked to pack. The
position schemes restart per document (input, rotary and bias schemes). One compiled program
per kind or scheme, at the test size (L = 16)."""

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.fast_jit import jit0
from tests.test_kinds_behaviour import _SPECS, CASES, DIM, HEADS, HIDDEN, VOCAB, L, _cases
from tests.tolerances import assert_close
from xformers_jax import models, nn
from xformers_jax.kinds import NOUNS
from xformers_jax.nn._ffns import call_ffn

# Three documents packed into one row of L = 16 (one padding position at the end); the
# second starts inside the first 8-tile, so a tiled kernel sees a boundary inside a tile.
DOCS = (5, 7, 3)
_TOKENS = np.asarray(jax.random.randint(jax.random.PRNGKey(5), (sum(DOCS),), 1, VOCAB))
_SEGMENTS = np.concatenate([np.full(n, i + 1) for i, n in enumerate(DOCS)]
                           + [np.zeros(L - sum(DOCS), int)]).astype(np.int32)
_PACKED = np.concatenate([_TOKENS, np.zeros(L - sum(DOCS), int)]).astype(np.int32)
_STARTS = np.cumsum((0,) + DOCS[:-1])
# Each document alone at the start of its own row, padded (id 0, masked) to L.
_ALONE = np.zeros((len(DOCS), L), np.int32)
for _i, (_s, _n) in enumerate(zip(_STARTS, DOCS)):
    _ALONE[_i, :_n] = _TOKENS[_s:_s + _n]
_ALONE_MASK = np.arange(L)[None, :] < np.asarray(DOCS)[:, None]


def _claims(slot, name, hp):
    kind = nn.get_kind(slot, name)
    return kind.segment_problem(kind.resolve({**dict(kind.test_hyperparameters), **dict(hp)}))


CLAIMS = [c for c in CASES if _claims(*c) is None]
REFUSES = [c for c in CASES if _claims(*c) is not None]


def _block(slot, name, hp):
    field, spec = _SPECS[slot]
    return {field: spec(name, {**dict(nn.get_kind(slot, name).test_hyperparameters),
                               **dict(hp)})}


def _packed_and_alone(model):
    """``(packed [L, V], alone [docs, L, V])`` logits: the packed row with its segment ids,
    and each document in its own padded row without any."""
    packed = model(jnp.asarray(_PACKED)[None], segment_ids=jnp.asarray(_SEGMENTS)[None])[0]
    alone = model(jnp.asarray(_ALONE), mask=jnp.asarray(_ALONE_MASK))
    return packed, alone


def _assert_documents_equal(packed, alone, what):
    for i, (s, n) in enumerate(zip(_STARTS, DOCS)):
        assert_close(packed[s:s + n], alone[i, :n],
                     err_msg=f"{what}: document {i + 1} (positions {s}..{s + n - 1}) of the "
                             "packed row differs from the document alone")


def _runs(block, positions=None):
    """The packed and alone logits of a one-layer CausalLM, built and run in one compiled
    program."""
    def run(k):
        return _packed_and_alone(models.CausalLM(VOCAB, DIM, 1, HEADS, HIDDEN, max_len=L,
                                                 block=block, positions=positions, key=k))

    return jax.tree.map(np.asarray, jit0(run)(jax.random.PRNGKey(1)))


def test_the_claims_cover_every_family():
    # The exact softmax kinds, the per-token FFN kinds and dropless token-choice MoE honour
    # segment ids; capacity dispatch does not (its slots are shared between documents).
    claimed = {(s, n) for s, n, hp in CLAIMS}
    assert {("attention", "flash"), ("attention", "local"), ("ffn", "dense"),
            ("ffn", "switch")} <= claimed
    assert ("ffn", "switch", (("capacity_factor", 1.0), ("mode", "capacity"))) in REFUSES


_FFN_CLAIMS = tuple(c for c in CLAIMS if c[0] == "ffn")


@functools.cache
def _ffn_runs():
    """Every claiming FFN kind's layer in one compiled program: ``{(name, hp): (packed [L,
    DIM], alone [docs, L, DIM])}``, the layer on the packed row (its real tokens masked in,
    as a block passes them) and on each document alone. An FFN's promise is about its layer
    alone: it never sees segment ids, so nothing but its mixing of tokens can differ."""
    x = jax.random.normal(jax.random.PRNGKey(6), (sum(DOCS), DIM))
    x_packed = jnp.zeros((1, L, DIM)).at[0, :sum(DOCS)].set(x)
    x_alone = jnp.zeros((len(DOCS), L, DIM))
    for i, (s, n) in enumerate(zip(_STARTS, DOCS)):
        x_alone = x_alone.at[i, :n].set(x[s:s + n])

    def run(key):
        out = {}
        for _, name, hp in _FFN_CLAIMS:
            ffn = _block("ffn", name, hp)["ffn"].build(DIM, HIDDEN, causal=True, key=key)
            packed = call_ffn(ffn, x_packed, mask=jnp.asarray(_SEGMENTS > 0)[None],
                              tokens=jnp.asarray(_PACKED)[None])[0]
            alone = call_ffn(ffn, x_alone, mask=jnp.asarray(_ALONE_MASK),
                             tokens=jnp.asarray(_ALONE))[0]
            out[name, hp] = (packed[0], alone)
        return out

    return jax.tree.map(np.asarray, jit0(run)(jax.random.PRNGKey(1)))


@pytest.mark.parametrize("slot,name,hp", _cases(CLAIMS))
def test_a_packed_row_equals_each_document_alone(slot, name, hp):
    kind = nn.get_kind(slot, name)
    # Packing is for causal language models here; a kind claiming segment ids without a
    # causal form needs a bidirectional packed model in this test first.
    assert kind.causal, f"{name} claims segment ids but has no causal form to test them in"
    if slot == "ffn":
        packed, alone = _ffn_runs()[name, hp]
    else:
        packed, alone = _runs(_block(slot, name, hp))
    _assert_documents_equal(packed, alone, f"{slot} kind {name!r} {dict(hp)}")


@pytest.mark.parametrize("slot,name,hp", _cases(REFUSES))
def test_packing_is_refused_naming_the_kind(slot, name, hp):
    kind = nn.get_kind(slot, name)
    block = _block(slot, name, hp)
    causal = kind.causal and not kind.mixes_rows
    cls = models.CausalLM if causal else models.EncoderClassifier
    args = (VOCAB,) if causal else (3,)
    kw = {} if causal else {"vocab_size": VOCAB, "pooling": "mean"}
    # Built abstractly: the refusal reads the records, not the arrays.
    model = eqx.filter_eval_shape(lambda: cls(*args, DIM, 1, HEADS, HIDDEN, max_len=L,
                                              block=block, key=jax.random.PRNGKey(0), **kw))
    with pytest.raises(ValueError, match=f"cannot run packed rows.*{NOUNS[kind.slot]} "
                                         f"'{name}'"):
        nn.check_segments(model)


def test_a_packed_call_of_a_refusing_kind_raises_at_trace_time():
    block = {"spec": nn.AttentionSpec("luna", dict(
        nn.get_kind("attention", "luna").test_hyperparameters))}
    model = eqx.filter_eval_shape(lambda: models.CausalLM(
        VOCAB, DIM, 1, HEADS, HIDDEN, max_len=L, block=block, key=jax.random.PRNGKey(0)))
    with pytest.raises(ValueError, match="attention kind 'luna': its packed sequence attends"):
        jax.eval_shape(lambda m: m(jnp.asarray(_PACKED)[None],
                                   segment_ids=jnp.asarray(_SEGMENTS)[None]), model)


# -- positions restart at every document ------------------------------------------------------

# CausalLM's default, sinusoidal input positions, is every claiming kind's run above.
_FLASH = {"spec": nn.AttentionSpec("flash", {"block_q": 8, "block_k": 8})}
# The attention's schemes run without input positions, so each is tested alone: the relative
# ones (rotary, ALiBi, T5) see the same distances either way, TUPE's absolute term and the
# learned input table only the restarted positions.
_NONE = nn.NoPositions()
SCHEMES = {
    "learned": lambda: ({}, nn.LearnedPositions(L, DIM, key=jax.random.PRNGKey(3))),
    "rotary": lambda: ({"position": nn.RotaryPositions(DIM // HEADS)}, _NONE),
    "alibi": lambda: ({"position": nn.ALiBi(HEADS)}, _NONE),
    "t5": lambda: ({"position": nn.T5Bias(HEADS, key=jax.random.PRNGKey(4))}, _NONE),
    "tupe": lambda: ({"position": nn.TUPE(HEADS, DIM // HEADS, L, key=jax.random.PRNGKey(4))},
                     _NONE),
}


@pytest.mark.parametrize("scheme", sorted(SCHEMES))
def test_positions_restart_at_every_document(scheme):
    block, positions = SCHEMES[scheme]()
    packed, alone = _runs({**_FLASH, **block}, positions)
    _assert_documents_equal(packed, alone, f"flash with {scheme} positions")


def test_conv_positions_are_refused():
    cpe = nn.ConvPositions(DIM, key=jax.random.PRNGKey(0))
    model = eqx.filter_eval_shape(lambda: models.CausalLM(
        VOCAB, DIM, 1, HEADS, HIDDEN, max_len=L, positions=cpe, key=jax.random.PRNGKey(0)))
    with pytest.raises(ValueError, match="ConvPositions"):
        nn.check_segments(model)


def test_a_block_memory_and_batch_statistics_are_refused():
    model = eqx.filter_eval_shape(lambda: models.CausalLM(
        VOCAB, DIM, 1, HEADS, HIDDEN, max_len=L, block={"memory": nn.XLMemory(4)},
        key=jax.random.PRNGKey(0)))
    with pytest.raises(ValueError, match="a block memory carries"):
        nn.check_segments(model)
    # PowerNorm (a stateful norm: blocks in a list, not a stack).
    block = eqx.filter_eval_shape(lambda: nn.TransformerBlock(
        DIM, HEADS, HIDDEN, causal=True, norm="power", key=jax.random.PRNGKey(0)))
    with pytest.raises(ValueError, match="PowerNorm normalises with statistics"):
        nn.check_segments([block])


# The scans' resets at the function level (one compiled program each): both scans of S5 and
# of Mamba's selective scan, both directions, and for the selective scan documents starting
# inside a group of positions and at a group's first position.

@pytest.mark.parametrize("form", ["associative", "sequential"])
def test_bidirectional_s5_restarts_at_both_ends_of_a_document(form):
    # The backward system (an encoder's S5) restarts at each document's last step.
    from xformers_jax import mixers

    k = jax.random.split(jax.random.PRNGKey(7), 5)
    p, h = 4, 3
    lam = -0.5 + 1j * jnp.arange(p, dtype=jnp.float32)
    dt, d = jnp.full((p,), 0.1), jax.random.normal(k[0], (h,))
    b, c, c_rev = (jax.random.normal(kk, shape) + 1j * jax.random.normal(kk, shape)
                   for kk, shape in ((k[1], (p, h)), (k[2], (h, p)), (k[3], (h, p))))
    u = jax.random.normal(k[4], (sum(DOCS), h))

    def run(u, seg):
        s5 = functools.partial(mixers.s5, lam=lam, dt=dt, b=b, c=c, d=d, c_reverse=c_rev,
                               implementation=form)
        return s5(u, segment_ids=seg), [s5(u[s:s + n]) for s, n in zip(_STARTS, DOCS)]

    packed, alone = jit0(run)(u, jnp.asarray(_SEGMENTS[:sum(DOCS)]))
    for (s, n), one in zip(zip(_STARTS, DOCS), alone):
        assert_close(packed[s:s + n], one, err_msg=f"{form}: document at {s}..{s + n - 1}")


@pytest.mark.parametrize("reverse", [False, True])
def test_the_selective_scan_restarts_across_groups(reverse):
    # Groups of 4 positions: documents start inside a group and at a group's first position.
    from xformers_jax import mixers

    k = jax.random.split(jax.random.PRNGKey(8), 5)
    n, dim, state = sum(DOCS), 3, 2
    x, b, c = (jax.random.normal(kk, shape) for kk, shape in
               ((k[0], (n, dim)), (k[1], (n, state)), (k[2], (n, state))))
    delta = jax.nn.softplus(jax.random.normal(k[3], (n, dim)))
    a = -jnp.exp(jax.random.normal(k[4], (dim, state)))

    def run(seg):
        out = {}
        for form in ("associative", "sequential", "loop"):
            scan = functools.partial(mixers.selective_scan, a=a, reverse=reverse,
                                     implementation=form, group_positions=4)
            out[form] = (scan(x, delta, b=b, c=c, segment_ids=seg),
                         [scan(x[s:s + m], delta[s:s + m], b=b[s:s + m], c=c[s:s + m])
                          for s, m in zip(_STARTS, DOCS)])
        return out

    for form, (packed, alone) in jit0(run)(jnp.asarray(_SEGMENTS[:n])).items():
        for (s, m), one in zip(zip(_STARTS, DOCS), alone):
            assert_close(packed[s:s + m], one, err_msg=f"{form}: document at {s}")


def test_document_positions():
    seg = jnp.asarray([[1, 1, 1, 2, 2, 3, 0, 0], [1, 1, 1, 1, 1, 1, 1, 1]])
    np.testing.assert_array_equal(nn.document_positions(seg),
                                  [[0, 1, 2, 0, 1, 0, 0, 1], list(range(8))])
