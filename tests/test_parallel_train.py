"""The trainer on a device mesh (8 simulated CPU devices, tests/conftest.py): a run sharded
over data x fsdp x tensor follows the one-device loss curve, parameters and optimizer state
carry the intended shardings, the models' activation annotations reach XLA only under a mesh,
and a checkpoint written on one mesh resumes on another."""

import os

import equinox as eqx
import jax
import ml_collections
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from tests.test_train import _tiny_config
from tests.tolerances import EXACT_GRAD, assert_close
from xformers_jax import data, parallel, train

MESH = {"data": 2, "fsdp": 2, "tensor": 2}
SEQUENCE_MESH = {"strategy": "fsdp+sequence", "sequence": 4}  # fsdp=2 x sequence=4: ring attention
OTHER_MESH = {"fsdp": 4, "tensor": 2}


def _config(mesh, steps=4):
    c = _tiny_config(steps)
    with c.unlocked():
        c.mesh = ml_collections.ConfigDict(mesh)
    c.tensorboard = False
    return c


def _losses(workdir):
    # The last row per step: a resumed run logs again the steps after its last checkpoint.
    rows = {r["step"]: r["train_loss"] for r in train.read_jsonl(
        os.path.join(workdir, "metrics.jsonl")) if "train_loss" in r}
    return [rows[s] for s in sorted(rows)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    out = {}
    for name, mesh in (("one", {"data": 1}), ("sharded", MESH), ("sequence", SEQUENCE_MESH)):
        out[name] = (train.train_and_evaluate(_config(mesh), str(root / name)),
                     str(root / name))
    return out


def test_sharded_run_follows_the_one_device_loss_curve(runs):
    (one, one_dir), (sharded, sharded_dir) = runs["one"], runs["sharded"]
    assert one["step"] == sharded["step"] == 4
    # Same math, different reduction order: within the gradient tolerance after 4 updates.
    assert_close(np.array(_losses(sharded_dir)), np.array(_losses(one_dir)), EXACT_GRAD)
    assert_close(sharded["test_loss"], one["test_loss"], EXACT_GRAD)


def test_fsdp_sequence_run_follows_the_one_device_loss_curve(runs):
    (one, one_dir), (seq, seq_dir) = runs["one"], runs["sequence"]
    assert seq["step"] == 4
    assert_close(np.array(_losses(seq_dir)), np.array(_losses(one_dir)), EXACT_GRAD)
    assert_close(seq["test_loss"], one["test_loss"], EXACT_GRAD)


def test_pipelined_run_follows_the_one_device_loss_curve_and_reports_its_bubble(tmp_path):
    """A 'stage' mesh axis pipelines the layer stack (GPipe); the run reports its bubble."""
    def two_layers(mesh):
        c = _config(mesh)
        with c.unlocked():
            c.model.num_layers = 2
        return c

    one = train.train_and_evaluate(two_layers({"data": 1}), str(tmp_path / "one"))
    staged = train.train_and_evaluate(two_layers({"stage": 2, "data": 4}),
                                      str(tmp_path / "staged"))
    assert "pipeline_bubble" not in one
    # 8 rows in 2 gradient micro-batches of 4, each pipelined as 2 x 2 stages = 4 micro-batches.
    assert (staged["pipeline_stages"], staged["pipeline_microbatches"]) == (2, 4)
    assert staged["pipeline_bubble"] == pytest.approx(1 / 5)
    assert_close(np.array(_losses(str(tmp_path / "staged"))),
                 np.array(_losses(str(tmp_path / "one"))), EXACT_GRAD)
    assert_close(staged["test_loss"], one["test_loss"], EXACT_GRAD)


def _state_and_plan(config):
    task = train.make_task(config.data, config.seed)
    model = train.build_model(config.model, task, jax.random.PRNGKey(0))
    optimizer = train.make_optimizer(
        train.make_schedule("constant", learning_rate=1e-3, warmup_steps=1, total_steps=1),
        weight_decay=0.1, grad_clip_norm=1.0)
    state = train.create_train_state(model, optimizer, jax.random.PRNGKey(1))
    return task, optimizer, state, train.make_sharding_plan(config, state, optimizer)


def test_parameters_and_optimizer_state_carry_the_intended_shardings():
    config = _config(MESH)
    task, optimizer, state, plan = _state_and_plan(config)
    assert dict(plan.mesh.shape) == {"stage": 1, "data": 2, "fsdp": 2, "expert": 1,
                                     "sequence": 1, "tensor": 2}
    step = train.make_train_step(train.make_loss_fn(task), optimizer, sharding=plan)
    batch = plan.place_batch(next(data.DataIterator(task.train, batch_size=8, seed=0)))
    assert batch["inputs"].sharding.is_equivalent_to(
        NamedSharding(plan.mesh, P(("data", "fsdp"))), 2)
    new, metrics = step(plan.place_state(state), batch)
    assert np.isfinite(float(metrics["loss"]))
    block = new.model.encoder.layers.layers
    # Stacked [layer, ...]: Megatron splits heads / MLP hidden over tensor, FSDP embed.
    expected = {"attn.wq": P(None, "fsdp", "tensor"), "attn.wo": P(None, "tensor", "fsdp"),
                "ffn.w1": P(None, "fsdp", "tensor"), "ffn.w2": P(None, "tensor", "fsdp"),
                "ffn.b1": P(None, "tensor")}
    adam = new.opt_state[1][0]  # chain(clip, adamw): adamw's scale_by_adam state
    for path, spec in expected.items():
        get = lambda tree: eval("tree." + path, {"tree": tree})  # noqa: E731
        want = NamedSharding(plan.mesh, spec)
        assert get(block).sharding.is_equivalent_to(want, get(block).ndim), path
        assert get(adam.mu.encoder.layers.layers).sharding.is_equivalent_to(
            want, get(block).ndim), path
    assert new.model.encoder.embed.table.sharding.is_equivalent_to(
        NamedSharding(plan.mesh, P("tensor", "fsdp")), 2)
    assert new.step.sharding.is_fully_replicated


def test_models_annotate_activations_only_under_a_mesh():
    config = _config(MESH)
    task, _, state, plan = _state_and_plan(config)
    tokens = np.ones((8, task.seq_len), np.int32)
    def lower():
        return eqx.filter_jit(lambda m, x: m(x)).lower(state.model, tokens).as_text()

    assert "sharding_constraint" not in lower()
    with plan.context():
        assert lower().count("sharding_constraint") >= 6  # embeddings, q/k/v, heads, MLP, residuals


class _Crash(Exception):
    pass


def test_checkpoint_from_one_mesh_resumes_on_another(runs, tmp_path):
    _, sharded_dir = runs["sharded"]
    workdir = str(tmp_path / "moved")

    def crash_at_3(step):  # after the checkpoint at step 2
        if step == 3:
            raise _Crash

    with pytest.raises(_Crash):
        train.train_and_evaluate(_config(MESH), workdir, on_step=crash_at_3)
    # The step-2 checkpoint read straight onto the other mesh's shardings.
    config = _config(OTHER_MESH)
    _, _, template, plan = _state_and_plan(config)
    checkpointer = train.Checkpointer(workdir)
    try:
        state, _ = checkpointer.restore_latest(template, plan.state)
    finally:
        checkpointer.close()
    wq = state.model.encoder.layers.layers.attn.wq
    assert int(state.step) == 2
    assert wq.sharding.is_equivalent_to(NamedSharding(plan.mesh, P(None, "fsdp", "tensor")), 3)
    resumed = train.train_and_evaluate(config, workdir)
    assert resumed["step"] == 4
    assert_close(np.array(_losses(workdir)), np.array(_losses(sharded_dir)), EXACT_GRAD)


def test_mesh_config_errors_and_strategies(tmp_path):
    assert train.resolve_mesh({"strategy": "data+tensor", "tensor": 2})["data"] == 4
    assert train.resolve_mesh({"data": 1}) == dict.fromkeys(parallel.axes.MESH_AXES, 1)
    with pytest.raises(ValueError, match="unknown axes"):
        train.resolve_mesh({"model": 2})
    config = _config({"data": 8})
    with pytest.raises(ValueError, match="not divisible by the 8 batch shards"):
        with config.unlocked():
            config.batch_size, config.num_microbatches = 4, 1
        train.train_and_evaluate(config, str(tmp_path))
