"""The benchmark harness and every suite in quick mode (builders run, checks computable)."""

import json
import subprocess
import sys

import jax
import pytest

from xformers_jax_experiments import bench_lib, benchmark


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
    case = bench_lib.Case("flash", "xformers_jax_experiments.suites.attention:build",
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
    case = bench_lib.Case("broken", "xformers_jax_experiments.suites.attention:build",
                          dict(variant="nonexistent", L=64))
    record = bench_lib.measure(case, "fwd", min_repeats=1, budget_s=0.0, timeout_s=300)
    assert "KeyError" in record["error"] or "exit" in record["error"]
    checks = bench_lib.ratio_check("x", None, 1.0, at_least=2)
    assert checks.ok is None


def test_unknown_suite_is_an_error():
    proc = subprocess.run([sys.executable, "-m", "xformers_jax_experiments.benchmark",
                           "--suite=nope"], capture_output=True, text=True)
    assert proc.returncode != 0 and "unknown suite" in proc.stderr


def test_in_process_compile_only_and_rerun_of_some_cases(tmp_path):
    """The accelerator modes: compile-only shares, one-process timing, --only re-runs that
    keep the other stored cases, and --render_only --recheck."""
    case = bench_lib.Case("flash", "xformers_jax_experiments.suites.attention:build",
                          dict(variant="flash", L=64))
    compiled = bench_lib.compile_only(case, "fwdbwd")
    assert "error" not in compiled and compiled["compile_s"] > 0 and compiled["compiled_mb"] > 0
    here = bench_lib.measure_here(case, "fwdbwd", min_repeats=2, budget_s=0.0)
    assert "error" not in here and here["time_s"] > 0 and here["compiled_mb"] > 0
    assert "peak_rss_mb" not in here and here["gflops"] > 0
    broken = bench_lib.measure_here(bench_lib.Case("x", case.builder, dict(variant="nope", L=8)),
                                    "fwd", min_repeats=1, budget_s=0.0)
    assert broken["error"].startswith("KeyError")

    run = [sys.executable, "-m", "xformers_jax_experiments.benchmark", "--suite=gpu_linear",
           "--quick", f"--results_dir={tmp_path}", f"--markdown={tmp_path / 'B.md'}", "--noplots"]
    share = subprocess.run(run + ["--compile_only=1/2"], capture_output=True, text=True)
    assert share.returncode == 0, share.stderr[-2000:]
    done = json.loads((tmp_path / "compile_1.json").read_text())["records"]
    assert len(done) == 2 and all("compile_s" in r for r in done)  # every other of 4 jobs
    first = subprocess.run(run + ["--in_process"], capture_output=True, text=True)
    assert first.returncode == 0, first.stderr[-2000:]
    stored = json.loads((tmp_path / "gpu_linear.json").read_text())
    assert len(stored["records"]) == 4 and stored["machine"]["in_process"]
    again = subprocess.run(run + ["--in_process", '--only="variant": "recurrent"'],
                           capture_output=True, text=True)
    assert again.returncode == 0, again.stderr[-2000:]
    rerun = json.loads((tmp_path / "gpu_linear.json").read_text())["records"]
    by_name = {(r["name"], r["mode"]): r for r in rerun}
    old = {(r["name"], r["mode"]): r for r in stored["records"]}
    assert by_name.keys() == old.keys() and len(rerun) == len(stored["records"])
    assert by_name[("chunked", "fwd")] == old[("chunked", "fwd")]  # kept, not re-measured
    assert by_name[("recurrent", "fwd")]["time_s"] != old[("recurrent", "fwd")]["time_s"]
    assert by_name[("chunked", "fwd")]["run"] == stored["machine"]["date"]
    payload = json.loads((tmp_path / "gpu_linear.json").read_text())
    for r in payload["records"]:  # as if the kept rows came from an earlier day's run
        if r["name"] == "chunked":
            r["run"] = "2000-01-01 00:00"
    (tmp_path / "gpu_linear.json").write_text(json.dumps(payload))
    render = subprocess.run(
        [sys.executable, "-m", "xformers_jax_experiments.benchmark", "--render_only",
         "--recheck=gpu_linear", f"--results_dir={tmp_path}", f"--markdown={tmp_path / 'R.md'}", "--noplots"],
        capture_output=True, text=True)
    assert render.returncode == 0, render.stderr[-2000:]
    text = (tmp_path / "R.md").read_text()
    assert "| chunked |" in text
    assert "Rows kept from earlier runs" in text and "2000-01-01 00:00: chunked fwd" in text


def test_device_time_from_a_trace_and_its_checks(monkeypatch):
    """Device time per call: kernels and copies on the device planes' stream lines only; none
    on the CPU (no device plane); the GPU suite checks its short lengths on it when recorded."""
    from types import SimpleNamespace as NS

    from xformers_jax_experiments.suites import gpu_attention as G

    def line(name, *events):
        return NS(name=name, events=[NS(name=n, duration_ns=d) for n, d in events])

    data = NS(planes=[
        NS(name="/device:GPU:0", lines=[line("Stream #13(Compute)", ("fwd", 100), ("fwd", 50),
                                             ("copy", 7)),
                                        line("XLA Ops", ("fwd", 1000))]),
        NS(name="/host:CPU", lines=[line("stream of the host", ("dispatch", 900))]),
    ])
    ns, calls = bench_lib.device_events(data)
    assert dict(ns) == {"fwd": 150, "copy": 7} and dict(calls) == {"fwd": 2, "copy": 1}

    case = bench_lib.Case("flash", "xformers_jax_experiments.suites.attention:build",
                          dict(variant="flash", L=64))
    here = bench_lib.measure_here(case, "fwd", min_repeats=1, budget_s=0.0, device_time=True)
    assert "error" not in here and "device_s" not in here  # the CPU trace has no device plane

    def broken_trace(*_):
        raise RuntimeError("no profiler here")

    monkeypatch.setattr(bench_lib, "trace_device", broken_trace)
    kept = bench_lib.measure_here(case, "fwd", min_repeats=1, budget_s=0.0, device_time=True)
    assert kept["time_s"] > 0 and "error" not in kept and "no profiler" in kept["device_error"]

    assert G.device_timed(bench_lib.Case("f", "", dict(impl="pallas flash", L=4096)))
    assert not G.device_timed(bench_lib.Case("f", "", dict(impl="pallas flash", L=8192)))
    assert not G.device_timed(bench_lib.Case("c", "", dict(impl="cudnn", L=2048)))
    records = []
    for L in (2048, 4096):
        for name, causal, wall, dev in (("pallas flash", False, 1.0, 0.5),
                                        ("pallas flash", True, 0.9, 0.2 if L == 2048 else 0.3),
                                        ("pallas sparse 10%", False, 0.5, 0.05)):
            records.append(dict(name=name, mode="fwd", time_s=wall, device_s=dev,
                                params=dict(impl="x", L=L, D=64, causal=causal)))
    checks = G._device_checks(bench_lib.Results(records, None), 64, "fwd", [2048, 4096])
    assert [c.measured for c in checks] == ["10.00x (worst, at L=2048)",
                                            "0.60x (worst, at L=4096)"]
    assert [c.ok for c in checks] == [True, True]
    for r in records:
        del r["device_s"]
    assert G._device_checks(bench_lib.Results(records, None), 64, "fwd", [2048, 4096]) == []


def test_gpu_profile_default_cases_name_suite_cases():
    """Every case gpu_profile profiles by default is a case of its suite (a typo would only
    show on the GPU machine)."""
    from xformers_jax_experiments import gpu_profile

    for spec in gpu_profile.DEFAULT_CASES:
        suite, builder, params, mode = gpu_profile._parse(spec)
        assert suite.startswith("gpu_") and mode in ("fwd", "fwdbwd") and builder, spec
    with pytest.raises(ValueError, match="no case"):
        gpu_profile._parse("gpu_attention:impl=pallas flash,L=3")


def test_moe_selection_case_times_the_lookups_top_k():
    """The moe suite's (why) case: the selection alone is the lookup's own top-k (the same
    slots and scores as inside ``product_key_lookup``'s workload)."""
    import numpy as np

    from xformers_jax_experiments.suites import moe
    from xformers_jax import experts as M

    sel = moe.build("product key top-k", T=8, N=64 ** 2)
    scores, slots = jax.jit(sel.fn)(*sel.args)
    x, wq, k1, k2 = sel.args
    q = (x @ wq).reshape(8, moe.PKM_HEADS, moe.PKM_KEY_DIM)
    want_scores, want_slots = M.product_key_topk(q, k1, k2, moe.PKM_K)
    np.testing.assert_array_equal(slots, want_slots)
    np.testing.assert_array_equal(scores, want_scores)
    assert scores.shape == (8, moe.PKM_HEADS, moe.PKM_K)


def test_unmeasured_checks_say_why_and_the_summary_counts_every_target():
    from xformers_jax_experiments import benchmark

    checks = [dict(figure="a", measured="2.00x", target=">= 1", ok=True),
              dict(figure="b", measured="0.50x", target=">= 1", ok=False),
              dict(figure="c", measured=bench_lib.NOT_MEASURED, target=">= 1", ok=None)]
    quick = benchmark.explain_unmeasured(checks, [], quick=True)
    assert quick[2]["measured"] == "n/a (not measured at --quick sizes)"
    assert quick[:2] == checks[:2]
    failed = benchmark.explain_unmeasured(checks, [{"name": "flash", "error": "OOM"},
                                                   {"name": "dense"}], quick=False)
    assert failed[2]["measured"] == "n/a (not measured; failed in this run: flash)"
    machine = {"cpu": "a CPU", "backend": "cpu", "date": "2026-01-01 00:00"}
    # A (why) row measures what bounds a figure: it is neither a target met nor one missed.
    why = [dict(figure="(why) a ceiling", measured="0.90x", target=">= 1", ok=False),
           dict(figure="(why) the work", measured="3.00x", target=">= 1", ok=True)]
    lines = benchmark.target_summary([{"suite": "s", "quick": False, "machine": machine,
                                       "checks": quick + why}])
    assert not any("(why)" in line for line in lines if line.startswith("| `s` |"))
    assert "| `s` | a CPU | 2026-01-01 00:00 | 3 | 1 | 1 | 1 |" in lines
    assert "| all | | | 3 | 1 | 1 | 1 |" in lines
    assert "| `s` | b | 0.50x | >= 1 |" in lines and "| `s` | a | 2.00x | >= 1 |" not in lines


def test_render_shows_a_suites_notes(tmp_path):
    payload = {"suite": "attention", "title": "t", "note": None, "quick": False,
               "machine": {"cpu": "a CPU", "cores": 2, "backend": "cpu", "date": "d",
                           "jax": "0"},
               "matmul_gflops": 1.0, "records": [], "checks": []}
    (tmp_path / "attention.json").write_text(json.dumps(payload))
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "attention.md").write_text("A profile said so.\n")
    text = benchmark.render_markdown(str(tmp_path), str(tmp_path / "B.md"), plots=False)
    assert "### `attention`: notes\n\nA profile said so.\n" in text
    assert text.index("## Summary of targets") < text.index("## `attention`")


def test_a_runs_machine_note_is_its_own_not_the_rendering_machines(tmp_path):
    """What a suite measured about its machine (peers: the CPU's vector extensions and
    PyTorch's build) is stored with the run and rendered from it, whatever machine renders."""
    from xformers_jax_experiments.suites import peers

    assert "CPU:" not in peers.NOTE and peers.machine_note().startswith("CPU: ")
    payload = {"suite": "peers", "title": "t", "note": "old documentation",
               "machine_note": "CPU: the run's CPU, 2 cores. PyTorch 9.9.",
               "quick": False, "machine": {"cpu": "a CPU", "cores": 2, "backend": "cpu",
                                           "date": "d", "jax": "0"},
               "matmul_gflops": 1.0, "records": [], "checks": []}
    (tmp_path / "peers.json").write_text(json.dumps(payload))
    text = benchmark.render_markdown(str(tmp_path), str(tmp_path / "B.md"), plots=False)
    assert "CPU: the run's CPU, 2 cores. PyTorch 9.9. Ratios are" in text
    assert peers.machine_note() not in text


def test_flex_ceilings_count_the_tiles_a_perfect_skip_leaves(monkeypatch):
    """The flex suite's (why) ceilings: with the fixed tile cost table (512 x 512 tiles win at
    L=8192), full flash computes 256 tiles and the ~10% band 46; causal flash 136 and 8 causal
    documents of 1K 24 (8 full, 16 half-masked diagonal tiles)."""
    from xformers_jax import kernels
    from xformers_jax_experiments.suites import flex

    table = dict(kernels.DEFAULT_TILE_COST)
    monkeypatch.setattr(kernels, "tile_costs", lambda: table)
    monkeypatch.setattr(kernels, "default_block", lambda: min(table, key=lambda t: (table[t], -t)))
    band, documents = flex.ceilings(8192)
    assert band == pytest.approx(256 / 46) and documents == pytest.approx(136 / 24)
