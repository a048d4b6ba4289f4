"""xformers_jax_experiments/run_lib.py: run-or-resume for studies, and the metrics reader."""

import json
import os
import re

import pytest

from xformers_jax_experiments import run_lib
from xformers_jax_experiments.configs.lra import listops

STUDIES = os.path.join(os.path.dirname(run_lib.__file__), "studies")


def _config():
    """``listops.py:transformer,runlocal`` shrunk to seconds: 4 steps, checkpoints every 2."""
    c = listops.get_config("transformer,runlocal")
    with c.unlocked():
        c.data.update(dict(num_train=64, num_eval=16, num_test=16))
        c.model.update(dict(dim=16, num_layers=1, num_heads=2, hidden=32))
        c.update(dict(batch_size=8, num_train_steps=4, log_every=1, eval_every=2,
                      checkpoint_every=2, plot=False, progress_bar=False, tensorboard=False))
    return c


class _Crash(Exception):
    pass


def _crash_at(step):
    def on_step(s):
        if s == step:
            raise _Crash(s)
    return on_step


def test_run_or_resume_resumes_an_interrupted_run_and_skips_a_finished_one(tmp_path,
                                                                           monkeypatch):
    workdir = str(tmp_path / "run")
    # A run that fails (here at step 3, after the checkpoint at step 2) leaves no result.
    with pytest.raises(_Crash):
        run_lib.run_or_resume(_config(), workdir, on_step=_crash_at(3))
    assert run_lib.finished(workdir) is None and run_lib.latest_checkpoint(workdir) == 2
    assert not [f for f in os.listdir(workdir) if f.startswith(run_lib.RESULT)]
    # Run again: it resumes from its checkpoint, finishes and records the result.
    record = run_lib.run_or_resume(_config(), workdir, tags=dict(method="tiny"),
                                   summarize=lambda w: dict(rows=len(run_lib.read_metrics(w))))
    assert record["method"] == "tiny" and record["resumed_from"] == 2 and record["steps"] == 4
    assert record["result"]["step"] == 4 and 0 <= record["result"]["test_accuracy"] <= 1
    assert {"seconds", "load_start", "load_end", "cpu", "cores"} <= set(record)
    assert record["rows"] > 0
    with open(os.path.join(workdir, run_lib.RESULT)) as f:
        assert json.load(f) == record
    assert sorted(os.listdir(workdir)).count(run_lib.RESULT) == 1  # no temporary file left
    # A finished run is not trained again: its record is read back.
    from xformers_jax import train

    def no_training(*args, **kwargs):
        raise AssertionError("a finished run was trained again")

    monkeypatch.setattr(train, "train_and_evaluate", no_training)
    assert run_lib.run_or_resume(_config(), workdir) == record
    # The metrics reader on the resumed run's metrics.jsonl.
    rows = run_lib.read_metrics(workdir)
    assert run_lib.last(rows, "test_accuracy") == record["result"]["test_accuracy"]
    assert list(run_lib.series(rows, "train_loss")) == [1, 2, 3, 4]
    assert list(run_lib.series(rows, "validation_accuracy")) == [2, 4]
    assert run_lib.final_step(rows) == 4


def test_a_preempted_run_leaves_no_result(tmp_path, monkeypatch):
    from xformers_jax import train

    monkeypatch.setattr(train, "train_and_evaluate",
                        lambda config, workdir, on_step=None: {"preempted": True, "step": 3})
    with pytest.raises(run_lib.Preempted, match="step 3"):
        run_lib.run_or_resume(_config(), str(tmp_path))
    assert run_lib.finished(str(tmp_path)) is None and os.listdir(tmp_path) == []


def test_metrics_reader():
    rows = [{"step": 1, "train_loss": 3.0, "steps_per_second": 1.0},
            {"step": 2, "train_loss": 2.0},
            {"step": 2, "validation_loss": 2.5, "validation_accuracy": 0.5},
            {"step": 2, "train_loss": 1.5},  # step 2 logged again after a resume
            {"step": 4, "train_loss": 1.0, "test_loss": 2.2, "validation_loss": 2.4}]
    assert run_lib.last(rows, "train_loss") == 1.0
    assert run_lib.last(rows, "missing") is None and run_lib.last(rows, "missing", 0) == 0
    assert run_lib.series(rows, "train_loss") == {1: 3.0, 2: 1.5, 4: 1.0}
    assert run_lib.latest(rows, ("validation_loss", "test_loss")) == {
        "validation_loss": 2.4, "test_loss": 2.2}
    assert run_lib.latest(rows, "validation_accuracy") == {"validation_accuracy": 0.5}
    assert run_lib.latest(rows, lambda k: k.startswith("validation")) == {
        "validation_loss": 2.4, "validation_accuracy": 0.5}
    assert run_lib.latest(rows)["steps_per_second"] == 1.0
    assert run_lib.last_row(rows, "validation_accuracy") is rows[2]
    assert run_lib.last_row(rows, "missing") is None
    assert run_lib.final_step(rows) == 4


def test_read_metrics_of_a_run_without_metrics(tmp_path):
    assert run_lib.read_metrics(str(tmp_path), missing_ok=True) == []
    with pytest.raises(FileNotFoundError):
        run_lib.read_metrics(str(tmp_path))


def test_every_study_folder_has_a_readme_and_runs_from_its_folder():
    names = sorted(n for n in os.listdir(STUDIES) if os.path.isdir(os.path.join(STUDIES, n))
                   and not n.startswith(("_", ".")))
    assert names == ["compress", "early_exit", "electra", "input_timing", "memory_lm",
                     "mixers_lra", "moe_lm", "swin_lra", "zoo"]
    for name in names:
        folder = os.path.join(STUDIES, name)
        assert os.path.exists(os.path.join(folder, "__init__.py")), name
        with open(os.path.join(folder, "README.md")) as f:
            readme = f.read()
        # The command that reproduces it names a script of this folder, or this folder's
        # sweep config.
        scripts = re.findall(rf"python -m xformers_jax_experiments\.studies\.{name}\.(\w+)",
                             readme)
        configs = re.findall(rf"--config=xformers_jax_experiments/studies/{name}/(\w+)\.py",
                             readme)
        assert scripts or configs, name
        for module in scripts + configs:
            assert os.path.exists(os.path.join(folder, module + ".py")), (name, module)
