#!/usr/bin/env bash
# The GPU figures and the GPU tests in one command, for a GPU machine (H100/H200) that is
# lent for minutes: run from the repository root with the machine's own JAX (CUDA build).
#
#   OUT=/some/dir xformers_jax_experiments/gpu_session.sh
#
# Phase 1, in parallel: SHARES processes compile every case of the gpu_* benchmark suites into
# JAX's persistent compilation cache (XLA:GPU compiles one program on one core, and the
# machine has many), while the Pallas kernel tests and the exact/sparse attention tests run
# on the GPU (tests/conftest.py: XFORMERS_JAX_TEST_PLATFORM=cuda).
# Phase 2: one process per suite times every case, reading the compiled programs from the
# cache (benchmark.py --in_process).
# TESTS: the test files to run in phase 1 (unset: the Pallas ones; empty: none).
# QUICK=1 shrinks the suites to smoke-test sizes (any backend; TEST_PLATFORM=cpu for the tests).
# Then xformers_jax_experiments/gpu_profile.py's per-kernel device time of a few cases
# (PROFILE=0: none).
# Writes to $OUT (at most 8 files): session.log (the machine, then progress), tests.log,
# compile.log, profile.txt and <suite>.json for each suite. Copy the JSON files to
# xformers_jax_experiments/results/ and run
# `python -m xformers_jax_experiments.benchmark --render_only` to put them in BENCHMARKS.md.
#
# Wheels for packages the machine lacks (tokamax, the comparison's other Pallas library) may
# be carried in .whl/; they are installed into /tmp/site first.
set -u
OUT=${OUT:-/tmp/gpu_session}
WORK=${WORK:-/tmp/gpu_work}
SHARES=${SHARES:-8}
SUITES=${SUITES:-gpu_attention,gpu_linear,gpu_lra}
TESTS=${TESTS-tests/test_pallas.py tests/test_exact_attention.py tests/test_sparse_patterns.py}
PY=${PY:-python3}
mkdir -p "$OUT" "$WORK"
if [ -d .whl ] && ls .whl/*.whl > /dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export XFORMERS_JAX_TILES=default PYTHONUNBUFFERED=1
export JAX_COMPILATION_CACHE_DIR=$WORK/jax_cache JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0
t0=$(date +%s)
log() { echo "[$(( $(date +%s) - t0 )) s] $*" | tee -a "$OUT/session.log"; }
{
  date; nvidia-smi; nproc; free -g
  $PY -c "import sys, jax, jaxlib; print(sys.version); print(jax.__version__, jaxlib.__version__, jax.devices())"
  $PY -m pip list 2>/dev/null | grep -i -E "^(jax|jaxlib|jax-cuda.*|equinox|optax|triton|tokamax|numpy|chex) "
} > "$OUT/session.log" 2>&1

# A re-run of some cases (ONLY=regex for every suite, ONLY_<SUITE> for one; matched against
# each case's name and parameters) keeps the other cases of the earlier run's JSON files
# found in the folder PREVIOUS.
if [ -n "${PREVIOUS:-}" ]; then cp "$PREVIOUS"/gpu_*.json "$OUT/"; fi

if [ "${SKIP_PHASE1:-0}" != 1 ]; then
  log "phase 1: $SHARES compile shares of $SUITES; tests: $TESTS"
  for i in $(seq 0 $((SHARES - 1))); do
    XLA_PYTHON_CLIENT_PREALLOCATE=false timeout "${COMPILE_TIMEOUT:-240}" \
      $PY -m xformers_jax_experiments.benchmark --suite="$SUITES" --compile_only="$i/$SHARES" \
      --results_dir="$WORK/compile" ${QUICK:+--quick} ${ONLY:+--only="$ONLY"} \
      > "$WORK/compile_$i.log" 2>&1 &
  done
  if [ -n "$TESTS" ]; then
    XFORMERS_JAX_TEST_PLATFORM=${TEST_PLATFORM:-cuda} timeout "${TEST_TIMEOUT:-240}" \
      $PY -m pytest -q -n "${TEST_WORKERS:-4}" -p no:cacheprovider $TESTS \
      > "$OUT/tests.log" 2>&1 &
  fi
  wait
  grep -h "compile\|Error\|error" "$WORK"/compile_*.log > "$OUT/compile.log"
  log "phase 1 done; tests: $(tail -1 "$OUT/tests.log" 2>/dev/null)"
  # A Hopper backward that failed its GPU tests (the compiled kernels': a failure of the
  # interpreted ones says nothing about the device) or hung until TEST_TIMEOUT is not timed:
  # the timings then run the Triton backward after the Mosaic forward, and say so.
  case "$TESTS" in *test_pallas_mosaic*)
    if ! tail -1 "$OUT/tests.log" 2>/dev/null | grep -q "passed" \
        || grep -qE "^(FAILED|ERROR) .*test_pallas_mosaic.py::test_compiled_" "$OUT/tests.log"; then
      export XFORMERS_JAX_MOSAIC_BACKWARD=0 XFORMERS_JAX_MOSAIC_MASKS=0
      export XFORMERS_JAX_MOSAIC_SPARSE=0
      log "Mosaic GPU tests did not all pass: timing with XFORMERS_JAX_MOSAIC_BACKWARD=0," \
        "XFORMERS_JAX_MOSAIC_MASKS=0 and XFORMERS_JAX_MOSAIC_SPARSE=0"
    fi;;
  esac
fi

# Results go straight to $OUT, rewritten after every case: a suite cut short by its time
# limit keeps what it measured. Each suite's limit is TIME_TIMEOUT_<SUITE>, else TIME_TIMEOUT
# (200 s); gpu_attention's default is 300 s (85 cases, and device-time traces of the short
# ones).
: "${TIME_TIMEOUT_GPU_ATTENTION:=${TIME_TIMEOUT:-300}}"
for s in ${SUITES//,/ }; do
  limit=TIME_TIMEOUT_${s^^} only=ONLY_${s^^}
  only=${!only:-${ONLY:-}}
  timeout "${!limit:-${TIME_TIMEOUT:-200}}" $PY -m xformers_jax_experiments.benchmark --suite="$s" \
    --in_process --budget_s="${BUDGET_S:-0.5}" --results_dir="$OUT" --noplots \
    --markdown="$WORK/BENCHMARKS.md" ${only:+--only="$only"} ${QUICK:+--quick} 2>&1 \
    | grep -v "^[IW][0-9]" >> "$OUT/session.log"
  log "$s done"
done

if [ "${PROFILE:-1}" = 1 ]; then
  timeout "${PROFILE_TIMEOUT:-90}" $PY -m xformers_jax_experiments.gpu_profile \
    --summary_out="$OUT/profile.txt" \
    ${PROFILE_CASES:+--cases="$PROFILE_CASES"} \
    2>&1 | grep -v "^[IW][0-9]" >> "$OUT/session.log"
  log "profile done"
fi
