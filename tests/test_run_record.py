"""The run record, the workdir lock and the command line's config errors.

A workdir records its config, code and package versions; a resume with another config refuses
with the difference unless allowed; a finished run is not run again and writes nothing twice;
a second trainer on a workdir refuses naming the first, and a lock left by a killed process is
taken over. The command line's unknown keys get "did you mean", and a slot kind's
hyperparameter the config does not list can be set.
"""

import glob
import json
import os
import pathlib
import signal
import socket
import subprocess
import sys

import pytest

from tests.test_train import _tiny_config
from xformers_jax import train

ROOT = pathlib.Path(__file__).resolve().parents[1]
LISTOPS = "xformers_jax_experiments/configs/lra/listops.py:performer,runlocal"


def _config(steps=4, **changes):
    config = _tiny_config(steps)
    config.plot = False
    for key, value in changes.items():
        node = config
        *parents, last = key.split(".")
        for p in parents:
            node = node[p]
        node[last] = value
    return config


def _record(workdir):
    with open(os.path.join(workdir, "run.json")) as fh:
        return json.load(fh)


class _Crash(Exception):
    pass


def _crash_at(n):
    def on_step(step):
        if step == n:
            raise _Crash
    return on_step


def test_the_record_refuses_another_config_and_a_finished_run_writes_nothing(tmp_path):
    workdir = str(tmp_path / "run")
    with pytest.raises(_Crash):
        train.train_and_evaluate(_config(), workdir, on_step=_crash_at(3))
    with open(os.path.join(workdir, "config.json")) as fh:
        assert json.load(fh) == train.config_json(_config())
    record = _record(workdir)
    (session,) = record["sessions"]
    assert set(session["packages"]) >= {"jax", "jaxlib", "equinox", "optax", "orbax-checkpoint"}
    assert session["packages"]["jax"] and "xformers_jax" in session["code"]
    assert "finished" not in record

    # A run recorded before two options existed (their keys absent from its config.json).
    recorded = train.config_json(_config())
    del recorded["max_consecutive_skips"], recorded["model"]["dim"]
    with open(os.path.join(workdir, "config.json"), "w") as fh:
        json.dump(recorded, fh)
    # Another seed or another attention kind of the same shapes: refused, naming each change;
    # so is an absent key set to other than its default (the model's width here).
    changed = _config(seed=1)
    changed.model.attention.kind = "flash"
    with pytest.raises(train.ConfigChanged, match=r"3 key\(s\) differ\): "
                       r"model\.attention\.kind: \"dot_product\" -> \"flash\"; "
                       r"model\.dim: \(absent\) -> \d+; "
                       r"seed: 0 -> 1\. .*--allow_config_change"):
        train.train_and_evaluate(changed, workdir)
    # What changes no number may change; an absent key at its default is no change.
    recorded["model"]["dim"] = _config().model.dim
    with open(os.path.join(workdir, "config.json"), "w") as fh:
        json.dump(recorded, fh)
    quiet = _config()
    quiet.progress_bar = False
    result = train.train_and_evaluate(quiet, workdir)
    assert result["step"] == 4 and "already_finished" not in result
    record = _record(workdir)
    assert len(record["sessions"]) == 2 and record["finished"]["step"] == 4
    assert record["sessions"][-1]["config_changes"] == []
    assert record["sessions"][-1]["config_keys_added"] == ["max_consecutive_skips: 25"]

    def written():  # every file and its time (the lock, taken and released, is no file now)
        files = sorted(glob.glob(os.path.join(workdir, "**"), recursive=True))
        return {f: os.path.getmtime(f) for f in files if os.path.isfile(f)}

    before = written()
    again = train.train_and_evaluate(_config(), workdir)
    assert again == {**result, "already_finished": True}
    assert written() == before  # no test row, events file, checkpoint or record written
    # Allowed, a change is recorded, and more steps continue the finished run.
    longer = train.train_and_evaluate(_config(steps=6), workdir, allow_config_change=True)
    assert longer["step"] == 6
    record = _record(workdir)
    assert record["sessions"][-1]["config_changes"] == ["num_train_steps: 4 -> 6"]
    assert record["finished"]["step"] == 6


_HOLD = """
import sys, time
from xformers_jax.train import _lock
_lock.acquire_for_job(sys.argv[1])
print("HELD", flush=True)
time.sleep(600)
"""


def test_a_second_trainer_refuses_and_a_killed_ones_lock_is_taken_over(tmp_path, monkeypatch):
    workdir = str(tmp_path / "run")
    holder = subprocess.Popen([sys.executable, "-c", _HOLD, workdir], cwd=ROOT,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "HELD"
        with pytest.raises(train.WorkdirLocked,
                           match=rf"in use by another trainer: pid {holder.pid} on host "
                                 rf"{socket.gethostname()} .*wait for it, stop it"):
            train.train_and_evaluate(_config(), workdir)
        assert not os.path.exists(os.path.join(workdir, "run.json"))  # nothing written
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    from xformers_jax.train import _lock

    warned = []
    monkeypatch.setattr(_lock.logging, "warning", lambda msg, *a: warned.append(msg % a))
    assert train.train_and_evaluate(_config(steps=2), workdir)["step"] == 2
    assert f"its holder, pid {holder.pid} on host {socket.gethostname()}" in warned[0]
    assert "is no longer running" in warned[0]
    assert not os.path.exists(os.path.join(workdir, "lock"))  # released at the end


def test_the_lock_is_released_when_a_run_fails(tmp_path):
    workdir = str(tmp_path / "run")
    with pytest.raises(_Crash):
        train.train_and_evaluate(_config(), workdir, on_step=_crash_at(1))
    assert not os.path.exists(os.path.join(workdir, "lock"))
    with train.WorkdirLock(workdir), pytest.raises(train.WorkdirLocked,
                                                   match=f"pid {os.getpid()}"):
        train.WorkdirLock(workdir).acquire()  # taken again by this process, then refused


def _cli(*args):
    return subprocess.Popen([sys.executable, "-m", "xformers_jax_experiments.train",
                             f"--config={LISTOPS}", "--print_config", *args], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, JAX_PLATFORMS="cpu"))


def test_command_line_config_errors_and_slot_hyperparameters():
    cases = {
        "top": _cli("--config.foo=1"),
        "top_typo": _cli("--config.sede=1"),
        "nested": _cli("--config.data.max_lenght=3"),
        "slot": _cli("--config.model.attention.kernel=relu", "--config.model.attention.chunk_size=16",
                     "--config.optim.learning_rate=0.5"),
        "slot_typo": _cli("--config.model.attention.kernal=relu"),
    }
    out = {}
    for name, proc in cases.items():
        stdout, stderr = proc.communicate(timeout=300)
        out[name] = (proc.returncode, stdout, stderr)
    rc, _, err = out["top"]
    assert rc != 0 and "Traceback" not in err
    assert "--config.foo: the config has no key 'foo' (its keys: batch_size, " in err
    rc, _, err = out["top_typo"]
    assert rc != 0 and "the config has no key 'sede' (did you mean 'seed'?)" in err
    rc, _, err = out["nested"]
    assert rc != 0 and "data has no key 'max_lenght' (did you mean 'max_length'?)" in err
    rc, printed, err = out["slot"]
    assert rc == 0, err[-2000:]
    config = json.loads(printed)
    assert config["model"]["attention"] == {"kind": "performer", "num_features": 32,
                                            "kernel": "relu", "chunk_size": 16}
    assert config["optim"]["learning_rate"] == 0.5
    rc, _, err = out["slot_typo"]
    assert rc != 0 and "model.attention: attention kind 'performer': unknown hyperparameters " \
                       "['kernal']" in err and "did you mean 'kernel'" in err


def test_what_a_run_spent_sums_its_timed_starts(tmp_path):
    """``RunRecord.spent``: the starts that recorded their end are summed; a killed start
    (no end) makes the run untimed; a finished run's last untimed start counts its wall time
    from its start to its finish."""
    workdir = tmp_path / "run"
    workdir.mkdir()
    record = train.RunRecord(str(workdir))
    assert record.spent() is None

    def write(sessions, finished=None):
        payload = {"config_file": "config.json", "sessions": sessions}
        if finished:
            payload["finished"] = finished
        (workdir / "run.json").write_text(json.dumps(payload))
        return record.spent()

    timed = {"started": "2026-11-29 10:00:00", "wall_s": 60.0, "cpu_s": 100.0}
    killed = {"started": "2026-11-29 11:00:00"}
    assert write([timed, dict(timed, wall_s=30.0, cpu_s=20.0)]) == dict(
        wall_s=90.0, cpu_s=120.0, timed=True)
    assert write([timed, killed]) == dict(wall_s=60.0, cpu_s=100.0, timed=False)
    assert write([killed, timed]) == dict(wall_s=60.0, cpu_s=100.0, timed=False)
    assert write([timed, killed], {"step": 4, "time": "2026-11-29 11:02:30"}) == dict(
        wall_s=210.0, cpu_s=100.0, timed=False)
