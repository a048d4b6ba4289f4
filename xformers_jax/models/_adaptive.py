"""Adaptive depth: the Universal Transformer with adaptive computation time, and early exit.

* :class:`ACTStack` (Dehghani et al., 2019, "Universal Transformers", with Graves, 2016,
  "Adaptive Computation Time for Recurrent Neural Networks"): one shared block applied up to
  ``max_steps`` times; a halting unit ``p = sigmoid(h w + b)`` per position accumulates until
  it passes ``threshold``, the step that passes it takes the remainder, and the output is the
  halting-weighted sum of the block's outputs, ``sum_n p_n s_n`` (Graves's eq. 7; the
  tensor2tensor code interpolates ``s_n w_n + out (1 - w_n)`` instead, a different mix). The ponder cost ``N + R`` (updates plus
  remainder) is returned for the loss. Halted positions keep being transformed, so later
  positions can still attend to them (the Universal Transformer's form); their output is fixed.
  A step after every real position of the batch has halted is not computed (``lax.cond``; it
  would add nothing to any output), so a batch costs its slowest position's steps. A single
  halted position cannot skip its compute: the attention of the positions still running reads
  its state, and taking the running positions out of the ``[B, L]`` grid would give each step
  a data-dependent shape. (Under ``vmap`` the cond becomes a select and every step runs.)
  Causal stacks decode token by token with one cache per step, equal to the parallel form
  (decoding runs every step: a later token still running attends to this token's states).
* :class:`EarlyExitClassifier` (Xin et al., 2020, "DeeBERT: Dynamic Early Exiting for
  Accelerating BERT Inference"; Zhou et al., 2020, "BERT Loses Patience: Fast and Robust
  Inference with Early Exit"): a classifier after every layer. :meth:`EarlyExitClassifier.exit`
  runs a batch layer by layer in a ``lax.while_loop`` that stops when every example has exited
  (DeeBERT: the prediction's entropy falls below a threshold; PABEE: the prediction stayed the
  same for ``patience`` layers), so the layers after the batch's last exit are not computed; it
  reports each example's exit layer, the expected layers and the FLOPs saved.

LayerDrop (Fan et al., 2020) lives in :class:`~xformers_jax.nn.LayerStack` (``layerdrop=``).

The model kinds ``act`` (:class:`ACTClassifier`: its mean ponder cost is the term ``ponder``,
weight 1e-2) and ``early_exit`` (:class:`ExitsClassifier`: trained with PABEE's weighted loss
over every exit, the term ``exits``, in place of the last exit's cross-entropy; evaluated and
reported at the last exit; :func:`evaluate_exits` runs the early-exit inference over a split).
"""

from __future__ import annotations

import functools
import math
from typing import Callable, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from ..data import DataIterator
from ..nn import Embedder, LayerNorm, TransformerBlock, sinusoid
from ._registry import SLOTS, TRUNK, block_kwargs, register_model
from ._trunk import Encoder, pool


class ACTInfo(NamedTuple):
    """Per-position ponder statistics ``[B, L]``: ``updates`` (N, steps taken), ``remainders``
    (R); the ponder cost is ``updates + remainders`` (mean it over real positions for the
    loss). ``steps_run``: the steps the batch computed (int32; its slowest real position's
    N)."""

    updates: jax.Array
    remainders: jax.Array
    steps_run: jax.Array | None = None

    @property
    def ponder_cost(self):
        return self.updates + self.remainders


class ACTStack(eqx.Module):
    """A Universal Transformer stack with adaptive computation time.

    Args:
      make_block: ``make_block(key)`` -> a block (e.g. a ``TransformerBlock`` partial);
        called once: the block is shared by every step.
      dim: model width. max_steps: the most steps a position may take.
      threshold: halting threshold (``1 - epsilon``; Graves's epsilon 0.01).
      halt_bias: initial bias of the halting unit (positive: halt early).
      key: PRNG key.

    Call: ``x [B, L, dim]`` -> ``(y [B, L, dim], ACTInfo)``.
    """

    block: eqx.Module
    halt_w: jax.Array
    halt_b: jax.Array
    max_steps: int = eqx.field(static=True)
    threshold: float = eqx.field(static=True)

    def __init__(self, make_block: Callable, dim: int, max_steps: int, *,
                 threshold: float = 0.99, halt_bias: float = 1.0, key):
        if not (isinstance(max_steps, int) and max_steps >= 1):
            raise ValueError(f"ACTStack: max_steps must be a positive int, got {max_steps!r}")
        if not 0.0 < threshold <= 1.0:
            raise ValueError(f"ACTStack: threshold must be in (0, 1], got {threshold}")
        kb, kh = jax.random.split(key)
        self.block = make_block(kb)
        self.halt_w = jax.random.normal(kh, (dim,)) / math.sqrt(dim)
        self.halt_b = jnp.asarray(halt_bias, jnp.float32)
        self.max_steps, self.threshold = max_steps, threshold

    def _halting(self, state, carry, t):
        """One step of the halting bookkeeping; returns the update weight and the new carry."""
        halting, remainders, updates = carry
        p = jax.nn.sigmoid(state.astype(jnp.float32) @ self.halt_w + self.halt_b)
        running = (halting < 1.0).astype(jnp.float32)
        total = halting + p * running
        new_halted = (total > self.threshold).astype(jnp.float32) * running
        # The last step halts whatever is still running (Graves: N(t) <= max steps).
        if t == self.max_steps - 1:
            new_halted = running
        running = running - new_halted
        halting = halting + p * running
        remainders = remainders + new_halted * (1.0 - halting)
        halting = halting + new_halted * (1.0 - halting)
        updates = updates + running + new_halted
        weight = p * running + new_halted * remainders
        return weight, (halting, remainders, updates)

    def _embed_step(self, x, t):
        return x + sinusoid(jnp.asarray(t), x.shape[-1]).astype(x.dtype)

    def __call__(self, x, *, kv_mask=None, key=None):
        b, length, _ = x.shape
        zeros = jnp.zeros((b, length), jnp.float32)
        carry = (zeros, zeros, zeros)
        state, out = x, jnp.zeros_like(x)
        # A Python loop over a static step count (max_steps is small): differentiable, and each
        # step's halting rule (the last step halts everything) is static.
        real = jnp.ones((b, length), bool) if kv_mask is None else kv_mask.astype(bool)
        steps_run = jnp.int32(0)
        for t in range(self.max_steps):
            # Whether a real position still runs at this step (after its halting update a
            # position that halts now still takes this step's output, with its remainder).
            active = jnp.any((carry[0] < 1.0) & real)
            state = self._embed_step(state, t)
            weight, carry = self._halting(state, carry, t)
            k = None if key is None else jax.random.fold_in(key, t)
            if t == 0:  # every position takes the first step
                state = self.block(state, kv_mask=kv_mask, key=k)
            else:
                state = jax.lax.cond(
                    active, lambda s: self.block(s, kv_mask=kv_mask, key=k), lambda s: s,
                    state)
            steps_run = steps_run + active.astype(jnp.int32)
            w = weight[..., None].astype(x.dtype)
            out = out + w * state
        return out, ACTInfo(carry[2], carry[1], steps_run)

    def init_cache(self, batch: int, max_len: int, dtype=jnp.float32):
        """One decoding cache per step, stacked on a leading step axis."""
        one = self.block.init_cache(batch, max_len, dtype)
        return jax.tree_util.tree_map(lambda a: jnp.broadcast_to(a, (self.max_steps, *a.shape)),
                                      one)

    def decode(self, x, caches):
        """One token through every step: ``x [B, 1, dim]`` -> ``(y, caches)``; equal to the
        token's row of the parallel form for a causal block."""
        dyn, static = eqx.partition(caches, eqx.is_array)
        b = x.shape[0]
        zeros = jnp.zeros((b, 1), jnp.float32)
        carry = (zeros, zeros, zeros)
        state, out, news = x, jnp.zeros_like(x), []
        for t in range(self.max_steps):
            state = self._embed_step(state, t)
            weight, carry = self._halting(state, carry, t)
            cache = eqx.combine(jax.tree_util.tree_map(lambda a: a[t], dyn), static)
            state, cache = self.block.decode(state, cache)
            news.append(eqx.filter(cache, eqx.is_array))
            w = weight[..., None].astype(x.dtype)
            out = out + w * state
        new = jax.tree_util.tree_map(lambda *a: jnp.stack(a), *news)
        return out, eqx.combine(new, static)


class ExitResult(NamedTuple):
    """What :meth:`EarlyExitClassifier.exit` returns.

    Attributes:
      logits: ``[B, C]``, each example's prediction at its exit.
      exit_layer: ``int32[B]``, the layer (1-based) each example exited after.
      layers_run: the layers the batch actually computed (the last example's exit).
      expected_layers: the mean exit layer (the per-example cost, as the papers report it).
      flops_saved: ``1 - expected_layers / num_layers`` (the layers' share; the embedding and
        the exit classifiers are not counted).
    """

    logits: jax.Array
    exit_layer: jax.Array
    layers_run: jax.Array
    expected_layers: jax.Array
    flops_saved: jax.Array


CRITERIA = ("entropy", "patience")


def _entropy(logits):
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return -jnp.sum(jnp.exp(logp) * logp, axis=-1)


class EarlyExitClassifier(eqx.Module):
    """An encoder classifier with an exit classifier after every layer.

    ``__call__`` returns every exit's logits ``[num_layers, B, C]`` (train with
    :func:`early_exit_loss`); :meth:`exit` runs the early-exit inference.
    Arguments as :class:`~xformers_jax.nn.EncoderClassifier` (``pooling`` "mean" or "cls").
    """

    encoder: Encoder
    heads: jax.Array
    pooling: str = eqx.field(static=True)

    def __init__(self, num_classes, dim, num_layers, num_heads, hidden, *, pooling="mean",
                 vocab_size=None, input_dim=None, max_len=512, block=None, key):
        k1, k2 = jax.random.split(key)
        self.encoder = Encoder(dim, num_layers, num_heads, hidden, vocab_size=vocab_size,
                               input_dim=input_dim, cls_token=pooling == "cls", max_len=max_len,
                               block=block, key=k1)
        self.heads = jax.random.normal(k2, (num_layers, dim, num_classes)) / math.sqrt(dim)
        self.pooling = pooling

    @property
    def num_layers(self) -> int:
        return self.heads.shape[0]

    def _layer(self, i, x, mask):
        dynamic, static = self.encoder.layers.per_layer()
        block = eqx.combine(jax.tree_util.tree_map(lambda a: a[i], dynamic), static)
        return block(x, kv_mask=mask)

    def _head(self, i, x, mask):
        h = x if self.encoder.final_norm is None else self.encoder.final_norm(x)
        return pool(h, mask, self.pooling) @ self.heads[i].astype(h.dtype)

    def __call__(self, inputs, *, mask=None):
        """Every exit's logits, ``[num_layers, B, C]``."""
        x, mask = self.encoder.embed(inputs, mask=mask)

        def step(x, i):
            x = self._layer(i, x, mask)
            return x, self._head(i, x, mask)

        _, logits = jax.lax.scan(step, x, jnp.arange(self.num_layers))
        return logits

    def exit(self, inputs, *, mask=None, criterion: str = "entropy", threshold: float = 0.5,
             patience: int = 2) -> ExitResult:
        """Early-exit inference on a batch.

        ``criterion="entropy"`` (DeeBERT): an example exits after the first layer whose
        prediction has entropy below ``threshold`` (nats). ``"patience"`` (PABEE): it exits
        after the layer at which its prediction has been unchanged for ``patience``
        consecutive layers. Examples that never meet the criterion exit after the last layer.
        Layers run for the whole batch until its last example exits, then stop.
        """
        if criterion not in CRITERIA:
            raise ValueError(f"EarlyExitClassifier.exit: criterion must be one of {CRITERIA}, "
                             f"got {criterion!r}")
        if criterion == "patience" and isinstance(patience, (int, float)) and patience < 1:
            raise ValueError(f"EarlyExitClassifier.exit: patience must be at least 1, got "
                             f"{patience!r}")
        x, mask = self.encoder.embed(inputs, mask=mask)
        b, n = x.shape[0], self.num_layers
        c = self.heads.shape[-1]
        init = (x, jnp.int32(0), jnp.zeros((b,), bool), jnp.full((b,), n, jnp.int32),
                jnp.zeros((b, c), jnp.float32), jnp.full((b,), -1, jnp.int32),
                jnp.zeros((b,), jnp.int32))

        def cond(carry):
            return (carry[1] < n) & ~jnp.all(carry[2])

        def body(carry):
            x, i, done, layer, out, prev, count = carry
            x = self._layer(i, x, mask)
            logits = self._head(i, x, mask).astype(jnp.float32)
            pred = jnp.argmax(logits, axis=-1).astype(jnp.int32)
            if criterion == "entropy":
                now = _entropy(logits) < threshold
            else:
                count = jnp.where(pred == prev, count + 1, 0)
                now = count >= patience
            now = (now | (i == n - 1)) & ~done
            layer = jnp.where(now, i + 1, layer)
            out = jnp.where(now[:, None], logits, out)
            return x, i + 1, done | now, layer, out, pred, count

        _, ran, _, layer, out, _, _ = jax.lax.while_loop(cond, body, init)
        expected = jnp.mean(layer.astype(jnp.float32))
        return ExitResult(out, layer, ran, expected, 1.0 - expected / n)


def early_exit_loss(all_logits, labels, *, weighting: str = "pabee"):
    """Cross-entropy over every exit, ``all_logits [N, B, C]``, ``labels int[B]``:
    ``"pabee"`` weights layer ``i`` by ``i`` (Zhou et al.'s weighted average), ``"mean"`` the
    plain average (DeeBERT trains the exits on a frozen encoder; averaging is its joint form)."""
    n = all_logits.shape[0]
    logp = jax.nn.log_softmax(all_logits.astype(jnp.float32), axis=-1)
    nll = -jnp.mean(jnp.take_along_axis(logp, labels[None, :, None], axis=-1)[..., 0], axis=1)
    if weighting == "pabee":
        w = jnp.arange(1, n + 1, dtype=jnp.float32)
    elif weighting == "mean":
        w = jnp.ones((n,), jnp.float32)
    else:
        raise ValueError(f"early_exit_loss: weighting must be 'pabee' or 'mean', got "
                         f"{weighting!r}")
    return jnp.sum(w * nll) / jnp.sum(w)


# -- the model kinds ---------------------------------------------------------------------------

class ACTClassifier(eqx.Module):
    """Embedding, an :class:`ACTStack` (at most ``num_layers`` steps of one shared block),
    final norm, pooling (mean or CLS) and a linear head. ``model(x, mask=, key=)`` returns the
    logits; with ``return_aux`` ``(logits, {"ponder": the mean ponder cost over real
    positions})``."""

    embed: Embedder
    stack: ACTStack
    norm: LayerNorm
    head: jax.Array
    pooling: str = eqx.field(static=True)

    def __init__(self, num_classes, dim, num_layers, num_heads, hidden, *, vocab_size,
                 pooling, max_len, block, threshold, key):
        k1, k2, k3 = jax.random.split(key, 3)
        self.embed = Embedder(dim, vocab_size=vocab_size, cls_token=pooling == "cls", key=k1)
        make = functools.partial(TransformerBlock, dim, num_heads, hidden, max_len=max_len,
                                 **block)
        self.stack = ACTStack(lambda k: make(key=k), dim, num_layers, threshold=threshold,
                              key=k2)
        self.norm = LayerNorm(dim)
        self.head = jax.random.normal(k3, (dim, num_classes)) / math.sqrt(dim)
        self.pooling = pooling

    def __call__(self, x, *, mask=None, key=None, return_aux=False):
        h, mask = self.embed(x, mask=mask)
        h, info = self.stack(h, kv_mask=mask, key=key)
        h = self.norm(h)
        w = jnp.ones(h.shape[:2]) if mask is None else mask.astype(jnp.float32)
        ponder = jnp.sum(info.ponder_cost * w) / jnp.maximum(jnp.sum(w), 1.0)
        logits = pool(h, mask, self.pooling) @ self.head.astype(h.dtype)
        return (logits, {"ponder": ponder}) if return_aux else logits


class ExitsClassifier(eqx.Module):
    """:class:`EarlyExitClassifier` as a trainable model: ``model(x, mask=)`` returns the last
    exit's logits; with ``return_aux`` ``(logits, {"exit_logits": every exit's [N, B, C]})``."""

    model: EarlyExitClassifier

    def __call__(self, x, *, mask=None, key=None, return_aux=False):
        logits = self.model(x, mask=mask)
        return (logits[-1], {"exit_logits": logits}) if return_aux else logits[-1]


def _max_len(config, task) -> int:
    # Exactly the attended length (CLS pooling prepends one token).
    return task.seq_len + (config.pooling == "cls")


@register_model("act", serves=("classification",),
                defaults=dict(TRUNK, pooling="cls", threshold=0.99, **SLOTS),
                loss_weights={"ponder": 1e-2})
def act(config, task, key):
    """A Universal Transformer with adaptive computation time (:class:`ACTClassifier`)."""
    return ACTClassifier(task.num_classes, config.dim, config.num_layers, config.num_heads,
                         config.hidden, vocab_size=task.vocab_size, pooling=config.pooling,
                         max_len=_max_len(config, task), block=block_kwargs(config),
                         threshold=config.threshold, key=key)


def _exit_terms(aux, targets):
    return {"exits": early_exit_loss(aux["exit_logits"], targets)}


@register_model("early_exit", serves=("classification",),
                defaults=dict(TRUNK, pooling="cls", **SLOTS),
                loss_weights={"cross_entropy": 0.0, "exits": 1.0}, target_terms=_exit_terms)
def early_exit(config, task, key):
    """An exit classifier after every layer, trained with PABEE's loss (:class:`ExitsClassifier`)."""
    return ExitsClassifier(EarlyExitClassifier(
        task.num_classes, config.dim, config.num_layers, config.num_heads, config.hidden,
        pooling=config.pooling, vocab_size=task.vocab_size, max_len=_max_len(config, task),
        block=block_kwargs(config), key=key))


@eqx.filter_jit
def _exit_batch(model, inputs, mask, criterion, threshold, patience):
    return model.exit(inputs, mask=mask, criterion=criterion, threshold=threshold,
                      patience=patience)


def evaluate_exits(model, source, batch_size: int, *, padded: bool, criterion: str = "entropy",
                   threshold: float = 0.5, patience: int = 2) -> dict:
    """Early-exit inference over a whole split (in order; the last batch may be short).

    ``model`` is an early-exit classifier (the ``early_exit`` kind's :class:`ExitsClassifier`
    or an :class:`EarlyExitClassifier`); each batch goes through
    :meth:`EarlyExitClassifier.exit` (``criterion``, ``threshold``, ``patience`` as there;
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
    if not isinstance(ee, EarlyExitClassifier):
        raise ValueError(f"evaluate_exits needs an early-exit classifier "
                         f"(model.kind='early_exit'), got {type(model).__name__}")
    if criterion not in CRITERIA:
        raise ValueError(f"evaluate_exits: criterion must be one of "
                         f"{CRITERIA}, got {criterion!r}")
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
