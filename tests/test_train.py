"""xformers_jax.train: learning, exact resume after SIGTERM, crashes and kills, configs, metrics."""

import json
import os
import pathlib
import signal
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.train_state import final_state
from xformers_jax import data, nn, train


ROOT = pathlib.Path(__file__).resolve().parents[1]


def _tiny_config(steps=8):
    c = train.base_config("listops")
    c.data.update(dict(num_train=48, num_eval=16, num_test=16, min_length=8, max_length=24,
                       max_depth=3, max_args=3))
    c.model.update(dict(dim=16, num_layers=1, num_heads=2, hidden=32, pooling="mean"))
    c.optim.update(dict(learning_rate=3e-3, warmup_steps=2, schedule="rsqrt"))
    c.update(dict(batch_size=8, num_microbatches=2, num_train_steps=steps, log_every=1,
                  eval_every=4, checkpoint_every=2, keep_checkpoints=2))
    c.lock()
    return c


def _rows(workdir):
    # A restarted run logs again the steps after its last checkpoint: keep the last row per
    # (step, kind of row), as a reader of the log would.
    rows = {}
    for row in train.read_jsonl(os.path.join(workdir, "metrics.jsonl")):
        rows[(row["step"], tuple(sorted(k for k in row if k not in ("step",
                                                                    "steps_per_second"))))] = row
    return {k: {m: v for m, v in r.items() if m != "steps_per_second"} for k, r in rows.items()}


class _Crash(Exception):
    pass


def _resume_config():
    config = _tiny_config()
    config.log_every = 2  # the SIGTERM at step 3 stops in the middle of a logging interval
    return config


@pytest.fixture(scope="module")
def straight_run(tmp_path_factory):
    """The resume tests' uninterrupted run: (result, workdir)."""
    workdir = str(tmp_path_factory.mktemp("straight"))
    return train.train_and_evaluate(_resume_config(), workdir), workdir


def _assert_same_run(resumed, resumed_dir, straight_run):
    straight, straight_dir = straight_run
    assert resumed == straight
    assert _rows(resumed_dir) == _rows(straight_dir)
    (state_a, data_a), (state_b, data_b) = (final_state(_resume_config(), d)
                                            for d in (straight_dir, resumed_dir))
    assert data_a == data_b and int(state_b.step) == 8
    for x, y in zip(jax.tree.leaves(state_a), jax.tree.leaves(state_b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_resume_after_sigterm_and_crash_matches_uninterrupted_run(straight_run, tmp_path):
    config = _resume_config()
    resumed_dir = str(tmp_path / "b")

    def sigterm_at_3(step):
        if step == 3:
            os.kill(os.getpid(), signal.SIGTERM)

    first = train.train_and_evaluate(config, resumed_dir, on_step=sigterm_at_3)
    assert first == {"preempted": True, "step": 3}

    def crash_at_5(step):  # after the checkpoint at 4: steps 5.. are lost and redone
        if step == 5:
            raise _Crash

    with pytest.raises(_Crash):
        train.train_and_evaluate(config, resumed_dir, on_step=crash_at_5)
    resumed = train.train_and_evaluate(config, resumed_dir)

    _assert_same_run(resumed, resumed_dir, straight_run)
    # Each start's session says how it ended, where, and what it cost.
    with open(os.path.join(resumed_dir, "run.json")) as fh:
        sessions = json.load(fh)["sessions"]
    assert [s["outcome"] for s in sessions] == ["preempted", "failed: _Crash: ", "finished"]
    assert [s.get("step") for s in sessions] == [3, None, 8]
    assert all(s["wall_s"] > 0 and s["cpu_s"] > 0 and s["ended"] >= s["started"]
               for s in sessions)
    # TensorBoard reads, after the restarts' purges, what the JSONL's last rows say.
    for workdir in (straight_run[1], resumed_dir):
        assert _tensorboard_scalars(workdir) == _jsonl_scalars(workdir)
    assert sorted(os.listdir(os.path.join(resumed_dir, "checkpoints"))) == ["6", "8"]


@pytest.mark.slow
def test_resume_after_sigkill_mid_epoch_matches_uninterrupted_run(straight_run, tmp_path):
    # A hard kill in a child process at step 5, in the middle of the first epoch (6 batches
    # per epoch) and of a logging interval: no handler, no finally, no flush. (TensorBoard
    # events still queued at the kill are lost, so only the JSONL is compared here.)
    workdir = str(tmp_path / "killed")
    code = ("import os, signal\n"
            "from tests.test_train import _resume_config\n"
            "from xformers_jax import train\n"
            "def kill(step):\n"
            "    if step == 5:\n"
            "        os.kill(os.getpid(), signal.SIGKILL)\n"
            f"train.train_and_evaluate(_resume_config(), {workdir!r}, on_step=kill)\n")
    child = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                           text=True, timeout=900)
    assert child.returncode == -signal.SIGKILL, child.stderr[-3000:]
    assert max(r["step"] for r in train.read_jsonl(os.path.join(workdir, "metrics.jsonl"))) == 4
    resumed = train.train_and_evaluate(_resume_config(), workdir)
    _assert_same_run(resumed, workdir, straight_run)


def test_tiny_classifier_learns_in_a_few_steps():
    # The label is the first token's parity: learnable in a few dozen steps.
    rng = np.random.default_rng(0)
    inputs = rng.integers(1, 9, (64, 12)).astype(np.int32)
    source = data.ArraySource({"inputs": inputs, "targets": (inputs[:, 0] % 2).astype(np.int32)})
    task = train.Task(source, source, source, vocab_size=10, num_classes=2, seq_len=12,
                      padded=True)
    c = _tiny_config().model
    model = train.build_model(c, task, jax.random.PRNGKey(0))
    optimizer = train.make_optimizer(
        train.make_schedule("constant", learning_rate=1e-2, warmup_steps=1, total_steps=60),
        weight_decay=0.0, grad_clip_norm=1.0)
    state = train.create_train_state(model, optimizer, jax.random.PRNGKey(1))
    step = train.make_train_step(train.make_loss_fn(task), optimizer)
    it = data.DataIterator(source, batch_size=32, seed=0)
    losses = []
    for _ in range(60):
        state, metrics = step(state, next(it))
        losses.append(float(metrics["loss"]))
    assert int(state.step) == 60
    assert np.mean(losses[-5:]) < 0.5 * np.mean(losses[:5])


def test_microbatches_match_one_big_batch():
    rng = np.random.default_rng(1)
    inputs = rng.integers(1, 9, (8, 10)).astype(np.int32)
    batch = {"inputs": inputs, "targets": (inputs[:, 0] % 2).astype(np.int32)}
    source = data.ArraySource(batch)
    task = train.Task(source, source, source, vocab_size=10, num_classes=2, seq_len=10,
                      padded=True)
    optimizer = train.make_optimizer(
        train.make_schedule("constant", learning_rate=1e-2, warmup_steps=1, total_steps=1),
        weight_decay=0.1, grad_clip_norm=0.0)
    outs = []
    for n in (1, 4):
        # A fresh model each time: the step donates the state's buffers.
        model = train.build_model(_tiny_config().model, task, jax.random.PRNGKey(0))
        state = train.create_train_state(model, optimizer, jax.random.PRNGKey(1))
        new, metrics = train.make_train_step(train.make_loss_fn(task), optimizer,
                                             num_microbatches=n)(state, batch)
        outs.append((new, metrics))
    (a, ma), (b, mb) = outs
    np.testing.assert_allclose(ma["loss"], mb["loss"], rtol=1e-5)
    for x, y in zip(jax.tree.leaves(a.model), jax.tree.leaves(b.model)):
        np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-6)


def test_schedules():
    rsqrt = train.make_schedule("rsqrt", learning_rate=1.0, warmup_steps=4, total_steps=100)
    np.testing.assert_allclose([float(rsqrt(s)) for s in (0, 3, 15)], [0.25, 1.0, 0.5],
                               rtol=1e-6)
    cosine = train.make_schedule("cosine", learning_rate=1.0, warmup_steps=4, total_steps=100)
    assert float(cosine(4)) == pytest.approx(1.0) and float(cosine(100)) == pytest.approx(0.0)
    with pytest.raises(ValueError, match="schedule must be one of"):
        train.make_schedule("linear", learning_rate=1.0, warmup_steps=1, total_steps=2)


def test_config_validation():
    train.validate_config(_tiny_config())
    c = train.base_config("listops")
    c.data.max_lenght = 5  # a typo: not silently ignored
    with pytest.raises(ValueError, match=r"unknown config keys: \['data.max_lenght'\]"):
        train.validate_config(c)
    c = train.base_config("pathfinder")
    del c.optim["b2"]
    with pytest.raises(ValueError, match=r"missing config keys: \['optim.b2'\]"):
        train.validate_config(c)
    c = train.base_config("text")
    c.optim.schedule = "step"
    with pytest.raises(ValueError, match="optim.schedule"):
        train.validate_config(c)
    c = train.base_config("image")
    c.batch_size, c.num_microbatches = 10, 3
    with pytest.raises(ValueError, match="not divisible"):
        train.validate_config(c)
    with pytest.raises(ValueError, match="task must be one of"):
        train.base_config("mnist")
    locked = _tiny_config()
    with pytest.raises(AttributeError):
        locked.new_key = 1


def _tensorboard_scalars(workdir):
    # TensorBoard's own reader (its event accumulator, as the TensorBoard server reads runs):
    # {(step, tag): value} after it has applied the restarts' purges.
    from tensorboard.backend.event_processing import event_accumulator

    acc = event_accumulator.EventAccumulator(workdir, size_guidance={"scalars": 0})
    acc.Reload()
    return {(e.step, tag): e.value for tag in acc.Tags()["scalars"] for e in acc.Scalars(tag)}


def _jsonl_scalars(workdir):
    # The last value per (step, tag), as float32 (TensorBoard stores float32 scalars).
    out = {}
    for row in train.read_jsonl(os.path.join(workdir, "metrics.jsonl")):
        out |= {(row["step"], k): np.float32(v) for k, v in row.items() if k != "step"}
    return out


def test_metric_writer_events_read_back_by_tensorboard(tmp_path):
    writer = train.MetricWriter(str(tmp_path))
    writer.write(3, {"loss": jnp.float32(0.5), "accuracy": np.float64(0.25)})
    writer.write(4, {"loss": 0.1})
    writer.close()
    assert train.read_jsonl(writer.jsonl_path) == [{"step": 3, "loss": 0.5, "accuracy": 0.25},
                                                   {"step": 4, "loss": 0.1}]
    assert os.path.dirname(writer.events_path) == str(tmp_path)
    assert _tensorboard_scalars(str(tmp_path)) == _jsonl_scalars(str(tmp_path)) == {
        (3, "loss"): 0.5, (3, "accuracy"): 0.25, (4, "loss"): np.float32(0.1)}
    # A restart at step 4 (same second, same process: a new file) hides the old step 4.
    again = train.MetricWriter(str(tmp_path), purge_step=4)
    again.write(4, {"loss": 0.2})
    again.close()
    assert again.events_path != writer.events_path
    assert _tensorboard_scalars(str(tmp_path)) == _jsonl_scalars(str(tmp_path)) == {
        (3, "loss"): 0.5, (3, "accuracy"): 0.25, (4, "loss"): np.float32(0.2)}


def test_metric_writer_does_not_import_pytorch():
    # tensorboardX imports torch when installed (seconds, hundreds of MB); the writer hides it.
    code = ("import sys, tempfile\n"
            "from xformers_jax.train import _metrics\n"
            "w = _metrics.MetricWriter(tempfile.mkdtemp())\n"
            "w.write(1, {'loss': 1.0})\n"
            "w.close()\n"
            "assert 'tensorboardX' in sys.modules and 'torch' not in sys.modules\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)


def test_interval_mean_and_its_state():
    interval, resumed = train.IntervalMean(), train.IntervalMean()
    for loss in (1.0, 2.0):
        interval.add({"loss": jnp.float32(loss), "accuracy": np.float32(loss / 4)})
    resumed.set_state(interval.get_state())
    for it in (interval, resumed):
        it.add({"loss": jnp.float32(6.0), "accuracy": np.float32(0.0)})
    assert interval.mean() == resumed.mean() == {"loss": 3.0, "accuracy": 0.25}
    interval.add({"loss": jnp.float32(5.0)})
    assert interval.mean() == {"loss": 5.0}  # a new interval after each mean
    assert interval.mean() == {}


def test_metric_writer_disabled_writes_nothing(tmp_path):
    # Hosts other than process 0 get enabled=False: no file, every call a no-op.
    writer = train.MetricWriter(str(tmp_path / "other_host"), enabled=False)
    writer.write(1, {"loss": 1.0})
    writer.close()
    assert not (tmp_path / "other_host").exists()


def test_lra_listops_config_and_plot(tmp_path):
    from xformers_jax_experiments import plot
    from xformers_jax_experiments.configs.lra import listops

    for arg in (None, "runlocal", "local,runlocal", "flash", "performer,main"):
        config = listops.get_config(arg)
        train.validate_config(config)
        nn.AttentionSpec.from_config(config.model.attention.to_dict())
    # LRA's Local attention: non-overlapping blocks (50 in the full configs, 16 in runlocal).
    from xformers_jax.attention.patterns import BlockLocal

    assert listops.get_config("local,runlocal").model.attention.pattern == BlockLocal(16)
    assert listops.get_config("local").model.attention.pattern == BlockLocal(50)
    assert listops.get_config(None).data.max_length == 2000
    with pytest.raises(ValueError, match="VARIANT"):
        listops.get_config("performr")
    with pytest.raises(AttributeError):
        listops.get_config("runlocal").optim.learning_rat = 1.0
    writer = train.MetricWriter(str(tmp_path), tensorboard=False)
    for step, loss in ((1, 2.0), (2, 1.5), (2, 1.4)):
        writer.write(step, {"train_loss": loss})
    writer.close()
    assert plot.curves(str(tmp_path), "train_loss") == ([1, 2], [2.0, 1.4])
    out = str(tmp_path / "curves.png")
    plot.plot([str(tmp_path)], ["train_loss"], out)
    with open(out, "rb") as fh:
        assert fh.read(8) == b"\x89PNG\r\n\x1a\n"


def test_dynamic_loss_scale_state_machine():
    ls = train.DynamicLossScale(init_scale=8.0, growth_interval=3)
    s = ls.init()
    s = ls.update(s, jnp.asarray(False))
    assert float(s.scale) == 4.0 and int(s.good_steps) == 0
    for expected in (4.0, 4.0, 8.0, 8.0):  # grows on the 3rd finite step in a row
        s = ls.update(s, jnp.asarray(True))
        assert float(s.scale) == expected
    s = ls.update(s, jnp.asarray(False))
    assert float(s.scale) == 4.0 and int(s.good_steps) == 0
    small = train.DynamicLossScale(init_scale=1.0, growth_interval=3)
    assert float(small.update(small.init(), jnp.asarray(False)).scale) == 1.0  # min_scale
    assert not bool(train._loss_scale.all_finite({"a": jnp.ones(2), "b": jnp.asarray([1.0, jnp.inf])}))
    with pytest.raises(ValueError, match="backoff"):
        train.DynamicLossScale(backoff=1.5)


def test_train_step_skips_non_finite_gradients_and_grows_the_scale():
    import equinox as eqx

    model = eqx.nn.Linear(3, 2, key=jax.random.PRNGKey(0))

    def loss_fn(model, batch, key):
        out = jax.vmap(model)(batch["x"].astype(jnp.float16)).astype(jnp.float32)
        loss = jnp.mean(out ** 2) * batch["factor"]
        return loss, {"accuracy": jnp.zeros(())}

    optimizer = train.make_optimizer(
        train.make_schedule("constant", learning_rate=0.1, warmup_steps=1, total_steps=10),
        weight_decay=0.0, grad_clip_norm=0.0)
    ls = train.DynamicLossScale(init_scale=2.0 ** 10, growth_interval=2)
    step = train.make_train_step(loss_fn, optimizer, loss_scale=ls)
    state = train.create_train_state(model, optimizer, jax.random.PRNGKey(1), loss_scale=ls)
    before = [np.asarray(x) for x in jax.tree.leaves((state.model, state.opt_state))]
    x = np.ones((4, 3), np.float32)
    state, m = step(state, {"x": x, "factor": np.float32(np.inf)})
    after = [np.asarray(x) for x in jax.tree.leaves((state.model, state.opt_state))]
    for a, b in zip(before, after):
        np.testing.assert_array_equal(a, b)
    assert float(m["skipped"]) == 1.0 and float(state.loss_scale.scale) == 2.0 ** 9
    assert int(state.step) == 1
    scales = []
    for _ in range(4):
        previous = np.asarray(state.model.weight)
        state, m = step(state, {"x": x, "factor": np.float32(1.0)})
        assert float(m["skipped"]) == 0.0 and np.isfinite(float(m["loss"]))
        assert not np.array_equal(previous, np.asarray(state.model.weight))
        scales.append(float(state.loss_scale.scale))
    assert scales == [2.0 ** 9, 2.0 ** 10, 2.0 ** 10, 2.0 ** 11]


def test_float16_training_run_logs_the_loss_scale(tmp_path):
    config = _tiny_config(steps=4)
    with config.unlocked():
        config.num_microbatches = 1
    config.precision = "float16"
    config.loss_scale.growth_interval = 2
    config.plot = False
    result = train.train_and_evaluate(config, str(tmp_path))
    assert np.isfinite(result["test_loss"])
    rows = [r for r in train.read_jsonl(str(tmp_path / "metrics.jsonl"))
            if "train_loss_scale" in r]
    assert len(rows) == 4 and all(np.isfinite(r["train_loss"]) for r in rows)
    config.precision = "float8"
    with pytest.raises(ValueError, match="precision must be one of"):
        train.validate_config(config)


def test_progress_bar_line():
    import io

    stream = io.StringIO()
    bar = train.ProgressBar(10, stream=stream, min_interval_s=0.0, width=10)
    bar.update(1, loss=2.0)
    bar.update(5, loss=1.5)
    bar.message("eval done")
    bar.update(10, loss=1.0)
    bar.close()
    text = stream.getvalue()
    assert "\r[#####.....] 5/10  50%" in text and "loss 1.5" in text
    assert "eval done" in text and "ETA" in text and "steps/s" in text
    assert text.endswith("10/10 100% " + text.split("10/10 100% ")[-1]) and text[-1] == "\n"
    assert train._progress.format_duration(3723) == "1h02m03s"


def _shrink(config):
    # Tiny splits, so that building the task costs nothing.
    d = config.data
    for key, value in dict(num_train=64, num_eval=16, num_test=16).items():
        if key in d:
            d[key] = value


def _cifar_and_aan_fixtures(root):
    import pickle

    d = root / "cifar-10-batches-py"
    d.mkdir()
    rng = np.random.default_rng(0)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        with open(d / name, "wb") as fh:
            pickle.dump({b"data": rng.integers(0, 256, (20, 3072), dtype=np.uint8),
                         b"labels": list(rng.integers(0, 10, 20))}, fh)
    rows = ["label\tid1\tid2\ttext1\ttext2"] + [
        f"{i % 2}.0\ta{i}\tb{i}\tpaper number {i}\tanother paper {i}" for i in range(40)]
    for split in ("train", "eval", "test"):
        (root / f"new_aan_pairs.{split}.tsv").write_text("\n".join(rows) + "\n")


@pytest.mark.parametrize("name", ["lra/listops", "lra/text", "lra/retrieval", "lra/image",
                                  "lra/pathfinder", "lra/pathx", "lm/stdlib_bytes"])
def test_every_config_runlocal_builds_model_and_batch(name, tmp_path):
    import importlib

    import equinox as eqx

    module = importlib.import_module("xformers_jax_experiments.configs." + name.replace("/", "."))
    train.validate_config(module.get_config(None))
    config = module.get_config("performer,runlocal")
    train.validate_config(config)
    _shrink(config)
    if name in ("lra/image", "lra/retrieval"):
        _cifar_and_aan_fixtures(tmp_path)
        config.data.data_dir = str(tmp_path)
    task = train.make_task(config.data, 0)
    model = train.build_model(config.model, task, jax.random.PRNGKey(0))
    batch = next(data.DataIterator(task.train, batch_size=4, seed=0))
    loss, _ = eqx.filter_eval_shape(train.make_loss_fn(task), model, batch,
                                    jax.random.PRNGKey(1))
    assert loss.shape == () and loss.dtype == jnp.float32
    with pytest.raises(ValueError, match="VARIANT"):
        module.get_config("performr,runlocal")


def test_lra_variants_all_build():
    import equinox as eqx

    from xformers_jax_experiments.configs.lra import _common, listops

    task = train.Task(None, None, None, vocab_size=20, num_classes=10, seq_len=64, padded=True)
    batch = {"inputs": jnp.ones((2, 64), jnp.int32), "targets": jnp.zeros((2,), jnp.int32)}
    for variant in _common.VARIANTS:
        config = listops.get_config(f"{variant},runlocal")
        model = train.build_model(config.model, task, jax.random.PRNGKey(0))
        loss, _ = eqx.filter_eval_shape(train.make_loss_fn(task), model, batch, None)
        assert loss.shape == (), variant
    assert listops.get_config("performer,main").model.attention.kind == "performer"


_DATA_PARALLEL_RUN = """
import json, sys
from tests.test_train import _tiny_config
from xformers_jax import train
import jax
assert jax.device_count() == 2
config = _tiny_config(steps=4)
config.plot = False
print("RESULT " + json.dumps(train.train_and_evaluate(config, sys.argv[1])))
"""


def test_data_parallel_over_two_devices_matches_one_device(tmp_path):
    import json
    import subprocess
    import sys

    config = _tiny_config(steps=4)
    single = train.train_and_evaluate(config, str(tmp_path / "one"))
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2",
               JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", _DATA_PARALLEL_RUN, str(tmp_path / "two")],
                          capture_output=True, text=True, env=env, timeout=600,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-2000:]
    double = json.loads(lines[0][len("RESULT "):])
    assert double["step"] == single["step"] == 4
    for key in ("test_loss", "validation_loss"):
        assert double[key] == pytest.approx(single[key], rel=1e-4)


def test_learning_curves_show_validation_loss_test_points_and_baseline(tmp_path):
    from xformers_jax_experiments import plot

    writer = train.MetricWriter(str(tmp_path), tensorboard=False)
    for step in (1, 2, 3, 4):
        writer.write(step, {"train_loss": 2.0 / step, "train_accuracy": 0.1 * step})
    for step in (2, 4):
        writer.write(step, {"validation_loss": 1.5 / step, "validation_accuracy": 0.2 * step})
    writer.write(4, {"test_loss": 0.5, "test_accuracy": 0.7})
    writer.close()
    out = str(tmp_path / "curves.png")
    drawn = plot.learning_curves(str(tmp_path), out, baseline=0.25, best_step=2)
    assert drawn == ["train_loss", "validation_loss", "test_loss", "train_accuracy",
                     "validation_accuracy", "test_accuracy", "majority class"]
    with open(out, "rb") as fh:
        assert fh.read(8) == b"\x89PNG\r\n\x1a\n"


def test_the_trainer_says_what_it_does_before_the_first_step():
    from xformers_jax_experiments import train as train_cli
    from xformers_jax_experiments.configs.lra import listops

    line = train_cli.starting_line(listops.get_config("performer,main"), "runs/x")
    assert line.startswith("listops: classifier with performer attention, 800 steps, in runs/x")
    assert "compiling" in line
    # a token mixer in its own slot replaces attention, and the line names it
    from xformers_jax_experiments.studies.zoo import config as zoo_config

    line = train_cli.starting_line(zoo_config.get_config("selective_copy,mixer,mamba,256"),
                                   "runs/y")
    assert line.startswith("selective_copy: causal_lm with the mamba token mixer, 10000 steps")
