"""Set Transformer blocks (Lee et al., 2019): SAB/ISAB permutation equivariant, PMA invariant."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.tolerances import assert_close
from xformers_jax.models import ISAB, MAB, PMA, SAB

N, DIM, HEADS = 11, 16, 4
X = jax.random.normal(jax.random.PRNGKey(0), (N, DIM))
PERM = jax.random.permutation(jax.random.PRNGKey(1), N)
KEY = jax.random.PRNGKey(2)


def run(module, x, mask=None):
    """One set through a batched module (a batch of one)."""
    return module(x[None], mask=None if mask is None else mask[None])[0]


@pytest.mark.parametrize("make", [lambda: SAB(DIM, HEADS, key=KEY),
                                  lambda: ISAB(DIM, HEADS, 3, key=KEY)])
def test_equivariant_blocks(make):
    block = make()
    out = run(block, X)
    assert out.shape == (N, DIM)
    assert_close(run(block, X[PERM]), out[PERM])


def test_pma_invariant_and_padding():
    pma = PMA(DIM, HEADS, num_seeds=2, key=KEY)
    out = run(pma, X)
    assert out.shape == (2, DIM)
    assert_close(run(pma, X[PERM]), out)
    mask = jnp.arange(N) < 7
    assert_close(run(pma, jnp.where(mask[:, None], X, 9.0), mask), run(pma, X[:7]))
    isab = ISAB(DIM, HEADS, 3, key=KEY)
    assert_close(run(isab, jnp.where(mask[:, None], X, 9.0), mask)[:7], run(isab, X[:7]))


def test_grads_and_errors():
    isab = ISAB(DIM, HEADS, 3, key=KEY)
    grads = eqx.filter_grad(lambda m: jnp.sum(run(m, X) ** 2))(isab)
    leaves = jax.tree_util.tree_leaves(eqx.filter(grads, eqx.is_array))
    assert all(np.all(np.isfinite(g)) for g in leaves)
    assert np.any(np.asarray(grads.inducing) != 0)
    with pytest.raises(ValueError, match="multiple of num_heads"):
        MAB(10, 4, key=KEY)
