"""The ListOps compression figures, over seeds: float32, int8 post-training quantization, 25% of
heads pruned, QAT fine-tuned from the float model then int8, 50% gradual magnitude pruning, a
half-depth student distilled from the float model and the same student without a teacher.

  python -m xformers_jax_experiments.studies.compress.figures --size=long --seeds=0,1,2 \
      --workdir=runs/compress

Runs ``xformers_jax_experiments/configs/compress.py``'s methods ``teacher``, ``qat``
(``init_from`` the seed's teacher), ``prune``, ``student`` and ``scratch`` (``distill.teacher``
the seed's teacher) at ``SIZE`` for each seed, one after another in this process, each in
``WORKDIR/METHOD_sSEED`` with ``run_lib.run_or_resume`` (a run whose ``result.json`` exists is
not run again, so an interrupted sweep resumes). Each run's result, wall time and load average
go to that file; then the table is written to
``OUT/compress_listops_SIZE.md`` (and ``.json``; ``OUT``: this study's folder by default): test
accuracy per seed, the mean, and each method's difference from float32 per seed and on the
mean.
"""

from __future__ import annotations

import json
import os

import numpy as np
from absl import app, flags

from xformers_jax_experiments import run_lib
from xformers_jax_experiments.configs import compress as configs

_SIZE = flags.DEFINE_string("size", "long", "compress.py size: 'long', 'runlocal' or 'main'.")
_SEEDS = flags.DEFINE_string("seeds", "0,1,2", "Comma-separated seeds (each also draws data).")
_METHODS = flags.DEFINE_string("methods", "teacher,qat,prune,student,scratch",
                               "Methods to run (teacher first: the others use it).")
_WORKDIR = flags.DEFINE_string("workdir", "runs/compress", "Where the runs go.")
_OUT = flags.DEFINE_string("out", os.path.dirname(os.path.abspath(__file__)),
                           "Where the table goes (default: this study's folder).")
_REPORT_ONLY = flags.DEFINE_bool("report_only", False, "Only rewrite the table from the runs.")

# (row label, method, result key, target against float32 in points or None)
ROWS = (
    ("float32", "teacher", "test_accuracy", None),
    ("int8 post-training (max-calibrated activations)", "teacher", "test_accuracy_int8", 1.0),
    ("25% of heads pruned by importance", "teacher", "test_accuracy_heads_pruned", None),
    ("QAT fine-tuned from float32, fake-quantized", "qat", "test_accuracy", None),
    ("QAT fine-tuned from float32, then int8", "qat", "test_accuracy_int8", 0.5),
    ("50% magnitude pruning, gradual schedule", "prune", "test_accuracy", 1.0),
    ("half-depth student distilled from float32", "student", "test_accuracy", None),
    ("half-depth student without a teacher", "scratch", "test_accuracy", None),
    ("majority class", "teacher", "test_majority_accuracy", None),
)


def _config(method, size, seed, workdir):
    c = configs.get_config(f"{method},{size}" if size != "main" else method)
    c.unlock()
    c.seed = seed
    c.update(dict(plot=False, progress_bar=False, tensorboard=False))
    teacher = os.path.join(workdir, f"teacher_s{seed}")
    if method == "qat":
        c.init_from = teacher
    if c.distill.teacher:
        c.distill.teacher = teacher
    c.lock()
    return c


def run_one(method, size, seed, workdir) -> dict:
    return run_lib.run_or_resume(_config(method, size, seed, workdir),
                                 os.path.join(workdir, f"{method}_s{seed}"),
                                 tags=dict(method=method, seed=seed, size=size))


def _runs(workdir, methods, seeds):
    """The finished runs' records, by (method, seed)."""
    runs = {}
    for m in methods:
        for s in seeds:
            record = run_lib.finished(os.path.join(workdir, f"{m}_s{s}"))
            if record is not None:
                runs[m, s] = record
    return runs


def _setting(size) -> str:
    c = configs.get_config(f"teacher,{size}" if size != "main" else "teacher")
    student = configs.get_config(f"student,{size}" if size != "main" else "student")
    d, m = c.data, c.model
    return (f"Setting: ListOps expressions of {d.min_length}-{d.max_length} tokens, depth <= "
            f"{d.max_depth}, {d.num_train} training / {d.num_test} test (drawn by the seed); "
            f"teacher {m.num_layers} layers, dim {m.dim}, {m.num_heads} heads, MLP {m.hidden}, "
            f"dense attention, {c.num_train_steps} steps of batch {c.batch_size}, peak learning "
            f"rate {c.optim.learning_rate} (cosine). QAT: {c.num_train_steps // 4} steps from the "
            f"teacher at a tenth of its learning rate. Students: {student.model.num_layers} "
            f"layer(s), {student.num_train_steps} steps, with and without the teacher; "
            f"distilled with KD (alpha 0.5, T 2), DistilBERT's every-other-layer "
            f"initialisation and cosine loss.")


def report(workdir, size, seeds, out_dir) -> str:
    methods = sorted({m for _, m, _, _ in ROWS})
    runs = _runs(workdir, methods, seeds)
    ref = {s: runs["teacher", s]["result"]["test_accuracy"] * 100
           for s in seeds if ("teacher", s) in runs}
    lines = [f"# ListOps compression figures (`compress.py` size `{size}`)", "",
             "Generated by `python -m xformers_jax_experiments.studies.compress.figures "
             f"--size={size} --seeds={','.join(map(str, seeds))}`; do not edit. Test accuracy "
             "in %, per seed and mean; diff = method minus float32 of the same seed (points).",
             "",
             _setting(size), "",
             "| | " + " | ".join(f"seed {s}" for s in seeds) + " | mean | diff per seed | "
             "diff of means | target |",
             "|---|" + "---|" * (len(seeds) + 4)]
    table = []
    for label, method, key, target in ROWS:
        vals = {s: runs[method, s]["result"].get(key) for s in seeds if (method, s) in runs}
        vals = {s: v * 100 for s, v in vals.items() if v is not None}
        if not vals:
            continue
        mean = float(np.mean(list(vals.values())))
        common = [s for s in vals if s in ref]
        diffs = {s: vals[s] - ref[s] for s in common}
        dmean = (mean - float(np.mean([ref[s] for s in vals]))) if common and \
            len(common) == len(vals) else None
        verdict = ""
        if target is not None and dmean is not None:
            verdict = (f"within {target}: " + ("met" if dmean >= -target else "missed")
                       + f" ({len(vals)} seed{'s' if len(vals) > 1 else ''})")
        if method == "student" and ("scratch", seeds[0]) in runs:
            sc = {s: runs["scratch", s]["result"]["test_accuracy"] * 100 for s in vals
                  if ("scratch", s) in runs}
            if len(sc) == len(vals):
                gap = mean - float(np.mean(list(sc.values())))
                wins = sum(vals[s] > sc[s] for s in sc)
                verdict = (f"beats no-teacher by {gap:+.2f} on the mean, on {wins}/{len(sc)} "
                           "seeds")
        row = dict(label=label, method=method, key=key, per_seed=vals, mean=mean,
                   diff_per_seed=diffs, diff_of_means=dmean, verdict=verdict)
        table.append(row)
        cells = [f"{vals[s]:.1f}" if s in vals else "" for s in seeds]
        dcell = " / ".join(f"{diffs[s]:+.1f}" for s in seeds if s in diffs) \
            if key not in ("test_accuracy", "test_majority_accuracy") or method != "teacher" \
            else ""
        lines.append(f"| {label} | " + " | ".join(cells) + f" | {mean:.2f} | {dcell} | "
                     + ("" if dmean is None or not dcell else f"{dmean:+.2f}")
                     + f" | {verdict} |")
    lines += ["", "Runs (wall time; load = 1-minute load average at start / end; runs of this "
              "sweep share the machine with whatever else ran):", ""]
    for (m, s), r in sorted(runs.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        where = f", {r['cpu']} ({r['cores']} cores)" if "cpu" in r else ""
        lines.append(f"- {m} seed {s}: {r['steps']} steps, {r['seconds']:.0f} s, load "
                     f"{r['load_start']:.1f} / {r['load_end']:.1f}{where}")
    text = "\n".join(lines) + "\n"
    os.makedirs(out_dir, exist_ok=True)
    base = os.path.join(out_dir, f"compress_listops_{size}")
    with open(base + ".md", "w") as f:
        f.write(text)
    with open(base + ".json", "w") as f:
        json.dump(dict(size=size, seeds=list(seeds), rows=table,
                       runs={f"{m}_s{s}": r for (m, s), r in runs.items()}), f, indent=1)
    return text


def main(argv):
    del argv
    seeds = [int(s) for s in _SEEDS.value.split(",") if s]
    methods = [m for m in _METHODS.value.split(",") if m]
    if not _REPORT_ONLY.value:
        for seed in seeds:
            for method in methods:
                r = run_one(method, _SIZE.value, seed, _WORKDIR.value)
                print(json.dumps(r), flush=True)
                report(_WORKDIR.value, _SIZE.value, seeds, _OUT.value)
    print(report(_WORKDIR.value, _SIZE.value, seeds, _OUT.value))


if __name__ == "__main__":
    app.run(main)
