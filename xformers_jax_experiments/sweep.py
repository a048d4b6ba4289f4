r"""Sweeps: a config module's ``get_hyper(hyper)`` lists the runs; run them here or on a TPU pod.

A sweep is a function in the config module (big_vision style)::

  def get_hyper(hyper):
      return hyper.product([
          hyper.sweep("config.optim.learning_rate", [1e-3, 3e-3]),
          hyper.sweep("config.model.attention.kind", ["performer", "linear"]),
      ])

Each run is one ``xformers_jax_experiments.train`` with those ``--config.KEY=VALUE`` overrides and
its own workdir ``WORKDIR/NNN``. Locally, ``--num_processes`` runs go at a time and the results are
gathered into one table (``WORKDIR/sweep.md``, ``WORKDIR/sweep.json``) from each run's
``metrics.jsonl``; the ListOps config's sweep is three learning rates over two seeds::

  python -m xformers_jax_experiments.sweep \
      --config=xformers_jax_experiments/configs/lra/listops.py:performer,runlocal \
      --workdir=/tmp/sweep --num_processes=2

``--tpu=NAME --zone=ZONE`` prints instead the commands that launch the runs one after the
other on every worker of a TPU pod slice (``gcloud compute tpus tpu-vm ssh --worker=all``);
the trainer then initialises ``jax.distributed`` (``--multihost``). Nothing is executed::

  python -m xformers_jax_experiments.sweep \
      --config=xformers_jax_experiments/configs/lra/text.py:performer \
      --workdir=/mnt/runs/text --tpu=my-pod --zone=us-central2-b

``--set=KEY=VALUE`` (repeatable) applies an override to every run. ``hyper.args([...])``
sweeps the config argument itself (the ``:ARG`` after the file: an attention variant, a
token mixer, a size), for runs that differ in more than overridable keys.
"""

from __future__ import annotations

import importlib.util
import itertools
import json
import os
import shlex
import subprocess
import sys
import time

from absl import app, flags

from xformers_jax_experiments import run_lib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FLAGS = flags.FLAGS


def define_flags() -> None:
    """The command's flags, defined when it runs as a script (or by a script built on it, such
    as the zoo study's runner), never at import: absl flags are process-global, and a test
    process imports this module beside the trainer's CLI, whose ``--config`` it would clash
    with."""
    flags.DEFINE_string("config", None, "Config file, optionally ':ARG'.")
    flags.DEFINE_string("workdir", None, "Base directory: one sub-directory per run.")
    flags.DEFINE_integer("num_processes", 1, "Local runs at a time.")
    flags.DEFINE_multi_string("set", [], "KEY=VALUE override for every run (KEY without the "
                              "'config.' prefix).")
    flags.DEFINE_string("tpu", None, "TPU VM name: print the pod launch commands instead.")
    flags.DEFINE_string("zone", None, "TPU zone (with --tpu).")
    flags.DEFINE_string("project", None, "GCP project (with --tpu; optional).")
    flags.DEFINE_string("repo_dir", "~/xformers_jax", "The checkout on the TPU workers.")
    flags.DEFINE_string("python", None, "Python on the runners (default: this one locally, "
                        "python3 on a TPU).")
    flags.DEFINE_bool("dry_run", False, "Print the local commands, run nothing.")
    flags.DEFINE_bool("resume", False, "Locally, skip runs whose directory already holds a "
                      "finished run's metrics (a test_accuracy record): resumes an interrupted "
                      "sweep with the same arguments.")


# The run key of a swept config argument (Hyper.args).
ARG = "config_arg"


class Hyper:
    """The ``hyper`` argument of ``get_hyper``: builds lists of ``{"config.KEY": value}``.

    ``arg`` is the sweep's own config argument (``--config=FILE:ARG``; None without one), for
    a sweep whose runs depend on it (e.g. a data directory that adds runs when it holds the
    files)."""

    def __init__(self, arg: str | None = None):
        self.arg = arg

    @staticmethod
    def sweep(name: str, values) -> list[dict]:
        """One run per value of ``name`` (``"config.a.b"``)."""
        if not name.startswith("config."):
            raise ValueError(f"sweep keys start with 'config.', got {name!r}")
        return [{name: v} for v in values]

    @staticmethod
    def args(values) -> list[dict]:
        """One run per config argument: ``--config=FILE:VALUE`` instead of ``FILE:ARG``."""
        return [{ARG: v} for v in values]

    @staticmethod
    def fixed(name: str, value) -> list[dict]:
        return Hyper.sweep(name, [value])

    @staticmethod
    def product(sweeps) -> list[dict]:
        """Every combination (the last sweep varies fastest)."""
        return [dict(kv for d in combo for kv in d.items())
                for combo in itertools.product(*sweeps)]

    @staticmethod
    def chainit(sweeps) -> list[dict]:
        """The runs of each sweep one after another."""
        return [d for s in sweeps for d in s]

    @staticmethod
    def zipit(sweeps) -> list[dict]:
        """Runs that pair the sweeps' values in order (equal lengths)."""
        sweeps = list(sweeps)
        if len({len(s) for s in sweeps}) > 1:
            raise ValueError(f"zipit needs sweeps of equal length, got {[len(s) for s in sweeps]}")
        return [dict(kv for d in combo for kv in d.items()) for combo in zip(*sweeps)]


def load_hyper(config: str) -> list[dict]:
    """The runs ``get_hyper(Hyper(ARG))`` lists in ``config``'s file (``FILE[:ARG]``; one empty
    run without ``get_hyper``)."""
    path, *arg = config.split(":", 1)
    spec = importlib.util.spec_from_file_location("_sweep_config", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if not hasattr(module, "get_hyper"):
        return [{}]
    return list(module.get_hyper(Hyper(arg[0] if arg else None)))


def _value(v) -> str:
    return str(v).lower() if isinstance(v, bool) else str(v)


def _override(key: str, value) -> str:
    return f"--{key}={_value(value)}"


def run_args(config: str, workdir: str, run: dict, overrides=(), *, python: str,
             multihost: bool = False) -> list[str]:
    """The ``xformers_jax_experiments.train`` argument list of one run."""
    if ARG in run:
        config = f"{config.split(':', 1)[0]}:{run[ARG]}"
    args = [python, "-m", "xformers_jax_experiments.train", f"--config={config}",
            f"--workdir={workdir}"]
    args += [f"--config.{o}" for o in overrides]
    args += [_override(k, v) for k, v in run.items() if k != ARG]
    return args + (["--multihost"] if multihost else [])


def run_dir(base: str, index: int) -> str:
    return os.path.join(base, f"{index:03d}")



def _remote_path(path: str) -> str:
    """``path`` quoted for the remote shell: a value is data, never code (a ``--repo_dir``
    holding ``; rm -rf ~`` is a directory name); a leading ``~/`` stays unquoted so that the
    remote shell still expands it to the worker's home."""
    if path == "~":
        return "~"
    if path.startswith("~/"):
        return "~/" + shlex.quote(path[2:])
    return shlex.quote(path)


def tpu_commands(config: str, base: str, runs, overrides=(), *, tpu: str, zone: str,
                 project: str | None = None, repo_dir: str = "~/xformers_jax",
                 python: str = "python3") -> list[str]:
    """One ``gcloud ... ssh --worker=all`` command per run: every host of the slice starts
    the same trainer, which joins them with ``jax.distributed.initialize``."""
    out = []
    for i, run in enumerate(runs):
        args = run_args(config, run_dir(base, i), run, overrides, python=python, multihost=True)
        remote = f"cd {_remote_path(repo_dir)} && " + " ".join(shlex.quote(a) for a in args)
        cmd = ["gcloud", "compute", "tpus", "tpu-vm", "ssh", tpu, f"--zone={zone}"]
        cmd += [f"--project={project}"] if project else []
        cmd += ["--worker=all", f"--command={remote}"]
        out.append(" ".join(shlex.quote(a) for a in cmd))
    return out


def finished(path: str) -> bool:
    """Whether the run directory ``path`` holds a finished run (a ``test_accuracy`` record in
    its ``metrics.jsonl``)."""
    return run_lib.last(run_lib.read_metrics(path, missing_ok=True), "test_accuracy") is not None


def run_local(config: str, base: str, runs, overrides=(), *, num_processes: int = 1,
              python: str = sys.executable, log=print, resume: bool = False,
              names=None) -> list[int]:
    """Runs every run, ``num_processes`` at a time; returns their exit codes. With
    ``resume``, a run whose directory already holds a finished run is not run again (code 0).
    ``names``: each run's directory name under ``base`` (default ``NNN``, its index); a sweep
    whose list of runs grows between invocations names them by content so that resuming
    finds each run's directory again."""
    runs = list(runs)
    if names is not None:
        names = list(names)
        if len(names) != len(runs) or len(set(names)) != len(names):
            raise ValueError(f"names must be {len(runs)} distinct directory names, one per "
                             f"run; got {len(names)} ({len(set(names))} distinct)")

    def where(i):
        return os.path.join(base, names[i]) if names is not None else run_dir(base, i)

    pending = list(enumerate(runs))
    active, codes = {}, {}
    if resume:
        for i, _ in list(pending):
            if finished(where(i)):
                log(f"[sweep] run {i:03d} already finished in {where(i)}: kept")
                codes[i] = 0
        pending = [(i, run) for i, run in pending if i not in codes]
    while pending or active:
        while pending and len(active) < num_processes:
            i, run = pending.pop(0)
            os.makedirs(where(i), exist_ok=True)
            log_file = open(os.path.join(where(i), "train.log"), "w")
            args = run_args(config, where(i), run, overrides, python=python)
            log(f"[sweep] start {i:03d}: " + " ".join(shlex.quote(a) for a in args[1:]))
            proc = subprocess.Popen(args, stdout=log_file, stderr=subprocess.STDOUT, cwd=ROOT)
            active[i] = (proc, log_file)
        for i, (proc, log_file) in list(active.items()):
            if proc.poll() is not None:
                log_file.close()
                codes[i] = proc.returncode
                log(f"[sweep] run {i:03d} finished with exit code {proc.returncode}")
                del active[i]
        time.sleep(0.2)
    return [codes[i] for i in range(len(runs))]


RESULT_METRICS = ("test_accuracy", "test_loss", "validation_accuracy", "steps_per_second")


def gather(base: str, runs) -> list[dict]:
    """One row per run: its overrides and the last value of each of ``RESULT_METRICS`` in its
    ``metrics.jsonl`` (missing when the run wrote none)."""
    rows = []
    for i, run in enumerate(runs):
        row = {"run": f"{i:03d}", **{k.removeprefix("config."): v for k, v in run.items()}}
        row.update(run_lib.latest(run_lib.read_metrics(run_dir(base, i), missing_ok=True),
                               RESULT_METRICS))
        rows.append(row)
    return rows


def table(rows: list[dict]) -> str:
    """A markdown table of ``rows`` (columns in first-seen order)."""
    columns = []
    for r in rows:
        columns += [k for k in r if k not in columns]

    def cell(v):
        return "" if v is None else f"{v:.4g}" if isinstance(v, float) else str(v)

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(r.get(c)) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    config, base = FLAGS.config, FLAGS.workdir
    runs = load_hyper(config)
    if FLAGS.tpu:
        if not FLAGS.zone:
            raise app.UsageError("--tpu needs --zone")
        for cmd in tpu_commands(config, base, runs, FLAGS.set, tpu=FLAGS.tpu,
                                zone=FLAGS.zone, project=FLAGS.project,
                                repo_dir=FLAGS.repo_dir, python=FLAGS.python or "python3"):
            print(cmd)
        return
    python = FLAGS.python or sys.executable
    if FLAGS.dry_run:
        for i, run in enumerate(runs):
            print(" ".join(shlex.quote(a) for a in run_args(config, run_dir(base, i), run,
                                                            FLAGS.set, python=python)))
        return
    codes = run_local(config, base, runs, FLAGS.set, num_processes=FLAGS.num_processes,
                      python=python, resume=FLAGS.resume)
    rows = gather(base, runs)
    for row, code in zip(rows, codes):
        row["exit_code"] = code
    text = table(rows)
    with open(os.path.join(base, "sweep.md"), "w") as fh:
        fh.write(text + "\n")
    with open(os.path.join(base, "sweep.json"), "w") as fh:
        json.dump(rows, fh, indent=1)
    print(text)
    if any(codes):
        sys.exit(1)


if __name__ == "__main__":
    define_flags()
    flags.mark_flags_as_required(["config", "workdir"])
    app.run(main)
