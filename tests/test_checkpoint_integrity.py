"""Damaged checkpoints (train.Checkpointer): found, reported, moved aside, never restored.

Each kind of damage a disk or a kill leaves in the newest step (64 bytes overwritten inside an
array file, an array file cut short, orbax's ``_METADATA`` or ``manifest.ocdbt`` gone, an empty
step directory, a step without its checksums) makes the restore fall back to the step before,
with a message; a damaged only step refuses. A trainer run resumed over a damaged step ends
bit for bit where the uninterrupted run ends.
"""

import glob
import os
import shutil

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from tests.test_train import _resume_config, _rows
from tests.train_state import final_state
from xformers_jax import train
from xformers_jax.train._integrity import fingerprints


def _state(seed):
    model = eqx.nn.MLP(16, 16, 32, 1, key=jax.random.PRNGKey(seed))
    return train.create_train_state(model, optax.adam(1e-2), jax.random.PRNGKey(7))


def _array_files(step_dir):
    return sorted(glob.glob(os.path.join(step_dir, "state", "**", "d", "*"), recursive=True),
                  key=os.path.getsize)


def _overwrite_64_bytes(step_dir):
    # In every data file of the arrays: a file may hold bytes no read touches.
    for path in _array_files(step_dir):
        with open(path, "r+b") as fh:
            fh.seek(os.path.getsize(path) // 2)
            fh.write(bytes(range(64)))


def _truncate(step_dir):
    path = _array_files(step_dir)[-1]
    with open(path, "r+b") as fh:
        fh.truncate(os.path.getsize(path) // 2)


def _delete(*parts):
    def damage(step_dir):
        os.remove(os.path.join(step_dir, *parts))
    return damage


def _empty(step_dir):
    shutil.rmtree(step_dir)
    os.makedirs(step_dir)


def _no_checksums(step_dir):
    shutil.rmtree(os.path.join(step_dir, "checksums"))


def _state_of_the_step_before(step_dir):
    # Valid orbax files with the wrong contents (a stale copy): orbax reads them silently.
    before = os.path.join(os.path.dirname(step_dir), "2", "state")
    shutil.rmtree(os.path.join(step_dir, "state"))
    shutil.copytree(before, os.path.join(step_dir, "state"))


DAMAGE = {
    "64_bytes_overwritten": _overwrite_64_bytes,
    "array_file_truncated": _truncate,
    "_METADATA_deleted": _delete("state", "_METADATA"),
    "manifest.ocdbt_deleted": _delete("state", "manifest.ocdbt"),
    "empty_step_directory": _empty,
    "no_checksums": _no_checksums,
    "state_of_the_step_before": _state_of_the_step_before,
}


def _leaves(state):
    return [np.asarray(x) for x in jax.tree.leaves(eqx.filter(state, eqx.is_array))]


def _assert_equal(a, b):
    for x, y in zip(_leaves(a), _leaves(b), strict=True):
        np.testing.assert_array_equal(x, y)


class _Warnings:
    def __init__(self):
        self.lines = []

    def warning(self, msg, *args):
        self.lines.append(msg % args)

    @property
    def text(self):
        return "\n".join(self.lines)


@pytest.fixture
def absl_warnings(monkeypatch):
    # The checkpointer's warnings, as absl formats them (the trainer's other libraries
    # reconfigure Python's logging, so caplog does not see them reliably).
    from xformers_jax.train import _checkpoint

    seen = _Warnings()
    monkeypatch.setattr(_checkpoint.logging, "warning", seen.warning)
    return seen


@pytest.mark.parametrize("kind", sorted(DAMAGE))
def test_damaged_latest_step_falls_back_to_the_one_before(kind, tmp_path, absl_warnings):
    workdir = str(tmp_path / "run")
    ckpt = train.Checkpointer(workdir, keep=3)
    ckpt.save(2, _state(2), {"position": 2}, force=True)
    ckpt.save(4, _state(4), {"position": 4}, force=True)
    ckpt.close()
    DAMAGE[kind](os.path.join(workdir, "checkpoints", "4"))

    ckpt = train.Checkpointer(workdir, keep=3)
    try:
        state, data_state = ckpt.restore_latest(_state(0))
        _assert_equal(state, _state(2))
        assert data_state == {"position": 2}
        assert "checkpoint step 4 is damaged" in absl_warnings.text
        assert "resuming from step 2" in absl_warnings.text
        if kind == "state_of_the_step_before":  # only the checksums see it
            assert "array(s) differ from their checksums" in absl_warnings.text
        # Moved aside: the step can be saved again, and the damage stays to inspect.
        assert ckpt.latest.all_steps() == [2]
        (aside,) = os.listdir(os.path.join(workdir, "checkpoints.corrupt"))
        assert aside.startswith("4.")
        ckpt.save(4, _state(5), {"position": 4}, force=True)
        ckpt.wait()
        _assert_equal(ckpt.restore_latest(_state(0))[0], _state(5))
    finally:
        ckpt.close()


@pytest.mark.parametrize("kind", ["64_bytes_overwritten", "_METADATA_deleted"])
def test_a_damaged_only_step_refuses_and_moves_nothing(kind, tmp_path):
    workdir = str(tmp_path / "run")
    ckpt = train.Checkpointer(workdir)
    ckpt.save(2, _state(2), {"position": 2}, force=True)
    ckpt.close()
    DAMAGE[kind](os.path.join(workdir, "checkpoints", "2"))
    ckpt = train.Checkpointer(workdir)
    try:
        with pytest.raises(train.CheckpointCorrupt, match=r"no intact checkpoint in .*checkpoints: "
                                                          r"step 2: .*start afresh"):
            ckpt.restore_latest(_state(0))
        assert ckpt.latest.all_steps() == [2]
    finally:
        ckpt.close()


def test_a_template_mismatch_is_not_damage(tmp_path):
    # A model that changed is the caller's error: it raises, nothing falls back or moves.
    workdir = str(tmp_path / "run")
    ckpt = train.Checkpointer(workdir)
    try:
        ckpt.save(2, _state(2), {}, force=True)
        ckpt.save(4, _state(4), {}, force=True)
        ckpt.wait()
        wider = train.create_train_state(eqx.nn.MLP(16, 16, 48, 1, key=jax.random.PRNGKey(0)),
                                         optax.adam(1e-2), jax.random.PRNGKey(7))
        with pytest.raises(ValueError, match=r"checkpoints/4/state: .*shape"):
            ckpt.restore_latest(wider)
        assert ckpt.latest.all_steps() == [2, 4]
    finally:
        ckpt.close()


def test_retention_deletes_only_after_the_checkpointer_saw_the_save_finish(tmp_path):
    # Orbax's own max_to_keep deletes the oldest step when the new save finalises, whether or
    # not that save succeeded; the checkpointer trims only after waiting on it without error.
    workdir = str(tmp_path / "run")
    ckpt = train.Checkpointer(workdir, keep=1)
    try:
        ckpt.save(2, _state(2), {}, force=True)
        ckpt.wait()
        ckpt.save(4, _state(4), {}, force=True)
        ckpt.latest.wait_until_finished()  # written, not yet seen by the checkpointer
        assert ckpt.latest.all_steps() == [2, 4]
        ckpt.wait()
        assert ckpt.latest.all_steps() == [4]
    finally:
        ckpt.close()


def test_fingerprints_see_one_changed_bit_and_ignore_the_mesh():
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    tree = {"w": jnp.arange(64.0).reshape(8, 8), "h": jnp.ones((8,), jnp.bfloat16),
            "mask": jnp.arange(8) > 3, "key": jax.random.PRNGKey(3)}
    base = fingerprints(tree)
    flipped = np.asarray(tree["w"]).copy()
    flipped.view(np.uint32)[5, 3] ^= 1  # the lowest mantissa bit of one element
    assert fingerprints({**tree, "w": jnp.asarray(flipped)})["w"] != base["w"]
    swapped = np.asarray(tree["w"])[[1, 0, 2, 3, 4, 5, 6, 7]]  # the same words, moved
    assert fingerprints({**tree, "w": jnp.asarray(swapped)})["w"] != base["w"]
    mesh = jax.make_mesh((4, 2), ("data", "tensor"))
    sharded = dict(tree, w=jax.device_put(tree["w"], NamedSharding(mesh, P("data", "tensor"))))
    assert fingerprints(sharded) == base


def test_trainer_resumes_over_a_damaged_step_as_if_uninterrupted(tmp_path, absl_warnings):
    # Checkpoints every 2 steps (keep 2): a crash at step 7 leaves 4 and 6; 64 bytes of step 6
    # overwritten (orbax reads it without a word) make the run resume from 4, and end exactly
    # where the uninterrupted run ends.
    straight_dir, resumed_dir = str(tmp_path / "straight"), str(tmp_path / "resumed")
    straight = train.train_and_evaluate(_resume_config(), straight_dir)

    def crash_at_7(step):
        if step == 7:
            raise RuntimeError("crash")

    with pytest.raises(RuntimeError, match="crash"):
        train.train_and_evaluate(_resume_config(), resumed_dir, on_step=crash_at_7)
    _overwrite_64_bytes(os.path.join(resumed_dir, "checkpoints", "6"))
    resumed = train.train_and_evaluate(_resume_config(), resumed_dir)
    assert "checkpoint step 6 is damaged" in absl_warnings.text
    assert "resuming from step 4" in absl_warnings.text
    assert resumed == straight
    assert _rows(resumed_dir) == _rows(straight_dir)
    (a, data_a), (b, data_b) = (final_state(_resume_config(), d)
                                for d in (straight_dir, resumed_dir))
    assert data_a == data_b
    _assert_equal(a, b)
