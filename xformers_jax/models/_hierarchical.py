"""Hierarchical Transformers (the survey's section 6.4.2).

* HIBERT (Zhang et al., 2019, "HIBERT: Document Level Pre-training of Hierarchical
  Bidirectional Transformers for Document Summarization"): a sentence encoder runs over each
  sentence's tokens separately; each sentence is represented by the hidden state of its last
  real token (HIBERT's EOS); a document encoder (with sentence positions) runs over those
  vectors (:class:`HierarchicalEncoder`).
* TNT (Han et al., 2021, "Transformer in Transformer"): an image is cut into patches and every
  patch into ``m`` sub-patches ("visual words"). Each TNT layer runs an inner Transformer block
  over the words of each patch (shared by all patches), adds the flattened words, linearly
  projected, to the patch embedding, and runs an outer block over the patches and a class
  token (:class:`TNTClassifier`).
"""

from __future__ import annotations

import math

import equinox as eqx
import jax
import jax.numpy as jnp

from ..nn import LayerNorm, TransformerBlock
from ._trunk import Encoder


def last_real(h, mask):
    """``h [B, T, d]``, ``mask bool[B, T]`` (or None) -> the hidden state at each row's last
    real position ``[B, d]`` (position 0 for an empty row)."""
    if mask is None:
        return h[:, -1]
    t = h.shape[1]
    idx = jnp.max(jnp.where(mask, jnp.arange(t), 0), axis=1)
    return jnp.take_along_axis(h, idx[:, None, None], axis=1)[:, 0]


class HierarchicalEncoder(eqx.Module):
    """HIBERT's sentence-then-document encoder.

    Args:
      vocab_size, dim, num_heads, hidden: widths. sentence_layers, document_layers: depths.
      max_sentence_len, max_sentences: the lengths. block: :class:`TransformerBlock` keywords
      for both encoders. key: PRNG key.

    Call: ``tokens int[B, S, T]`` (``S`` sentences of ``T`` tokens), ``mask bool[B, S, T]``
    -> ``(document states [B, S, dim], sentence mask bool[B, S])``; a sentence with no real
    token is padding for the document encoder.
    """

    sentence: Encoder
    document: Encoder

    def __init__(self, vocab_size: int, dim: int, num_heads: int, hidden: int, *,
                 sentence_layers: int = 2, document_layers: int = 2,
                 max_sentence_len: int = 64, max_sentences: int = 64, block=None, key):
        k1, k2 = jax.random.split(key)
        self.sentence = Encoder(dim, sentence_layers, num_heads, hidden, vocab_size=vocab_size,
                                max_len=max_sentence_len, block=block, key=k1)
        self.document = Encoder(dim, document_layers, num_heads, hidden, input_dim=dim,
                                max_len=max_sentences, block=block, key=k2)

    def sentence_vectors(self, tokens, *, mask=None):
        """``[B, S, dim]``: each sentence's last real token's state from the sentence encoder."""
        if tokens.ndim != 3:
            raise ValueError(f"HierarchicalEncoder: tokens must be int[B, S, T], got shape "
                             f"{tokens.shape}")
        b, s, t = tokens.shape
        flat_mask = None if mask is None else mask.reshape(b * s, t)
        h, _ = self.sentence(tokens.reshape(b * s, t), mask=flat_mask)
        return last_real(h, flat_mask).reshape(b, s, -1)

    def __call__(self, tokens, *, mask=None):
        vecs = self.sentence_vectors(tokens, mask=mask)
        doc_mask = None if mask is None else mask.any(-1)
        h, _ = self.document(vecs, mask=doc_mask)
        return h, doc_mask


class TNTLayer(eqx.Module):
    """One TNT layer: ``words [B N, m, c]`` through the inner block; ``patches [B, N + 1, d]``
    gain ``LN(flatten(words)) W + b`` (not the class token), then the outer block."""

    inner: TransformerBlock
    outer: TransformerBlock
    norm: LayerNorm
    proj: jax.Array
    proj_b: jax.Array

    def __init__(self, dim: int, inner_dim: int, words: int, num_heads: int, inner_heads: int,
                 *, mlp_ratio: int = 4, key):
        k1, k2, k3 = jax.random.split(key, 3)
        self.inner = TransformerBlock(inner_dim, inner_heads, mlp_ratio * inner_dim, key=k1)
        self.outer = TransformerBlock(dim, num_heads, mlp_ratio * dim, key=k2)
        self.norm = LayerNorm(words * inner_dim)
        self.proj = jax.random.normal(k3, (words * inner_dim, dim)) / math.sqrt(words * inner_dim)
        self.proj_b = jnp.zeros((dim,))

    def __call__(self, words, patches):
        words = self.inner(words)
        b, n1, d = patches.shape
        flat = self.norm(words.reshape(b, n1 - 1, -1))
        add = flat @ self.proj.astype(flat.dtype) + self.proj_b.astype(flat.dtype)
        patches = patches.at[:, 1:].add(add)
        return words, self.outer(patches)


class TNTClassifier(eqx.Module):
    """Transformer in Transformer for images ``[B, S, S, C]`` (or flattened ``[B, S*S, C]``).

    Arguments: ``num_classes``, ``image_size`` (square side), ``channels``, ``patch`` (side of a
    patch), ``word`` (side of a sub-patch; divides ``patch``), ``dim`` (outer width),
    ``inner_dim``, ``depth``, ``num_heads``, ``inner_heads``, ``key`` (PRNG key).

    Learned position embeddings for the words (shared by patches) and the patches; the class
    token's final state, normalised, goes to a linear head.
    """

    word_proj: jax.Array
    patch_proj: jax.Array
    word_pos: jax.Array
    patch_pos: jax.Array
    cls: jax.Array
    layers: tuple
    norm: LayerNorm
    head: jax.Array
    image_size: int = eqx.field(static=True)
    patch: int = eqx.field(static=True)
    word: int = eqx.field(static=True)

    def __init__(self, num_classes: int, *, image_size: int, channels: int = 1, patch: int = 4,
                 word: int = 2, dim: int = 32, inner_dim: int = 8, depth: int = 2,
                 num_heads: int = 2, inner_heads: int = 1, key):
        if image_size % patch or patch % word:
            raise ValueError(f"TNTClassifier: image_size={image_size} must be a multiple of "
                             f"patch={patch}, and patch of word={word}")
        n = (image_size // patch) ** 2
        m = (patch // word) ** 2
        keys = jax.random.split(key, depth + 6)
        wd = word * word * channels
        self.word_proj = jax.random.normal(keys[0], (wd, inner_dim)) / math.sqrt(wd)
        self.patch_proj = jax.random.normal(keys[1], (m * inner_dim, dim)) / math.sqrt(
            m * inner_dim)
        self.word_pos = 0.02 * jax.random.normal(keys[2], (m, inner_dim))
        self.patch_pos = 0.02 * jax.random.normal(keys[3], (n + 1, dim))
        self.cls = 0.02 * jax.random.normal(keys[4], (dim,))
        self.layers = tuple(TNTLayer(dim, inner_dim, m, num_heads, inner_heads, key=k)
                            for k in keys[6:])
        self.norm = LayerNorm(dim)
        self.head = jax.random.normal(keys[5], (dim, num_classes)) / math.sqrt(dim)
        self.image_size, self.patch, self.word = image_size, patch, word

    def words(self, images):
        """``[B, S, S, C]`` -> the sub-patch pixels ``[B, N, m, word * word * C]`` (patches in
        raster order, words in raster order inside each patch)."""
        s, p, w = self.image_size, self.patch, self.word
        if images.ndim == 3:
            images = images.reshape(images.shape[0], s, s, -1)
        b, h, ww, c = images.shape
        if (h, ww) != (s, s) or w * w * c != self.word_proj.shape[0]:
            raise ValueError(f"TNTClassifier: images must be [B, {s}, {s}, "
                             f"{self.word_proj.shape[0] // (w * w)}] (or flattened); got "
                             f"{images.shape}")
        g, q = s // p, p // w
        x = images.reshape(b, g, q, w, g, q, w, c).transpose(0, 1, 4, 2, 5, 3, 6, 7)
        return x.reshape(b, g * g, q * q, w * w * c)

    def __call__(self, images):
        pix = self.words(images).astype(self.word_proj.dtype)
        b, n, m, _ = pix.shape
        words = (pix @ self.word_proj + self.word_pos).reshape(b * n, m, -1)
        patches = words.reshape(b, n, -1) @ self.patch_proj
        patches = jnp.concatenate([jnp.broadcast_to(self.cls, (b, 1, patches.shape[-1])),
                                   patches], 1) + self.patch_pos
        for layer in self.layers:
            words, patches = layer(words, patches)
        return self.norm(patches[:, 0]) @ self.head.astype(patches.dtype)
