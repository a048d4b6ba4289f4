#!/usr/bin/env bash
# Zoology's full grid (studies/zoo, `--grid=full`) on a GPU that is lent for minutes, one part
# per call: run from the repository root with the machine's own JAX (CUDA build).
#
#   OUT=/some/dir KINDS='^(attention/dot_product|mixer/mamba)$' TASKS=mqar LENGTHS=64 \
#     WIDTHS=64,128 LIMIT=420 xformers_jax_experiments/zoo_session.sh
#
# Runs the selected runs of the grid (KINDS: a regular expression on SLOT/KIND; TASKS,
# LENGTHS, WIDTHS, RATES: comma lists, each the grid's own when unset), PROCS at a time on the
# one GPU (each process gets an equal share of its memory), for at most LIMIT seconds. A run
# the limit cuts short is dropped: its checkpoint cannot come back (the machine keeps nothing),
# so size a part to finish. DONE=path/to/zoo_runs.tgz (carried) brings earlier parts' runs
# back in: the sweep keeps them (it resumes) and the report covers them all.
# Writes to $OUT: session.log, zoo_runs.tgz (every finished run's run.json, config.json,
# metrics.jsonl and train.log; no checkpoints), and the report (zoo.json, zoo.md) so far.
# Locally: extract zoo_runs.tgz into a workdir and run
# `python -m xformers_jax_experiments.studies.zoo.run --grid=full --workdir=DIR --report_only`.
# GRID=cpu and ZOO_ARGS (more flags for the runner, e.g. --num_train_steps=20) try it on a CPU.
#
# The machine lacks grain, ml-collections, tensorboardX, array-record and portpicker: carry
# their wheels in .whl/ (BUILD.md, "On a GPU"); they are installed into /tmp/site first.
set -u
OUT=${OUT:-/tmp/zoo_session}
WORK=${WORK:-/tmp/zoo_work}
PROCS=${PROCS:-8}
LIMIT=${LIMIT:-420}
PY=${PY:-python3}
mkdir -p "$OUT" "$WORK"
if [ -d .whl ] && ls .whl/*.whl > /dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export XLA_PYTHON_CLIENT_PREALLOCATE=false
export XLA_PYTHON_CLIENT_MEM_FRACTION=$($PY -c "print(round(0.9 / $PROCS, 3))")
if [ -n "${DONE:-}" ]; then tar -xzf "$DONE" -C "$WORK"; fi
t0=$(date +%s)
{ date; nvidia-smi -L 2>/dev/null; echo "part: kinds=${KINDS:-all} tasks=${TASKS:-all}" \
    "lengths=${LENGTHS:-grid} widths=${WIDTHS:-grid} rates=${RATES:-grid} procs=$PROCS"; } \
  > "$OUT/session.log"
args=(--grid="${GRID:-full}" --workdir="$WORK" --num_processes="$PROCS" --results_dir="$OUT")
[ -n "${KINDS:-}" ] && args+=(--kinds="$KINDS")
[ -n "${TASKS:-}" ] && args+=(--tasks="$TASKS")
[ -n "${LENGTHS:-}" ] && args+=(--lengths="$LENGTHS")
[ -n "${WIDTHS:-}" ] && args+=(--widths="$WIDTHS")
[ -n "${RATES:-}" ] && args+=(--learning_rates="$RATES")
# shellcheck disable=SC2086
timeout -k 30 "$LIMIT" $PY -m xformers_jax_experiments.studies.zoo.run "${args[@]}" \
  ${ZOO_ARGS:-} >> "$OUT/session.log" 2>&1
rc=$?  # 124: the time limit
echo "[$(( $(date +%s) - t0 )) s] sweep exited with $rc" >> "$OUT/session.log"
pkill -TERM -f "xformers_jax_experiments.train .*--workdir=$WORK/" 2> /dev/null  # this part's
# The finished runs (a test accuracy recorded), without their checkpoints.
(cd "$WORK" && grep -l '"test_accuracy"' --include=metrics.jsonl -r . | xargs -r -n1 dirname \
  | while read -r d; do for f in run.json config.json metrics.jsonl train.log; do
      [ -f "$d/$f" ] && echo "$d/$f"; done; done) > "$WORK/finished.txt"
tar -czf "$OUT/zoo_runs.tgz" -C "$WORK" -T "$WORK/finished.txt"
$PY -m xformers_jax_experiments.studies.zoo.run "${args[@]}" --report_only ${ZOO_ARGS:-} \
  >> "$OUT/session.log" 2>&1
echo "finished runs: $(grep -c metrics.jsonl "$WORK/finished.txt"); log: $OUT/session.log"
