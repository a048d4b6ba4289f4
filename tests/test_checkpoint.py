"""Checkpoints keyed by tree path (xformers_jax.parallel._checkpoint, train.Checkpointer).

Small Equinox models on the 8 simulated CPU devices of conftest.py: the stored keys are the
tree paths, arrays load by name (a reordered model gets its own arrays, a renamed or added field
fails naming the path before anything is read), restores onto another mesh are exact, a prefix
restores a part, and index-keyed checkpoints of earlier versions are detected and converted.
"""

import json
import os

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from xformers_jax import parallel as par
from xformers_jax import train

OPT = optax.adam(1e-2)


def _opt_init(model):  # the optimizer on the arrays only (`eps` is a Python float)
    return OPT.init(eqx.filter(model, eqx.is_array))


class Layer(eqx.Module):
    wq: jax.Array
    w1: jax.Array
    act: str = eqx.field(static=True)

    def __init__(self, key, act="gelu"):
        kq, k1 = jax.random.split(key)
        self.wq = jax.random.normal(kq, (8, 4))
        self.w1 = jax.random.normal(k1, (8, 16), jnp.bfloat16)
        self.act = act


class Model(eqx.Module):
    layers: list
    scale: jax.Array
    eps: float

    def __init__(self, key, n=2, eps=1e-5):
        keys = jax.random.split(key, n)
        self.layers = [Layer(k) for k in keys]
        self.scale = jnp.arange(8.0)
        self.eps = eps


class RenamedLayer(eqx.Module):  # Layer with `wq` renamed: same shapes, another path
    w_query: jax.Array
    w1: jax.Array

    def __init__(self, key):
        kq, k1 = jax.random.split(key)
        self.w_query = jax.random.normal(kq, (8, 4))
        self.w1 = jax.random.normal(k1, (8, 16), jnp.bfloat16)


class AB(eqx.Module):
    a: jax.Array
    b: jax.Array


class BA(eqx.Module):  # the same fields declared in the other order: leaf 0 is `b`
    b: jax.Array
    a: jax.Array


def _paths(tree):
    return [par.path_string(p) for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]
            if eqx.is_array(x)]


def _assert_equal(a, b):
    la, lb = (jax.tree.leaves(eqx.filter(t, eqx.is_array)) for t in (a, b))
    assert len(la) == len(lb)
    for x, y in zip(la, lb):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_round_trip_is_keyed_by_tree_path(tmp_path):
    model = Model(jax.random.PRNGKey(0))
    state = (model, _opt_init(model))
    par.save_checkpoint(str(tmp_path / "ckpt"), state)

    listed = par.checkpoint_contents(str(tmp_path / "ckpt"))
    assert set(listed) == set(_paths(state))
    assert "0/layers/1/wq" in listed and "1/0/mu/layers/0/w1" in listed
    assert listed["0/layers/1/w1"].shape == (8, 16)
    assert listed["0/layers/1/w1"].dtype == jnp.bfloat16
    assert listed["1/0/count"].shape == ()

    like = (Model(jax.random.PRNGKey(1), eps=0.5), _opt_init(model))
    restored = par.restore_checkpoint(str(tmp_path / "ckpt"), like)
    _assert_equal(restored, state)
    assert restored[0].eps == 0.5  # static parts come from the template
    assert restored[0].layers[0].wq.devices() == {jax.local_devices()[0]}
    # An abstract template (no arrays allocated) restores the same.
    abstract = eqx.filter_eval_shape(lambda: (Model(jax.random.PRNGKey(1)), _opt_init(model)))
    _assert_equal(par.restore_checkpoint(str(tmp_path / "ckpt"), abstract), state)


def test_reordered_fields_load_by_name_not_by_position(tmp_path):
    saved = AB(a=jnp.full((3,), 1.0), b=jnp.full((3,), 2.0))
    par.save_checkpoint(str(tmp_path / "ckpt"), saved)
    template = BA(b=jnp.zeros(3), a=jnp.zeros(3))
    # By leaf index, `b` (leaf 0 of BA) would have received `a` (leaf 0 of AB).
    restored = par.restore_checkpoint(str(tmp_path / "ckpt"), template)
    np.testing.assert_array_equal(restored.a, saved.a)
    np.testing.assert_array_equal(restored.b, saved.b)


def test_a_different_structure_fails_naming_the_path_before_reading(tmp_path, monkeypatch):
    key = jax.random.PRNGKey(0)
    directory = str(tmp_path / "ckpt")
    par.save_checkpoint(directory, Model(key))

    def never(*args, **kwargs):
        raise AssertionError("an array was read")

    monkeypatch.setattr(ocp.Checkpointer, "restore", never)
    renamed = Model(key)
    renamed = eqx.tree_at(lambda m: m.layers, renamed, [RenamedLayer(key), renamed.layers[1]])
    with pytest.raises(ValueError, match=r"'layers/0/w_query'.*'layers/0/wq'"):
        par.restore_checkpoint(directory, renamed)
    with pytest.raises(ValueError, match=r"template has an array at 'layers/2/wq'"):
        par.restore_checkpoint(directory, Model(key, n=3))  # an extra layer
    with pytest.raises(ValueError, match=r"checkpoint has an array at 'layers/1/w1'"):
        par.restore_checkpoint(directory, Model(key, n=1))  # a missing layer
    wider = eqx.tree_at(lambda m: m.layers[1].wq, Model(key), jnp.zeros((8, 6)))
    with pytest.raises(ValueError, match=r"'layers/1/wq' is stored with shape \(8, 4\) but the "
                                         r"template's has shape \(8, 6\)"):
        par.restore_checkpoint(directory, wider)
    f32 = eqx.tree_at(lambda m: m.layers[0].w1, Model(key), jnp.zeros((8, 16)))
    with pytest.raises(ValueError, match=r"'layers/0/w1' is stored as bfloat16\[8, 16\] but the "
                                         r"template's is float32\[8, 16\]"):
        par.restore_checkpoint(directory, f32)


def test_restore_onto_other_meshes_is_exact(tmp_path):
    model = Model(jax.random.PRNGKey(0))
    mesh_a = jax.make_mesh((4, 2), ("data", "tensor"))
    mesh_b = jax.make_mesh((2, 4), ("data", "tensor"))

    def shardings(mesh):  # a NamedSharding per array: wq [8, 4] split both ways, the rest
        split, rep = NamedSharding(mesh, P("tensor", "data")), NamedSharding(mesh, P())
        return jax.tree.map(lambda x: split if x.shape == (8, 4) else rep,
                            eqx.filter(model, eqx.is_array))

    sharded = eqx.combine(jax.device_put(eqx.filter(model, eqx.is_array), shardings(mesh_a)),
                          eqx.filter(model, eqx.is_array, inverse=True))
    assert len(sharded.layers[0].wq.addressable_shards) == 8
    par.save_checkpoint(str(tmp_path / "ckpt"), sharded)

    on_b = par.restore_checkpoint(str(tmp_path / "ckpt"), model, shardings(mesh_b))
    assert on_b.layers[0].wq.sharding.is_equivalent_to(
        NamedSharding(mesh_b, P("tensor", "data")), 2)
    everywhere = par.restore_checkpoint(str(tmp_path / "ckpt"), model,
                                        NamedSharding(mesh_b, P()))  # one sharding for all
    one = par.restore_checkpoint(str(tmp_path / "ckpt"), model)
    assert len(one.layers[0].wq.devices()) == 1
    for restored in (on_b, everywhere, one):
        _assert_equal(restored, model)
    with pytest.raises(ValueError, match="no sharding for the template's array at 'scale'"):
        par.restore_checkpoint(str(tmp_path / "ckpt"), model,
                               {"layers": NamedSharding(mesh_b, P())})


def test_partial_restore_by_prefix(tmp_path):
    model = Model(jax.random.PRNGKey(0))
    directory = str(tmp_path / "ckpt")
    par.save_checkpoint(directory, (model, _opt_init(model)))
    template = Model(jax.random.PRNGKey(1))
    _assert_equal(par.restore_checkpoint(directory, template, prefix="0"), model)
    layer = par.restore_checkpoint(directory, Layer(jax.random.PRNGKey(1), act="relu"),
                                   prefix="0/layers/1")
    _assert_equal(layer, model.layers[1])
    assert layer.act == "relu"
    mu = par.restore_checkpoint(directory, _opt_init(template)[0].mu, prefix="1/0/mu")
    _assert_equal(mu, _opt_init(model)[0].mu)  # Adam's first moment
    with pytest.raises(ValueError, match=r"no array under '0/decoder'; there it has \['layers'"):
        par.restore_checkpoint(directory, template, prefix="0/decoder")
    with pytest.raises(ValueError, match=r"under '0/layers/1'.*'wq' is stored with shape"):
        par.restore_checkpoint(directory, eqx.tree_at(lambda l: l.wq, layer, jnp.zeros((4, 8))),
                               prefix="0/layers/1")


def test_keys_orbax_would_merge_are_refused(tmp_path):
    with pytest.raises(ValueError, match=r"'w.b'.*contain neither '\.'"):
        par.save_checkpoint(str(tmp_path / "a"), {"w.b": jnp.ones(2), "w": {"b": jnp.zeros(2)}})
    with pytest.raises(ValueError, match="bare array"):
        par.save_checkpoint(str(tmp_path / "b"), jnp.ones(2))


def _index_checkpoint(directory, state, width):
    """A checkpoint in the earlier format: array leaves by index ('00000' or '0')."""
    leaves = jax.tree.leaves(eqx.filter(state, eqx.is_array))
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(directory, {f"{i:0{width}d}": x for i, x in enumerate(leaves)})
        ckpt.wait_until_finished()


def test_index_checkpoint_is_detected_and_converted(tmp_path):
    model = Model(jax.random.PRNGKey(0))
    state = (model, _opt_init(model))
    old, new = str(tmp_path / "old"), str(tmp_path / "new")
    _index_checkpoint(old, state, width=5)
    like = (Model(jax.random.PRNGKey(1)), _opt_init(model))
    with pytest.raises(ValueError, match=r"keyed by leaf index.*convert_index_checkpoint"):
        par.restore_checkpoint(old, like)
    # A template in another order is caught where shapes differ.
    reordered = ({"a_scale": model.scale, "layers": model.layers}, like[1])  # scale first
    with pytest.raises(ValueError, match=r"stored array 0 is float32\[8, 4\] but the template's array "
                                         r"0, at '0/a_scale', is float32\[8\]"):
        par.convert_index_checkpoint(old, str(tmp_path / "bad"), reordered)
    assert par.convert_index_checkpoint(old, new, like) == [new]
    assert set(par.checkpoint_contents(new)) == set(_paths(state))
    _assert_equal(par.restore_checkpoint(new, like), state)


def _train_state(key, n=2):
    model = Model(key, n=n)
    return train.create_train_state(model, OPT, jax.random.PRNGKey(7))


def test_train_checkpointer_uses_the_path_format(tmp_path):
    state = _train_state(jax.random.PRNGKey(0))
    workdir = str(tmp_path / "run")
    ckpt = train.Checkpointer(workdir)
    try:
        ckpt.save(3, state, {"epoch": 1, "position": 5, "seed": 0}, force=True)
        ckpt.wait()
        template = _train_state(jax.random.PRNGKey(1))
        restored, data_state = ckpt.restore_latest(template)
        _assert_equal(restored, state)
        assert data_state == {"epoch": 1, "position": 5, "seed": 0}
        with pytest.raises(ValueError, match=r"checkpoints/3/state: .*'model/layers/2/wq'"):
            ckpt.restore_latest(_train_state(jax.random.PRNGKey(1), n=3))
    finally:
        ckpt.close()
    item = os.path.join(workdir, "checkpoints", "3", "state")
    listed = par.checkpoint_contents(item)
    assert {"step", "key", "model/layers/0/wq", "opt_state/0/mu/layers/1/w1"} <= set(listed)
    assert set(listed) == set(_paths(state))
    # The model alone, e.g. for evaluation, without reading the optimizer state.
    _assert_equal(par.restore_checkpoint(item, template.model, prefix="model"), state.model)


def test_best_checkpoint_takes_a_redone_step(tmp_path):
    # A run stopped after evaluating step 4 but before saving checkpoints/ again resumes from
    # an earlier step and evaluates step 4 a second time; orbax refuses a step it already has.
    state = _train_state(jax.random.PRNGKey(0))
    data = {"epoch": 0, "position": 4, "seed": 0}
    workdir = str(tmp_path / "run")
    ckpt = train.Checkpointer(workdir)
    ckpt.save_best(4, state, data, {"accuracy": 0.5})
    ckpt.wait()
    ckpt.close()
    ckpt = train.Checkpointer(workdir)
    try:
        ckpt.save_best(4, state, data, {"accuracy": 0.5})
        ckpt.save_best(6, state, data, {"accuracy": 0.25})
        ckpt.wait()
        assert ckpt.best.best_step() == 4
        restored, _ = ckpt.restore_best(_train_state(jax.random.PRNGKey(1)))
        _assert_equal(restored, state)
    finally:
        ckpt.close()


def test_train_index_checkpoints_fail_clearly_and_convert(tmp_path):
    state = _train_state(jax.random.PRNGKey(0))
    old, new = str(tmp_path / "old"), str(tmp_path / "new")
    # An earlier trainer's run: state by leaf index ('0', '1', ...) beside the iterator JSON.
    leaves = jax.tree.leaves(eqx.filter(state, eqx.is_array))
    with ocp.CheckpointManager(os.path.join(old, "checkpoints"),
                               options=ocp.CheckpointManagerOptions(create=True)) as manager:
        manager.save(2, args=ocp.args.Composite(
            state=ocp.args.StandardSave({str(i): np.asarray(x) for i, x in enumerate(leaves)}),
            data=ocp.args.JsonSave({"epoch": 0, "position": 16, "seed": 0})))
        manager.wait_until_finished()
    template = _train_state(jax.random.PRNGKey(1))
    ckpt = train.Checkpointer(old)
    try:
        with pytest.raises(ValueError, match=r"keyed by leaf index.*convert_index_checkpoint"):
            ckpt.restore_latest(template)
    finally:
        ckpt.close()

    converted = par.convert_index_checkpoint(old, new, template)
    assert converted == [os.path.join(new, "checkpoints", "2", "state")]
    with open(os.path.join(new, "checkpoints", "2", "data", "metadata")) as f:
        assert json.load(f)["position"] == 16
    ckpt = train.Checkpointer(new)
    try:
        assert ckpt.latest_step() == 2
        restored, data_state = ckpt.restore_latest(template)
    finally:
        ckpt.close()
    _assert_equal(restored, state)
    assert data_state == {"epoch": 0, "position": 16, "seed": 0}
