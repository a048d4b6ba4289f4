"""Architecture-level and adaptive-depth variants selected from configs: ``model.kind='swin'``,
``'act'`` / ``'early_exit'`` and the LSRA token mixer build through ``train.build_model``, and
``train.make_loss_fn`` gives the losses they train with (the ponder cost added, PABEE's
weighted loss over the exits); the LRA configs take them; errors."""

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest

from xformers_jax import models, nn, parallel, train
from tests.fast_jit import jit0
from tests.tolerances import assert_close

B, L, VOCAB, CLASSES = 2, 16, 20, 3


def _config(kind="classifier", **model):
    c = train.base_config("listops", model=kind)
    if kind == "swin":
        c.model.update(dict(dim=16, **model))
    else:
        c.model.update(dict(dim=16, num_layers=2, num_heads=2, hidden=32, pooling="mean",
                            **model))
    return c


def _batch():
    x = jax.random.randint(jax.random.PRNGKey(1), (B, L), 1, VOCAB)
    return {"inputs": x.at[1, 12:].set(0), "targets": jnp.array([0, 2])}


TASK = train.Task(None, None, None, vocab_size=VOCAB, num_classes=CLASSES, seq_len=L,
                  padded=True)


@pytest.mark.parametrize("setting", ["act", "early_exit", "swin", "lsra"])
def test_configs_build_and_train(setting):
    if setting == "swin":
        c = _config("swin", patch=1, window=2, depths=(2,), heads=(2,))
    elif setting == "lsra":
        c = _config()
        c.model.mixer = ml_collections.ConfigDict(dict(kind="lsra", kernel_size=3))
    else:
        c = _config(setting)
    train.validate_config(c)
    model = jit0(lambda k: train.build_model(c.model, TASK, k))(jax.random.PRNGKey(0))
    batch = _batch()
    loss_fn = train.make_loss_fn(TASK, weights=dict(c.loss), kind=c.model.kind)
    # Under a mesh, as the trainer runs it: the models' sharding constraints name their axes
    # (Swin's 4D grid once reached the FFN's [batch, length, mlp] constraint there).
    one = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
    with parallel.use_mesh(one):
        (loss, metrics), grads = jit0(jax.value_and_grad(
            lambda m: loss_fn(m, batch, None), has_aux=True))(model)
    assert np.isfinite(float(loss))
    assert all(bool(jnp.all(jnp.isfinite(g))) for g in jax.tree_util.tree_leaves(grads))
    mask = batch["inputs"] != 0
    if setting == "act":
        assert isinstance(model.stack, models.ACTStack)
        logits, aux = jit0(lambda m: m(batch["inputs"], mask=mask, return_aux=True))(model)
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()
        assert_close(loss, ce + c.loss.ponder * aux["ponder"])
        assert float(metrics["ponder"]) >= 1.0
    elif setting == "early_exit":
        exits = jit0(lambda m: m.model(batch["inputs"], mask=mask))(model)
        assert exits.shape == (2, B, CLASSES)
        assert_close(loss, models.early_exit_loss(exits, batch["targets"]))
    elif setting == "swin":
        assert isinstance(model.swin, models.SwinClassifier)
    else:
        assert isinstance(model.encoder.layers.layers.attn, nn.LSRA)


def test_lra_configs_and_errors():
    from xformers_jax_experiments.configs.lra import listops

    c = listops.get_config("lsra,runlocal")
    train.validate_config(c)
    assert c.model.mixer.kind == "lsra"
    for kind in ("realformer", "predictive", "lazy"):
        assert listops.get_config(f"{kind},runlocal").model.attention.kind == kind
    nope = _config()
    nope.model.kind = "nope"
    with pytest.raises(ValueError, match="unknown model kind 'nope'"):
        train.validate_config(nope)
    lm = train.base_config("lm", model="swin")
    with pytest.raises(ValueError, match="model.kind='swin' trains \\['classification'\\] "
                                         "tasks, not 'language_model' ones"):
        train.validate_config(lm)
    with pytest.raises(ValueError, match="square image"):
        train.build_model(_config("swin").model, train.Task(
            None, None, None, vocab_size=VOCAB, num_classes=2, seq_len=15, padded=False),
            jax.random.PRNGKey(0))


def test_evaluate_exits_goes_through_the_trained_exits():
    """``evaluate_exits`` over a split (two batches, the last short) equals the exits chosen
    from every exit's logits by DeeBERT's rule; a threshold no entropy passes is the last
    exit's accuracy at full depth (PABEE's exits are checked in test_adaptive.py)."""
    import equinox as eqx
    from xformers_jax.data import ArraySource

    c = _config("early_exit")
    model = jit0(lambda k: train.build_model(c.model, TASK, k))(jax.random.PRNGKey(2))
    # Larger exit weights than at initialisation: confident, varied predictions to exit on.
    model = eqx.tree_at(lambda m: m.model.heads, model, model.model.heads * 6)
    n = 5
    x = np.array(jax.random.randint(jax.random.PRNGKey(3), (n, L), 1, VOCAB))
    x[1, 10:] = 0
    x[3, 5:] = 0
    y = np.array([0, 1, 2, 1, 0])
    source = ArraySource({"inputs": x, "targets": y})
    every = np.asarray(jit0(lambda m: m.model(x, mask=x != 0))(model))    # [2, n, C]
    logp = jax.nn.log_softmax(every, -1)
    entropy = np.asarray(-(jnp.exp(logp) * logp).sum(-1))
    preds = every.argmax(-1)
    threshold = float(np.median(entropy[0]))
    first = entropy[0] < threshold
    assert 0 < first.sum() < n, "test needs some examples exiting early and some not"
    want = np.where(first, 1, 2)
    cases = [("entropy", dict(threshold=threshold), want),
             ("entropy", dict(threshold=-1.0), np.full(n, 2))]
    for criterion, kw, layer in cases:
        got = models.evaluate_exits(model, source, 3, padded=True, criterion=criterion,
                                          **kw)
        pred = preds[layer - 1, np.arange(n)]
        np.testing.assert_allclose(got["accuracy"], np.mean(pred == y))
        np.testing.assert_allclose(got["expected_layers"], layer.mean())
        np.testing.assert_allclose(got["flops_saved"], 1 - layer.mean() / 2)
        # Batches [0:3], [3:5] run until their last example exits.
        batch = [layer[:3].max()] * 3 + [layer[3:].max()] * 2
        np.testing.assert_allclose(got["batch_layers"], np.mean(batch))
        assert got["exits"] == [int((layer == 1).sum()), int((layer == 2).sum())]
    with pytest.raises(ValueError, match="needs an early-exit classifier"):
        models.evaluate_exits(model.model.encoder, source, 3, padded=True)
    with pytest.raises(ValueError, match="patience must be at least 1"):
        models.evaluate_exits(model, source, 3, padded=True, criterion="patience",
                                    patience=0)
