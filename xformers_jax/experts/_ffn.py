"""Position-wise FFNs as pure functions: the dense FFN with its GLU variants, Scaling
Transformers' sparse FFN, and the empty FFN of all-attention blocks. The Equinox layers over
them are ``nn.FeedForward``, ``nn.SparseFeedForward`` and ``nn.NoFeedForward``."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .. import axes as X

# The dense FFN's activations; the GLU variants (Shazeer, 2020) gate with a second projection.
FFN_ACTIVATIONS = {
    "relu": jax.nn.relu,
    "gelu": jax.nn.gelu,
    "swish": jax.nn.swish,
    "glu": jax.nn.sigmoid,
    "geglu": jax.nn.gelu,
    "swiglu": jax.nn.swish,
}
GATED = ("glu", "geglu", "swiglu")


def feed_forward(x, w1, b1, w2, b2, w_gate=None, *, activation: str = "gelu"):
    """The position-wise FFN of Vaswani et al. (2017), ``act(x W1 + b1) W2 + b2``, or for the
    GLU variants (Shazeer, 2020, "GLU Variants Improve Transformer": ``glu``, ``geglu``,
    ``swiglu``) ``(act(x W1 + b1) * (x W_gate)) W2 + b2``.

    ``x [..., dim]``, ``w1 [dim, hidden]``, ``b1 [hidden]``, ``w2 [hidden, dim]``, ``b2 [dim]``,
    ``w_gate [dim, hidden]`` (the GLU variants only) -> ``[..., dim]`` in ``x``'s dtype. The
    hidden activation carries the ``mlp`` logical axis (``xformers_jax.axes.HIDDEN``).
    """
    if activation not in FFN_ACTIVATIONS:
        raise ValueError(f"feed_forward: unknown activation {activation!r}; choose one of "
                         f"{sorted(FFN_ACTIVATIONS)}")
    if (activation in GATED) != (w_gate is not None):
        raise ValueError(f"feed_forward: activation {activation!r} "
                         + ("needs w_gate" if activation in GATED else "takes no w_gate"))
    h = FFN_ACTIVATIONS[activation](x @ w1.astype(x.dtype) + b1.astype(x.dtype))
    if w_gate is not None:
        h = h * (x @ w_gate.astype(x.dtype))
    h = X.constrain(h, X.HIDDEN)
    return h @ w2.astype(x.dtype) + b2.astype(x.dtype)


def sparse_controller(x, c1, c2, block: int):
    """The sparse FFN's controller logits ``(x C1) C2`` as ``[..., hidden / block, block]``
    (float32)."""
    logits = (x.astype(jnp.float32) @ c1) @ c2
    return logits.reshape(*x.shape[:-1], -1, block)


def sparse_masked(x, onehot, w1, b1, w2, b2):
    """The sparse FFN's masked dense form: ``(relu(x W1 + b1) * onehot) W2 + b2``."""
    h = jax.nn.relu(x @ w1.astype(x.dtype) + b1.astype(x.dtype))
    h = h * onehot.reshape(h.shape).astype(x.dtype)
    return h @ w2.astype(x.dtype) + b2.astype(x.dtype)


def _gumbel_one_hot(logits, key):
    # Straight-through Gumbel-softmax (Jang et al., 2017): one-hot forward, softmax gradient.
    g = -jnp.log(-jnp.log(jax.random.uniform(key, logits.shape, minval=1e-20, maxval=1.0)))
    soft = jax.nn.softmax(logits + g, axis=-1)
    hard = jax.nn.one_hot(jnp.argmax(soft, -1), logits.shape[-1], dtype=soft.dtype)
    return hard + soft - jax.lax.stop_gradient(soft)


def sparse_feed_forward(x, w1, b1, w2, b2, c1, c2, *, block: int, key=None):
    """The sparse FFN of Scaling Transformers (Jaszczur et al., 2021, "Sparse is Enough in
    Scaling Transformers"): the ``hidden`` units form ``hidden / block`` blocks and a low-rank
    controller ``(x C1) C2`` picks one unit per block; the others are zeroed: ``y = (relu(x W1
    + b1) * onehot) W2 + b2``.

    ``x [..., dim]``, ``w1 [dim, hidden]``, ``b1 [hidden]``, ``w2 [hidden, dim]``, ``b2 [dim]``,
    ``c1 [dim, rank]``, ``c2 [rank, hidden]`` -> ``[..., dim]``. With a ``key`` (training), a
    straight-through Gumbel-softmax over each block and the masked dense form; without one
    (inference), the argmax, computing only the chosen units (a gather of ``hidden / block``
    columns of ``W1`` and rows of ``W2`` per token).
    """
    logits = sparse_controller(x, c1, c2, block)
    if key is not None:
        return sparse_masked(x, _gumbel_one_hot(logits, key), w1, b1, w2, b2)
    nb = logits.shape[-2]
    units = jnp.argmax(logits, -1) + block * jnp.arange(nb)  # [..., nb]
    w1 = w1.T.astype(x.dtype)[units]  # [..., nb, d]
    h = jnp.einsum("...d,...nd->...n", x, w1) + b1.astype(x.dtype)[units]
    y = jnp.einsum("...n,...nd->...d", jax.nn.relu(h), w2.astype(x.dtype)[units])
    return y + b2.astype(x.dtype)


def no_feed_forward(x):
    """The empty FFN of all-attention blocks (Sukhbaatar et al., 2019, "Augmenting
    Self-attention with Persistent Memory": persistent key/value vectors in the attention take
    the FFN's role): ``y = 0`` like ``x``, so the FFN sublayer's residual adds nothing."""
    return jnp.zeros_like(x)
