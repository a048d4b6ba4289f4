"""The model registry: a model registered here, in a test file, with an auxiliary loss of its
own, trains through the trainer and logs that term, with no edit to ``train/`` or the config
schema; the registry's errors; every registered kind builds for the tasks it serves."""

import math
import os

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
import pytest

from tests.fast_jit import jit0
from tests.tolerances import assert_close
from xformers_jax import models, train


class BagOfTokens(eqx.Module):
    """A classifier from the mean token embedding, with an auxiliary term of its own: the
    squared norm of its head (an L2 penalty the model reports by name)."""

    table: jax.Array
    head: jax.Array
    scale: float = eqx.field(static=True)

    def __init__(self, vocab_size, num_classes, dim, scale, *, key):
        k1, k2 = jax.random.split(key)
        self.table = jax.random.normal(k1, (vocab_size, dim)) / math.sqrt(dim)
        self.head = jax.random.normal(k2, (dim, num_classes)) / math.sqrt(dim)
        self.scale = scale

    def __call__(self, x, *, mask=None, key=None, return_aux=False):
        w = jnp.ones(x.shape, jnp.float32) if mask is None else mask.astype(jnp.float32)
        h = jnp.einsum("bl,bld->bd", w, self.table[x]) / jnp.maximum(w.sum(1, keepdims=True), 1)
        logits = h @ self.head
        aux = {"head_norm": self.scale * jnp.sum(self.head ** 2)}
        return (logits, aux) if return_aux else logits


@models.register_model("bag_of_tokens", serves=("classification",),
                       defaults=dict(dim=16, scale=1.0), loss_weights={"head_norm": 0.5},
                       replace=True)
def bag_of_tokens(config, task, key):
    """A mean-embedding classifier with a head-norm penalty (a test model)."""
    return BagOfTokens(task.vocab_size, task.num_classes, config.dim, config.scale, key=key)


def _config(steps=6, **loss):
    c = train.base_config("listops", model="bag_of_tokens")
    c.data.update(dict(num_train=48, num_eval=16, num_test=16, min_length=8, max_length=24,
                       max_depth=3, max_args=3))
    c.model.update(dict(dim=8, scale=2.0))
    c.loss.update(loss)
    c.optim.update(dict(learning_rate=3e-3, warmup_steps=2, schedule="rsqrt"))
    c.update(dict(batch_size=8, num_train_steps=steps, log_every=2, eval_every=3,
                  checkpoint_every=3, tensorboard=False, progress_bar=False, plot=False))
    c.lock()
    return c


def test_a_model_registered_here_trains_and_logs_its_own_term(tmp_path):
    config = _config(head_norm=0.25)
    assert dict(config.loss) == {"cross_entropy": 1.0, "head_norm": 0.25}
    result = train.train_and_evaluate(config, str(tmp_path))
    assert result["step"] == 6 and math.isfinite(result["test_loss"])
    rows = train.read_jsonl(os.path.join(tmp_path, "metrics.jsonl"))
    logged = [r for r in rows if "train_head_norm" in r]
    assert [r["step"] for r in logged] == [2, 4, 6]
    # The term enters the loss with the configured weight: loss = CE + 0.25 * head_norm.
    task = train.make_task(config.data, 0)
    model = train.build_model(config.model, task, jax.random.PRNGKey(0))
    x = jnp.asarray([task.train[i]["inputs"] for i in range(4)])
    batch = {"inputs": x, "targets": jnp.asarray([task.train[i]["targets"] for i in range(4)])}
    loss, metrics = jit0(lambda m: train.make_loss_fn(task, None, config.loss,
                                                      kind="bag_of_tokens")(m, batch, None))(model)
    ce = optax.softmax_cross_entropy_with_integer_labels(model(x, mask=x != 0),
                                                         batch["targets"]).mean()
    assert_close(metrics["head_norm"], 2.0 * jnp.sum(model.head ** 2))
    assert_close(loss, ce + 0.25 * metrics["head_norm"])
    assert_close(metrics["cross_entropy"], ce)


def test_registry_errors():
    with pytest.raises(ValueError, match="unknown model kind 'bag_of_token' "
                                         "\\(did you mean 'bag_of_tokens'\\?\\)"):
        models.get_model("bag_of_token")
    with pytest.raises(ValueError, match="'bag_of_tokens' is already registered"):
        models.register_model("bag_of_tokens", serves=("classification",), defaults={})(
            bag_of_tokens)
    with pytest.raises(ValueError, match="serves must name task types"):
        models.register_model("nowhere", serves=("translation",), defaults={})(bag_of_tokens)
    # A loss weight must name a term the model returns; a model key must be the kind's.
    with pytest.raises(ValueError, match="\\['head_nrm'\\] name no term of model kind "
                                         "'bag_of_tokens'.*did you mean 'head_norm'"):
        train.validate_config(_config(head_nrm=1.0))
    bad = _config().unlock()
    bad.model.scael = 1.0
    with pytest.raises(ValueError, match="unknown config keys: \\['model.scael'\\] "
                                         "\\(did you mean 'scale'\\?\\)"):
        train.validate_config(bad)
    with pytest.raises(ValueError, match="model kind 'bag_of_tokens' has no keys \\['depth'\\]"):
        train.model_config("bag_of_tokens", depth=2)


def test_every_kind_declares_what_it_serves_and_its_defaults():
    for name in models.registered_models():
        kind = models.get_model(name)
        assert kind.serves and set(kind.serves) <= set(models.TASK_TYPES), name
        assert kind.doc, name
        section = models.model_defaults(name)
        assert section["kind"] == name
        # Every default weight names a term; the task's own term is always weighable.
        assert models.TASK_TERM in kind.weights()
