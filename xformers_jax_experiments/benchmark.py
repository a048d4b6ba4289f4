r"""Benchmarks: time, peak memory and GFLOP/s of attention variants, side by side in one run.

Runs the suites in ``xformers_jax_experiments/suites/`` (each case in a fresh subprocess),
writes ``<results_dir>/<suite>.json`` and regenerates BENCHMARKS.md (tables, the target figures
as checks, and plots when matplotlib is installed) from every suite's stored results.

  python -m xformers_jax_experiments.benchmark --suite=attention         # one suite, full size
  python -m xformers_jax_experiments.benchmark --suite=attention,sparse  # several
  python -m xformers_jax_experiments.benchmark --suite=all --quick       # every suite, seconds
  python -m xformers_jax_experiments.benchmark --render_only             # from stored JSON
  python -m xformers_jax_experiments.benchmark --render_only --recheck=gpu_attention
      # BENCHMARKS.md with the suite's checks recomputed

On an accelerator (the ``gpu_*`` suites; ``xformers_jax_experiments/gpu_session.sh`` runs them
all), ``--in_process`` measures every case in one process (a fresh process per case would
spend seconds starting the device each time), and ``--compile_only=I/N`` compiles the I-th of
N shares of the cases without running them, so that N processes fill JAX's persistent
compilation cache (``JAX_COMPILATION_CACHE_DIR``) in parallel before the one timing process
reads it.

``--quick`` writes to a temporary directory and leaves BENCHMARKS.md alone unless
``--markdown`` is given explicitly: quick figures are smoke tests, not measurements.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import pkgutil
import re
import sys
import tempfile

from absl import app, flags

from xformers_jax_experiments import bench_lib
from xformers_jax_experiments.bench_lib import Case

_SUITE = flags.DEFINE_string("suite", "attention", "Comma-separated suites, or 'all'.")
_QUICK = flags.DEFINE_bool("quick", False, "Tiny sizes: a smoke test of the suites.")
_RESULTS_DIR = flags.DEFINE_string(
    "results_dir", None, "Where suite JSON goes (default xformers_jax_experiments/results; a "
    "temp dir with --quick).")
_MARKDOWN = flags.DEFINE_string(
    "markdown", None, "BENCHMARKS.md to regenerate (default BENCHMARKS.md at the repository "
    "root; none with --quick).")
_MIN_REPEATS = flags.DEFINE_integer("min_repeats", 3, "Timed repeats per case at least.")
_BUDGET_S = flags.DEFINE_float("budget_s", 2.0, "Keep repeating until this many seconds.")
_TIMEOUT_S = flags.DEFINE_float("timeout_s", 900.0, "Per-case subprocess time limit.")
_MALLOC_TOP_PAD_MB = flags.DEFINE_integer(
    "malloc_top_pad_mb", 1024,
    "glibc MALLOC_TOP_PAD_ for the case workers, in MiB (0: glibc's default). By default glibc "
    "hands freed heap memory back to the OS after every step, so a step whose temporaries are "
    "hundreds of MB pays fresh page faults on every call (at L=32K this made Sinkhorn's "
    "fwd+bwd ~30% slower); a pad keeps it, as a long training process with tcmalloc or "
    "jemalloc would. Recorded in each suite's machine info.")
_IN_PROCESS = flags.DEFINE_bool(
    "in_process", False, "Measure every case in this process (accelerators); no RSS figures.")
_COMPILE_ONLY = flags.DEFINE_string(
    "compile_only", None, "I/N: only compile the I-th of N shares of the suites' cases (to "
    "fill JAX's persistent compilation cache from N processes); writes "
    "<results_dir>/compile_I.json.")
_ONLY = flags.DEFINE_string(
    "only", None, "Regular expression searched in each case's name and parameters (as JSON: "
    "'[\"name\", {\"L\": 4096, ...}]'): measure (or compile) only these, keeping the stored "
    "results of the others (to re-run a few cases).")
_RENDER_ONLY = flags.DEFINE_bool(
    "render_only", False, "Regenerate BENCHMARKS.md from the stored JSON; measure nothing.")
_PLOTS = flags.DEFINE_bool("plots", True, "Write each suite's plot (results_dir/<suite>.png).")
_RECHECK = flags.DEFINE_string(
    "recheck", None, "With --render_only: suites whose checks are recomputed from their stored "
    "records with the suite's current code (after a change to how a figure is judged).")
_WORKER = flags.DEFINE_bool("worker", False, "Internal: measure one case in this process.")
_CASE = flags.DEFINE_string("case", None, "Internal: the case (JSON) for --worker.")
_MODE = flags.DEFINE_string("mode", "fwd", "Internal: fwd or fwdbwd for --worker.")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Suites in the order BENCHMARKS.md lists them; others follow alphabetically.
ORDER = ("attention", "sparse", "linear", "lowrank", "learned", "models", "lra", "parallel")


def available_suites() -> list[str]:
    import xformers_jax_experiments.suites as pkg

    names = [m.name for m in pkgutil.iter_modules(pkg.__path__) if not m.name.startswith("_")]
    return sorted(names, key=lambda n: (ORDER.index(n) if n in ORDER else len(ORDER), n))


def runs_here(name: str) -> bool:
    """Whether ``--suite=all`` measures suite ``name`` on this backend: a suite may name the
    backends it is for (``PLATFORMS = ("gpu",)``: full-size GPU cases would take hours on a
    CPU); every suite runs in ``--quick`` mode."""
    import jax

    platforms = getattr(load_suite(name), "PLATFORMS", None)
    return platforms is None or jax.default_backend() in platforms


def load_suite(name: str):
    if name not in available_suites():
        raise app.UsageError(f"unknown suite {name!r}; available: {available_suites()}")
    return importlib.import_module(f"xformers_jax_experiments.suites.{name}")


def run_suite(name: str, *, quick: bool, results_dir: str, log=print) -> dict:
    suite = load_suite(name)
    pad = _MALLOC_TOP_PAD_MB.value
    in_process = _IN_PROCESS.value
    opts = dict(min_repeats=1 if quick else _MIN_REPEATS.value,
                budget_s=0.0 if quick else _BUDGET_S.value)
    sub = dict(timeout_s=_TIMEOUT_S.value,
               env={"MALLOC_TOP_PAD_": str(pad * 2**20)} if pad else None)

    def run(case, mode):
        if in_process:
            timed = getattr(suite, "device_timed", None)  # cases that also get a device time
            return bench_lib.measure_here(case, mode, **opts,
                                          device_time=bool(timed and timed(case)))
        return bench_lib.measure(case, mode, **opts, **sub)

    path = os.path.join(results_dir, f"{name}.json")
    kept = []
    if _ONLY.value and os.path.exists(path):
        with open(path) as f:
            stored = json.load(f)
        kept = stored["records"]
        for r in kept:  # which run measured a kept row (shown in BENCHMARKS.md)
            r.setdefault("run", stored["machine"]["date"])
    only = re.compile(_ONLY.value) if _ONLY.value else None
    matmul = run(bench_lib.MATMUL_CASE, "fwd")
    rate = matmul.get("gflops")
    log(f"[{name}] matmul reference: {rate and round(rate, 1)} GFLOP/s")
    machine = {**bench_lib.machine_info(), "malloc_top_pad_mb": None if in_process else pad,
               "in_process": in_process}
    payload = dict(suite=name, title=suite.TITLE, note=getattr(suite, "NOTE", None), quick=quick,
                   machine=machine, matmul_gflops=rate, records=[], checks=[])
    if hasattr(suite, "machine_note"):  # measured here and now: kept with the run
        payload["machine_note"] = suite.machine_note()
    records = {bench_lib.record_key(r["name"], r["mode"], r["params"]): r for r in kept}
    os.makedirs(results_dir, exist_ok=True)
    for case in suite.cases(quick):
        if only and not _selected(only, case):
            continue
        for mode in case.modes:
            r = dict(run(case, mode), run=machine["date"])
            if rate and r.get("gflops"):
                r["matmul_fraction"] = r["gflops"] / rate
            records[case.key(mode)] = r
            log(f"[{name}] {_row(r)}")
            payload["records"] = list(records.values())
            _write(path, payload)  # after every case: a run cut short keeps what it measured
    results = bench_lib.Results(payload["records"], rate)
    payload["checks"] = explain_unmeasured(
        [dataclasses.asdict(c) for c in suite.checks(results)], payload["records"], quick)
    for c in payload["checks"]:
        log(f"[{name}] check: {c['figure']}: {c['measured']} (target {c['target']}) "
            f"{'OK' if c['ok'] else 'MISSED' if c['ok'] is False else 'n/a'}")
    _write(path, payload)
    return payload


def explain_unmeasured(checks: list[dict], records: Sequence[dict], quick: bool) -> list[dict]:
    """Says why a check has no measurement: ``--quick`` runs other sizes than the checks
    read, and a case that failed has no figure (named, with the run's failures)."""
    failed = sorted({r["name"] for r in records if r.get("error")})
    why = ("not measured at --quick sizes" if quick else
           f"not measured; failed in this run: {', '.join(failed)}" if failed else
           "not measured in this run")
    return [dict(c, measured=f"n/a ({why})") if c["ok"] is None else c for c in checks]


def _selected(only: "re.Pattern", case: Case) -> bool:
    return bool(only.search(json.dumps([case.name, case.params])))


def _write(path: str, payload: dict) -> None:
    with open(path + ".tmp", "w") as f:
        json.dump(payload, f, indent=1)
    os.replace(path + ".tmp", path)


def compile_share(names: Sequence[str], share: str, results_dir: str, log=print) -> None:
    """Compiles the ``I``-th of ``N`` shares (``share = "I/N"``) of the suites' cases."""
    i, n = (int(x) for x in share.split("/"))
    only = re.compile(_ONLY.value) if _ONLY.value else None
    jobs = [(case, mode) for name in names for case in load_suite(name).cases(_QUICK.value)
            if only is None or _selected(only, case) for mode in case.modes]
    out = []
    for case, mode in jobs[i::n]:
        r = bench_lib.compile_only(case, mode)
        done = r.get("error") or f"{r.get('compile_s', 0.0):.1f} s"
        log(f"[compile {share}] {case.name} {case.params} {mode}: {done}")
        out.append(r)
        os.makedirs(results_dir, exist_ok=True)
        _write(os.path.join(results_dir, f"compile_{i}.json"), dict(share=share, records=out))


def _fmt(x, spec):
    return "" if x is None else format(x, spec)


def _row(r: dict) -> str:
    params = " ".join(f"{k}={v}" for k, v in r["params"].items())
    if r.get("error"):
        return f"{r['name']:<28} {params:<40} {r['mode']:<7} ERROR {r['error']}"
    memory = (f"peak {r['peak_rss_mb']:8.0f} MB (+{r['delta_rss_mb']:.0f})"
              if "peak_rss_mb" in r else f"XLA {_fmt(r.get('compiled_mb'), '.0f')} MB")
    return (f"{r['name']:<28} {params:<40} {r['mode']:<7} {r['time_s'] * 1e3:10.2f} ms "
            f"{_fmt(r.get('gflops'), '8.1f')} GFLOP/s  {memory}")


def _plot(payload: dict, path: str) -> bool:
    """Time against L for each (case, mode), log-log. False when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    series: dict = {}
    for r in payload["records"]:
        if r.get("error") or "L" not in r["params"]:
            continue
        other = ", ".join(f"{k}={v}" for k, v in r["params"].items() if k != "L")
        label = f"{r['name']} {r['mode']}" + (f" ({other})" if other else "")
        series.setdefault(label, []).append((r["params"]["L"], r["time_s"]))
    if not series:
        return False
    fig, ax = plt.subplots(figsize=(8, 5))
    for label, pts in sorted(series.items()):
        pts.sort()
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("sequence length L")
    ax.set_ylabel("time (s, median)")
    ax.set_title(payload["title"])
    ax.legend(fontsize=7)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def _device(m: dict) -> str:
    """The machine a suite ran on, for its header: the CPU, and the accelerator if any."""
    where = f"{m['cpu']} ({m['cores']} cores, backend {m['backend']})"
    if m["backend"] != "cpu" and m.get("devices"):
        where = f"{m['devices'][0]} (backend {m['backend']}; host {m['cpu']}, {m['cores']} cores)"
    if m.get("in_process"):
        where += ", every case in one process (no RSS figures; 'XLA' is the device memory)"
    return where


def _refresh(payload: dict) -> None:
    """The suite's current note (documentation, not a measurement) for stored records."""
    try:
        suite = load_suite(payload["suite"])
    except Exception:  # noqa: BLE001 - a suite that no longer exists: as stored
        return
    payload["note"] = getattr(suite, "NOTE", None) or payload.get("note")


def recheck(name: str, results_dir: str) -> None:
    """Recomputes suite ``name``'s checks from its stored records with the suite's current
    code and stores them (``--recheck``: after a change to how a figure is judged, without
    measuring again)."""
    path = os.path.join(results_dir, f"{name}.json")
    with open(path) as f:
        payload = json.load(f)
    results = bench_lib.Results(payload["records"], payload["matmul_gflops"])
    payload["checks"] = [dataclasses.asdict(c) for c in load_suite(name).checks(results)]
    _write(path, payload)


def is_why(check: dict) -> bool:
    """Whether a check is a (why) row: not a target, but a measurement of what bounds one
    (a ceiling, the same work without a mask, the work summed over threads)."""
    return check["figure"].startswith("(why)")


def target_summary(payloads: Sequence[dict]) -> list[str]:
    """BENCHMARKS.md's opening summary: every suite's targets counted (met, missed, not
    measured), then each target missed or not measured with its figure, so the misses are
    read first; the met ones are in each suite's own table."""
    out = ["## Summary of targets", "",
           "Every target figure of every suite: how many were met in the suite's stored run, "
           "then each one missed or not measured (the suite's section has its full table and "
           "what bounds it). Rows marked (why) are not targets and are not counted here: they "
           "measure what bounds a figure, and stand in their suite's table.", "",
           "| suite | machine | run | targets | met | missed | not measured |",
           "|---|---|---|---|---|---|---|"]
    totals = [0, 0, 0, 0]
    misses = []
    for p in payloads:
        checks = [c for c in p["checks"] if not is_why(c)]
        counts = [len(checks), sum(c["ok"] is True for c in checks),
                  sum(c["ok"] is False for c in checks), sum(c["ok"] is None for c in checks)]
        totals = [a + b for a, b in zip(totals, counts)]
        m = p["machine"]
        where = m["devices"][0] if m["backend"] != "cpu" and m.get("devices") else m["cpu"]
        out.append(f"| `{p['suite']}` | {where} | {m['date']}"
                   f"{' (quick)' if p['quick'] else ''} | " + " | ".join(map(str, counts)) + " |")
        misses += [(p["suite"], c) for c in checks if c["ok"] is not True]
    out += ["| all | | | " + " | ".join(map(str, totals)) + " |", ""]
    if misses:
        out += ["| suite | figure | measured | target |", "|---|---|---|---|"]
        out += [f"| `{suite}` | {c['figure']} | {c['measured']} | {c['target']} |"
                for suite, c in misses]
        out.append("")
    return out


def render_markdown(results_dir: str, markdown_path: str, plots: bool = True) -> str:
    """BENCHMARKS.md from every suite JSON in ``results_dir`` (generated; do not edit): the
    summary of every target first, then each suite's checks and cases, and its notes
    (``results_dir/notes/<suite>.md``: what investigating its figures found) when it has
    them."""
    payloads = []
    for name in available_suites():
        path = os.path.join(results_dir, f"{name}.json")
        if os.path.exists(path):
            with open(path) as f:
                payloads.append(json.load(f))
    out = [
        "# Benchmarks",
        "",
        "Generated by `python -m xformers_jax_experiments.benchmark` from "
        "`xformers_jax_experiments/results/*.json`; do "
        "not edit by hand. Each case runs in a fresh subprocess: time is the median of repeats "
        "after a warm-up call, peak RSS is the process's maximum resident memory (Δ is above "
        "the process after JAX start-up; it includes XLA's compiler), 'XLA' is the compiled "
        "step's own memory from XLA's buffer assignment (arguments + outputs + live-range "
        "packed temporaries: what the step needs on a device), GFLOP/s counts useful forward work (x3.5 for "
        "forward+backward), and '% mm' is that rate as a fraction of a 2048² float32 matmul "
        "measured in the same run. Machines are shared and noisy: compare within a suite's run.",
        "",
    ]
    out += target_summary(payloads)
    for p in payloads:
        m = p["machine"]
        _refresh(p)
        out += [
            f"## `{p['suite']}`: {p['title']}",
            "",
            f"Run {m['date']} on {_device(m)}, "
            f"JAX {m['jax']}; matmul reference {_fmt(p['matmul_gflops'], '.1f')} GFLOP/s"
            + ("." if m.get("in_process") else
               f"; glibc MALLOC_TOP_PAD_ {m.get('malloc_top_pad_mb') or 'default'}"
               f"{' MiB' if m.get('malloc_top_pad_mb') else ''}.")
            + (" **Quick mode: smoke-test sizes, not measurements.**" if p["quick"] else ""),
            "",
        ]
        earlier = {}
        for r in p["records"]:
            if r.get("run", m["date"]) != m["date"]:
                earlier.setdefault(r["run"], []).append(f"{r['name']} {r['mode']}")
        if earlier:
            out += ["Rows kept from earlier runs (a re-run of some cases with `--only`): "
                    + "; ".join(f"{d}: {', '.join(rows)}" for d, rows in sorted(earlier.items()))
                    + ".", ""]
        if p.get("machine_note") or p.get("note"):
            out += [" ".join(x for x in (p.get("machine_note"), p.get("note")) if x), ""]
        if p["checks"]:
            out += ["| figure | measured | target | met |", "|---|---|---|---|"]
            for c in p["checks"]:
                met = {True: "yes", False: "**no**", None: "n/a"}[c["ok"]]
                out.append(f"| {c['figure']} | {c['measured']} | {c['target']} | {met} |")
            out.append("")
        keys, figures = [], []
        for r in p["records"]:
            keys += [k for k in r["params"] if k not in keys]
            figures += [k for k in r.get("figures", {}) if k not in figures]
        head = ["case", *keys, *figures, "mode", "time (ms)", "GFLOP/s", "% mm", "peak RSS (MB)",
                "Δ RSS (MB)", "XLA (MB)"]
        out += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for r in p["records"]:
            cells = [r["name"], *[str(r["params"].get(k, "")) for k in keys],
                     *[str(r.get("figures", {}).get(k, "")) for k in figures], r["mode"]]
            if r.get("error"):
                cells += [f"error: {r['error']}", "", "", "", "", ""]
            else:
                frac = r.get("matmul_fraction")
                cells += [
                    f"{r['time_s'] * 1e3:.1f}", _fmt(r.get("gflops"), ".1f"),
                    "" if frac is None else f"{100 * frac:.0f}%",
                    _fmt(r.get("peak_rss_mb"), ".0f"), _fmt(r.get("delta_rss_mb"), ".0f"),
                    _fmt(r.get("compiled_mb"), ".0f"),
                ]
            out.append("| " + " | ".join(cells) + " |")
        out.append("")
        notes = os.path.join(results_dir, "notes", f"{p['suite']}.md")
        if os.path.exists(notes):
            with open(notes) as f:
                out += [f"### `{p['suite']}`: notes", "", f.read().rstrip("\n"), ""]
        png = os.path.join(results_dir, f"{p['suite']}.png")
        if plots and _plot(p, png):
            rel = os.path.relpath(png, os.path.dirname(os.path.abspath(markdown_path)))
            out += [f"![{p['suite']}]({rel})", ""]
    text = "\n".join(out)
    with open(markdown_path, "w") as f:
        f.write(text)
    return text


def main(argv: Sequence[str]) -> None:
    del argv
    if _WORKER.value:
        record = bench_lib.run_worker(_CASE.value, _MODE.value, _MIN_REPEATS.value,
                                      _BUDGET_S.value)
        print("RESULT " + json.dumps(record), flush=True)
        return
    results_dir = _RESULTS_DIR.value or (
        tempfile.mkdtemp(prefix="xformers_jax_bench_") if _QUICK.value
        else os.path.join(ROOT, "xformers_jax_experiments", "results"))
    markdown = _MARKDOWN.value or (None if _QUICK.value else os.path.join(ROOT, "BENCHMARKS.md"))
    if _RENDER_ONLY.value:
        for name in filter(None, (_RECHECK.value or "").split(",")):
            recheck(name, results_dir)
        render_markdown(results_dir, markdown or os.path.join(ROOT, "BENCHMARKS.md"))
        return
    if _SUITE.value == "all":
        names = [n for n in available_suites() if _QUICK.value or runs_here(n)]
    else:
        names = _SUITE.value.split(",")
    for n in names:
        load_suite(n)  # fail fast on a typo
    if _COMPILE_ONLY.value:
        compile_share(names, _COMPILE_ONLY.value, results_dir)
        return
    failed_checks = []
    for n in names:
        payload = run_suite(n, quick=_QUICK.value, results_dir=results_dir)
        failed_checks += [c for c in payload["checks"] if c["ok"] is False]
    if markdown:
        render_markdown(results_dir, markdown, plots=_PLOTS.value)
        print(f"wrote {markdown} and {results_dir}/*.json")
    else:
        print(f"wrote {results_dir}/*.json")
    if failed_checks and not _QUICK.value:
        print(f"{len(failed_checks)} figure(s) missed their targets (see the table)")


if __name__ == "__main__":
    sys.exit(app.run(main))
