r"""The zoo's one command: sweep every causal kind over the synthetic tasks, then write the
leaderboards and plots.

  python -m xformers_jax_experiments.studies.zoo.run --workdir=runs/zoo --num_processes=2

Each run is ``xformers_jax_experiments.train`` with ``studies/zoo/config.py`` (one kind, task,
length, width and learning rate) in its own directory ``WORKDIR/TASK/KIND/L{L}_d{D}_lr{LR}``,
started through ``xformers_jax_experiments.sweep.run_local``. Re-running the command resumes:
finished runs are kept, interrupted ones resume from their checkpoints, and kinds registered
since the last invocation are added. ``--grid=full`` is Zoology's full grid (widths up to 512,
100k examples, 64 epochs) for an accelerator. ``--tasks``, ``--kinds`` (regular expression on
``SLOT/KIND``), ``--lengths`` and ``--widths`` narrow a sweep; ``--report_only`` only rewrites the results.
Rows of the results directory's ``zoo.json`` that the invocation has no run for on disk are
kept (``merge_rows``; ``--nokeep_earlier`` drops them).

Results (``--results_dir``, default the study's folder): ``zoo.json`` (one row per run),
``zoo.md`` (per task the best accuracy over the learning rates by kind, width and length,
with each kind's decoding state per sequence and the sweep's wall time) and two plots:
accuracy against width per kind, and accuracy against state size (the recall/memory
trade-off of Arora et al. 2024, "Based", Figure 1).
"""

from __future__ import annotations

import json
import os
import re
import resource
import sys
import time

from absl import app, flags

from xformers_jax import train
from xformers_jax_experiments import run_lib, sweep
from xformers_jax_experiments.studies.zoo import config as Z

HERE = os.path.dirname(os.path.abspath(__file__))
CONFIG = os.path.join(HERE, "config.py")

FLAGS = flags.FLAGS


def _define_flags() -> None:
    """This script's flags, with the sweep tool's own (``--workdir``: the runs' base
    directory, ``--num_processes``: runs at a time, ``--set=KEY=VALUE``: an override of every
    run), defined when it runs as a script (absl flags are process-global)."""
    sweep.define_flags()
    flags.DEFINE_enum("grid", "cpu", Z.GRIDS, "cpu: the CPU grid; full: Zoology's.")
    flags.DEFINE_list("tasks", list(Z.TASKS), "Tasks to sweep.")
    flags.DEFINE_string("kinds", None, "Regular expression on 'SLOT/KIND' (default all).")
    flags.DEFINE_list("widths", None, "Widths (default: the grid's).")
    flags.DEFINE_list("lengths", None, "Lengths (default: each task's in the grid).")
    flags.DEFINE_list("learning_rates", None, "Learning rates (default: the grid's).")
    flags.DEFINE_integer("num_train_steps", None, "Override the steps of every run.")
    flags.DEFINE_string("results_dir", HERE, "Where zoo.json, zoo.md and plots go.")
    flags.DEFINE_bool("report_only", False, "Rewrite the results; run nothing.")
    flags.DEFINE_bool("keep_earlier", True,
                      "Keep the rows of the results directory's zoo.json that this "
                      "invocation has no run for on disk (other kinds, or runs made on "
                      "another machine); --nokeep_earlier writes this invocation's runs only.")


def runs(grid: str, tasks, kinds_re=None, widths=None, lrs=None, steps=None, lengths=None):
    """``(name, config_arg, overrides)`` of every run of the sweep."""
    widths = [int(w) for w in widths] if widths else Z.WIDTHS[grid]
    lrs = [float(x) for x in lrs] if lrs else Z.LEARNING_RATES[grid]
    pattern = re.compile(kinds_re) if kinds_re else None
    out = []
    for task in tasks:
        task_lengths = ([L for L, _ in Z.MQAR_SETTINGS] if task == "mqar"
                        else Z.LENGTHS[task][grid])
        if lengths:
            task_lengths = [int(L) for L in lengths]
        for slot in ("attention", "mixer"):
            for kind in Z.kinds(slot):
                if pattern and not pattern.search(f"{slot}/{kind}"):
                    continue
                for L in task_lengths:
                    for d in widths:
                        for lr in lrs:
                            run = {"config.model.dim": d, "config.model.num_heads": d // 32,
                                   "config.model.hidden": 4 * d,
                                   "config.optim.learning_rate": lr}
                            if steps:
                                run["config.num_train_steps"] = steps
                            run[sweep.ARG] = f"{task},{slot},{kind},{L},{grid}"
                            out.append((f"{task}/{slot}-{kind}/L{L}_d{d}_lr{lr:g}", run))
    return out


def _row(workdir: str, name: str, run: dict) -> dict:
    task, kind_dir, setting = name.split("/")
    slot, kind = kind_dir.split("-", 1)
    L, d, lr = re.match(r"L(\d+)_d(\d+)_lr(.+)", setting).groups()
    metrics = run_lib.read_metrics(os.path.join(workdir, name), missing_ok=True)
    row = dict(task=task, slot=slot, kind=kind, L=int(L), d=int(d), lr=float(lr))
    row.update(run_lib.latest(metrics, ("test_accuracy", "validation_accuracy",
                                        "stopped_early_at", "step")))
    curve = {m["step"]: round(float(m["validation_accuracy"]), 4)
             for m in metrics if "validation_accuracy" in m}  # a resumed step: its last
    row["curve"] = sorted([s, a] for s, a in curve.items())
    config = os.path.join(workdir, name, "config.json")
    if task == "induction" and os.path.exists(config):
        with open(config) as f:  # the test split's length: extrapolation beyond training's
            row["test_L"] = json.load(f)["data"].get("test_seq_len") or int(L)
    run_record = train.RunRecord(os.path.join(workdir, name))
    last_start = ((run_record.read() or {}).get("sessions") or [{}])[-1]
    spent = run_record.spent()
    if spent is not None:  # what the run cost (run.json's sessions); timed: every start's
        row.update(wall_s=round(spent["wall_s"], 1), cpu_s=round(spent["cpu_s"], 1),
                   timed=spent["timed"])
    log = os.path.join(workdir, name, "train.log")
    last_validation = row["curve"][-1][0] if row["curve"] else None
    if row.get("test_accuracy") is None and train.WorkdirLock(
            os.path.join(workdir, name)).holder() is not None:
        # A trainer holds the workdir (training now, or paused): neither a result nor an error.
        row["running"] = True
        row["validation_step"] = last_validation
    elif row.get("test_accuracy") is None:
        # How the last recorded start ended (run.json); a start refused before it was recorded
        # (another config: ConfigChanged) leaves the run as that start found it. Without an
        # ended start (a record from before starts recorded their end, or a killed start),
        # the log's last line.
        if "outcome" in last_start:
            outcome = last_start["outcome"]
        elif os.path.exists(log):
            with open(log, errors="replace") as f:
                tail = [line.strip() for line in f if line.strip()][-1:]
            outcome = tail[0] if tail else "no output"
        else:
            return row
        if outcome.startswith("preempted"):
            row["unfinished"] = True  # interrupted with a checkpoint: the sweep resumes it
            row["validation_step"] = last_validation
        elif outcome == "finished":
            row["error"] = "finished, but its metrics hold no test accuracy"
        else:
            row["error"] = outcome.removeprefix("failed: ")[:200]
    return row


def _has_result(row: dict) -> bool:
    return any(row.get(k) is not None for k in ("test_accuracy", "validation_accuracy",
                                                "error", "unfinished", "running"))


def merge_rows(earlier, fresh):
    """One row per run (task, slot, kind, L, d, lr): ``fresh`` rows (read from the runs on
    disk) replace ``earlier`` ones (an earlier zoo.json) where they have a result; a run with
    nothing on disk keeps its earlier row, so narrowed invocations, and sweeps continued on
    another machine, add to the results rather than erase them. Earlier rows come first, in
    their order; new runs follow."""
    key = lambda r: (r["task"], r["slot"], r["kind"], r["L"], r["d"], float(r["lr"]))  # noqa: E731
    out = {key(r): r for r in earlier}
    for r in fresh:
        if _has_result(r) or key(r) not in out:
            out[key(r)] = r
    return list(out.values())


def state_bytes(slot: str, kind: str, seq_len: int, dim: int) -> int | None:
    """Bytes of one sequence's decoding state of the 2-layer model after ``seq_len`` tokens
    (float32): a key/value cache grows with the length, a recurrent state does not; None when
    the kind cannot decode step by step."""
    import jax

    from xformers_jax import models

    c = Z.get_config(f"mqar,{slot},{kind},{max(seq_len, 64)}")
    c.unlock()
    c.model.update(dict(dim=dim, num_heads=dim // 32, hidden=4 * dim))
    k = models.get_model("causal_lm")
    task = type("T", (), dict(vocab_size=64, seq_len=seq_len))()
    model = k.build(c.model, task, jax.random.PRNGKey(0))
    if not hasattr(model, "init_cache"):
        return None
    try:
        cache = jax.eval_shape(lambda: model.init_cache(1, seq_len))
    except (NotImplementedError, ValueError, TypeError):
        return None
    return int(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(cache)))


def _kib(size: int) -> str:
    return f"{size / 1024:.0f} KiB" if size < 1024 ** 2 else f"{size / 1024 ** 2:.1f} MiB"


def _rank(row):
    """A finished row (with a test accuracy) above every unfinished one; among unfinished
    rows, the higher last validation accuracy."""
    if row.get("test_accuracy") is not None:
        return (1, row["test_accuracy"])
    return (0, row.get("validation_accuracy") or -1.0)


def best_rows(rows):
    """The best test accuracy over learning rates per (task, slot, kind, L, d); where no
    rate has finished, the unfinished run with the higher last validation accuracy."""
    best = {}
    for r in rows:
        key = (r["task"], r["slot"], r["kind"], r["L"], r["d"])
        if key not in best or _rank(r) > _rank(best[key]):
            best[key] = r
    return best


def report(rows, results_dir: str, wall_s: float | None, grid: str,
           cpu_s: float | None = None) -> str:
    """Writes ``zoo.json``, ``zoo.md`` and the plots of ``rows`` into ``results_dir``;
    ``wall_s`` and ``cpu_s``: this invocation's sweep's wall time and its runs' CPU time
    (None when it ran nothing). Returns zoo.md's text."""
    best = best_rows(rows)
    os.makedirs(results_dir, exist_ok=True)
    with open(os.path.join(results_dir, "zoo.json"), "w") as f:
        json.dump(dict(grid=grid, wall_s=wall_s, cpu_s=cpu_s, rows=rows), f, indent=1)
    lines = ["# The zoo: recall, copying and induction by kind", "",
             f"Generated by `python -m xformers_jax_experiments.studies.zoo.run` (grid `{grid}`"
             + (f"; this invocation's sweep took {wall_s / 3600:.2f} h" if wall_s else "")
             + (f" and {cpu_s / 3600:.2f} CPU-hours" if cpu_s else "")
             + "). Test accuracy on the scored positions, the best over the learning rates, "
             "and in brackets the state: one sequence's decoding state of the 2-layer model at "
             "the run's length and width (float32; a key/value cache grows with the length). "
             "A run interrupted before its test shows its last validation accuracy and step. "
             "Induction heads train at the column's length and are tested longer: the test "
             "accuracy at its length, then the validation accuracy at the training length.",
             ""]
    for task in Z.TASKS:
        keys = sorted(k for k in best if k[0] == task)
        if not keys:
            continue
        settings = sorted({(k[3], k[4]) for k in keys})
        lines += [f"## {task}", "",
                  "| kind | " + " | ".join(f"L={L} d={d}" for L, d in settings) + " |",
                  "|---|" + "---|" * len(settings)]
        for slot, kind in sorted({(k[1], k[2]) for k in keys}):
            cells = []
            for L, d in settings:
                r = best.get((task, slot, kind, L, d))
                acc = None if r is None else r.get("test_accuracy")
                size = None if r is None else r.get("state_bytes")
                state = "" if size is None else f" ({_kib(size)})"
                val = None if r is None else r.get("validation_accuracy")
                at = None if r is None else r.get("validation_step")
                test_at = None if r is None else r.get("test_L")
                cells.append("" if r is None else "error" if acc is None and r.get("error")
                             else f"({val:.3f} validation at step {at}, "
                             f"{'running' if r.get('running') else 'unfinished'})"
                             if acc is None and (r.get("unfinished") or r.get("running"))
                             and val is not None
                             else "" if acc is None
                             else f"{acc:.3f} at L={test_at} ({val:.3f} at L={L}){state}"
                             if test_at and test_at != L and val is not None
                             else f"{acc:.3f}{state}")
            lines.append(f"| {slot}/{kind} | " + " | ".join(cells) + " |")
        lines.append("")
    lines += _curve_lines(rows)
    lines += _cost_lines(rows)
    text = "\n".join(lines)
    with open(os.path.join(results_dir, "zoo.md"), "w") as f:
        f.write(text + "\n")
    _plots(best, rows, results_dir)
    return text


# The evaluations zoo.md shows of each run's validation curve (``eval_every`` = 200 on the
# cpu grid; the whole curve is in zoo.json and zoo_curves.png).
CURVE_STEPS = (200, 400, 1000, 2000, 3000, 4000, 6000, 8000, 10000)


def _curve_lines(rows) -> list[str]:
    """zoo.md's validation accuracy of every run at ``CURVE_STEPS`` (up to the last step any
    run of the task reached), its last and best evaluations and its first at or above 0.9."""
    out = []
    for task in Z.TASKS:
        ran = sorted((r for r in rows if r["task"] == task and r.get("curve")),
                     key=lambda r: (r["slot"], r["kind"], r["L"], r["d"], r["lr"]))
        if not ran:
            continue
        last = max(r["curve"][-1][0] for r in ran)
        steps = [s for s in CURVE_STEPS if s <= last]
        out += [f"### {task}", "",
                "| run | " + " | ".join(f"step {s}" for s in steps)
                + " | last evaluation | best evaluation | first at 0.9 |",
                "|---|" + "---|" * (len(steps) + 3)]
        for r in ran:
            at = dict(map(tuple, r["curve"]))
            high = next((s for s, a in r["curve"] if a >= 0.9), None)
            s_last, a_last = r["curve"][-1]
            s_best, a_best = max(r["curve"], key=lambda p: (p[1], -p[0]))  # the first best
            out.append(f"| {r['slot']}/{r['kind']} L={r['L']} d={r['d']} lr={r['lr']:g} | "
                       + " | ".join("" if s not in at else f"{at[s]:.3f}" for s in steps)
                       + f" | {a_last:.3f} (step {s_last}) | {a_best:.3f} (step {s_best}) | "
                       + ("" if high is None else f"step {high}") + " |")
        out.append("")
    if not out:
        return []
    return ["## How the runs learned", "",
            "Every run's validation accuracy (the scored positions of the validation split) at "
            "some of its evaluations, read from its `metrics.jsonl`; `zoo_curves.png` plots "
            "them all.", "", *out]


def _cost_lines(rows) -> list[str]:
    """zoo.md's table of what the runs cost, per task: every run with a record, each
    learning rate counted (the grid runs them all)."""
    out = []
    for task in Z.TASKS:
        ran = [r for r in rows if r["task"] == task and r.get("wall_s") is not None]
        if not ran:
            continue
        timed = [r for r in ran if r.get("timed")]
        out.append(f"| {task} | {len(ran)} | {len(timed)} | "
                   f"{sum(r['cpu_s'] for r in timed) / 3600:.2f} | "
                   f"{sum(r['wall_s'] for r in ran) / 3600:.2f} |")
    if not out:
        return []
    return ["## What the runs cost", "",
            "Read from each run's `run.json`: a run is *timed* when every start of it recorded "
            "its wall and CPU time (all threads) at its end; the CPU-hours are the timed runs', "
            "the wall-hours every run's (a finished run's untimed start counts from its start "
            "to its finish; a start still running, or killed, nothing).", "",
            "| task | runs | timed | CPU-hours (timed runs) | wall-hours |",
            "|---|---|---|---|---|", *out, ""]


def _plots(best, rows, results_dir: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = [t for t in Z.TASKS if any(r["task"] == t and r.get("curve") for r in rows)]
    if tasks:
        fig, axes = plt.subplots(1, len(tasks), figsize=(6 * len(tasks), 4), squeeze=False)
        for ax, task in zip(axes[0], tasks):
            for r in rows:
                if r["task"] == task and r.get("curve"):
                    ax.plot(*zip(*r["curve"]), linewidth=1,
                            label=f"{r['kind']} L={r['L']} d={r['d']} lr={r['lr']:g}")
            ax.set(title=task, xlabel="step", ylabel="validation accuracy", ylim=(0, 1))
            ax.legend(fontsize=5)
        fig.tight_layout()
        fig.savefig(os.path.join(results_dir, "zoo_curves.png"), dpi=120)
        plt.close(fig)
    mqar = {k: r for k, r in best.items() if k[0] == "mqar" and r.get("test_accuracy") is not None}
    if not mqar:
        return
    lengths = sorted({k[3] for k in mqar})
    fig, axes = plt.subplots(1, len(lengths), figsize=(5 * len(lengths), 4), squeeze=False)
    for ax, L in zip(axes[0], lengths):
        for slot, kind in sorted({(k[1], k[2]) for k in mqar if k[3] == L}):
            pts = sorted((k[4], r["test_accuracy"]) for k, r in mqar.items()
                         if k[1:3] == (slot, kind) and k[3] == L)
            ax.plot(*zip(*pts), marker="o", label=kind)
        ax.set(title=f"MQAR, L={L}", xlabel="model width", ylabel="accuracy", xscale="log")
    axes[0][-1].legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(os.path.join(results_dir, "zoo_width.png"), dpi=120)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(6, 4))
    for (task, slot, kind, L, d), r in mqar.items():
        size = r.get("state_bytes")
        if size:
            ax.scatter(size, r["test_accuracy"], s=12)
            ax.annotate(kind, (size, r["test_accuracy"]), fontsize=5)
    ax.set(title="MQAR: accuracy against decoding state", xlabel="state bytes per sequence",
           ylabel="accuracy", xscale="log")
    fig.tight_layout()
    fig.savefig(os.path.join(results_dir, "zoo_state.png"), dpi=120)
    plt.close(fig)


def main(argv):
    del argv
    if not FLAGS.workdir:
        raise app.UsageError("--workdir is required")
    planned = runs(FLAGS.grid, FLAGS.tasks, FLAGS.kinds, FLAGS.widths, FLAGS.learning_rates,
                   FLAGS.num_train_steps, FLAGS.lengths)
    names = [n for n, _ in planned]
    wall, cpu, failed = None, None, []
    if not FLAGS.report_only:
        t0, before = time.time(), resource.getrusage(resource.RUSAGE_CHILDREN)
        codes = sweep.run_local(CONFIG, FLAGS.workdir, [r for _, r in planned], FLAGS.set,
                                num_processes=FLAGS.num_processes, resume=True, names=names)
        wall = time.time() - t0
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
        failed = [n for n, c in zip(names, codes) if c != 0]
        if failed:
            print(f"[zoo] {len(failed)} of {len(names)} runs failed (their rows say why): "
                  + ", ".join(failed[:10]), file=sys.stderr)
    rows = [_row(FLAGS.workdir, n, r) for n, r in planned]
    earlier = os.path.join(FLAGS.results_dir, "zoo.json")
    if FLAGS.keep_earlier and os.path.exists(earlier):
        with open(earlier) as f:
            rows = merge_rows(json.load(f)["rows"], rows)
    rows = [r for r in rows if _has_result(r)]  # a setting never run adds nothing to the tables
    sizes = {}
    for r in rows:
        key = (r["slot"], r["kind"], r["L"], r["d"])
        if key not in sizes:
            try:
                sizes[key] = state_bytes(*key)
            except Exception as e:  # a kind whose model cannot be built reports it in its row
                sizes[key] = None
                r.setdefault("error", f"state: {type(e).__name__}: {e}"[:200])
        r["state_bytes"] = sizes[key]
    print(report(rows, FLAGS.results_dir, wall, FLAGS.grid, cpu))
    if not FLAGS.report_only and failed:
        sys.exit(1)


if __name__ == "__main__":
    _define_flags()
    app.run(main)
