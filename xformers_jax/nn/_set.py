"""Set Transformer blocks: MAB, SAB, ISAB (inducing points) and PMA (seed vectors).

Lee et al., "Set Transformer" (2019); survey T1 3.2.3::

    MAB(X, Y) = LayerNorm(H + rFF(H)),  H = LayerNorm(X + Multihead(X, Y, Y))
    SAB(X) = MAB(X, X)    ISAB_m(X) = MAB(X, MAB(I_m, X))    PMA_k(X) = MAB(S_k, rFF(X))

Each module takes one set ``x [N, dim]`` (vmap for a batch) and an optional ``mask bool[N]``
marking real elements; padding never reaches a real output.
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp

from ..attention import dot_product_attention


class MAB(eqx.Module):
    """Multihead attention block: ``x [Nx, dim]`` attends over ``y [Ny, dim]``."""

    q_proj: eqx.nn.Linear
    k_proj: eqx.nn.Linear
    v_proj: eqx.nn.Linear
    o_proj: eqx.nn.Linear
    ff: eqx.nn.MLP
    norm1: eqx.nn.LayerNorm
    norm2: eqx.nn.LayerNorm
    num_heads: int = eqx.field(static=True)

    def __init__(self, dim: int, num_heads: int, *, key):
        if dim % num_heads:
            raise ValueError(f"MAB: dim={dim} must be a multiple of num_heads={num_heads}")
        keys = jax.random.split(key, 5)
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (
            eqx.nn.Linear(dim, dim, key=k) for k in keys[:4])
        self.ff = eqx.nn.MLP(dim, dim, dim, depth=1, activation=jax.nn.relu, key=keys[4])
        self.norm1, self.norm2 = eqx.nn.LayerNorm(dim), eqx.nn.LayerNorm(dim)
        self.num_heads = num_heads

    def __call__(self, x, y, *, mask=None):
        heads = lambda a: a.reshape(a.shape[0], self.num_heads, -1)
        q = heads(jax.vmap(self.q_proj)(x))
        k, v = heads(jax.vmap(self.k_proj)(y)), heads(jax.vmap(self.v_proj)(y))
        att = jax.vmap(lambda q, k, v: dot_product_attention(q, k, v, kv_mask=mask),
                       in_axes=1, out_axes=1)(q, k, v)
        h = jax.vmap(self.norm1)(x + jax.vmap(self.o_proj)(att.reshape(x.shape[0], -1)))
        return jax.vmap(self.norm2)(h + jax.vmap(self.ff)(h))


class SAB(eqx.Module):
    """Set attention block ``MAB(X, X)``: permutation equivariant, ``O(N^2)``."""

    mab: MAB

    def __init__(self, dim: int, num_heads: int, *, key):
        self.mab = MAB(dim, num_heads, key=key)

    def __call__(self, x, *, mask=None):
        return self.mab(x, x, mask=mask)


class ISAB(eqx.Module):
    """Induced set attention block ``MAB(X, MAB(I, X))`` with ``m`` learned inducing points:
    permutation equivariant, ``O(N m)``."""

    inducing: jax.Array
    mab_in: MAB
    mab_out: MAB

    def __init__(self, dim: int, num_heads: int, num_inducing: int, *, key):
        ki, k1, k2 = jax.random.split(key, 3)
        self.inducing = dim ** -0.5 * jax.random.normal(ki, (num_inducing, dim))
        self.mab_in = MAB(dim, num_heads, key=k1)
        self.mab_out = MAB(dim, num_heads, key=k2)

    def __call__(self, x, *, mask=None):
        summary = self.mab_in(self.inducing, x, mask=mask)
        return self.mab_out(x, summary)


class PMA(eqx.Module):
    """Pooling by multihead attention ``MAB(S, rFF(X))`` with ``k`` learned seed vectors:
    ``[N, dim] -> [k, dim]``, permutation invariant."""

    seeds: jax.Array
    ff: eqx.nn.MLP
    mab: MAB

    def __init__(self, dim: int, num_heads: int, num_seeds: int = 1, *, key):
        ks, kf, km = jax.random.split(key, 3)
        self.seeds = dim ** -0.5 * jax.random.normal(ks, (num_seeds, dim))
        self.ff = eqx.nn.MLP(dim, dim, dim, depth=1, activation=jax.nn.relu, key=kf)
        self.mab = MAB(dim, num_heads, key=km)

    def __call__(self, x, *, mask=None):
        return self.mab(self.seeds, jax.vmap(self.ff)(x), mask=mask)
