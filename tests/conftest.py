"""Shared fixtures. Tests see 8 simulated CPU devices (for the sharding tests)."""

import gc
import os

# XFORMERS_JAX_TEST_PLATFORM re-targets the suite (default "cpu", what CI runs): "cuda" runs
# it on a GPU, where the Pallas kernels run compiled instead of in interpret mode
# (xformers_jax_experiments/gpu_session.sh runs the kernel and exact/sparse attention tests
# that way).
PLATFORM = os.environ.get("XFORMERS_JAX_TEST_PLATFORM", "cpu")
# Must happen before JAX initialises its backends.
os.environ.setdefault("XLA_FLAGS", "")
if PLATFORM == "cpu":
    if "--xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
        os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"
    # XLA:CPU's backend (LLVM) optimisation level 0: the suite's shapes are tiny, so compiling
    # dominates its time, and level 0 compiles much faster (test_nn_layers.py: 48 s of CPU
    # against 69-79 s at the default level). The HLO passes (fusion, layout, simplification)
    # still run; only machine-code optimisation is skipped, which changes float results at
    # most by rounding.
    if "--xla_backend_optimization_level" not in os.environ["XLA_FLAGS"]:
        os.environ["XLA_FLAGS"] += " --xla_backend_optimization_level=0"
    # XLA:CPU's fusions emitted by its older LLVM IR emitters instead of the MLIR fusion
    # emitters (the default since JAX 0.5): most of the compile time of the suite's small
    # programs is spent in the MLIR emitters (one kind's padding program in
    # test_kinds_padding.py: 0.6 s of CPU against 2.2 s), and the two emit the same
    # arithmetic up to rounding. Codegen in one thread: the suite runs one worker per core.
    if "--xla_cpu_use_fusion_emitters" not in os.environ["XLA_FLAGS"]:
        os.environ["XLA_FLAGS"] += " --xla_cpu_use_fusion_emitters=false"
    if "--xla_cpu_parallel_codegen_split_count" not in os.environ["XLA_FLAGS"]:
        os.environ["XLA_FLAGS"] += " --xla_cpu_parallel_codegen_split_count=1"
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
else:
    # The accelerator first (the default device), the CPU beside it: Mosaic GPU's interpreter
    # runs its kernels through host callbacks, which need a CPU device (the interpreted tests
    # of test_pallas_mosaic.py failed on an H200 without it, 2026-11-29).
    os.environ["JAX_PLATFORMS"] = f"{PLATFORM},cpu"
    # Several test processes share one GPU: none may take most of its memory up front.
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
# The fixed tile cost table, never one measured on this machine (kernels/_autotune.py): tests
# are deterministic and never spend time autotuning.
os.environ["XFORMERS_JAX_TILES"] = "default"

import jax  # noqa: E402
import pytest  # noqa: E402

from hypothesis import settings  # noqa: E402

if PLATFORM != "cpu":
    # The tolerance table's float32 entries are for float32 arithmetic; on a GPU, XLA's and
    # Triton's default for a float32 matmul is TF32 (about 1e-3 relative).
    jax.config.update("jax_default_matmul_precision", "highest")

settings.register_profile("ci", max_examples=15, deadline=None, derandomize=True)
settings.load_profile("ci")


@pytest.fixture
def key():
    """A fixed PRNG key; tests split it for what they need."""
    return jax.random.PRNGKey(0)


@pytest.fixture(autouse=True, scope="module")
def _free_compiled_programs():
    """Drops JAX's compiled programs after each test module: the suite compiles hundreds of
    models in one process, and programs are not shared across modules, so keeping them only
    grows the process (a fresh-clone run of the whole suite once crashed in XLA's compiler
    near its end)."""
    yield
    jax.clear_caches()
    gc.collect()
