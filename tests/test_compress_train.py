"""The trainer's compression switches: defaults off, bad values rejected by name, the ELECTRA
task registered with its own objective, the teacher's checkpoint directory resolved."""

import ml_collections
import pytest

from xformers_jax import train
from xformers_jax.train import _compress


def _config(**changes):
    c = train.base_config("listops")
    for path, value in changes.items():
        section, _, key = path.rpartition(".")
        (c[section] if section else c)[key] = value
    return c


def test_defaults_are_off_and_bad_values_are_named():
    c = train.base_config("listops")
    assert c.quantize == "none" and c.prune.sparsity == 0 and c.distill.teacher == ""
    train.validate_config(c)
    for change, match in ((dict(quantize="int2"), "quantize"),
                          ({"prune.sparsity": 1.0}, "prune.sparsity"),
                          ({"prune.scope": "row"}, "prune.scope"),
                          ({"calibration.method": "mse"}, "calibration.method"),
                          ({"distill.init": "every_other"}, "distill.init needs"),
                          ({"distill.alpha": 2.0}, "distill.alpha"),
                          ({"prune.rewind_step": 5}, "needs prune.sparsity"),
                          ({"prune.sparsity": 0.5, "prune.rewind_step": 5,
                            "prune.end_step": 5}, "must come before"),
                          ({"prune.layers": 5}, "prune.layers"),
                          ({"distill.tinybert_hidden": 1.0}, "need distill.teacher")):
        with pytest.raises(ValueError, match=match):
            train.validate_config(_config(**change))


def test_electra_task_and_teacher_directory(tmp_path):
    spec = train.TASKS["electra"]
    assert spec.type == "self_supervised" and not spec.classification
    (tmp_path / "best" / "12" / "state").mkdir(parents=True)
    (tmp_path / "checkpoints" / "40" / "state").mkdir(parents=True)
    assert train.state_dir(str(tmp_path)) == str(tmp_path / "best" / "12" / "state")
    assert train.state_dir("/elsewhere/state") == "/elsewhere/state"
    c = ml_collections.ConfigDict(dict(num_train_steps=100, prune=ml_collections.ConfigDict(
        dict(sparsity=0.0))))
    assert _compress.wrap_optimizer(c, "opt") == "opt"
