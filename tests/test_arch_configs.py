"""Architecture-level and adaptive-depth variants selected from configs: ``model.arch='swin'``,
``model.depth_mode='act'`` / ``'early_exit'`` and the LSRA token mixer build through
``train.build_model``, and ``train.make_loss_fn`` gives the losses they train with (the ponder
cost added, PABEE's weighted loss over the exits); the LRA configs take them; errors."""

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest

from xformers_jax import nn, train
from xformers_jax.train import _arch_models
from tests.fast_jit import jit0
from tests.tolerances import assert_close

B, L, VOCAB, CLASSES = 2, 16, 20, 3


def _config(**model):
    c = train.base_config("listops")
    c.model.update(dict(dim=16, num_layers=2, num_heads=2, hidden=32, pooling="mean", **model))
    return c


def _batch():
    x = jax.random.randint(jax.random.PRNGKey(1), (B, L), 1, VOCAB)
    return {"inputs": x.at[1, 12:].set(0), "targets": jnp.array([0, 2])}


TASK = train.Task(None, None, None, vocab_size=VOCAB, num_classes=CLASSES, seq_len=L,
                  padded=True)


@pytest.mark.parametrize("setting", ["act", "early_exit", "swin", "lsra"])
def test_configs_build_and_train(setting):
    if setting == "swin":
        c = _config(arch="swin")
        c.model.swin = ml_collections.ConfigDict(dict(patch=1, window=2, depths=(2,), heads=(2,)))
    elif setting == "lsra":
        c = _config()
        c.model.mixer = ml_collections.ConfigDict(dict(kind="lsra", kernel_size=3))
    else:
        c = _config(depth_mode=setting)
    train.validate_config(c)
    model = jit0(lambda k: train.build_model(c.model, TASK, k))(jax.random.PRNGKey(0))
    batch = _batch()
    loss_fn = train.make_loss_fn(TASK, aux_coefficients=dict(c.loss))
    (loss, metrics), grads = jit0(jax.value_and_grad(
        lambda m: loss_fn(m, batch, None), has_aux=True))(model)
    assert np.isfinite(float(loss))
    assert all(bool(jnp.all(jnp.isfinite(g))) for g in jax.tree_util.tree_leaves(grads))
    mask = batch["inputs"] != 0
    if setting == "act":
        assert isinstance(model.stack, nn.ACTStack)
        logits, aux = jit0(lambda m: m(batch["inputs"], mask=mask))(model)
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()
        assert_close(loss, ce + c.loss.ponder * aux["ponder"])
        assert float(metrics["ponder"]) >= 1.0
    elif setting == "early_exit":
        exits = jit0(lambda m: m.model(batch["inputs"], mask=mask))(model)
        assert exits.shape == (2, B, CLASSES)
        assert_close(loss, nn.early_exit_loss(exits, batch["targets"]))
    elif setting == "swin":
        assert isinstance(model.swin, nn.SwinClassifier)
    else:
        assert isinstance(model.encoder.layers.layers.attn, nn.LSRA)


def test_lra_configs_and_errors():
    from experiments.configs.lra import listops

    c = listops.get_config("lsra,runlocal")
    train.validate_config(c)
    assert c.model.mixer.kind == "lsra"
    for kind in ("realformer", "predictive", "lazy"):
        assert listops.get_config(f"{kind},runlocal").model.attention.kind == kind
    with pytest.raises(ValueError, match="model.arch must be one of"):
        train.validate_config(_config(arch="nope"))
    with pytest.raises(ValueError, match="needs model.arch='transformer'"):
        train.validate_config(_config(arch="swin", depth_mode="act"))
    with pytest.raises(ValueError, match="square image"):
        _arch_models.classifier(_config(arch="swin").model, train.Task(
            None, None, None, vocab_size=VOCAB, num_classes=2, seq_len=15, padded=False),
            jax.random.PRNGKey(0), block={}, max_len=15)
