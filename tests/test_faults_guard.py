"""The non-finite guard: ranges checked at config time, a non-finite step stops the run naming
the step (or is skipped and counted, with a bound), no non-finite state is ever saved, out of
range data is refused at the loss boundary, and the trainer script exits non-zero."""

import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.train_state import final_state
from xformers_jax import data, train
from xformers_jax.train import _loop

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _config(steps=6, **updates):
    c = train.base_config("listops")
    c.data.update(dict(num_train=32, num_eval=8, num_test=8, min_length=8, max_length=16,
                       max_depth=2, max_args=3))
    c.model.update(dict(dim=8, num_layers=1, num_heads=1, hidden=16, pooling="mean"))
    c.optim.update(dict(learning_rate=3e-3, warmup_steps=2))
    c.update(dict(batch_size=8, num_train_steps=steps, log_every=1, eval_every=steps,
                  checkpoint_every=2, keep_checkpoints=5, tensorboard=False,
                  progress_bar=False, plot=False))
    c.update(updates)
    return c


def _nan_lr_from(monkeypatch, first):
    """The schedule is NaN from the update of step ``first`` (1-based) on (a skipped step
    does not advance the optimizer's count, so it stays NaN): non-finite updates."""
    make = _loop.make_schedule

    def poisoned(*args, **kwargs):
        schedule = make(*args, **kwargs)
        return lambda count: jnp.where(count + 1 >= first, jnp.nan, schedule(count))

    monkeypatch.setattr(_loop, "make_schedule", poisoned)


def _nan_loss_at(monkeypatch, steps):
    """The training loss is NaN at the given (1-based) steps: each step's batch carries a
    ``poison`` factor (1 or NaN) the loss is multiplied by."""
    make_loss, make_step = _loop.make_loss_fn, _loop.make_train_step

    def loss_maker(*args, **kwargs):
        loss_fn = make_loss(*args, **kwargs)

        def poisoned(model, batch, key):
            batch = dict(batch)
            factor = batch.pop("poison")[0]
            loss, metrics = loss_fn(model, batch, key)
            return loss * factor, metrics
        return poisoned

    def step_maker(*args, **kwargs):
        run, calls = make_step(*args, **kwargs), [0]

        def wrapped(state, batch):
            calls[0] += 1
            factor = np.nan if calls[0] in steps else 1.0
            rows = batch["targets"].shape[0]
            return run(state, dict(batch, poison=np.full((rows,), factor, np.float32)))
        return wrapped

    monkeypatch.setattr(_loop, "make_loss_fn", loss_maker)
    monkeypatch.setattr(_loop, "make_train_step", step_maker)


@pytest.mark.parametrize("key, value, match", [
    ("optim.learning_rate", float("nan"), "optim.learning_rate=nan"),
    ("optim.learning_rate", float("inf"), "optim.learning_rate=inf"),
    ("optim.learning_rate", 1e3, r"optim.learning_rate=1000.0 is outside its range \(0, 1\]"),
    ("optim.learning_rate", 0.0, "optim.learning_rate=0.0"),
    ("optim.warmup_steps", -1, "optim.warmup_steps=-1.0 is outside"),
    ("optim.weight_decay", -0.1, "optim.weight_decay=-0.1"),
    ("optim.b2", 1.0, r"optim.b2=1.0 is outside its range \[0, 1\)"),
    ("on_nonfinite", "ignore", "on_nonfinite must be one of"),
    ("max_consecutive_skips", 0, "max_consecutive_skips=0.0"),
])
def test_config_ranges_are_checked(key, value, match):
    c = _config()
    section, _, name = key.rpartition(".")
    (c[section] if section else c)[name] = value
    with pytest.raises(ValueError, match=match):
        train.validate_config(c)


def test_non_finite_step_stops_the_run_naming_it_and_is_never_saved(tmp_path, monkeypatch):
    _nan_loss_at(monkeypatch, {3})
    workdir = str(tmp_path)
    with pytest.raises(train.NonFiniteError, match="step 3: non-finite loss, non-finite grad"):
        train.train_and_evaluate(_config(), workdir)
    # Nothing after step 2 was logged or saved, and the checkpoint at 2 is finite.
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["2"]
    assert max(r["step"] for r in train.read_jsonl(str(tmp_path / "metrics.jsonl"))) == 2
    state, _ = final_state(_config(), workdir)
    assert int(state.step) == 2
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(state)
               if jnp.issubdtype(x.dtype, jnp.inexact))


def test_skip_mode_skips_and_counts_and_bounds_consecutive_skips(tmp_path, monkeypatch):
    _nan_loss_at(monkeypatch, {3})
    result = train.train_and_evaluate(_config(on_nonfinite="skip"), str(tmp_path / "one"))
    assert np.isfinite(result["test_loss"])
    rows = [r for r in train.read_jsonl(str(tmp_path / "one" / "metrics.jsonl"))
            if "train_skipped" in r]
    assert [r["train_skipped"] for r in rows] == [0, 0, 1, 0, 0, 0]

    monkeypatch.undo()
    _nan_lr_from(monkeypatch, 3)  # a NaN learning rate: a non-finite update at every step
    with pytest.raises(train.NonFiniteError, match="step 5: 3 steps in a row skipped"):
        train.train_and_evaluate(_config(on_nonfinite="skip", max_consecutive_skips=2),
                                 str(tmp_path / "all"))


def test_float16_run_skipping_every_step_does_not_finish(tmp_path, monkeypatch):
    make = _loop.make_loss_fn

    def diverged(*args, **kwargs):  # every loss (so every gradient) is NaN
        loss_fn = make(*args, **kwargs)
        return lambda m, b, k: (lambda lm: (lm[0] * jnp.nan, lm[1]))(loss_fn(m, b, k))

    monkeypatch.setattr(_loop, "make_loss_fn", diverged)
    c = _config(precision="float16", max_consecutive_skips=3)
    with pytest.raises(train.NonFiniteError, match="step 4: 4 steps in a row skipped"):
        train.train_and_evaluate(c, str(tmp_path))


def test_out_of_range_data_is_refused_at_the_loss_boundary():
    task = train.Task(None, None, None, vocab_size=20, num_classes=10, seq_len=8, padded=True)
    c = _config()
    model = train.build_model(c.model, task, jax.random.PRNGKey(0))
    loss_fn = train.make_loss_fn(task)
    optimizer = train.make_optimizer(lambda s: 1e-3, weight_decay=0.0, grad_clip_norm=1.0)
    step = train.make_train_step(loss_fn, optimizer)
    state = train.create_train_state(model, optimizer, jax.random.PRNGKey(1))
    tokens = np.ones((4, 8), np.int32)
    good = {"inputs": tokens, "targets": np.arange(4, dtype=np.int32)}
    guard = train.Guard()
    for n, bad in enumerate([{"inputs": np.where(np.eye(4, 8) > 0, 20, tokens)},
                             {"targets": np.array([0, 1, 99, 2], np.int32)},
                             {"targets": np.array([0, -1, 1, 2], np.int32)}]):
        before = [np.asarray(x) for x in jax.tree.leaves(state.model)]
        state, metrics = step(state, dict(good, **bad))
        assert int(metrics["faults"]) & 8, bad  # the data bit: nothing was updated
        for x, y in zip(before, jax.tree.leaves(state.model)):
            np.testing.assert_array_equal(x, np.asarray(y))
        guard.add(n + 1, metrics["faults"], metrics)
        with pytest.raises(train.InvalidDataError, match=f"step {n + 1}: the batch holds"):
            guard.check()
    state, metrics = step(state, good)
    assert int(metrics["faults"]) == 0
    # Evaluation refuses them too (the eval step's sums carry the count).
    eval_step = train.make_eval_step(train.make_metrics_fn(task))
    source = data.ArraySource({"inputs": tokens, "targets": np.array([0, 1, 10, 2], np.int32)})
    with pytest.raises(train.InvalidDataError, match="evaluation batch 0"):
        train.evaluate(eval_step, state.model, source, 4)


def test_trainer_script_exits_non_zero_naming_the_cause(tmp_path):
    code = (
        "import sys\n"
        "from absl import app\n"
        "from xformers_jax import train\n"
        "def diverged(config, workdir, **kwargs):\n"
        "    raise train.NonFiniteError('step 15: non-finite loss (loss nan)')\n"
        "train.train_and_evaluate = diverged\n"
        "from xformers_jax_experiments import train as script\n"
        "sys.argv = ['train', '--config=xformers_jax_experiments/configs/lra/listops.py:"
        f"performer,runlocal', '--workdir={tmp_path}']\n"
        "app.run(script.main)\n")
    child = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                           text=True, timeout=300)
    assert child.returncode == 1, child.stderr[-2000:]
    assert "training stopped: NonFiniteError: step 15: non-finite loss" in child.stderr
