"""Bad data refused where it is found (numpy checks naming the value and its position), no
code run from data files, no unquoted values in remote commands."""

import os
import pickle
import shlex
import subprocess

import numpy as np
import pytest

from xformers_jax import data, train
from xformers_jax_experiments import sweep


def test_out_of_range_ids_and_labels_are_named_with_their_position():
    tokens = np.ones((4, 6), np.int32)
    tokens[3, 5] = 20
    with pytest.raises(ValueError, match=r"split inputs: token id 20 at row 3, position 5 is "
                                         r"outside \[0, 20\) \(1 of 24"):
        data.check_arrays({"inputs": tokens}, vocab_size=20, num_classes=10, where="split")
    for label in (99, -1):
        with pytest.raises(ValueError, match=f"split targets: label {label} at row 2 is "
                                             r"outside \[0, 10\)"):
            data.check_arrays({"targets": np.array([0, 1, label, 3])}, vocab_size=20,
                              num_classes=10, where="split")
    data.check_arrays({"inputs": np.zeros((2, 3), np.float32) - 5, "targets": np.arange(2)},
                      vocab_size=20, num_classes=10, where="split")  # features: not ids


def test_make_task_refuses_a_split_with_an_out_of_range_label():
    spec = train.TASKS["listops"]

    def make(c, seed):
        task = spec.make(c, seed)
        task.test.arrays["targets"][1] = 10
        return task

    bad = train.register_task(train.TaskSpec("listops_bad_label", spec.data, make,
                                             model=spec.model), replace=True)
    c = train.base_config("listops")
    c.data.update(dict(task=bad.name, num_train=4, num_eval=2, num_test=2, min_length=4,
                       max_length=8, max_depth=2, max_args=2))
    try:
        with pytest.raises(ValueError, match="'listops_bad_label' test split targets: label 10"
                                             " at row 1"):
            train.make_task(c.data, 0)
    finally:
        del train.TASKS[bad.name]


def test_tsv_loaders_range_check_labels_naming_file_and_line(tmp_path):
    rows = "Source\tTarget\n( [MAX 1 2 ] )\t2\n( [MIN 3 4 ] )\t10\n"
    (tmp_path / "basic_train.tsv").write_text(rows)
    with pytest.raises(ValueError, match=r"basic_train.tsv, line 3: label 10 is outside "
                                         r"\[0, 10\)"):
        data.load_listops_tsv(str(tmp_path), "train", max_length=8)
    row = "{}\tid1\tid2\tfirst text\tsecond text\n"
    for label, match in (("2", r"label 2 is outside \[0, 2\)"), ("-1", "label -1 is outside"),
                         ("0.5", "label '0.5' is not an integer"), ("x", "label 'x' is not a number")):
        (tmp_path / "new_aan_pairs.train.tsv").write_text(row.format(1) + row.format(label))
        with pytest.raises(ValueError, match=f"new_aan_pairs.train.tsv, line 2: {match}"):
            data.load_aan(str(tmp_path), "train", seq_len=8)


class _Exploit:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {shlex.quote(self.marker)}",)


def test_cifar_reader_refuses_a_pickle_that_runs_code(tmp_path):
    d = tmp_path / "cifar-10-batches-py"
    d.mkdir()
    marker = str(tmp_path / "ran")
    with open(d / "test_batch", "wb") as fh:
        pickle.dump({b"data": np.zeros((2, 3072), np.uint8), b"labels": [0, 1],
                     b"filenames": _Exploit(marker)}, fh)
    with pytest.raises(pickle.UnpicklingError, match=r"refusing to load (posix|os)\.system"):
        data.load_cifar10(str(tmp_path), "test")
    assert not os.path.exists(marker)
    # A real batch's content (arrays, byte strings, lists of numpy ints) still loads, and a
    # label out of range is named.
    with open(d / "test_batch", "wb") as fh:
        pickle.dump({b"batch_label": b"testing batch 1 of 1", b"filenames": [b"a.png", b"b.png"],
                     b"data": np.zeros((2, 3072), np.uint8),
                     b"labels": list(np.array([3, 12]))}, fh)
    with pytest.raises(ValueError, match=r"test_batch: label of image: label 12 at row 1"):
        data.load_cifar10(str(tmp_path), "test")


def test_sweep_passes_repo_dir_to_the_remote_shell_as_data(tmp_path):
    repo = tmp_path / "repo; echo INJECTED"
    repo.mkdir()
    (cmd,) = sweep.tpu_commands("c.py", "/runs", [{}], tpu="pod", zone="z",
                                repo_dir=str(repo), python="true")
    remote = shlex.split(cmd)[-1].removeprefix("--command=")
    # What the worker's shell runs: cd into the directory of that name, then the trainer.
    done = subprocess.run(["sh", "-c", remote], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "INJECTED" not in done.stdout
    assert shlex.split(remote)[:3] == ["cd", str(repo), "&&"]
    # The home-relative default still expands on the worker.
    (cmd,) = sweep.tpu_commands("c.py", "/runs", [{}], tpu="pod", zone="z")
    assert shlex.split(cmd)[-1].startswith("--command=cd ~/xformers_jax && ")
