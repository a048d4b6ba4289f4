"""The benchmark harness and every suite in quick mode (builders run, checks computable)."""

import json
import subprocess
import sys

import jax
import pytest

from experiments import bench_lib, benchmark


@pytest.mark.parametrize("suite", benchmark.available_suites())
def test_suite_quick_cases_build_and_run(suite):
    module = benchmark.load_suite(suite)
    assert module.TITLE
    cases = module.cases(quick=True)
    assert cases
    for case in cases[:3]:
        try:
            work = bench_lib._import(case.builder)(**case.params)
        except ImportError:  # a benchmark-only extra (peers: PyTorch) that is not installed
            continue
        if work.native is not None:  # a non-JAX callable, timed as is
            work.native(case.modes[0])()
        else:
            jax.block_until_ready(jax.jit(work.fn)(*work.args))


def test_worker_subprocess_and_markdown(tmp_path):
    case = bench_lib.Case("flash", "experiments.suites.attention:build",
                          dict(variant="flash", L=64))
    record = bench_lib.measure(case, "fwdbwd", min_repeats=2, budget_s=0.0, timeout_s=300)
    assert "error" not in record, record
    assert record["time_s"] > 0 and record["peak_rss_mb"] >= record["baseline_rss_mb"] > 0
    assert record["gflops"] > 0
    payload = dict(suite="attention", title="t", quick=True, machine=bench_lib.machine_info(),
                   matmul_gflops=100.0, records=[record], checks=[])
    (tmp_path / "attention.json").write_text(json.dumps(payload))
    text = benchmark.render_markdown(str(tmp_path), str(tmp_path / "B.md"))
    assert "| flash |" in text and "Quick mode" in text


def test_failed_case_is_recorded_not_raised():
    case = bench_lib.Case("broken", "experiments.suites.attention:build",
                          dict(variant="nonexistent", L=64))
    record = bench_lib.measure(case, "fwd", min_repeats=1, budget_s=0.0, timeout_s=300)
    assert "KeyError" in record["error"] or "exit" in record["error"]
    checks = bench_lib.ratio_check("x", None, 1.0, at_least=2)
    assert checks.ok is None


def test_unknown_suite_is_an_error():
    proc = subprocess.run([sys.executable, "-m", "experiments.benchmark", "--suite=nope"],
                          capture_output=True, text=True)
    assert proc.returncode != 0 and "unknown suite" in proc.stderr
