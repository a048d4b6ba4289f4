"""Suite ``faults``: the trainer under faults and bad input, as a user meets them.

Each case is one scenario of :data:`SCENARIOS`, run against the real trainer
(``python -m xformers_jax_experiments.train`` on the smallest ListOps config, :data:`FLAGS`)
as subprocesses in a temporary workdir, every subprocess with a time limit. A fault
(kill -9 during a save, SIGTERM, damaged checkpoints, two trainers on one workdir, two
processes preempted) must end in one of two ways: the run resumes exactly (its final metrics
and every ``metrics.jsonl`` row, the last one per step, equal to the uninterrupted run's), or
it refuses clearly (a non-zero exit whose error is raised by the project's own code, not deep
in a library) with the last good checkpoint still there. A bad input (config, data) must give
a clear error that names it. Anything else is reported: a hang (a subprocess past its limit),
a silent wrong result (exit 0 with other metrics than the uninterrupted run), an unclear
error.

A scenario is one line of :data:`SCENARIOS`: ``Scenario(name, kind, expect, runner,
params)``, ``runner`` one of the functions below (``interrupted`` with a ``stop`` and an
optional ``damage`` of :data:`DAMAGES`, ``two_hosts``, ``concurrent``, ``bad_flags``).

The harness measures a case by building it in a fresh worker process: here the build runs
the scenario, and a scenario that did not end as expected raises :class:`Unexpected`, whose
message (the observed outcome, hang, silent wrong result) becomes the case's error;
:func:`checks` turns every case into a row of the table and computes its two target figures.
The times in the records table are those of a no-op (nothing is timed here).
"""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

from xformers_jax_experiments.bench_lib import Case, Check, Results, Workload

TITLE = "Faults and bad input: every run resumes exactly or refuses clearly (tiny ListOps)"
NOTE = ("Each row is a scenario run against the real trainer as subprocesses (every one "
        "with a time limit) in a temporary workdir, on the smallest ListOps config; "
        "'measured' is what happened: the outcome, whether anything hung and whether a run "
        "finished with other metrics than the uninterrupted run (a silent wrong result). "
        "The records table below it times nothing (its times are those of a no-op).")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_BUILD = "xformers_jax_experiments.suites.faults:build"

RESUME = "resume exactly"
REFUSE = "refuse clearly, last good step kept"
ERROR = "clear error"
# What a fault may end in (the figure counts both); a bad input must end in a clear error.
_FAULT_OK = (RESUME, REFUSE)

STEPS, CHECKPOINT_EVERY, SAVE_STEP = 16, 4, 8
FLAGS = (
    "--config=xformers_jax_experiments/configs/lra/listops.py:transformer,runlocal",
    "--config.data.num_train=48", "--config.data.num_eval=16", "--config.data.num_test=16",
    "--config.data.min_length=8", "--config.data.max_length=24", "--config.data.max_depth=3",
    "--config.data.max_args=3", "--config.model.dim=16", "--config.model.num_layers=1",
    "--config.model.num_heads=2", "--config.model.hidden=32",
    "--config.optim.learning_rate=3e-3", "--config.optim.warmup_steps=2",
    "--config.optim.schedule=rsqrt", "--config.batch_size=8",
    f"--config.num_train_steps={STEPS}", "--config.log_every=3", "--config.eval_every=4",
    f"--config.checkpoint_every={CHECKPOINT_EVERY}", "--config.keep_checkpoints=2",
    "--config.tensorboard=False", "--config.progress_bar=False", "--config.plot=False",
)
TIMEOUT_S = 240.0  # per trainer subprocess: past it, the scenario hung

# The trainer's command line with two hooks, for the scenarios only: "SAVE <step>" is printed
# as a checkpoint save begins and "STEP <step>" after every step; FAULTS_SIGTERM_AT=<step>
# sends the process SIGTERM after that step (process i of several: after step + i), and
# FAULTS_SLOW_S sleeps after each step from then on (or from the start without it), so that
# a kill lands while the run is still going.
_CHILD = """
import os, signal, sys, time
from xformers_jax import train
from xformers_jax_experiments import train as cli
from absl import app
save = train.Checkpointer.save
def announced(self, step, *args, **kwargs):
    print(f"SAVE {step}", flush=True)
    return save(self, step, *args, **kwargs)
train.Checkpointer.save = announced
run = train.train_and_evaluate
sigterm_at = int(os.environ.get("FAULTS_SIGTERM_AT", "0"))
slow = float(os.environ.get("FAULTS_SLOW_S", "0"))
def hooked(config, workdir, on_step=None, **kwargs):
    import jax
    def on(step):
        print(f"STEP {step}", flush=True)
        if sigterm_at and step == sigterm_at + jax.process_index():
            os.kill(os.getpid(), signal.SIGTERM)
        if step >= sigterm_at:
            time.sleep(slow)
    return run(config, workdir, on_step=on, **kwargs)
train.train_and_evaluate = hooked
# FAULTS_NAN_AT=<step>: that step's loss is NaN (its batch carries a factor the loss is
# multiplied by); FAULTS_BAD_ID_AT=<step>: that step's batch holds a token id out of range.
nan_at = int(os.environ.get("FAULTS_NAN_AT", "0"))
bad_id_at = int(os.environ.get("FAULTS_BAD_ID_AT", "0"))
if nan_at or bad_id_at:
    import numpy as np
    from xformers_jax.train import _loop
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
        run_step, calls = make_step(*args, **kwargs), [0]
        def wrapped(state, batch):
            calls[0] += 1
            rows = batch["targets"].shape[0]
            factor = np.nan if calls[0] == nan_at else 1.0
            batch = dict(batch, poison=np.full((rows,), factor, np.float32))
            if calls[0] == bad_id_at:
                inputs = np.array(batch["inputs"])
                inputs[0, 0] = 10**6
                batch["inputs"] = inputs
            return run_step(state, batch)
        return wrapped
    _loop.make_loss_fn, _loop.make_train_step = loss_maker, step_maker
sys.argv = ["train", *sys.argv[1:]]
app.run(cli.main, flags_parser=cli.parse_flags)
"""


@dataclasses.dataclass(frozen=True)
class Scenario:
    """One row: ``kind`` "fault" or "input"; ``expect`` RESUME, REFUSE or ERROR; ``runner``
    a function of this module called as ``runner(workdir, **params)`` -> :class:`Outcome`."""

    name: str
    kind: str
    expect: str
    runner: str
    params: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class Outcome:
    what: str  # RESUME, REFUSE, ERROR or a description of anything else
    detail: str = ""
    hang: bool = False
    wrong: bool = False  # exit 0 with other metrics than the uninterrupted run

    def text(self) -> str:
        what = " ".join((self.what + (f" ({self.detail})" if self.detail else "")).split())
        # The harness keeps 200 characters of the error this becomes.
        return (f"observed: {what[:75]}; hang: {'yes' if self.hang else 'no'}; "
                f"silent wrong result: {'yes' if self.wrong else 'no'}")


class Unexpected(RuntimeError):
    """A scenario that did not end as expected; its message is the :class:`Outcome`."""


# -- running the trainer ---------------------------------------------------------------------

@dataclasses.dataclass
class Run:
    code: int | None  # None: killed by us after TIMEOUT_S (a hang)
    stdout: str
    stderr: str

    @property
    def result(self) -> dict | None:
        for line in self.stdout.splitlines():
            if line.startswith("{"):
                return json.loads(line)
        return None


def _env(devices: int, **extra) -> dict:
    flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "",
                   os.environ.get("XLA_FLAGS", ""))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "FAULTS_"))}
    return {**env, "JAX_PLATFORMS": "cpu", "XFORMERS_JAX_TILES": "default",
            "XLA_FLAGS": f"{flags} --xla_force_host_platform_device_count={devices}",
            **{k: str(v) for k, v in extra.items()}}


def _start(workdir, flags=(), devices=1, **env) -> tuple[subprocess.Popen, str]:
    """A trainer subprocess; its stdout and stderr go to ``<log>.out`` / ``<log>.err`` files
    beside the workdir (read while it runs, never a pipe that could fill)."""
    fd, log = tempfile.mkstemp(prefix="log_", dir=os.path.dirname(os.path.abspath(workdir)))
    os.close(fd)
    with open(log + ".out", "w") as out, open(log + ".err", "w") as err:
        proc = subprocess.Popen([sys.executable, "-c", _CHILD, *FLAGS, *flags,
                                 f"--workdir={workdir}"], cwd=ROOT, env=_env(devices, **env),
                                stdout=out, stderr=err, text=True)
    return proc, log


def _finish(started, deadline: float) -> Run:
    proc, log = started
    try:
        code = proc.wait(timeout=max(deadline - time.monotonic(), 1.0))
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        code = None
    with open(log + ".out") as out, open(log + ".err") as err:
        return Run(code, out.read(), err.read())


def train(workdir, flags=(), devices=1, **env) -> Run:
    """One trainer subprocess to its end (or TIMEOUT_S)."""
    return _finish(_start(workdir, flags, devices, **env), time.monotonic() + TIMEOUT_S)


def _rows(workdir) -> dict:
    # The last row per (step, kind of row), as a reader of the log takes it: a resumed run
    # logs again the steps after its last checkpoint. steps_per_second is a timing.
    rows = {}
    path = os.path.join(workdir, "metrics.jsonl")
    if os.path.exists(path):
        with open(path) as fh:
            for line in fh:
                row = {k: v for k, v in json.loads(line).items() if k != "steps_per_second"}
                rows[(row["step"], tuple(sorted(row)))] = row
    return rows


def _raw_rows(workdir) -> list:
    with open(os.path.join(workdir, "metrics.jsonl")) as fh:
        return [{k: v for k, v in json.loads(line).items() if k != "steps_per_second"}
                for line in fh]


def _source_hash() -> str:
    h = hashlib.sha256()
    for path in sorted(glob.glob(os.path.join(ROOT, "xformers_jax", "**", "*.py"),
                                 recursive=True) + [os.path.abspath(__file__)]):
        with open(path, "rb") as fh:
            h.update(fh.read())
    return h.hexdigest()[:16]


def reference(devices: int = 1) -> tuple[dict, dict, list]:
    """The uninterrupted run's ``(result, rows, raw rows)``, computed once per source version
    and device count (kept in the temp directory: every case runs in its own process)."""
    key = hashlib.sha256(json.dumps([FLAGS, devices, _source_hash(),
                                     os.environ.get("XLA_FLAGS", "")]).encode()).hexdigest()
    cache = os.path.join(tempfile.gettempdir(), "xformers_jax_faults", key[:16])
    if not os.path.exists(os.path.join(cache, "result.json")):
        os.makedirs(os.path.dirname(cache), exist_ok=True)
        work = tempfile.mkdtemp(prefix="reference_", dir=os.path.dirname(cache))
        run = train(os.path.join(work, "run"), devices=devices)
        if run.code != 0 or run.result is None:
            raise RuntimeError(f"the uninterrupted run failed: {run.stderr[-500:]}")
        os.rename(os.path.join(work, "run", "metrics.jsonl"), os.path.join(work, "metrics.jsonl"))
        shutil.rmtree(os.path.join(work, "run"))
        with open(os.path.join(work, "result.json"), "w") as fh:
            json.dump(run.result, fh)
        try:
            os.rename(work, cache)
        except OSError:  # another case wrote it first
            shutil.rmtree(work, ignore_errors=True)
    with open(os.path.join(cache, "result.json")) as fh:
        return json.load(fh), _rows(cache), _raw_rows(cache)


def good_steps(workdir) -> list[int]:
    """The checkpoint steps orbax committed (temporary directories of a save cut short and
    anything else are not steps)."""
    where = os.path.join(workdir, "checkpoints")
    if not os.path.isdir(where):
        return []
    return sorted(int(d) for d in os.listdir(where) if d.isdigit())


# Exceptions that are slips of code, never a message meant for the user.
_SLIPS = ("AttributeError", "KeyError", "TypeError", "IndexError", "NameError",
          "AssertionError", "UnboundLocalError")


def _clear(run: Run) -> str | None:
    """The error a failed run gave, if it is clear: the last line of stderr, from an exception
    the project's own code raised on purpose (or no traceback at all), not one deep in a
    library nor a slip such as an AttributeError."""
    lines = [l for l in run.stderr.strip().splitlines()
             if l.strip() and not l.startswith("Pass --helpshort")]  # absl's hint after it
    if not lines or lines[-1].strip().split(":")[0].split(".")[-1] in _SLIPS:
        return None
    frames = re.findall(r'File "([^"]+)"', run.stderr)
    project = (os.path.join(ROOT, "xformers_jax"), os.path.join(ROOT, "xformers_jax_experiments"))
    if frames and not (frames[-1].startswith(project) or frames[-1] == "<string>"):
        return None
    return lines[-1].strip()


def _resumed(run: Run, workdir, kept: int | None, ref=None) -> Outcome:
    """What a run that should finish a faulted workdir ended in."""
    result, rows, _ = ref or reference()
    if run.code is None:
        return Outcome("hung", f"killed after {TIMEOUT_S:.0f} s", hang=True)
    if run.code == 0:
        if run.result == result and _rows(workdir) == rows:
            return Outcome(RESUME)
        return Outcome("finished with other metrics", wrong=True)
    message = _clear(run)
    still = kept is None or kept in good_steps(workdir)
    if message and still:
        return Outcome(REFUSE, f"exit {run.code}, step {kept} kept: {message[:60]}")
    return Outcome("refused unclearly" if still else "refused, good step deleted",
                   f"exit {run.code}: {(message or run.stderr.strip()[-60:])[:60]}")


# -- the runners -----------------------------------------------------------------------------

def _array_files(step_dir) -> list[str]:
    # The files OCDBT keeps the arrays' bytes in (``d/`` of the step and of each process's
    # database, whichever the save left; not every one holds bytes a restore reads, so the
    # damage goes to each).
    files = glob.glob(os.path.join(step_dir, "state", "**", "d", "*"), recursive=True)
    if not files:
        raise FileNotFoundError(f"no array data files under {step_dir}/state")
    return files


def _corrupt_bytes(step_dir):
    # 64 bytes overwritten in the middle of each array file.
    for path in _array_files(step_dir):
        with open(path, "r+b") as fh:
            fh.seek(os.path.getsize(path) // 2)
            fh.write(b"\xa5" * 64)


def _truncate(step_dir):
    for path in _array_files(step_dir):
        with open(path, "r+b") as fh:
            fh.truncate(os.path.getsize(path) // 2)


def _delete_metadata(step_dir):
    os.remove(os.path.join(step_dir, "state", "_METADATA"))


def _delete_manifest(step_dir):
    os.remove(os.path.join(step_dir, "state", "manifest.ocdbt"))


def _empty_step(step_dir):
    shutil.rmtree(step_dir)
    os.mkdir(step_dir)


# A damage done to the latest checkpoint step directory of a stopped run.
DAMAGES = {"corrupt_bytes": _corrupt_bytes, "truncate": _truncate,
           "delete_metadata": _delete_metadata, "delete_manifest": _delete_manifest,
           "empty_step": _empty_step}


def interrupted(workdir, *, stop: str, ms: float = 0.0, damage: str | None = None) -> Outcome:
    """Stops a run (``stop``: "kill9_save", SIGKILL ``ms`` after the save of SAVE_STEP
    begins; "sigterm", SIGTERM after step 5), optionally damages its latest checkpoint
    (``damage``: a key of DAMAGES), and runs the same command again to the end."""
    ref = reference()
    if stop == "kill9_save":
        started = _start(workdir, FAULTS_SLOW_S=0.02)
        proc, log = started
        deadline = time.monotonic() + TIMEOUT_S
        killed = False
        while proc.poll() is None and time.monotonic() < deadline:  # the moment, to ~1 ms
            with open(log + ".out") as out:
                if f"SAVE {SAVE_STEP}\n" in out.read():
                    time.sleep(ms / 1e3)
                    proc.send_signal(signal.SIGKILL)
                    killed = True
                    break
            time.sleep(0.001)
        first = _finish(started, deadline)
        if first.code is None:
            return Outcome("hung", "before the kill", hang=True)
        if not killed or first.code != -signal.SIGKILL:
            return Outcome("not injected", f"the run ended with exit {first.code} first")
    elif stop == "sigterm":
        first = train(workdir, FAULTS_SIGTERM_AT=5)
        if first.code is None:
            return Outcome("hung", "on SIGTERM", hang=True)
        if first.result != {"preempted": True, "step": 5}:
            return Outcome("not preempted", f"exit {first.code}: {first.stdout[-80:]}")
    else:
        raise ValueError(f"stop must be 'kill9_save' or 'sigterm', got {stop!r}")
    steps = good_steps(workdir)
    kept = steps[-2] if damage and len(steps) > 1 else steps[-1] if steps else None
    if damage:
        if not steps:
            return Outcome("not injected", "no checkpoint to damage")
        DAMAGES[damage](os.path.join(workdir, "checkpoints", str(steps[-1])))
    return _resumed(train(workdir), workdir, kept, ref)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _two(workdir, **env) -> list[Run]:
    port = _free_port()
    procs = [_start(workdir, devices=1, JAX_COORDINATOR_ADDRESS=f"localhost:{port}",
                    JAX_NUM_PROCESSES=2, JAX_PROCESS_ID=i, **env) for i in range(2)]
    deadline = time.monotonic() + TIMEOUT_S
    return [_finish(p, deadline) for p in procs]


def two_hosts(workdir, *, resume_on: int) -> Outcome:
    """Two processes (one CPU device each, CPU collectives) SIGTERMed after steps 3 and 4,
    then resumed on ``resume_on`` processes; against one process with two devices (the same
    global device count, so the same sums)."""
    ref = reference(devices=2)
    first = _two(workdir, FAULTS_SIGTERM_AT=3, FAULTS_SLOW_S=0.25)
    if any(r.code is None for r in first):
        return Outcome("hung", "after SIGTERM", hang=True)
    results = [r.result for r in first]
    if any(r is None or not r.get("preempted") for r in results) or results[0] != results[1]:
        return Outcome("did not stop together", f"{results}"[:80])
    kept = good_steps(workdir)[-1] if good_steps(workdir) else None
    if resume_on == 1:
        return _resumed(train(workdir, devices=2), workdir, kept, ref)
    runs = _two(workdir)
    if any(r.code is None for r in runs):
        return Outcome("hung", "on resume", hang=True)
    outcomes = [_resumed(r, workdir, kept, ref) for r in runs]
    return outcomes[0] if outcomes[0].what != RESUME else outcomes[1]


def concurrent(workdir, *, delay_s: float) -> Outcome:
    """Two trainers on one workdir, the second ``delay_s`` after the first: one finishes
    exactly (every row once) and the other refuses clearly, or both wait their turn."""
    result, _, raw = reference()
    first = _start(workdir, FAULTS_SLOW_S=0.05)
    time.sleep(delay_s)
    second = _start(workdir, FAULTS_SLOW_S=0.05)
    deadline = time.monotonic() + TIMEOUT_S
    runs = [_finish(first, deadline), _finish(second, deadline)]
    if any(r.code is None for r in runs):
        return Outcome("hung", f"exits {[r.code for r in runs]}", hang=True)
    finished = [r for r in runs if r.code == 0]
    if not finished:
        return Outcome("both failed", (_clear(runs[1]) or runs[1].stderr[-60:])[:60])
    if any(r.result != result for r in finished) or _raw_rows(workdir) != raw:
        return Outcome("finished with other metrics or rows twice", wrong=True)
    if len(finished) == 2:
        return Outcome(RESUME, "one after the other")
    refused = next(r for r in runs if r.code != 0)
    message = _clear(refused)
    if message is None:
        return Outcome("refused unclearly", refused.stderr.strip()[-60:])
    return Outcome(REFUSE, f"the other finished exactly: {message[:60]}")


def poisoned(workdir, *, at: int, **env) -> Outcome:
    """A run whose step ``at`` goes wrong in memory (``env``: FAULTS_NAN_AT or
    FAULTS_BAD_ID_AT): it must stop non-zero with a clear error naming that step, with no
    checkpoint of that step or later written."""
    run = train(workdir, **env)
    if run.code is None:
        return Outcome("hung", f"killed after {TIMEOUT_S:.0f} s", hang=True)
    steps = good_steps(workdir)
    if any(s >= at for s in steps):
        return Outcome("saved after the fault", f"steps {steps}", wrong=True)
    if run.code == 0:
        return Outcome("finished", "exit 0 after a faulty step", wrong=True)
    message = _clear(run)
    if message is None or f"step {at}" not in message:
        return Outcome("refused unclearly", (message or run.stderr.strip()[-60:])[:60])
    return Outcome(REFUSE, f"exit {run.code}, steps {steps} kept: {message[:60]}")


def changed_config(workdir, *, flags: tuple) -> Outcome:
    """A run stopped by SIGTERM, resumed with ``flags`` changing its config: it must refuse,
    naming the change, and keep its checkpoints."""
    first = train(workdir, FAULTS_SIGTERM_AT=5)
    if first.code is None:
        return Outcome("hung", "on SIGTERM", hang=True)
    steps = good_steps(workdir)
    return _resumed(train(workdir, flags), workdir, steps[-1] if steps else None)


def finished_rerun(workdir) -> Outcome:
    """A finished run run again: it must write nothing twice (every row once) and report the
    recorded result."""
    first = train(workdir)
    if first.code != 0:
        return Outcome("not finished", f"exit {first.code}")
    rows = _raw_rows(workdir)
    again = train(workdir)
    if again.code is None:
        return Outcome("hung", "on the rerun", hang=True)
    if again.code != 0 or _raw_rows(workdir) != rows:
        return Outcome("rows written twice or refused", f"exit {again.code}", wrong=True)
    return Outcome(RESUME, "nothing written twice")


def snippet(workdir, *, code: str, says: str) -> Outcome:
    """A bad input given to the library's API (``code``, run in a subprocess with ``W`` the
    scenario's directory): it must end in a clear error matching ``says``."""
    os.makedirs(workdir, exist_ok=True)
    try:
        proc = subprocess.run([sys.executable, "-c", f"W = {workdir!r}\n{code}"], cwd=ROOT,
                              env=_env(1), capture_output=True, text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return Outcome("hung", f"killed after {TIMEOUT_S:.0f} s", hang=True)
    run = Run(proc.returncode, proc.stdout, proc.stderr)
    if run.code == 0:
        return Outcome("accepted", run.stdout.strip()[-60:], wrong=True)
    message = _clear(run)
    if message is None or not re.search(says, message, re.IGNORECASE):
        return Outcome("unclear error", run.stderr.strip()[-60:])
    return Outcome(ERROR, message[:80])


# Bad data given to the loaders: a label out of range in a ListOps TSV, a token id out of
# range in a task split, a CIFAR batch whose pickle would run code (the marker file must not
# appear).
_TSV = r"""
import os
from xformers_jax import data
os.makedirs(W, exist_ok=True)
with open(os.path.join(W, "basic_train.tsv"), "w") as fh:
    fh.write("Source\tTarget\n( [MAX 2 9 ] )\t9\n( [MIN 2 9 ] )\t10\n")
data.load_listops_tsv(W, "train")
"""
_IDS = """
import numpy as np
from xformers_jax import data
data.check_arrays({"inputs": np.array([[1, 2], [3, 20]]), "targets": np.array([0, 1])},
                  vocab_size=20, num_classes=10, where="train split")
"""
_CIFAR = """
import os, pickle
from xformers_jax import data
class Evil:
    def __reduce__(self):
        return (os.system, ("touch " + os.path.join(W, "PWNED"),))
root = os.path.join(W, "cifar-10-batches-py")
os.makedirs(root, exist_ok=True)
with open(os.path.join(root, "test_batch"), "wb") as fh:
    pickle.dump({b"data": Evil(), b"labels": [0]}, fh)
try:
    data.load_cifar10(W, "test")
finally:
    assert not os.path.exists(os.path.join(W, "PWNED")), "the pickle ran code"
"""


def bad_flags(workdir, *, flags: tuple, says: str) -> Outcome:
    """The trainer with ``flags`` must exit non-zero with a clear error matching ``says``."""
    run = train(workdir, flags)
    if run.code is None:
        return Outcome("hung", hang=True)
    if run.code == 0:
        return Outcome("accepted", f"exit 0: {(run.stdout.strip().splitlines() or [''])[-1][:60]}",
                       wrong=True)
    message = _clear(run)
    if message is None or not re.search(says, message, re.IGNORECASE):
        last = (run.stderr.strip().splitlines() or ["no output"])[-1]
        return Outcome("unclear error", f"{len(run.stderr.splitlines())} lines: {last[:60]}")
    return Outcome(ERROR, message[:80])


# -- the table -------------------------------------------------------------------------------

SCENARIOS = (
    *(Scenario(f"kill -9 {ms} ms into the save of step {SAVE_STEP}", "fault", RESUME,
               "interrupted", {"stop": "kill9_save", "ms": ms}) for ms in range(0, 50, 5)),
    Scenario("SIGTERM, one process", "fault", RESUME, "interrupted", {"stop": "sigterm"}),
    Scenario("2-host preemption, resumed on 1 process", "fault", RESUME, "two_hosts",
             {"resume_on": 1}),
    Scenario("2-host preemption, resumed on 2 processes", "fault", RESUME, "two_hosts",
             {"resume_on": 2}),
    *(Scenario(f"SIGTERM, then the latest checkpoint damaged: {d}", "fault", RESUME,
               "interrupted", {"stop": "sigterm", "damage": d}) for d in DAMAGES),
    Scenario("two trainers on one workdir, started together", "fault", REFUSE, "concurrent",
             {"delay_s": 0.0}),
    Scenario("two trainers on one workdir, started 3 s apart", "fault", REFUSE, "concurrent",
             {"delay_s": 3.0}),
    Scenario("NaN loss at step 7", "fault", REFUSE, "poisoned",
             {"at": 7, "FAULTS_NAN_AT": 7}),
    Scenario("token id out of range at step 7", "fault", REFUSE, "poisoned",
             {"at": 7, "FAULTS_BAD_ID_AT": 7}),
    Scenario("resumed with another seed", "fault", REFUSE, "changed_config",
             {"flags": ("--config.seed=1",)}),
    Scenario("a finished run run again", "fault", RESUME, "finished_rerun", {}),
    Scenario("--config.foo=1 (unknown key)", "input", ERROR, "bad_flags",
             {"flags": ("--config.foo=1",), "says": "no key 'foo'|foo.*did you mean"}),
    Scenario("--config.optim.schedule=linearr", "input", ERROR, "bad_flags",
             {"flags": ("--config.optim.schedule=linearr",), "says": "schedule"}),
    Scenario("--config.num_train_steps=0", "input", ERROR, "bad_flags",
             {"flags": ("--config.num_train_steps=0",), "says": "num_train_steps"}),
    Scenario("--config.optim.learning_rate=1e3 (diverges)", "input", ERROR, "bad_flags",
             {"flags": ("--config.optim.learning_rate=1e3",), "says": "learning_rate"}),
    Scenario("--config.optim.warmup_steps=-5", "input", ERROR, "bad_flags",
             {"flags": ("--config.optim.warmup_steps=-5",), "says": "warmup"}),
    Scenario("--config.optim.learning_rate=nan", "input", ERROR, "bad_flags",
             {"flags": ("--config.optim.learning_rate=nan",), "says": "learning_rate"}),
    Scenario("--config.model.attention.num_featurs=8 (a slot hyperparameter's typo)", "input",
             ERROR, "bad_flags", {"flags": ("--config.model.attention.num_featurs=8",),
                                  "says": "num_featurs"}),
    Scenario("ListOps TSV with label 10", "input", ERROR, "snippet",
             {"code": _TSV, "says": "label.*10|10.*label"}),
    Scenario("token id 20 in a split of vocabulary 20", "input", ERROR, "snippet",
             {"code": _IDS, "says": "token id"}),
    Scenario("CIFAR batch whose pickle would run code", "input", ERROR, "snippet",
             {"code": _CIFAR, "says": "Unpickl|refuse|not allowed|forbidden"}),
)
# Quick mode (a smoke test, and what tests/test_benchmark_harness.py builds): two bad inputs
# that cost one short trainer start each.
QUICK = ("--config.optim.schedule=linearr", "--config.num_train_steps=0")


def cases(quick: bool) -> list[Case]:
    chosen = [s for s in SCENARIOS if not quick or s.name in QUICK]
    return [Case(s.name, _BUILD, {"scenario": s.name, "kind": s.kind}, ("run",))
            for s in chosen]


def build(scenario: str, kind: str) -> Workload:
    """Runs the scenario; raises :class:`Unexpected` unless it ended as expected."""
    s = next(s for s in SCENARIOS if s.name == scenario)
    where = tempfile.mkdtemp(prefix="xformers_jax_faults_")
    try:
        outcome = globals()[s.runner](os.path.join(where, "run"), **s.params)
    finally:
        shutil.rmtree(where, ignore_errors=True)
    if outcome.what != s.expect or outcome.hang or outcome.wrong:
        raise Unexpected(outcome.text())
    return Workload(None, (), native=lambda mode: lambda: None)


def _judged(s: Scenario, record: dict | None) -> tuple[str, bool | None, bool, bool]:
    """``(measured, acceptable, hang, silent wrong result)`` of a scenario's record."""
    if record is None:
        return "not run", None, False, False
    error = record.get("error")
    if not error:
        return f"observed: {s.expect}; hang: no; silent wrong result: no", True, False, False
    if "timeout" in error and "observed:" not in error:  # the harness's own limit
        return f"hung: {error}", False, True, False
    found = re.search(r"observed: (.*?); hang: (yes|no); silent wrong result: (yes|no)", error)
    if not found:
        return f"failed to run: {error[:120]}", False, False, False
    what, hang, wrong = found.group(1), found.group(2) == "yes", found.group(3) == "yes"
    allowed = _FAULT_OK if s.kind == "fault" else (ERROR,)
    ok = any(what.startswith(a) for a in allowed) and not hang and not wrong
    return found.group(0), ok, hang, wrong


def checks(results: Results) -> list[Check]:
    out, tally = [], {"fault": [], "input": []}
    for s in SCENARIOS:
        record = next((r for r in results.records if r["params"].get("scenario") == s.name),
                      None)
        if record is None:
            continue
        measured, ok, hang, wrong = _judged(s, record)
        target = (f"{RESUME} or {REFUSE}" if s.kind == "fault" else ERROR)
        out.append(Check(f"{s.kind}: {s.name} (expected: {s.expect})", measured, target, ok))
        tally[s.kind].append((ok, hang, wrong))

    def share(rows):
        good = sum(1 for ok, _, _ in rows if ok)
        return f"{good}/{len(rows)} ({100 * good / len(rows):.0f}%)", good == len(rows)

    faults, inputs = tally["fault"], tally["input"]
    if faults:
        measured, ok = share(faults)
        hangs = sum(h for _, h, _ in faults + inputs)
        wrong = sum(w for _, _, w in faults + inputs)
        out += [Check("Faults injected: resume exactly or refuse clearly with the last good "
                      "step kept", measured, "100%", ok),
                Check("Hangs (faults and bad inputs)", str(hangs), "0", hangs == 0),
                Check("Silent wrong results (faults and bad inputs)", str(wrong), "0",
                      wrong == 0)]
    if inputs:
        measured, ok = share(inputs)
        out.append(Check("Bad inputs tried: a clear error or a documented correct result",
                         measured, "100%", ok))
    return out
