"""Sequence packing end to end: the packer (``data.PackedDocuments``), the lm task's
``data.pack`` switch, the loss of a packed batch (the mean over real tokens, equal to the same
documents scored alone) and the trainer's refusals. Kind by kind equality is in
``test_kinds_packing.py``."""

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest

from tests.fast_jit import jit0
from tests.tolerances import EXACT_GRAD, assert_close
from xformers_jax import data as D
from xformers_jax import models, nn, train
from xformers_jax.train import _tasks

SEQ = 8


def _docs():
    # Lengths 1 (no target: left out), 3, 12 (longer than a row: two pieces), 5, 9.
    rng = np.random.default_rng(0)
    return [rng.integers(1, 50, n).astype(np.int32) for n in (1, 3, 12, 5, 9)]


def _pairs(source):
    """Every (document piece, position, input, target) the rows hold, read back from the
    segment ids."""
    out = []
    for i in range(len(source)):
        row = source[i]
        for seg in range(1, row["segment_ids"].max() + 1):
            at = row["segment_ids"] == seg
            out.append((row["inputs"][at].tolist(), row["targets"][at].tolist(),
                        row["positions"][at].tolist()))
    return out


def test_rows_hold_every_pair_once_and_nothing_across_documents():
    docs = _docs()
    source = D.PackedDocuments(docs, seq_len=SEQ, seed=3)
    pieces = _pairs(source)
    # Each document gives its n - 1 (input, target) pairs exactly once: the 12-token one as
    # pieces of 9 and 4 tokens overlapping by one, 8 and 3 pairs.
    assert sorted(len(p[0]) for p in pieces) == sorted([2, 8, 3, 4, 8])
    assert source.num_documents == 5
    got = sorted((tuple(i), tuple(t)) for i, t, _ in pieces)
    want = []
    for d in docs[1:]:
        for start in range(0, d.size - 1, SEQ):
            piece = d[start:start + SEQ + 1]
            want.append((tuple(piece[:-1]), tuple(piece[1:])))
    assert got == sorted(want)
    for _, _, positions in pieces:  # positions restart at each document
        assert positions == list(range(len(positions)))
    for i in range(len(source)):
        row = source[i]
        pad = row["segment_ids"] == 0
        assert (row["inputs"][pad] == 0).all() and (row["targets"][pad] == 0).all()
        assert not pad.any() or pad[np.argmax(pad):].all(), "padding only at the row's end"
        real = row["segment_ids"] > 0
        np.testing.assert_array_equal(
            np.asarray(nn.document_positions(jnp.asarray(row["segment_ids"])[None]))[0][real],
            row["positions"][real])
    assert source.fill == pytest.approx(25 / (len(source) * SEQ))


def test_packing_is_seeded_and_next_fit():
    docs = _docs()
    a, b = D.PackedDocuments(docs, seq_len=SEQ, seed=3), D.PackedDocuments(docs, seq_len=SEQ,
                                                                             seed=3)
    for i in range(len(a)):
        for k in a[i]:
            np.testing.assert_array_equal(a[i][k], b[i][k])
    orders = {tuple(D.PackedDocuments(docs, seq_len=SEQ, seed=s).order) for s in range(6)}
    assert len(orders) > 1
    # In order (2, 8, 3, 4, 8 pairs): [2] [8] [3, 4] [8].
    plain = D.PackedDocuments(docs, seq_len=SEQ, shuffle=False)
    assert [int(plain[i]["segment_ids"].max()) for i in range(len(plain))] == [1, 1, 2, 1]


def test_packed_rows_go_through_grain_batches():
    source = D.PackedDocuments(_docs(), seq_len=SEQ, seed=0)
    it = D.DataIterator(source, batch_size=2, seed=1, num_epochs=1)
    batch = next(it)
    it.close()
    assert {k: v.shape for k, v in batch.items()} == {
        k: (2, SEQ) for k in ("inputs", "targets", "segment_ids", "positions")}


def test_packer_errors():
    with pytest.raises(ValueError, match="seq_len must be a positive integer, got 0"):
        D.PackedDocuments(_docs(), seq_len=0)
    with pytest.raises(ValueError, match="document 1 has dtype float32"):
        D.PackedDocuments([np.ones(3, np.int32), np.ones(3, np.float32)], seq_len=4)
    with pytest.raises(ValueError, match="no document has 2 or more tokens"):
        D.PackedDocuments([np.ones(1, np.int32)], seq_len=4)


# -- the loss of a packed batch ----------------------------------------------------------------

VOCAB, L = 20, 16
_LM = models.CausalLM(VOCAB, 16, 1, 2, 32, max_len=L,
                      block={"spec": nn.AttentionSpec("flash", {"block_q": 8, "block_k": 8})},
                      key=jax.random.PRNGKey(0))


def _packed_task():
    return _tasks.Task(None, None, None, vocab_size=VOCAB, num_classes=VOCAB, seq_len=L,
                       padded=False, spec=_tasks.get_task("lm"), packed=True)


def test_the_loss_of_a_packed_batch_is_the_mean_over_its_real_tokens():
    # Two packed rows: [5, 7 | pad 4] and [10, 3 | pad 3]; the loss equals the mean
    # cross-entropy over every token of the four documents, each run alone.
    rng = np.random.default_rng(1)
    lengths = ((5, 7), (10, 3))
    docs = [[rng.integers(1, VOCAB, n + 1) for n in row] for row in lengths]
    batch = {k: np.zeros((2, L), np.int32) for k in ("inputs", "targets", "segment_ids")}
    for r, row in enumerate(docs):
        at = 0
        for s, d in enumerate(row, start=1):
            n = d.size - 1
            batch["inputs"][r, at:at + n], batch["targets"][r, at:at + n] = d[:-1], d[1:]
            batch["segment_ids"][r, at:at + n] = s
            at += n
    task = _packed_task()
    loss_fn = train.make_loss_fn(task, kind="causal_lm")
    metrics_fn = train.make_metrics_fn(task, kind="causal_lm")
    loss, metrics = jit0(loss_fn)(_LM, batch, None)
    sums = jit0(metrics_fn)(_LM, batch)

    # Each document alone in its own row, padded and masked (one compiled call).
    alone = [d for row in docs for d in row]
    tokens = np.zeros((len(alone), L), np.int32)
    for i, d in enumerate(alone):
        tokens[i, :d.size - 1] = d[:-1]
    mask = tokens != 0
    logits = np.asarray(jit0(lambda m, t, k: m(t, mask=k))(_LM, tokens, mask))
    ce, correct = [], []
    for i, d in enumerate(alone):
        n = d.size - 1
        ce.append(optax.softmax_cross_entropy_with_integer_labels(logits[i, :n], d[1:]))
        correct.append(logits[i, :n].argmax(-1) == d[1:])
    ce, correct = np.concatenate(ce), np.concatenate(correct)
    np.testing.assert_allclose(metrics["cross_entropy"], ce.mean(), rtol=2e-5)
    np.testing.assert_allclose(loss, ce.mean(), rtol=2e-5)
    np.testing.assert_allclose(metrics["accuracy"], correct.mean(), rtol=1e-6)
    assert int(sums["count"]) == ce.size == 25
    np.testing.assert_allclose(sums["loss_sum"], ce.sum(), rtol=2e-5)
    assert int(sums["correct"]) == int(correct.sum())

    # The gradients too: the packed batch's against the documents alone, through the tiled
    # kernel's backward with segment ids.
    targets = np.zeros_like(tokens)
    for i, d in enumerate(alone):
        targets[i, :d.size - 1] = d[1:]

    def alone_loss(m):
        real = jnp.asarray(mask)
        ce = optax.softmax_cross_entropy_with_integer_labels(m(tokens, mask=real), targets)
        return jnp.where(real, ce, 0.0).sum() / real.sum()

    grads = jit0(lambda m: eqx.filter_grad(lambda m: loss_fn(m, batch, None)[0])(m))(_LM)
    expected = jit0(lambda m: eqx.filter_grad(alone_loss)(m))(_LM)
    assert_close(grads, expected, EXACT_GRAD)


# -- the trainer's switch ------------------------------------------------------------------------

def _lm_config(**data):
    c = train.base_config("lm")
    c.data.update(dict(seq_len=32, num_eval=4, num_test=4, **data))
    c.model.update(dict(dim=16, num_layers=1, num_heads=2, hidden=32))
    return c


def test_data_pack_gives_packed_batches_to_the_model():
    c = _lm_config(pack=True)
    task = train.make_task(c.data, 0)
    assert task.packed and isinstance(task.train, D.PackedDocuments)
    assert task.train.fill > 0.9
    batch = {k: v[None] for k, v in task.train[0].items()}
    args, kwargs = _tasks.model_inputs(task, batch)
    assert set(kwargs) == {"segment_ids"} and kwargs["segment_ids"] is batch["segment_ids"]
    with pytest.raises(ValueError, match="data.source='enwik8' is one stream"):
        train.make_task(_lm_config(pack=True, source="enwik8").data, 0)


def test_the_trainer_refuses_packing_by_name(monkeypatch):
    c = _lm_config(pack=True)
    task = dataclasses.replace(_packed_task(), seq_len=32)
    c.model.attention = ml_collections.ConfigDict(dict(kind="luna"))
    with pytest.raises(ValueError, match="attention kind 'luna': its packed sequence "
                                         "attends over every earlier token"):
        jax.eval_shape(lambda: _tasks.build_model(c.model, task, jax.random.PRNGKey(0)))
    # A language model kind that does not declare packs=True (registered for this test only).
    unpacked = dataclasses.replace(models.get_model("causal_lm"), name="unpacked_lm",
                                   packs=False)
    monkeypatch.setitem(models._registry._MODELS, "unpacked_lm", unpacked)
    c = _lm_config(pack=True)
    train.set_model_kind(c, "unpacked_lm")
    with pytest.raises(ValueError, match="model.kind='unpacked_lm' does not take packed rows"):
        _tasks.build_model(c.model, task, jax.random.PRNGKey(0))


def test_the_packed_lm_config_builds_and_scores_a_packed_batch():
    from xformers_jax_experiments.configs.lm import stdlib_bytes

    config = stdlib_bytes.get_config("flash,packed,runlocal")
    train.validate_config(config)
    assert config.data.pack and not stdlib_bytes.get_config("flash,runlocal").data.pack
    config.data.update(dict(seq_len=32))
    config.model.update(dict(dim=16, num_layers=1, num_heads=2, hidden=32))
    task = train.make_task(config.data, 0)
    model = eqx.filter_eval_shape(train.build_model, config.model, task, jax.random.PRNGKey(0))
    it = D.DataIterator(task.train, batch_size=4, seed=0)
    batch = next(it)
    it.close()
    assert (batch["segment_ids"] > 0).any()
    loss, _ = eqx.filter_eval_shape(train.make_loss_fn(task), model, batch,
                                    jax.random.PRNGKey(1))
    assert loss.shape == () and loss.dtype == jnp.float32
    with pytest.raises(ValueError, match="honours segment ids.*got 'reformer'"):
        stdlib_bytes.get_config("reformer,packed")
