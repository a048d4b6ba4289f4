"""ELECTRA's replaced-token detection (Clark et al., 2020, "ELECTRA: Pre-training Text Encoders
as Discriminators Rather Than Generators").

A small masked-LM generator and a discriminator are trained jointly. A fraction of the real
positions is masked; the generator predicts them (MLM loss); tokens are sampled from its
distribution (no gradient flows through the sample) and written into the masked positions;
the discriminator labels every real position original or replaced, a sampled token equal to
the original counting as original; loss = MLM + ``disc_weight`` * binary cross-entropy (the
paper: 50). The generator and discriminator share the token and position embeddings (the
embedding width is the discriminator's; the generator projects it to its own, smaller width and
scores tokens against the tied embedding table). After pre-training,
:meth:`Electra.classifier` turns the discriminator into an :class:`EncoderClassifier`.
"""

from __future__ import annotations

import math

import equinox as eqx
import jax
import jax.numpy as jnp
import optax

from .. import axes as X
from ..nn import AttentionSpec, Embedder, NoPositions, RotaryPositions, transformer_stack
from ._classifiers import EncoderClassifier
from ._registry import TRUNK, register_model, section
from ._trunk import Encoder


class Electra(eqx.Module):
    """Generator + discriminator with shared embeddings over token ids ``0..vocab_size-1``
    (id ``vocab_size`` is the ``[MASK]`` token; id 0 is padding when a mask is given).

    Args:
      vocab_size: token vocabulary (without ``[MASK]``). dim, num_layers, num_heads, hidden:
        the discriminator. gen_dim, gen_layers, gen_heads, gen_hidden: the generator (the
        paper: a quarter to a third of the discriminator's width). mask_prob: the fraction of
        real positions masked. disc_weight: the discriminator loss weight (50).
      max_len, block, stack, positions: as for the other ``nn`` models.
    """

    embed: Embedder
    gen_in: jax.Array = X.param(X.EMBED, None)
    gen_layers: eqx.Module
    gen_norm: eqx.Module | None
    gen_out: jax.Array = X.param(None, X.EMBED)
    gen_bias: jax.Array = X.param(X.VOCAB)
    disc_layers: eqx.Module
    disc_norm: eqx.Module | None
    disc_head: jax.Array = X.param(X.EMBED)
    vocab_size: int = eqx.field(static=True)
    mask_prob: float = eqx.field(static=True)
    disc_weight: float = eqx.field(static=True)

    def __init__(self, vocab_size: int, dim: int, num_layers: int, num_heads: int, hidden: int,
                 *, gen_dim: int | None = None, gen_layers: int | None = None,
                 gen_heads: int | None = None, gen_hidden: int | None = None,
                 mask_prob: float = 0.15, disc_weight: float = 50.0, max_len: int = 512,
                 positions=None, block=None, stack=None, key):
        if not 0 < mask_prob < 1:
            raise ValueError(f"Electra: mask_prob must be in (0, 1), got {mask_prob}")
        gen_dim = gen_dim or max(dim // 4, 1)
        gen_heads = gen_heads or max(num_heads // 4, 1)
        gen_hidden = gen_hidden or max(hidden // 4, 1)
        gen_layers = gen_layers or num_layers
        if gen_dim % gen_heads:
            raise ValueError(f"Electra: gen_dim={gen_dim} is not divisible by "
                             f"gen_heads={gen_heads}")
        k = jax.random.split(key, 6)
        self.embed = Embedder(dim, vocab_size=vocab_size + 1, positions=positions, key=k[0])
        self.gen_in = jax.random.normal(k[1], (dim, gen_dim)) / math.sqrt(dim)
        self.gen_layers, self.gen_norm = transformer_stack(
            gen_dim, gen_layers, gen_heads, gen_hidden, causal=False, max_len=max_len,
            block=block, stack=stack, key=k[2])
        self.gen_out = jax.random.normal(k[3], (gen_dim, dim)) / math.sqrt(gen_dim)
        self.gen_bias = jnp.zeros((vocab_size,))
        self.disc_layers, self.disc_norm = transformer_stack(
            dim, num_layers, num_heads, hidden, causal=False, max_len=max_len, block=block,
            stack=stack, key=k[4])
        self.disc_head = jax.random.normal(k[5], (dim,)) / math.sqrt(dim)
        self.vocab_size, self.mask_prob, self.disc_weight = vocab_size, mask_prob, disc_weight

    @property
    def mask_id(self) -> int:
        return self.vocab_size

    def generator_logits(self, tokens, *, mask=None, key=None):
        """MLM logits ``[B, L, vocab_size]`` (scores against the shared embedding table)."""
        x, mask = self.embed(tokens, mask=mask)
        h = self.gen_layers(x @ self.gen_in.astype(x.dtype), kv_mask=mask, key=key)
        if self.gen_norm is not None:
            h = self.gen_norm(h)
        e = h @ self.gen_out.astype(h.dtype)
        table = self.embed.table[: self.vocab_size]
        return e @ table.T.astype(e.dtype) + self.gen_bias.astype(e.dtype)

    def discriminator_hidden(self, tokens, *, mask=None, key=None):
        """The discriminator's hidden states ``[B, L, dim]``."""
        x, mask = self.embed(tokens, mask=mask)
        h = self.disc_layers(x, kv_mask=mask, key=key)
        return h if self.disc_norm is None else self.disc_norm(h)

    def discriminator_logits(self, tokens, *, mask=None, key=None):
        """Replaced-token logits ``[B, L]`` (positive: replaced)."""
        h = self.discriminator_hidden(tokens, mask=mask, key=key)
        return h @ self.disc_head.astype(h.dtype)

    def corrupt(self, tokens, key, *, mask=None, dropout_key=None):
        """Masks, samples and replaces. Returns ``(masked bool[B, L], corrupted int[B, L],
        labels bool[B, L], generator logits [B, L, V])``: ``labels`` is True exactly where the
        corrupted token differs from the original."""
        if not jnp.issubdtype(tokens.dtype, jnp.integer) or tokens.ndim != 2:
            raise ValueError(f"Electra: tokens must be int[B, L], got {tokens.dtype} "
                             f"{tokens.shape}")
        real = jnp.ones(tokens.shape, bool) if mask is None else mask
        k_mask, k_sample = jax.random.split(key)
        masked = jax.random.bernoulli(k_mask, self.mask_prob, tokens.shape) & real
        inputs = jnp.where(masked, self.mask_id, tokens)
        logits = self.generator_logits(inputs, mask=mask, key=dropout_key)
        # The sample carries no gradient (the generator learns only from its MLM loss).
        sample = jax.random.categorical(k_sample, jax.lax.stop_gradient(
            logits.astype(jnp.float32)))
        corrupted = jnp.where(masked, sample, tokens).astype(tokens.dtype)
        labels = (corrupted != tokens) & real
        return masked, corrupted, labels, logits

    def loss(self, tokens, key, *, mask=None, dropout_key=None):
        """``(mlm + disc_weight * disc, {"mlm", "disc", "accuracy", "replaced"})``: the MLM
        cross-entropy over masked positions, the discriminator's binary cross-entropy and
        accuracy over real positions, and the fraction of real positions replaced."""
        _, terms = self._detect(tokens, key, mask=mask, dropout_key=dropout_key)
        return terms["mlm"] + self.disc_weight * terms["disc"], terms

    def _detect(self, tokens, key, *, mask, dropout_key):
        """``(discriminator logits [B, L] on the corrupted tokens, {"mlm", "disc", "accuracy",
        "replaced"})``."""
        real = jnp.ones(tokens.shape, bool) if mask is None else mask
        masked, corrupted, labels, logits = self.corrupt(tokens, key, mask=mask,
                                                         dropout_key=dropout_key)
        ce = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), tokens)
        n_masked = jnp.maximum(masked.sum(), 1)
        mlm = jnp.sum(jnp.where(masked, ce, 0)) / n_masked
        d = self.discriminator_logits(corrupted, mask=mask, key=dropout_key).astype(jnp.float32)
        bce = optax.sigmoid_binary_cross_entropy(d, labels.astype(jnp.float32))
        n_real = jnp.maximum(real.sum(), 1)
        disc = jnp.sum(jnp.where(real, bce, 0)) / n_real
        acc = jnp.sum(jnp.where(real, (d > 0) == labels, False)) / n_real
        return d, {"mlm": mlm, "disc": disc, "accuracy": acc, "replaced": labels.sum() / n_real}

    def __call__(self, tokens, *, mask=None, key=None, return_aux=False):
        """Replaced-token detection on ``tokens int[B, L]``: masked with the first half of
        ``key`` (a fixed key when None, so that every evaluation sees the same masking), the
        generator's samples written in, the discriminator's logits ``[B, L]`` returned; with
        ``return_aux`` ``(logits, {"mlm", "disc", "accuracy", "replaced"})`` (the terms of
        :meth:`loss`; no dropout)."""
        mask_key, _ = jax.random.split(jax.random.PRNGKey(0) if key is None else key)
        logits, terms = self._detect(tokens, mask_key, mask=mask, dropout_key=None)
        return (logits, terms) if return_aux else logits

    def classifier(self, num_classes: int, *, key) -> EncoderClassifier:
        """The discriminator (shared embeddings, layers, final norm) as an
        :class:`EncoderClassifier` with mean pooling and a new linear head, for fine-tuning."""
        encoder = object.__new__(Encoder)
        object.__setattr__(encoder, "embed", self.embed)
        object.__setattr__(encoder, "layers", self.disc_layers)
        object.__setattr__(encoder, "final_norm", self.disc_norm)
        model = object.__new__(EncoderClassifier)
        object.__setattr__(model, "encoder", encoder)
        dim = self.disc_head.shape[0]
        object.__setattr__(model, "head",
                           jax.random.normal(key, (dim, num_classes)) / math.sqrt(dim))
        object.__setattr__(model, "pooling", "mean")
        return model


@register_model("electra", serves=("self_supervised",),
                defaults=dict(TRUNK, attention=dict(kind="dot_product")),
                loss_weights={"mlm": 1.0, "disc": 50.0})
def electra(config, task, key):
    """ELECTRA's generator and discriminator (:class:`Electra`), pre-trained on byte text."""
    # The paper's generator: a quarter of the discriminator's width, heads and FFN (so both
    # have the same head width and can share one rotary scheme). Positions are rotary, not
    # BERT's absolute ones: both objectives are decided by a token's neighbours, and with
    # sinusoids added to the inputs the small byte-level models sat at the unigram MLM loss
    # and the base-rate discriminator loss for hundreds of steps before finding them.
    spec = AttentionSpec.from_config(section(config, "attention"))
    return Electra(task.vocab_size, config.dim, config.num_layers, config.num_heads,
                   config.hidden, max_len=task.seq_len, positions=NoPositions(),
                   block=dict(spec=spec, position=RotaryPositions()), key=key)
