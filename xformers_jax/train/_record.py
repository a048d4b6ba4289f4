"""The run record: what a workdir was trained with, by which code, and whether it finished.

``<workdir>/config.json`` is the resolved config (``config_json``: every key, sorted; values
JSON can hold as they are, tuples as lists, other objects such as sparsity patterns as their
``repr``). ``<workdir>/run.json`` holds ``config_file`` (that file's name), one entry per
start in ``sessions`` (time, host, pid, the code version: the
package version and, when the package is a git checkout, the commit and whether the tree had
uncommitted changes; the versions of jax, jaxlib, equinox, optax, orbax-checkpoint, grain,
ml-collections and numpy; the config keys changed on that start; and, when the start ends,
``ended``, ``outcome`` (``"finished"``, ``"preempted"`` or ``"failed: <error>"``), the step it
ended at when known, ``wall_s`` and ``cpu_s``: the start's wall and process CPU time, all
threads, from its record to its end) and, once the run is over, ``finished``: its step and
final metrics. Both files are written by process 0, atomically
(a temporary file renamed over the old one).

A resume compares the config with the recorded one: a difference raises ``ConfigChanged``
listing each changed key as ``key: old -> new`` unless ``allow_config_change`` (then the
change is recorded in the session). Keys that change no number of the run (``FREE``: the
progress bar, plots, TensorBoard, how many checkpoints to keep, the mesh and sharding rules)
may always change. A key the recorded config lacks, set to its default (``defaults``: the
trainer passes ``base_config`` of the run's task and model kind), is not a change: an option
added to the code after the run started defaults to the behaviour of the code before it, so
the run resumes and the session lists the key under ``config_keys_added``. A finished
run whose ``num_train_steps`` is not larger than the step it finished at is not run again:
``begin`` returns its recorded result and nothing is written (no second test row, events file
or plot).
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import socket
import subprocess
import time

from absl import logging

RECORD, CONFIG = "run.json", "config.json"
PACKAGES = ("jax", "jaxlib", "equinox", "optax", "orbax-checkpoint", "grain", "ml-collections",
            "numpy")
# Keys (and sections) that change nothing the run computes: what it shows and keeps, and
# where it runs (checkpoints restore onto any mesh).
FREE = ("progress_bar", "plot", "tensorboard", "keep_checkpoints", "mesh", "sharding")


class ConfigChanged(ValueError):
    """A resume with a config other than the one the workdir was started with."""


def _jsonable(value):
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in sorted(value.items())}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return repr(value)


def config_json(config) -> dict:
    """The config as the record stores it (nested dicts, keys sorted)."""
    return _jsonable(config.to_dict() if hasattr(config, "to_dict") else dict(config))


def _flat(tree: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict) and v:
            out |= _flat(v, f"{prefix}{k}.")
        else:
            out[prefix + k] = v
    return out


def added_at_default(old: dict, new: dict, defaults: dict | None) -> list[str]:
    """``["key: value", ...]``: the keys of ``new`` that ``old`` lacks and whose value is their
    default in ``defaults`` (all three ``config_json`` trees; none when ``defaults`` is None)."""
    return [f"{k}: {json.dumps(v)}" for k, v in _at_default(old, new, defaults).items()]


def _at_default(old: dict, new: dict, defaults: dict | None) -> dict:
    if defaults is None:
        return {}
    a, b, d = _flat(old), _flat(new), _flat(defaults)
    return {k: b[k] for k in sorted(b) if k not in a and k in d and b[k] == d[k]}


def config_changes(old: dict, new: dict, defaults: dict | None = None) -> list[str]:
    """``["key: old -> new", ...]`` between two ``config_json`` trees (keys in ``FREE``
    ignored; a key one side lacks shows as ``(absent)``; a key ``old`` lacks that ``new`` sets
    to its value in ``defaults`` is not a change, see ``added_at_default``)."""
    a, b = _flat(old), _flat(new)
    missing = "(absent)"
    added = _at_default(old, new, defaults)
    return [f"{k}: {json.dumps(a[k]) if k in a else missing} -> "
            f"{json.dumps(b[k]) if k in b else missing}"
            for k in sorted(set(a) | set(b))
            if k.split(".")[0] not in FREE and k not in added
            and a.get(k, missing) != b.get(k, missing)]


def code_version() -> dict:
    """``{"xformers_jax": version, "git_commit", "git_dirty"}`` (git fields when the package is
    a git checkout and git is installed)."""
    try:
        out = {"xformers_jax": importlib.metadata.version("xformers_jax")}
    except importlib.metadata.PackageNotFoundError:
        out = {"xformers_jax": None}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    try:
        commit = subprocess.run(["git", "-C", root, "rev-parse", "HEAD"], capture_output=True,
                                text=True, timeout=10, check=False)
        if commit.returncode == 0:
            status = subprocess.run(["git", "-C", root, "status", "--porcelain",
                                     "--untracked-files=no"], capture_output=True, text=True,
                                    timeout=10, check=False)
            out |= {"git_commit": commit.stdout.strip(), "git_dirty": bool(status.stdout.strip())}
    except (OSError, subprocess.SubprocessError):
        pass
    return out


def package_versions() -> dict:
    out = {}
    for name in PACKAGES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def _write_atomic(path: str, payload: dict) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as fh:
        json.dump(payload, fh, indent=1, sort_keys=True)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


class RunRecord:
    """``workdir``'s ``run.json`` and ``config.json``; ``writer``: whether this process
    writes them (process 0)."""

    def __init__(self, workdir: str, *, writer: bool = True):
        self.workdir = os.path.abspath(workdir)
        self.path = os.path.join(self.workdir, RECORD)
        self.writer = writer
        self._clock = None  # (wall, process CPU) seconds when this start was recorded

    def read(self) -> dict | None:
        if not os.path.exists(self.path):
            return None
        with open(self.path) as fh:
            return json.load(fh)

    def begin(self, config, *, allow_config_change: bool = False,
              defaults=None) -> dict | None:
        """Checks ``config`` against the record and records this start; returns the recorded
        result of a finished run (then records nothing), else None.

        Raises ``ConfigChanged`` (listing ``key: old -> new``) when the workdir was started
        with another config and ``allow_config_change`` is False. ``defaults`` (a config of
        the same schema, or None): a key the recorded config lacks is no change when
        ``config`` sets it to its value there."""
        record, new = self.read(), config_json(config)
        defaults = None if defaults is None else config_json(defaults)
        changes, added = [], []
        if record is not None:
            with open(os.path.join(self.workdir, record.get("config_file", CONFIG))) as fh:
                old = json.load(fh)
            changes = config_changes(old, new, defaults)
            added = added_at_default(old, new, defaults)
            if added:
                logging.info("%s: keys the recorded config lacks, at their defaults: %s",
                             self.workdir, "; ".join(added))
            if changes and not allow_config_change:
                raise ConfigChanged(
                    f"{self.workdir} was started with another config ({len(changes)} "
                    f"key(s) differ): {'; '.join(changes)}. Resume with the recorded config "
                    f"({os.path.join(self.workdir, CONFIG)}), use another workdir, or allow "
                    "the change (--allow_config_change; "
                    "train_and_evaluate(..., allow_config_change=True))")
            finished = record.get("finished")
            if finished and config.num_train_steps <= finished["step"]:
                return finished["result"]
        elif os.path.isdir(os.path.join(self.workdir, "checkpoints")):
            logging.warning("%s has checkpoints but no run record (an earlier version): "
                            "recording this config", self.workdir)
        if not self.writer:
            return None
        record = record or {"config_file": CONFIG, "sessions": []}
        record.pop("finished", None)
        self._clock = (time.time(), time.process_time())
        record["sessions"].append({
            "started": time.strftime("%Y-%m-%d %H:%M:%S"), "host": socket.gethostname(),
            "pid": os.getpid(), "code": code_version(), "packages": package_versions(),
            "config_changes": changes, **({"config_keys_added": added} if added else {})})
        os.makedirs(self.workdir, exist_ok=True)
        _write_atomic(os.path.join(self.workdir, CONFIG), new)
        _write_atomic(self.path, record)
        return None

    def end(self, outcome: str, step: int | None = None) -> None:
        """Records how this start ended (``outcome``: ``"finished"``, ``"preempted"`` or
        ``"failed: ..."``), the step it ended at, and its wall and CPU seconds since
        :meth:`begin` recorded it."""
        if not self.writer or self._clock is None:
            return
        wall, cpu = time.time() - self._clock[0], time.process_time() - self._clock[1]
        record = self.read()
        session = record["sessions"][-1]
        session.update(ended=time.strftime("%Y-%m-%d %H:%M:%S"), outcome=outcome[:300],
                       wall_s=round(wall, 3), cpu_s=round(cpu, 3))
        if step is not None:
            session["step"] = int(step)
        _write_atomic(self.path, record)
        self._clock = None

    def spent(self) -> dict:
        """What the run has cost so far: ``wall_s`` and ``cpu_s`` summed over its starts that
        recorded their end, and ``timed``: whether every start did (a start that was killed,
        or ran before starts recorded their end, did not; a finished run's last such start
        still counts its wall time, from its start to ``finished``). None without a record."""
        record = self.read()
        if record is None:
            return None
        wall = cpu = 0.0
        timed = True
        stamp = lambda text: time.mktime(time.strptime(text, "%Y-%m-%d %H:%M:%S"))  # noqa: E731
        sessions = record.get("sessions", [])
        for i, session in enumerate(sessions):
            if "wall_s" in session:
                wall, cpu = wall + session["wall_s"], cpu + session["cpu_s"]
                continue
            timed = False
            if i == len(sessions) - 1 and "finished" in record and "time" in record["finished"]:
                wall += stamp(record["finished"]["time"]) - stamp(session["started"])
        return dict(wall_s=wall, cpu_s=cpu, timed=timed)

    def finish(self, result: dict) -> None:
        """Records the run as finished with ``result`` (its ``step`` and final metrics)."""
        if not self.writer:
            return
        record = self.read()
        record["finished"] = {"step": int(result["step"]), "result": _jsonable(result),
                              "time": time.strftime("%Y-%m-%d %H:%M:%S")}
        _write_atomic(self.path, record)
