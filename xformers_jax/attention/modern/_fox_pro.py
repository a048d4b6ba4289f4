"""The attention components of the Forgetting Transformer's "Pro" block (Lin, Nikishin, He
and Courville, 2025, "Forgetting Transformer: Softmax Attention with a Forget Gate"):
components common in recurrent sequence models, added around forgetting attention (the layer
is the ``fox_pro`` kind; the block's other changes, e.g. its SwiGLU MLP, are the model's):

- the data-dependent token shift of keys and values (KV-shift): with ``k_t = W_k x_t``, each
  key/value head mixes the previous token's key into its own,
  ``k~_t = alpha_t k_{t-1} + (1 - alpha_t) k_t``, ``alpha_t = sigmoid(w_alpha^T x_t)`` (and
  the same for values with its own ``w``), ``k_{-1} = 0``;
- QK-norm: RMSNorm of each head's query and (shifted) key, a learned scale per head and
  channel;
- output normalisation: RMSNorm of each head's output, a learned scale per head and channel;
- the output gate: ``o_t <- o_t * sigmoid(W_g x_t)``, after the normalisation.

Packed rows: the shift reads no token of another document (a document's first token mixes in
zeros, as the row's first token does). A padded token's key and value are zeros to the shift:
padding at the end of a row changes nothing, but a token just after padding in the middle of
a row mixes in zeros, not the last real token. Like FoX, the Pro layer needs no position scheme (the
paper's uses none); given a rotary one, the layer rotates queries and keys before the shift
and the norm.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from ...kernels import STATS_DTYPE

RMS_EPS = 1e-6


def token_shift(x: Float[Array, "batch seq heads dim"], alpha: Float[Array, "batch seq heads"],
                segment_ids: Int[Array, "batch seq"] | None = None
                ) -> Float[Array, "batch seq heads dim"]:
    """``alpha_t x_{t-1} + (1 - alpha_t) x_t`` per head, in float32, ``x_{-1} = 0``; with
    ``segment_ids`` a document's first token has ``x_{t-1} = 0`` too."""
    x = x.astype(STATS_DTYPE)
    prev = jnp.pad(x, ((0, 0), (1, 0), (0, 0), (0, 0)))[:, :-1]
    if segment_ids is not None:
        same = segment_ids == jnp.pad(segment_ids, ((0, 0), (1, 0)), constant_values=-1)[:, :-1]
        prev = jnp.where(same[..., None, None], prev, 0.0)
    a = alpha.astype(STATS_DTYPE)[..., None]
    return a * prev + (1.0 - a) * x


def head_rms_norm(x: Float[Array, "... heads dim"], scale: Float[Array, "heads dim"]
                  ) -> Float[Array, "... heads dim"]:
    """RMSNorm over each head's channels, ``x / sqrt(mean(x^2) + eps) * scale``, in float32."""
    x = x.astype(STATS_DTYPE)
    x = x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + RMS_EPS)
    return x * scale.astype(STATS_DTYPE)
