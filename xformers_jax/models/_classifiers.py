"""Classifiers over the encoder trunk: :class:`EncoderClassifier` (CLS or mean pooling and a
linear head: LRA ListOps, Text, Image, Pathfinder) and :class:`DualEncoder` (two inputs through
one shared encoder: LRA Retrieval)."""

from __future__ import annotations

import math

import equinox as eqx
import jax
import jax.numpy as jnp

from .. import axes as X
from ..nn import AUX_WEIGHTS
from ._registry import SLOTS, TRUNK, block_kwargs, register_model
from ._trunk import Encoder, pool


class EncoderClassifier(eqx.Module):
    """Encoder + CLS or mean pooling + a linear classifier (LRA ListOps, Text, Image, ...).

    The encoder is an embedder (token ids or continuous inputs, positions added) and a stack
    of ``num_layers`` bidirectional :class:`~xformers_jax.nn.TransformerBlock` s; which
    attention kind, token mixer or FFN kind each block uses is chosen by name in ``block``.

    Args:
      num_classes: classes of the linear head.
      dim: model width.
      num_layers: blocks in the stack.
      num_heads: attention heads per block.
      hidden: the FFN's hidden width.
      pooling: ``"cls"`` (a learned CLS token prepended; its final state is classified) or
        ``"mean"`` (the mean over real positions).
      key: PRNG key.
      **kwargs: the encoder's: ``vocab_size`` (token ids ``int[B, L]``) or ``input_dim``
        (continuous inputs ``[B, L, input_dim]``), exactly one; ``positions`` (an input
        position scheme of :mod:`xformers_jax.nn`, sinusoids by default); ``max_len``
        (default 512: the longest sequence, for kinds and positions sized by it); ``block``:
        the blocks' keyword arguments, e.g. ``dict(spec=nn.AttentionSpec("performer",
        {"num_features": 64}))`` for the attention kind (CATALOGUE.md lists every kind and
        its hyperparameters), ``mixer=nn.MixerSpec("fnet")`` to replace attention with a
        token mixer, ``ffn=nn.FFNSpec("switch", {...})`` for the FFN, ``placement``,
        ``norm``, ``activation``, ``num_kv_heads``, ``position`` (a score-level position
        scheme); ``stack``: the :class:`~xformers_jax.nn.LayerStack` 's (``remat``,
        ``sharing``, ``scan``, ``reversible``, ``layerdrop``).

    Example:
        ```python
        model = EncoderClassifier(10, 64, 2, 4, 128, vocab_size=256, pooling="mean",
                                  block=dict(spec=nn.AttentionSpec("nystrom",
                                                                   {"num_landmarks": 16})),
                                  key=jax.random.PRNGKey(0))
        logits = model(tokens, mask=tokens != 0)  # [B, num_classes]
        ```
    """

    encoder: Encoder
    head: jax.Array = X.param(X.EMBED, None)
    pooling: str = eqx.field(static=True)

    def __init__(self, num_classes, dim, num_layers, num_heads, hidden, *, pooling="cls",
                 key, **kwargs):
        if pooling not in ("cls", "mean"):
            raise ValueError(f"EncoderClassifier: pooling must be 'cls' or 'mean', got {pooling!r}")
        k1, k2 = jax.random.split(key)
        self.encoder = Encoder(dim, num_layers, num_heads, hidden, cls_token=pooling == "cls",
                               key=k1, **kwargs)
        self.head = jax.random.normal(k2, (dim, num_classes)) / math.sqrt(dim)
        self.pooling = pooling

    def __call__(self, inputs, *, mask=None, key=None, state=None, inference=False,
                 return_aux=False):
        """Returns logits ``[B, num_classes]`` (``(logits, state)`` when ``state`` is given;
        ``(that, aux)`` with ``return_aux``: the layers' auxiliary outputs, ``nn.aux_terms``)."""
        h, mask, *rest = self.encoder(inputs, mask=mask, key=key, state=state,
                                      inference=inference, return_aux=True)
        logits = pool(h, mask, self.pooling) @ self.head.astype(h.dtype)
        out = logits if state is None else (logits, rest[0])
        return (out, rest[-1]) if return_aux else out


class DualEncoder(eqx.Module):
    """Two inputs through one shared encoder (LRA Retrieval): embeddings ``u, v`` are pooled
    and classified from ``[u, v, u * v, u - v]``."""

    encoder: Encoder
    mlp: tuple
    pooling: str = eqx.field(static=True)

    def __init__(self, num_classes, dim, num_layers, num_heads, hidden, *, pooling="mean",
                 key, **kwargs):
        k1, k2, k3 = jax.random.split(key, 3)
        self.encoder = Encoder(dim, num_layers, num_heads, hidden, cls_token=pooling == "cls",
                               key=k1, **kwargs)
        self.mlp = (jax.random.normal(k2, (4 * dim, dim)) / math.sqrt(4 * dim),
                    jax.random.normal(k3, (dim, num_classes)) / math.sqrt(dim))
        self.pooling = pooling

    def embed(self, inputs, *, mask=None, key=None, return_aux=False):
        """The pooled embedding ``[B, dim]`` of one input (``(that, aux)`` with
        ``return_aux``: the layers' auxiliary outputs)."""
        h, mask, aux = self.encoder(inputs, mask=mask, key=key, return_aux=True)
        u = pool(h, mask, self.pooling)
        return (u, aux) if return_aux else u

    def __call__(self, a, b, *, mask_a=None, mask_b=None, key=None, return_aux=False):
        """Logits ``[B, num_classes]`` for the pairs ``(a[i], b[i])``; with ``return_aux``
        ``(logits, aux)``, each auxiliary output the mean of its two encodings' (each input is
        encoded as its own batch)."""
        u, aux_a = self.embed(a, mask=mask_a, key=key, return_aux=True)
        v, aux_b = self.embed(b, mask=mask_b, key=key, return_aux=True)
        h = jax.nn.gelu(jnp.concatenate([u, v, u * v, u - v], -1) @ self.mlp[0].astype(u.dtype))
        logits = h @ self.mlp[1].astype(u.dtype)
        if not return_aux:
            return logits
        return logits, jax.tree.map(lambda x, y: (x + y) / 2, aux_a, aux_b)


def _max_len(config, task) -> int:
    # Exactly the attended length (CLS pooling prepends one token): Sinkhorn's sort net and
    # Linformer's projections are sized by it.
    return task.seq_len + (config.pooling == "cls")


@register_model("classifier", serves=("classification",),
                defaults=dict(TRUNK, pooling="cls", **SLOTS), loss_weights=AUX_WEIGHTS)
def classifier(config, task, key):
    """The encoder classifier (:class:`EncoderClassifier`: CLS or mean pooling)."""
    return EncoderClassifier(task.num_classes, config.dim, config.num_layers, config.num_heads,
                             config.hidden, pooling=config.pooling, vocab_size=task.vocab_size,
                             max_len=_max_len(config, task), block=block_kwargs(config), key=key)


@register_model("dual_encoder", serves=("pair_classification",),
                defaults=dict(TRUNK, pooling="cls", **SLOTS), loss_weights=AUX_WEIGHTS)
def dual_encoder(config, task, key):
    """Two inputs through one shared encoder (:class:`DualEncoder`: LRA Retrieval)."""
    return DualEncoder(task.num_classes, config.dim, config.num_layers, config.num_heads,
                       config.hidden, pooling=config.pooling, vocab_size=task.vocab_size,
                       max_len=_max_len(config, task), block=block_kwargs(config), key=key)
