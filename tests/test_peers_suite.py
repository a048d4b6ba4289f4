"""The peers benchmark suite compares like with like (xformers_jax_experiments/suites/peers.py)."""

import numpy as np
import pytest

from xformers_jax_experiments.bench_lib import Results
from xformers_jax_experiments.suites import peers
from tests.tolerances import assert_close


def test_header_names_the_cpu_and_its_vector_extensions():
    text = peers.cpu_description()
    assert "cores; vector extensions:" in text
    # measured at run time and stored with the run (BENCHMARKS.md renders the run's own)
    assert peers.machine_note().startswith(f"CPU: {text}.")


def test_checks_are_computable_without_results():
    checks = peers.checks(Results([], None))
    assert checks and all(c.ok is None for c in checks if "(why)" not in c.figure)


@pytest.mark.parametrize("causal", [False, True])
def test_torch_sdpa_computes_what_flash_computes(causal):
    """The PyTorch anchor is the same attention: its output on the suite's layout
    ([B, H, L, D]) equals flash attention's on the same numbers ([B, L, H, D])."""
    torch = pytest.importorskip("torch")
    from xformers_jax.attention import flash_attention, multihead

    q, k, v = peers._torch_qkv(32, 1, 2, 8, requires_grad=False)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal).numpy()
    ours = multihead(flash_attention)(*(np.swapaxes(x.numpy(), 1, 2) for x in (q, k, v)),
                                      causal=causal)
    assert_close(np.swapaxes(np.asarray(ours), 1, 2), ref)
    step = peers.build("torch", 32, causal, B=1, H=2, D=8).native("fwdbwd")
    step()  # runs, and leaves gradients on its inputs


def test_tile_matmuls_bound_does_the_forwards_matmuls():
    """The bound's program computes what flash's two tile matmuls compute without the softmax:
    ``(q k^T) v`` per head, every key tile of every query tile (a tile skipped or counted twice
    would change it)."""
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((2, 64, 3, 8)).astype(np.float32) for _ in range(3))
    want = np.einsum("bqhd,bkhd,bkhe->bqhe", q, k, v)
    # float32 sums of 64 products of O(1) terms: rounding is relative to the largest entry.
    np.testing.assert_allclose(np.asarray(peers.tile_matmuls(q, k, v, 16)), want, rtol=1e-5,
                               atol=1e-5 * np.abs(want).max())
    with pytest.raises(ValueError, match="multiple of the tile 48"):
        peers.tile_matmuls(q, k, v, 48)
    with pytest.raises(ValueError, match="full attention only"):
        peers.build("tile matmuls", 64, causal=True)
