"""Every guide under examples/ runs, at a small size, and shows what its text says it shows.

The scripts that change process-wide state (registering a kind, the number of CPU devices)
run in a subprocess; the others are imported and their ``main`` called, sharing this
process's compiled programs.
"""

import importlib.util
import os
import pathlib
import subprocess
import sys

import numpy as np

from tests.tolerances import EXACT, tol

ROOT = pathlib.Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
GUIDES = ("attention_function", "switch_kinds", "lra_compare", "new_kind", "shard", "decode",
          "compress", "flex_attention")


def _load(name):
    sys.path.insert(0, str(EXAMPLES))  # compress.py imports lra_compare.py beside it
    try:
        spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(EXAMPLES))


def _run(name, *args, env=None):
    """The script as a user runs it (``python examples/NAME.py``), this checkout first on
    the import path; returns its standard output."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    done = subprocess.run([sys.executable, str(EXAMPLES / f"{name}.py"), *args], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_every_example_is_tested():
    assert sorted(p.stem for p in EXAMPLES.glob("*.py")) == sorted(GUIDES)


def test_attention_function():
    r = _load("attention_function").main(length=64, heads=2, dim=16)
    assert r["exact_error"] < tol(EXACT, np.float32)["atol"]
    assert r["local_error"] < tol(EXACT, np.float32)["atol"]
    assert r["padded_grad"] == 0.0
    assert r["approx_error"] > 1e-3  # an approximation, not the exact kernel again


def test_switch_kinds():
    logits = _load("switch_kinds").main(length=32)
    assert all(v.shape == (2, 10) and np.isfinite(v).all() for v in logits.values())
    # The same weights (same key) under two exact kinds give the same logits.
    np.testing.assert_allclose(logits["flash"], logits["dot_product"], **tol(EXACT, np.float32))
    assert not np.allclose(logits["performer"], logits["dot_product"], atol=1e-3)


def test_lra_compare(tmp_path):
    results = _load("lra_compare").main(steps=4, workdir=str(tmp_path),
                                        kinds=("transformer", "performer"))
    for variant, r in results.items():
        assert r["step"] == 4 and 0 <= r["test_accuracy"] <= 1, (variant, r)
        assert (tmp_path / variant / "metrics.jsonl").exists()


def test_new_kind():
    out = _run("new_kind")
    assert "Ramapuram et al. (2024)" in out
    assert "earlier logits moved by later tokens: 0.0e+00" in out, out
    assert "logits moved by junk in the padding: 0.0e+00" in out, out


def test_shard():
    out = _run("shard", env={"XLA_FLAGS": "--xla_force_host_platform_device_count=8 "
                                          "--xla_backend_optimization_level=0"})
    assert "8 devices, mesh {'fsdp': 4, 'tensor': 2}" in out, out
    assert "one device holds (2, 16, 32)" in out, out
    single, sharded = (float(x) for x in out.split("loss on one device ")[1].split(", sharded "))
    np.testing.assert_allclose(sharded, single, **tol(EXACT, np.float32))


def test_decode():
    results = _load("decode").main(length=12, new_tokens=4)
    for label, r in results.items():
        assert r["error"] < 1e-4, (label, r["error"])
        assert r["greedy"].shape == r["sampled"].shape == (2, 16)
    # A window cache and a recurrent state are smaller than a growing key/value cache.
    assert results["local (window)"]["cache_bytes"] < results["dot_product (kv)"]["cache_bytes"]
    assert results["linear (recurrent)"]["cache_bytes"] < results["local (window)"]["cache_bytes"]


def test_compress(tmp_path):
    r = _load("compress").main(steps=4, workdir=str(tmp_path))
    assert r["int8"]["bytes"] < r["float32"]["bytes"] / 2
    assert r["agreement"] >= 0.9
    assert all(0 <= v["accuracy"] <= 1 for k, v in r.items() if k != "agreement")


def test_flex_attention():
    """docs/flex.md's three examples: the script asserts each against its definition."""
    import runpy

    runpy.run_path(str(EXAMPLES / "flex_attention.py"), run_name="__main__")
