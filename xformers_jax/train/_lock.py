"""One trainer per workdir: ``<workdir>/lock`` names the run that owns it.

Two trainers on one workdir interleave checkpoints (orbax renames each other's temporary
directories) and append every metrics row twice. ``WorkdirLock.acquire`` creates the lock file
atomically (``O_CREAT | O_EXCL``) holding ``{"host", "pid", "started", "argv"}``; a second
trainer finds it and refuses, naming the holder. A lock whose holder is gone (the same host and
no process with its pid: a ``kill -9``, an out-of-memory kill, a crash before ``release``) is
stale: it is taken over with a warning (renamed aside first, atomically, so that two trainers
taking over the same stale lock cannot both win). A lock from another host cannot be checked:
the message says to delete it if that run is over.

In a multi-process run the lock belongs to the job, not to each process: process 0 takes it
and tells the others (``multihost_utils.broadcast_one_to_all``), so that every process of a
second job stops with the same refusal instead of waiting in a collective for a process 0 that
left; per-process locks would let a second job's processes 1.. start when it has more
processes than the first.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time

from absl import logging

LOCK = "lock"


class WorkdirLocked(RuntimeError):
    """Another trainer owns the workdir."""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _stale(holder: dict | None) -> bool:
    # A holder on this host whose process is gone (kill -9, out of memory, a crash).
    return bool(holder) and holder.get("host") == socket.gethostname() and isinstance(
        holder.get("pid"), int) and not _alive(holder["pid"])


class WorkdirLock:
    """The lock file of ``workdir``; ``acquire`` then ``release`` (or ``with``)."""

    def __init__(self, workdir: str):
        self.path = os.path.join(os.path.abspath(workdir), LOCK)
        self.held = False

    def _holder(self) -> dict | None:
        try:
            with open(self.path) as fh:
                return json.load(fh)
        except FileNotFoundError:
            return None
        except (OSError, ValueError):
            return {}  # being written, or unreadable: treated as held

    def holder(self) -> dict | None:
        """The trainer that holds the workdir: its ``{"host", "pid", "started", "argv"}``
        (``{}`` while the file is being written), or None when the workdir is free or its
        holder is gone (a stale lock: the same host and no process with its pid). A holder on
        another host cannot be checked and is returned as holding."""
        holder = self._holder()
        return None if _stale(holder) else holder

    def _try_create(self) -> bool:
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        me = {"host": socket.gethostname(), "pid": os.getpid(),
              "started": time.strftime("%Y-%m-%d %H:%M:%S"), "argv": sys.argv}
        with os.fdopen(fd, "w") as fh:
            json.dump(me, fh)
        return True

    def acquire(self) -> None:
        """Takes the lock; ``WorkdirLocked`` (naming the holder) when a live run holds it."""
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        for _ in range(10):
            if self._try_create():
                self.held = True
                return
            holder = self._holder()
            if holder is None:
                continue  # released meanwhile
            host, pid = holder.get("host"), holder.get("pid")
            who = f"pid {pid} on host {host} (started {holder.get('started')})"
            if _stale(holder):
                aside = f"{self.path}.stale-{pid}"
                try:
                    os.rename(self.path, aside)  # one of two racing trainers wins this
                except FileNotFoundError:
                    continue
                os.remove(aside)
                logging.warning("%s: taking over a stale lock: its holder, %s, is no longer "
                                "running", self.path, who)
                continue
            if not holder:
                raise WorkdirLocked(f"{self.path} exists and cannot be read: another trainer "
                                    "is starting in this workdir")
            advice = ("wait for it, stop it, or use another --workdir" if host ==
                      socket.gethostname() else "if that run is over, delete the lock file")
            raise WorkdirLocked(f"workdir {os.path.dirname(self.path)} is in use by another "
                                f"trainer: {who}; {advice}")
        raise WorkdirLocked(f"{self.path}: could not take the lock (it keeps changing hands)")

    def release(self) -> None:
        if self.held:
            self.held = False
            try:
                os.remove(self.path)
            except FileNotFoundError:
                pass

    def __enter__(self):
        self.acquire()
        return self

    def __exit__(self, *exc):
        self.release()


def acquire_for_job(workdir: str) -> WorkdirLock:
    """Process 0 takes ``workdir``'s lock and every process learns whether it did; all
    processes raise ``WorkdirLocked`` together when it did not. Returns the lock (held only
    by process 0)."""
    import jax

    lock = WorkdirLock(workdir)
    error = None
    if jax.process_index() == 0:
        try:
            lock.acquire()
        except WorkdirLocked as e:
            error = e
    if jax.process_count() > 1:
        import numpy as np
        from jax.experimental import multihost_utils

        taken = bool(multihost_utils.broadcast_one_to_all(np.int32(error is None)))
        if not taken and error is None:
            error = WorkdirLocked(f"workdir {os.path.dirname(lock.path)} is in use by another "
                                  "trainer (process 0 names it)")
    if error is not None:
        raise error
    return lock
