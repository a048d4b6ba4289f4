"""The benchmark harness: cases, measurement in fresh subprocesses, results and checks.

A suite is a module ``xformers_jax_experiments/suites/<name>.py`` defining:

- ``TITLE``: one line for BENCHMARKS.md (and optionally ``NOTE``: a paragraph shown under it);
- ``cases(quick: bool) -> list[Case]``: what to measure (``quick`` shrinks it to seconds);
- a builder per case (``Case.builder = "xformers_jax_experiments.suites.<name>:<function>"``)
  called in the worker process as ``builder(**case.params) -> Workload``;
- ``checks(results: Results) -> list[Check]``: the suite's target figures (each from the paper
  or design goal its figure names), computed from this run's measurements as ratios (machines
  are shared and noisy, so only ratios within one run count).

Every case runs in a fresh subprocess so its peak resident memory (``VmHWM``) is its own;
on GPU/TPU the device's ``peak_bytes_in_use`` is reported too. Time is the median of repeats
after a warm-up call (which includes compilation). Forward+backward differentiates the sum of
the outputs with respect to the workload's float arguments.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from typing import Any, Callable, Sequence

MODES = ("fwd", "fwdbwd")


@dataclasses.dataclass(frozen=True)
class Case:
    """One thing to measure. ``params`` must be JSON-serialisable; they become table columns."""

    name: str
    builder: str
    params: dict
    modes: tuple = MODES

    def key(self, mode: str) -> str:
        return record_key(self.name, mode, self.params)


def record_key(name: str, mode: str, params: dict) -> str:
    """The identity of one measurement (a case in one mode) in a suite's stored records."""
    return json.dumps([name, mode, params], sort_keys=True)


@dataclasses.dataclass
class Workload:
    """What a builder returns: ``fn(*args)`` is the forward computation.

    ``flops`` is the forward's useful floating point work (e.g. ``4 * B * H * Lq * Lk * D`` for
    attention), used for GFLOP/s; fwd+bwd counts it as 3.5x (the usual flash accounting:
    forward 2 matmuls, backward 5 with the recomputation). ``grad_argnums`` defaults to every
    floating point argument.
    """

    fn: Callable[..., Any]
    args: tuple
    flops: float | None = None
    grad_argnums: tuple | None = None
    # For a framework other than JAX (the ``peers`` suite's PyTorch cases): ``native(mode)``
    # returns the zero-argument callable to time for that mode, synchronous, run as is (no
    # jit, no compiled-memory figure); ``fn`` and ``args`` are then unused.
    native: Callable[[str], Callable[[], Any]] | None = None
    # Further figures the builder computed for the case (e.g. a decoding cache's bytes per
    # sequence), recorded with it as ``figures`` and shown as table columns.
    figures: dict | None = None


@dataclasses.dataclass(frozen=True)
class Check:
    """One target figure, computed from a run: ``ok`` is None when it could not be computed
    (a case it needs was not measured: not run at these sizes, or failed)."""

    figure: str
    measured: str
    target: str
    ok: bool | None


# A check whose cases have no measurement; benchmark.py says why (quick sizes, a failed case).
NOT_MEASURED = "n/a (not measured)"

FWDBWD_FLOP_FACTOR = 3.5


class Results:
    """Measurements of one suite run, looked up by case name, mode and parameters."""

    def __init__(self, records: Sequence[dict], matmul_gflops: float | None):
        self.records = list(records)
        self.matmul_gflops = matmul_gflops

    def find(self, name: str, mode: str, **params) -> dict | None:
        for r in self.records:
            if r["name"] == name and r["mode"] == mode and all(
                r["params"].get(k) == v for k, v in params.items()
            ):
                return r
        return None

    def time(self, name: str, mode: str, **params) -> float | None:
        r = self.find(name, mode, **params)
        return None if r is None or r.get("error") else r["time_s"]

    def value(self, field: str, name: str, mode: str, **params):
        r = self.find(name, mode, **params)
        return None if r is None or r.get("error") else r.get(field)


def ratio_check(figure: str, num, den, *, at_least=None, at_most=None, fmt="{:.2f}x") -> Check:
    """A check on ``num / den`` against a bound; None-safe when a case was not measured."""
    target = f">= {at_least}" if at_least is not None else f"<= {at_most}"
    if num is None or den is None or den == 0:
        return Check(figure, NOT_MEASURED, target, None)
    value = num / den
    ok = value >= at_least if at_least is not None else value <= at_most
    return Check(figure, fmt.format(value), target, bool(ok))


def value_check(figure: str, value, *, at_least=None, at_most=None, fmt="{:.1f}") -> Check:
    target = f">= {at_least}" if at_least is not None else f"<= {at_most}"
    if value is None:
        return Check(figure, NOT_MEASURED, target, None)
    ok = value >= at_least if at_least is not None else value <= at_most
    return Check(figure, fmt.format(value), target, bool(ok))


def linear_growth_check(figure: str, results: Results, field: str, name: str, mode: str,
                        lengths: Sequence[int], *, slack: float = 1.3, **params) -> Check:
    """Checks that ``field`` grows at most linearly from the first to the last length:
    ``value(L_last) / value(L_first) <= slack * L_last / L_first``."""
    lo = results.value(field, name, mode, L=lengths[0], **params)
    hi = results.value(field, name, mode, L=lengths[-1], **params)
    bound = slack * lengths[-1] / lengths[0]
    return ratio_check(figure, hi, lo, at_most=round(bound, 2))


# -- measurement (runs in the worker subprocess) ---------------------------------------------

def _max_rss_mb() -> float:
    """This process's peak resident memory in MB: Linux's ``VmHWM`` (the high-water mark of
    this address space, which starts afresh at ``exec``). Not ``ru_maxrss``: Linux carries the
    pre-``exec`` peak into it, so a worker forked from a parent holding 650 MB reported 650 MB
    for every case that needed less."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024.0  # kB
    except (OSError, ValueError, IndexError):
        pass
    # Elsewhere (macOS reports bytes, Linux kilobytes); inherited peaks may inflate it.
    scale = 1024.0 * 1024.0 if sys.platform == "darwin" else 1024.0
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / scale


def _import(path: str):
    import importlib

    module, _, attr = path.partition(":")
    return getattr(importlib.import_module(module), attr)


def _timed(f, args, min_repeats: int, budget_s: float):
    import jax

    t0 = time.perf_counter()
    jax.block_until_ready(f(*args))  # compile + warm-up
    warm = time.perf_counter() - t0
    times, cpu = [], []
    while len(times) < min_repeats or (sum(times) < budget_s and len(times) < 50):
        t, c = time.perf_counter(), time.process_time()
        jax.block_until_ready(f(*args))
        times.append(time.perf_counter() - t)
        cpu.append(time.process_time() - c)
        if warm > budget_s and len(times) >= min_repeats:
            break
    return statistics.median(times), warm, len(times), statistics.median(cpu)


def _memory_mb(compiled) -> float | None:
    try:
        m = compiled.memory_analysis()
    except Exception:  # noqa: BLE001 - a backend (or a deserialised executable) without it
        return None
    if m is None:
        return None
    return (m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
            - m.alias_size_in_bytes) / 2**20


def compiled_memory_mb(f, args) -> float | None:
    """The memory XLA's buffer assignment gives the compiled step: arguments + outputs +
    temporaries (live-range packed), less donated aliases, in MiB.

    This is what the step needs on a device (parameters, inputs, saved activations,
    gradients), without the process's compiler and runtime overhead that peak RSS includes.
    None where the backend does not report it.
    """
    try:
        compiled = f.lower(*args).compile()
    except Exception:  # noqa: BLE001 - a backend without the analysis
        return None
    return _memory_mb(compiled)


def program(work: Workload, mode: str):
    """``(f, args)``: the jitted function a case times for ``mode`` (``fwd``, ``step`` or
    ``fwdbwd``) and its arguments. Every runner builds it here (subprocess workers, in-process
    runs and compile-only shards), so a program compiled in one process is the one another
    finds in JAX's persistent compilation cache."""
    import jax
    import jax.numpy as jnp

    if mode in ("fwd", "step"):  # "step": ``fn`` is a whole training step, jitted as is
        return jax.jit(work.fn), work.args
    argnums = work.grad_argnums
    if argnums is None:
        argnums = tuple(
            i for i, a in enumerate(work.args)
            if hasattr(a, "dtype") and jnp.issubdtype(a.dtype, jnp.floating)
        )

    def loss(*args):
        out = work.fn(*args)
        return sum(jnp.sum(x.astype(jnp.float32)) for x in jax.tree_util.tree_leaves(out))

    return jax.jit(jax.grad(loss, argnums=argnums)), work.args


def _finish(record: dict, work: Workload, mode: str) -> dict:
    if work.figures:
        record["figures"] = dict(work.figures)
    if work.flops:
        flops = work.flops * (FWDBWD_FLOP_FACTOR if mode == "fwdbwd" else 1.0)
        record["gflops"] = flops / record["time_s"] / 1e9
    return record


def run_worker(case_json: str, mode: str, min_repeats: int, budget_s: float) -> dict:
    """Measures one case in this (fresh) process; returns a JSON-able record."""
    import jax

    jax.devices()  # initialise the backend before the baseline reading
    baseline = _max_rss_mb()
    spec = json.loads(case_json)
    work: Workload = _import(spec["builder"])(**spec["params"])
    if work.native is not None:
        step = work.native(mode)
        f, args = (lambda: step()), ()
    else:
        f, args = program(work, mode)
    median, warm, n, cpu = _timed(f, args, min_repeats, budget_s)
    # cpu_s: the process's CPU time per call (all threads); on a machine shared with other
    # jobs it is stretched far less than wall time by their load.
    record = dict(time_s=median, cpu_s=cpu, warmup_s=warm, repeats=n, baseline_rss_mb=baseline,
                  peak_rss_mb=_max_rss_mb())
    record["delta_rss_mb"] = record["peak_rss_mb"] - baseline
    compiled = None if work.native is not None else compiled_memory_mb(f, args)
    if compiled is not None:
        record["compiled_mb"] = compiled
    stats = jax.devices()[0].memory_stats() if jax.default_backend() != "cpu" else None
    if stats and "peak_bytes_in_use" in stats:
        record["device_peak_mb"] = stats["peak_bytes_in_use"] / 2**20
    return _finish(record, work, mode)


def _compile(work: Workload, mode: str):
    """``(executable, args, seconds)``: the case's program compiled ahead of time."""
    jitted, args = program(work, mode)
    t0 = time.perf_counter()
    compiled = jitted.lower(*args).compile()
    return compiled, args, time.perf_counter() - t0


DEVICE_STEPS = 5  # calls traced for a device time


def device_events(data) -> tuple[dict, dict]:
    """``(nanoseconds, calls)`` per kernel name, summed over the device planes' stream lines of
    a profiler trace (``jax._src.lib._profile_data.ProfileData``): kernels and copies as the
    device ran them, without host dispatch. Empty on a backend whose trace has no device plane
    (the CPU)."""
    import collections

    ns: dict = collections.Counter()
    calls: dict = collections.Counter()
    for plane in data.planes:
        if not plane.name.startswith("/device:"):
            continue
        for line in plane.lines:
            if "stream" not in line.name.lower():  # kernels and copies, not derived lines
                continue
            for ev in line.events:
                ns[ev.name] += ev.duration_ns
                calls[ev.name] += 1
    return ns, calls


def trace_device(f, args, steps: int):
    """Runs ``f(*args)`` ``steps`` times under ``jax.profiler.trace``; returns the trace's
    :func:`device_events` and the trace itself."""
    import glob
    import tempfile

    import jax
    from jax._src.lib import _profile_data

    trace_dir = tempfile.mkdtemp(prefix="xformers_jax_profile_")
    with jax.profiler.trace(trace_dir):
        for _ in range(steps):
            jax.block_until_ready(f(*args))
    path = sorted(glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True))[-1]
    data = _profile_data.ProfileData.from_file(path)
    return (*device_events(data), data)


def measure_here(case: Case, mode: str, *, min_repeats: int, budget_s: float,
                 device_time: bool = False) -> dict:
    """Measures one case in this process: for accelerators, where a fresh process per case
    spends seconds starting the device and its compilers. The program is compiled once
    (ahead of time; a hit in JAX's persistent compilation cache when a compile-only shard
    filled it) and that executable is timed. No RSS figures (the process holds every earlier
    case's compiler state); ``compiled_mb`` is the executable's own memory from XLA's buffer
    assignment, which on a device is the step's device memory. With ``device_time``,
    ``device_s`` is the device's kernel time per call from a profiler trace (where the trace
    has a device plane): for calls so short that dispatch and synchronisation are a large part
    of the wall time. Failures become records with an ``error``, as in :func:`measure`."""
    import gc


    record = dict(name=case.name, mode=mode, params=case.params)
    work = None
    try:
        work = _import(case.builder)(**case.params)
        if work.native is not None:
            step = work.native(mode)
            f, args, compile_s = (lambda: step()), (), None
        else:
            f, args, compile_s = _compile(work, mode)
            memory = _memory_mb(f)
            if memory is not None:
                record["compiled_mb"] = memory
        median, warm, n, cpu = _timed(f, args, min_repeats, budget_s)
        record.update(time_s=median, cpu_s=cpu, warmup_s=warm, repeats=n, compile_s=compile_s)
        if device_time:
            try:  # a profiler that fails (no CUPTI, say) costs the device time, not the case
                ns = trace_device(f, args, DEVICE_STEPS)[0]
            except Exception as e:  # noqa: BLE001
                ns, record["device_error"] = {}, _error(e)
            if ns:
                record["device_s"] = sum(ns.values()) / DEVICE_STEPS / 1e9
        _finish(record, work, mode)
    except Exception as e:  # noqa: BLE001 - recorded, as a failed subprocess would be
        record["error"] = _error(e)
    finally:
        del work
        gc.collect()
    return record


def compile_only(case: Case, mode: str) -> dict:
    """Builds, lowers and compiles one case without running it (filling JAX's persistent
    compilation cache when one is configured); returns ``compiled_mb`` and ``compile_s`` or
    an ``error``."""
    record = dict(name=case.name, mode=mode, params=case.params)
    try:
        work = _import(case.builder)(**case.params)
        if work.native is None:
            compiled, _, record["compile_s"] = _compile(work, mode)
            record["compiled_mb"] = _memory_mb(compiled)
    except Exception as e:  # noqa: BLE001
        record["error"] = _error(e)
    return record


def _error(e: Exception) -> str:
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0][:300] if lines else ''}"


def matmul_workload(n: int = 2048) -> Workload:
    """The reference rate: one ``n x n`` float32 matmul."""
    import jax

    a, b = jax.random.normal(jax.random.PRNGKey(0), (2, n, n))
    return Workload(lambda x, y: x @ y, (a, b), flops=2.0 * n**3)


MATMUL_CASE = Case("matmul", "xformers_jax_experiments.bench_lib:matmul_workload", {"n": 2048},
                   ("fwd",))


# -- orchestration (parent process) ---------------------------------------------------------

def measure(case: Case, mode: str, *, min_repeats: int, budget_s: float, timeout_s: float,
            env: dict | None = None) -> dict:
    """Runs one case in a fresh subprocess; failures become records with an ``error``."""
    cmd = [
        sys.executable, "-m", "xformers_jax_experiments.benchmark", "--worker",
        "--case", json.dumps(dataclasses.asdict(case)), "--mode", mode,
        "--min_repeats", str(min_repeats), "--budget_s", str(budget_s),
    ]
    record = dict(name=case.name, mode=mode, params=case.params)
    try:
        proc = subprocess.run(
            cmd, capture_output=True, text=True, timeout=timeout_s,
            env={**os.environ, **(env or {})},
            cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
        )
    except subprocess.TimeoutExpired:
        record["error"] = f"timeout after {timeout_s:.0f} s"
        return record
    lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        record["error"] = f"exit {proc.returncode}: {tail[0][:200]}"
        return record
    record.update(json.loads(lines[-1][len("RESULT "):]))
    return record


def machine_info() -> dict:
    import jax

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return dict(
        cpu=cpu, cores=os.cpu_count(), backend=jax.default_backend(),
        devices=[d.device_kind for d in jax.devices()][:1],
        jax=jax.__version__, python=platform.python_version(),
        date=time.strftime("%Y-%m-%d %H:%M"),
    )
