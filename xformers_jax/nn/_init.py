"""Initialisations that stabilise deep Transformers without warm-up.

* :func:`t_fixup` (Huang et al., 2020): blocks without normalisation (``placement="none"``);
  the value/output projections and FFN weights are scaled by ``0.67 N^(-1/4)`` (encoder) or
  ``(9 N)^(-1/4)`` (decoder).
* :func:`admin_initialize` (Liu et al., 2020): post-LN blocks ``LN(omega_i x + f_i(x))`` whose
  ``omega_i`` come from a profiling pass on sample data: ``omega_i = sqrt(sum_{j<i} Var f_j)``,
  the variance the residual stream accumulated before sublayer i.
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp

from ._stack import LayerStack


def t_fixup(stack: LayerStack, *, decoder: bool = False) -> LayerStack:
    """Rescales a normalisation-free stack's weights as T-Fixup prescribes."""
    block = stack.layers
    if block.placement != "none" or stack.sharing != "none":
        raise ValueError("t_fixup: needs blocks with placement='none' and unshared layers")
    n = stack.num_layers
    scale = (9 * n) ** -0.25 if decoder else 0.67 * n ** -0.25
    attns = [lambda s: s.layers.attn] + ([lambda s: s.layers.cross] if block.cross is not None
                                         else [])
    for attn in attns:
        for name in ("wv", "wo"):
            stack = eqx.tree_at(lambda s, a=attn, n=name: getattr(a(s), n), stack,
                                replace_fn=lambda w: w * scale)
    for name in ("w1", "w2"):
        stack = eqx.tree_at(lambda s, n=name: getattr(s.layers.ffn, n), stack,
                            replace_fn=lambda w: w * scale)
    return stack


def admin_initialize(stack: LayerStack, x, *, kv_mask=None) -> LayerStack:
    """Admin's profiling pass: runs ``x [B, L, dim]`` through the post-LN stack (unrolled),
    records each sublayer's output variance and sets ``omega``. Returns the new stack."""
    if stack.layers.placement != "post" or stack.sharing != "none":
        raise ValueError("admin_initialize: needs post-LN blocks (placement='post') that are "
                         "not shared")
    dynamic, static = stack.per_layer()
    variances = []
    for i in range(stack.num_layers):
        block = eqx.combine(jax.tree_util.tree_map(lambda a: a[i], dynamic), static)
        x, outs = block.branch_outputs(x, kv_mask=kv_mask)
        variances += [jnp.var(o.astype(jnp.float32)) for o in outs]
    var = jnp.stack(variances)
    # The residual stream before sublayer i carries the (normalised, unit-variance) input plus
    # every earlier branch: omega_1 = 1, then it grows with the accumulated variance.
    # (An exclusive cumulative sum: ``1 + cumsum(var) - var`` rounds omega_1 away from 1.)
    omega = jnp.sqrt(1.0 + jnp.concatenate([jnp.zeros((1,), var.dtype), jnp.cumsum(var)[:-1]]))
    return eqx.tree_at(lambda s: s.layers.gains, stack,
                       omega.reshape(stack.num_layers, -1).astype(stack.layers.gains.dtype))
