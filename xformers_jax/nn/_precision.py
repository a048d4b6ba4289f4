"""Mixed precision (Micikevicius et al., 2018): parameters stored in one dtype, computation in
another, outputs in a third. Softmax statistics and norms stay in float32 inside the layers."""

from __future__ import annotations

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp


def _cast(tree, dtype):
    def cast(x):
        if eqx.is_array(x) and jnp.issubdtype(x.dtype, jnp.floating):
            return x.astype(dtype)
        return x
    return jax.tree_util.tree_map(cast, tree)


@dataclasses.dataclass(frozen=True)
class Policy:
    """``params`` f32, ``compute`` bf16 (or f16), ``output`` f32 by default.

    ``policy(model_fn, model, *inputs, **kw)`` casts the model's floating parameters and
    floating inputs to ``compute``, runs it and casts floating outputs to ``output``. Gradients
    flow back to the ``params``-dtype parameters through the casts.
    """

    params: object = jnp.float32
    compute: object = jnp.bfloat16
    output: object = jnp.float32

    def cast_params(self, model):
        return _cast(model, self.params)

    def __call__(self, fn, model, *inputs, **kwargs):
        out = fn(_cast(model, self.compute), *_cast(inputs, self.compute), **kwargs)
        return _cast(out, self.output)
