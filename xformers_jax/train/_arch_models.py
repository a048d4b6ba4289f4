"""Architecture-level and adaptive-depth classifiers the classification configs select.

* ``model.arch``: ``"transformer"`` (``nn.EncoderClassifier``, the default) or ``"swin"``
  (``nn.SwinClassifier`` over a square pixel grid: the image tasks' token ids 0..255 become
  intensities ``id / 255`` on a ``sqrt(seq_len)``-sided grid; ``model.swin`` gives ``patch``,
  ``window``, ``depths`` and ``heads``, the first stage's width is ``model.dim``). Lite
  Transformer's LSRA is a token mixer (``model.mixer.kind = "lsra"``), not an arch.
* ``model.depth_mode``: ``"fixed"``; ``"act"`` (a Universal Transformer with adaptive
  computation time, ``nn.ACTStack``: one shared block, at most ``num_layers`` steps,
  threshold ``model.act_threshold``; the mean ponder cost, weighted by ``loss.ponder``, joins
  the loss); ``"early_exit"`` (``nn.EarlyExitClassifier``: an exit classifier after every layer,
  trained with PABEE's weighted loss over the exits; training and evaluation report the last
  exit's accuracy; :func:`evaluate_exits` evaluates a split through the trained exits with
  :meth:`nn.EarlyExitClassifier.exit`, DeeBERT's entropy threshold or PABEE's patience).

The models return ``(logits, aux)``; :func:`adaptive_loss` turns their aux into the loss
terms.
"""

from __future__ import annotations

import functools
import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from .. import nn
from ..data import DataIterator
from ..nn._adaptive import CRITERIA as EXIT_CRITERIA
from ..nn._models import pool

ARCHS = ("transformer", "swin")
DEPTH_MODES = ("fixed", "act", "early_exit")


class PixelSwin(eqx.Module):
    """``nn.SwinClassifier`` on pixel token ids ``int[B, S*S]`` (intensities ``id / 255``)."""

    swin: nn.SwinClassifier

    def __call__(self, x, *, mask=None, key=None):
        return self.swin((x.astype(jnp.float32) / 255.0)[..., None]), {}


class ACTClassifier(eqx.Module):
    """Embedding, an ``nn.ACTStack`` (at most ``num_layers`` steps of one shared block), final
    norm, pooling (mean or CLS) and a linear head. Returns ``(logits, {"ponder": mean ponder
    cost over real positions})``."""

    embed: nn.Embedder
    stack: nn.ACTStack
    norm: nn.LayerNorm
    head: jax.Array
    pooling: str = eqx.field(static=True)

    def __init__(self, num_classes, dim, num_layers, num_heads, hidden, *, vocab_size,
                 pooling, max_len, block, threshold, key):
        k1, k2, k3 = jax.random.split(key, 3)
        self.embed = nn.Embedder(dim, vocab_size=vocab_size, cls_token=pooling == "cls", key=k1)
        make = functools.partial(nn.TransformerBlock, dim, num_heads, hidden, max_len=max_len,
                                 **block)
        self.stack = nn.ACTStack(lambda k: make(key=k), dim, num_layers, threshold=threshold,
                                 key=k2)
        self.norm = nn.LayerNorm(dim)
        self.head = jax.random.normal(k3, (dim, num_classes)) / math.sqrt(dim)
        self.pooling = pooling

    def __call__(self, x, *, mask=None, key=None):
        h, mask = self.embed(x, mask=mask)
        h, info = self.stack(h, kv_mask=mask, key=key)
        h = self.norm(h)
        w = jnp.ones(h.shape[:2]) if mask is None else mask.astype(jnp.float32)
        ponder = jnp.sum(info.ponder_cost * w) / jnp.maximum(jnp.sum(w), 1.0)
        logits = pool(h, mask, self.pooling) @ self.head.astype(h.dtype)
        return logits, {"ponder": ponder}


class ExitsClassifier(eqx.Module):
    """``nn.EarlyExitClassifier`` for the trainer: ``(last exit's logits, {"exit_logits":
    every exit's [N, B, C]})``."""

    model: nn.EarlyExitClassifier

    def __call__(self, x, *, mask=None, key=None):
        logits = self.model(x, mask=mask)
        return logits[-1], {"exit_logits": logits}


def is_adaptive(model) -> bool:
    """Whether ``model`` is one of this module's classifiers (they return ``(logits, aux)``)."""
    return isinstance(model, (PixelSwin, ACTClassifier, ExitsClassifier))


def check(m) -> None:
    """Raises ValueError for an unknown ``model.arch`` / ``model.depth_mode`` or a pair that
    does not combine."""
    arch, mode = m.get("arch", "transformer"), m.get("depth_mode", "fixed")
    if arch not in ARCHS:
        raise ValueError(f"model.arch must be one of {ARCHS}, got {arch!r}")
    if mode not in DEPTH_MODES:
        raise ValueError(f"model.depth_mode must be one of {DEPTH_MODES}, got {mode!r}")
    if arch != "transformer" and mode != "fixed":
        raise ValueError(f"model.depth_mode={mode!r} needs model.arch='transformer' (got "
                         f"{arch!r})")


def classifier(m, task, key, *, block, max_len):
    """The classifier ``model.arch`` / ``model.depth_mode`` name, or None for the plain
    ``nn.EncoderClassifier`` (built by the caller)."""
    check(m)
    arch, mode = m.get("arch", "transformer"), m.get("depth_mode", "fixed")
    if arch == "swin":
        side = math.isqrt(task.seq_len)
        if side * side != task.seq_len:
            raise ValueError(f"model.arch='swin' needs a square image: seq_len={task.seq_len}")
        s = dict(m.swin.to_dict()) if "swin" in m else {}
        return PixelSwin(nn.SwinClassifier(
            task.num_classes, image_size=side, channels=1, patch=s.get("patch", 1),
            dim=m.dim, depths=tuple(s.get("depths", (2, 2))), heads=tuple(s.get("heads", (2, 4))),
            window=s.get("window", 4), key=key))
    if mode == "act":
        return ACTClassifier(task.num_classes, m.dim, m.num_layers, m.num_heads, m.hidden,
                             vocab_size=task.vocab_size, pooling=m.pooling, max_len=max_len,
                             block=block, threshold=m.get("act_threshold", 0.99), key=key)
    if mode == "early_exit":
        return ExitsClassifier(nn.EarlyExitClassifier(
            task.num_classes, m.dim, m.num_layers, m.num_heads, m.hidden, pooling=m.pooling,
            vocab_size=task.vocab_size, max_len=max_len, block=block, key=key))
    return None


def adaptive_loss(loss, aux: dict, labels, coefs) -> tuple:
    """``(loss, aux without this module's keys, metrics)``: early exit replaces the loss by
    PABEE's weighted loss over every exit; ACT adds ``coefs["ponder"]`` (default 1e-2) times
    the mean ponder cost."""
    aux, metrics = dict(aux), {}
    if "exit_logits" in aux:
        loss = nn.early_exit_loss(aux.pop("exit_logits"), labels)
    if "ponder" in aux:
        ponder = aux.pop("ponder")
        loss = loss + coefs.get("ponder", 1e-2) * ponder
        metrics["ponder"] = ponder
    return loss, aux, metrics


@eqx.filter_jit
def _exit_batch(model, inputs, mask, criterion, threshold, patience):
    return model.exit(inputs, mask=mask, criterion=criterion, threshold=threshold,
                      patience=patience)


def evaluate_exits(model, source, batch_size: int, *, padded: bool, criterion: str = "entropy",
                   threshold: float = 0.5, patience: int = 2) -> dict:
    """Early-exit inference over a whole split (in order; the last batch may be short).

    ``model`` is an early-exit classifier (``model.depth_mode='early_exit'``'s
    :class:`ExitsClassifier` or an ``nn.EarlyExitClassifier``); each batch goes through
    :meth:`nn.EarlyExitClassifier.exit` (``criterion``, ``threshold``, ``patience`` as there;
    id 0 is padding when ``padded``). Returns::

      accuracy         the exits' predictions against ``targets``
      expected_layers  the mean exit layer over examples (what each example costs, DeeBERT's
                       and PABEE's figure)
      flops_saved      1 - expected_layers / num_layers (the layers' share of the compute)
      batch_layers     the mean over examples of the layers their batch ran (a batch runs
                       until its last example exits: the compute actually spent at this
                       batch size)
      exits            examples exiting after layer 1..num_layers (a list)
    """
    ee = model.model if isinstance(model, ExitsClassifier) else model
    if not isinstance(ee, nn.EarlyExitClassifier):
        raise ValueError(f"evaluate_exits needs an early-exit classifier "
                         f"(model.depth_mode='early_exit'), got {type(model).__name__}")
    if criterion not in EXIT_CRITERIA:
        raise ValueError(f"evaluate_exits: criterion must be one of "
                         f"{EXIT_CRITERIA}, got {criterion!r}")
    if criterion == "patience" and patience < 1:
        raise ValueError(f"evaluate_exits: patience must be at least 1, got {patience!r}")
    n = ee.num_layers
    # Arrays, so that every threshold and patience shares one compiled program per shape.
    thr, pat = jnp.float32(threshold), jnp.int32(patience)
    it = DataIterator(source, batch_size=min(batch_size, len(source)), shuffle=False,
                      num_epochs=1, drop_remainder=False)
    correct = count = layers = batch_layers = 0
    exits = np.zeros(n, np.int64)
    for batch in it:
        x = jnp.asarray(batch["inputs"])
        res = _exit_batch(ee, x, (x != 0) if padded else None, criterion, thr, pat)
        targets = np.asarray(batch["targets"])
        layer = np.asarray(res.exit_layer)
        correct += int(np.sum(np.asarray(jnp.argmax(res.logits, -1)) == targets))
        count += len(targets)
        layers += int(layer.sum())
        batch_layers += int(res.layers_run) * len(targets)
        exits += np.bincount(layer - 1, minlength=n)
    expected = layers / count
    return {"accuracy": correct / count, "expected_layers": expected,
            "flops_saved": 1.0 - expected / n, "batch_layers": batch_layers / count,
            "exits": exits.tolist()}
