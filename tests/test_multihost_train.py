"""Two real processes on localhost (``jax.distributed`` over CPU collectives): a run that
SIGTERM stops on both processes, at different steps of each, stops both after one agreed step,
and resumes on one process equal to the uninterrupted one-process run in every
``metrics.jsonl`` row, its final metrics and its final state, bit for bit. (The resume on two
processes too is the ``faults`` benchmark suite's "2-host preemption" scenario: a minute more
of two processes starting and compiling.)

The comparison keeps the global device count: one process with two devices against two
processes with one each (the same sharded program; a different count of devices would sum
gradients in another order). The batch each step reads is the same global batch for any
process count (``data.batches``), and the data state saved with a checkpoint is a position in
those batches, so a checkpoint of two processes resumes on one."""

import json
import os
import re
import socket
import subprocess
import sys

import jax
import ml_collections
import numpy as np
import pytest

from tests.test_train import ROOT, _rows, _tiny_config
from tests.train_state import final_state
from xformers_jax import train

STEPS = 16
# Each process sends itself SIGTERM after step STOP_AT + its index (3 and 4), then slows to
# SLOW_S a step so that JAX's preemption notifier (which polls about once a second) is heard
# well before the last step.
STOP_AT, SLOW_S = 3, 0.25
_CHILD = """
import json, os, signal, sys, time
from xformers_jax.parallel import initialize_from_env
assert initialize_from_env()
import jax
from tests.test_multihost_train import STOP_AT, SLOW_S, _config
from xformers_jax import train
stop = sys.argv[2] == "stop"
def on_step(step):
    if stop and step == STOP_AT + jax.process_index():
        os.kill(os.getpid(), signal.SIGTERM)
    if stop and step >= STOP_AT:
        time.sleep(SLOW_S)
result = train.train_and_evaluate(_config(), sys.argv[1], on_step=on_step)
print("RESULT " + json.dumps(result), flush=True)
"""


def _config():
    c = _tiny_config(STEPS)
    with c.unlocked():
        c.mesh = ml_collections.ConfigDict({"data": 2})
    c.log_every = 3  # the stop falls inside a logging interval
    c.tensorboard = c.progress_bar = c.plot = False
    return c


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _two_processes(workdir, mode, timeout=240):
    """Runs the child on 2 processes (one CPU device each); returns their results."""
    flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "",
                   os.environ.get("XLA_FLAGS", ""))
    port = _free_port()
    procs = [subprocess.Popen(
        [sys.executable, "-c", _CHILD, workdir, mode], cwd=ROOT, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        env={**os.environ, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu",
             "JAX_COORDINATOR_ADDRESS": f"localhost:{port}", "JAX_NUM_PROCESSES": "2",
             "JAX_PROCESS_ID": str(i)}) for i in range(2)]
    results = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=timeout)
            assert p.returncode == 0, err[-3000:]
            results.append(json.loads(out.split("RESULT ")[-1]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return results


def _assert_same_run(result, workdir, straight, straight_dir):
    assert result == straight
    assert _rows(workdir) == _rows(straight_dir)
    (a, data_a), (b, data_b) = (final_state(_config(), d) for d in (straight_dir, workdir))
    assert data_a == data_b and int(b.step) == STEPS
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_two_processes_stop_together_and_resume_on_one_or_two(tmp_path):
    straight_dir = str(tmp_path / "straight")
    straight = train.train_and_evaluate(_config(), straight_dir)  # 1 process, 2 devices

    stopped = str(tmp_path / "two")
    first = _two_processes(stopped, "stop")
    # Both stop after the same step and save it (once). The step is at or after the first
    # SIGTERM (process 0's, after step STOP_AT); how far past depends on how soon the
    # notifier hears it, so process 1 may stop before its own SIGTERM (after STOP_AT + 1):
    # on their own the two would stop at STOP_AT and STOP_AT + 1.
    assert first[0] == first[1], first
    step = first[0]["step"]
    assert first[0]["preempted"] and STOP_AT <= step < STEPS, first
    assert int(max(os.listdir(os.path.join(stopped, "checkpoints")), key=int)) == step
    data_files = sorted(f for f in os.listdir(os.path.join(stopped, "checkpoints", str(step),
                                                             "data")) if f.startswith("process"))
    assert data_files == ["process_0-of-2.json", "process_1-of-2.json"]
    # On one process (two devices): reads the two processes' data state.
    _assert_same_run(train.train_and_evaluate(_config(), stopped), stopped, straight,
                     straight_dir)


def test_data_states_that_differ_refuse_another_process_count(tmp_path):
    from etils import epath

    from xformers_jax.train._checkpoint import _read_data_state

    state = {"iterator": {"next_index": 5}, "interval": {}}
    for i in range(2):
        (tmp_path / f"process_{i}-of-2.json").write_text(json.dumps(state))
    assert _read_data_state(epath.Path(tmp_path)) == state  # written by 2, read by 1
    (tmp_path / "process_1-of-2.json").write_text(json.dumps({**state, "iterator": {}}))
    with pytest.raises(ValueError, match="differ.*resume it on the process count"):
        _read_data_state(epath.Path(tmp_path))
