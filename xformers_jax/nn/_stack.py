"""Layer stacks: built with ``eqx.filter_vmap``, run with ``lax.scan`` (or unrolled), with a
remat policy, parameter sharing and reversible residuals.

* ``remat``: ``"none"``, ``"dots_saveable"`` (keep matmul outputs, recompute the rest) or
  ``"full"`` (keep only each layer's input; gradient checkpointing, Chen et al., 2016).
* ``sharing``: ``"none"``, ``"all"`` (ALBERT, Lan et al., 2020: one block's parameters for
  every layer) or ``"attention"`` (ALBERT's attention-only sharing).
* ``universal``: Universal-Transformer recurrence (Dehghani et al., 2019): one shared block
  applied ``num_layers`` times, with a sinusoidal timestep embedding added before each step.
* ``layerdrop``: LayerDrop (Fan et al., 2020, "Reducing Transformer Depth on Demand with
  Structured Dropout"): in training calls (a ``key``, not ``inference``) each layer is skipped
  with this probability by ``lax.cond`` inside the scan, so its compute is not done;
  :meth:`LayerStack.prune` keeps a subset of layers for inference.
* Attention kinds that pass scores from layer to layer (Realformer, Predictive attention,
  Lazyformer: ``MultiHeadAttention.carries_between_layers``) get the previous layer's scores
  through the scan's carry (the first layer's from ``init_layer_carry``).
* Memory, state and auxiliary outputs travel in a :class:`~xformers_jax.nn.Carry`: each layer
  gets its slice of the carried memory and state and returns them updated with its auxiliary
  outputs, stacked on a leading layer axis (the stack never looks inside them).

Every way of running the stack (scanned, unrolled, pipelined over a ``stage`` mesh axis)
shares one step body, :meth:`LayerStack.step`, with remat around it; the reversible stack is
the one other path (two streams and a custom VJP).
* ``reversible``: RevNet residuals (Gomez et al., 2017; Kitaev et al., 2020, Reformer)
  ``y1 = x1 + F(x2)``, ``y2 = x2 + G(y1)`` with ``F`` the attention branch and ``G`` the FFN
  branch (pre-norm inside each), on two copies of the input, averaged at the end. A custom VJP
  reconstructs each layer's inputs from its outputs during the backward pass, so activation
  memory does not grow with depth.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import equinox as eqx
import jax
import jax.numpy as jnp

from .. import axes as X
from ._carry import Carry
from ._ffn import FeedForward
from ._positions import sinusoid

REMAT = ("none", "dots_saveable", "full")
SHARING = ("none", "all", "attention")


def _remat(fn, policy: str):
    if policy == "none":
        return fn
    if policy == "dots_saveable":
        return jax.checkpoint(fn, policy=jax.checkpoint_policies.dots_saveable)
    return jax.checkpoint(fn)


class LayerStack(eqx.Module):
    """``num_layers`` blocks made by ``make_block(key)`` (e.g. a ``TransformerBlock`` partial).

    Blocks hold arrays stacked on a leading layer axis; stateful norms (PowerNorm) are not
    supported inside a stack. Stateful attention (routing) is: its ``eqx.nn.StateIndex`` is
    created once under ``filter_vmap``, so one state entry holds every layer's value on a
    leading layer axis, sliced per layer by the scan (``sharing="none"``, not reversible).
    """

    layers: eqx.Module = X.stacked()
    num_layers: int = eqx.field(static=True)
    remat: str = eqx.field(static=True)
    sharing: str = eqx.field(static=True)
    universal: bool = eqx.field(static=True)
    scan: bool = eqx.field(static=True)
    reversible: bool = eqx.field(static=True)
    layerdrop: float = eqx.field(static=True)

    def __init__(self, make_block: Callable, num_layers: int, *, remat: str = "none",
                 sharing: str = "none", universal: bool = False, scan: bool = True,
                 reversible: bool = False, layerdrop: float = 0.0, key):
        if remat not in REMAT:
            raise ValueError(f"LayerStack: remat must be one of {REMAT}, got {remat!r}")
        if sharing not in SHARING:
            raise ValueError(f"LayerStack: sharing must be one of {SHARING}, got {sharing!r}")
        if universal and sharing != "all":
            sharing = "all"
        unique = 1 if sharing == "all" else num_layers
        self.layers = eqx.filter_vmap(make_block)(jax.random.split(key, unique))
        indices = _state_indices(self.layers)
        if len(indices) != len(_state_indices(getattr(self.layers, "attn", None))):
            raise ValueError("LayerStack: blocks with stateful norms (PowerNorm) cannot be "
                             "stacked; use a list of blocks")
        if indices and (sharing != "none" or reversible):
            raise ValueError("LayerStack: stateful attention (routing) keeps one state per layer; "
                             "it needs sharing='none' and reversible=False")
        if reversible:
            block = make_block(jax.random.key(0))
            if (getattr(block, "cross", None) is not None or block.placement != "pre"
                    or not isinstance(getattr(block, "ffn", None), FeedForward)):
                raise ValueError("LayerStack: reversible=True needs pre-norm blocks without "
                                 "cross attention (the branches F, G must be separable)")
        if _carries(self.layers) and (reversible or indices):
            raise ValueError("LayerStack: attention that passes scores between layers cannot be "
                             "reversible")
        self.num_layers, self.remat, self.sharing = num_layers, remat, sharing
        self.universal, self.scan, self.reversible = universal, scan, reversible
        if not 0.0 <= layerdrop < 1.0 or (layerdrop and reversible):
            raise ValueError(f"LayerStack: layerdrop must be in [0, 1) (and 0 for reversible "
                             f"stacks), got {layerdrop}")
        self.layerdrop = float(layerdrop)

    def per_layer(self):
        """Parameters with a leading axis of ``num_layers`` (shared ones broadcast, so their
        gradients sum over layers) and the static part. (An :meth:`unstacked` stack's layers
        are stacked again: a copy of the parameters.)"""
        if isinstance(self.layers, tuple):
            parts = [eqx.partition(block, eqx.is_array) for block in self.layers]
            return (jax.tree_util.tree_map(lambda *a: jnp.stack(a), *[p for p, _ in parts]),
                    parts[0][1])
        dynamic, static = eqx.partition(self.layers, eqx.is_array)
        n = self.num_layers

        def expand(a):
            return jnp.broadcast_to(a[:1], (n, *a.shape[1:]))

        if self.sharing == "all":
            dynamic = jax.tree_util.tree_map(expand, dynamic)
        elif self.sharing == "attention":
            dynamic = eqx.tree_at(lambda b: b.attn, dynamic,
                                  jax.tree_util.tree_map(expand, dynamic.attn))
        return dynamic, static

    def unstacked(self) -> LayerStack:
        """The stack for decoding: ``layers`` a tuple of ``num_layers`` blocks, each holding
        its own parameters (arrays without the leading layer axis), built once.

        A decoding step runs the layers one after the other (:meth:`decode`); out of the
        stacked ``[layers, ...]`` arrays each layer's parameters are a slice, which XLA
        copies inside every step (a step of a small model at 16K tokens copied 3 MiB per
        layer beside reading 8 MiB of its cache). Split once before the decoding loop
        (``CausalLM.generate``, ``models.Server`` and the ``decode`` suite do), a step reads
        each layer's parameters where they lie. Shared parameters (``sharing``) stay one
        array, used by every layer. :meth:`decode` and :meth:`init_cache` give the stacked
        stack's results; a forward call stacks the layers again (a copy of the parameters:
        train the stacked stack). Idempotent."""
        if isinstance(self.layers, tuple):
            return self
        dynamic, static = eqx.partition(self.layers, eqx.is_array)

        def layer(i, tree=dynamic):
            return jax.tree_util.tree_map(lambda a: a[i], tree)

        # A shared part is sliced once and is then the same array in every layer.
        if self.sharing == "all":
            blocks = [layer(0)] * self.num_layers
        elif self.sharing == "attention":
            attn = layer(0, dynamic.attn)
            blocks = [eqx.tree_at(lambda b: b.attn, layer(i), attn)
                      for i in range(self.num_layers)]
        else:
            blocks = [layer(i) for i in range(self.num_layers)]
        return self._replace(layers=tuple(eqx.combine(b, static) for b in blocks))

    def stacked(self) -> LayerStack:
        """The stack with ``[layers, ...]`` arrays (the inverse of :meth:`unstacked`; shared
        parameters are then one copy per layer, equal)."""
        if not isinstance(self.layers, tuple):
            return self
        return self._replace(layers=eqx.combine(*self.per_layer()))

    def _replace(self, **fields) -> LayerStack:
        """This stack with ``fields`` replaced (no ``__init__``: the layers are not rebuilt)."""
        out = object.__new__(type(self))
        for f in dataclasses.fields(self):
            object.__setattr__(out, f.name, fields.get(f.name, getattr(self, f.name)))
        return out

    def __call__(self, x, carry: Carry | None = None, *, kv_mask=None, context=None,
                 context_mask=None, positions=None, key=None, inference=False, tokens=None,
                 segment_ids=None):
        """x: ``[B, L, dim]`` -> ``[B, L, dim]``; with a ``carry`` (:class:`~xformers_jax.nn.Carry`)
        -> ``(y, carry)``: ``carry.state`` (the ``eqx.nn.State`` of stateful attention)
        updated, ``carry.memory`` (every layer's :class:`~xformers_jax.nn.MemoryState` on a
        leading layer axis, :meth:`init_memory`; blocks built with ``memory=``) replaced by
        the memory after this segment, and ``carry.aux`` every layer's auxiliary outputs
        (``nn.aux_terms``: router losses, tokens dropped, expert load) on a leading layer
        axis. ``tokens int[B, L]`` reach hash-routed FFNs. Scores passed between layers
        (Realformer, ...) start from the first layer's ``init_layer_carry`` and stay inside
        the stack. ``segment_ids int[B, L]``: packed rows, each document as if alone
        (``TransformerBlock``; not in reversible stacks)."""
        if isinstance(self.layers, tuple):
            return self.stacked()(x, carry, kv_mask=kv_mask, context=context,
                                  context_mask=context_mask, positions=positions, key=key,
                                  inference=inference, tokens=tokens, segment_ids=segment_ids)
        given = carry is not None
        carry = Carry() if carry is None else carry
        kw = dict(kv_mask=kv_mask, context=context, context_mask=context_mask,
                  positions=positions, inference=inference, tokens=tokens)
        if segment_ids is not None:
            kw["segment_ids"] = segment_ids
        if X.mesh_axis_size(X.STAGE) > 1:
            # A 'stage' mesh axis: the layers run as a GPipe pipeline (nn._pipeline).
            from ._pipeline import stack_on_stages
            y, out = stack_on_stages(self, x, carry, key=key, **kw)
        elif self.reversible:
            y, out = self._run_reversible(x, carry, key=key, **kw)
        else:
            y, out = self._layers(x, carry, key=key, **kw)
        return (y, out) if given else y

    def step(self, static, **kw) -> Callable:
        """The one step body every way of running the stack shares: ``step((x, scores),
        (params, t, key, state, memory)) -> ((y, scores), (state, memory, aux))`` runs layer
        ``t`` (its ``params`` combined with ``static``) with its slices of the carried state
        and memory: the Universal Transformer's timestep embedding first, LayerDrop's skip
        around it (a training call, ``key`` given and not ``inference``), the block's carried
        call inside. ``kw`` are the blocks' inputs (``kv_mask``, ``context``, ...,
        ``inference``)."""
        inference = kw.get("inference", False)

        def run(block, x, carry, key):
            y, c = block(x, carry, key=key, **kw)
            return (y, c.scores), (c.state, c.memory, c.aux)

        def step(xc, inputs):
            x, scores = xc
            params, t, k, state, memory = inputs
            block = eqx.combine(params, static)
            if self.universal:
                x = x + sinusoid(t, x.shape[-1]).astype(x.dtype)
            carry = Carry(state=state, memory=memory, scores=scores)
            if not self.layerdrop or k is None or inference:
                return run(block, x, carry, k)
            # LayerDrop (Fan et al., 2020): a dropped layer is skipped by lax.cond, so its
            # compute is not done (not multiplied by zero); it passes its carry on unchanged and
            # its auxiliary outputs are zeros.
            shapes = jax.eval_shape(lambda x: run(block, x, carry, k)[1][2], x)

            def skipped(x):
                aux = jax.tree_util.tree_map(lambda a: jnp.zeros(a.shape, a.dtype), shapes)
                return (x, scores), (state, memory, aux)

            return jax.lax.cond(_dropped(k, self.layerdrop), skipped,
                                lambda x: run(block, x, carry, k), x)

        return _remat(step, self.remat)

    def _layers(self, x, carry, *, key, **kw):
        """The stack as a ``lax.scan`` over :meth:`step` (or unrolled)."""
        dynamic, static = self.per_layer()
        keys = None if key is None else jax.random.split(key, self.num_layers)
        scores = None
        if _carries(self.layers):
            if carry.state is not None:
                raise ValueError("LayerStack: attention that passes scores between layers "
                                 "takes no eqx.nn.State")
            first = eqx.combine(jax.tree_util.tree_map(lambda a: a[0], dynamic), static)
            scores = first.attn.init_layer_carry(x.shape[0], x.shape[1], self.num_layers)
        # Every layer's state on a leading layer axis (see the class docstring).
        states = None if carry.state is None else carry.state.substate(self.layers)
        xs = (dynamic, jnp.arange(self.num_layers), keys, states, carry.memory)
        step = self.step(static, **kw)
        # Under a sequence split the layers are unrolled: differentiating a lax.scan whose body
        # holds the ring's shard_map kept every ring step's score tiles as residuals (measured:
        # per-device memory quadratic in the length), while the unrolled stack keeps only the
        # ring's own residuals.
        if self.scan and X.sequence_shards() == 1:
            (x, _), (states, memory, aux) = jax.lax.scan(step, (x, scores), xs)
        else:
            outs, xc = [], (x, scores)
            for i in range(self.num_layers):
                xc, o = step(xc, jax.tree_util.tree_map(lambda a: a[i], xs))
                outs.append(o)
            x = xc[0]
            states, memory, aux = jax.tree_util.tree_map(lambda *a: jnp.stack(a), *outs)
        state = None if carry.state is None else carry.state.update(states)
        return x, Carry(state=state, memory=memory, aux=aux)

    def _run_reversible(self, x, carry, *, key, **kw):
        """RevNet residuals (the module docstring): two streams, a custom VJP that rebuilds
        every layer's inputs in the backward pass; no state, memory or auxiliary outputs."""
        if key is not None:
            raise ValueError("LayerStack: reversible blocks must be deterministic (key=None)")
        if carry.memory is not None or carry.state is not None:
            raise ValueError("LayerStack: reversible stacks take no memory or eqx.nn.State")
        if kw.get("segment_ids") is not None:
            raise ValueError("LayerStack: reversible stacks take no segment_ids (packed rows)")
        dynamic, static = self.per_layer()
        y1, y2 = _reversible(static, dynamic, x, x, kw["kv_mask"])
        return (y1 + y2) / 2, Carry()

    def dropped_layers(self, key):
        """``bool[num_layers]``: the layers LayerDrop skips in a training call with ``key``."""
        keys = jax.random.split(key, self.num_layers)
        return jax.vmap(lambda k: _dropped(k, self.layerdrop))(keys)

    def prune(self, keep) -> "LayerStack":
        """The stack with only the layers ``keep`` (indices, in order): LayerDrop's pruning
        at inference (Fan et al. keep every other layer: ``keep=range(0, n, 2)``)."""
        if isinstance(self.layers, tuple):
            return self.stacked().prune(keep)
        keep = [int(i) for i in keep]
        if self.sharing != "none" or not keep or not all(0 <= i < self.num_layers for i in keep):
            raise ValueError(f"LayerStack.prune: keep must be layer indices in [0, "
                             f"{self.num_layers}) of an unshared stack; got {keep} with "
                             f"sharing={self.sharing!r}")
        idx = jnp.asarray(keep)
        return self._replace(layers=jax.tree_util.tree_map(
            lambda a: a[idx] if eqx.is_array(a) else a, self.layers), num_layers=len(keep))

    def init_memory(self, batch: int, dim: int, dtype=jnp.float32, *, inference=False):
        """Every layer's empty memory (evaluation lengths when ``inference``), stacked on a
        leading layer axis."""
        dynamic, static = self.per_layer()
        block = eqx.combine(jax.tree_util.tree_map(lambda a: a[0], dynamic), static)
        if getattr(block, "memory", None) is None:
            raise ValueError("LayerStack.init_memory: the blocks have no memory (memory=...)")
        one = block.memory.init(batch, dim, dtype, inference=inference)
        return jax.tree_util.tree_map(
            lambda a: jnp.broadcast_to(a, (self.num_layers, *a.shape)), one)

    def init_cache(self, batch: int, max_len: int, dtype=jnp.float32):
        """Every layer's decoding cache: a tuple of ``num_layers`` caches, one per layer
        (each what its block's ``init_cache`` gives, e.g. an :class:`~xformers_jax.nn.KVCache`
        with keys ``[B, Hkv, C, D]``), its own buffers rather than a slice of one
        ``[layers, ...]`` array, so that a decoding step writes each layer's cache in place
        (see :meth:`decode`)."""
        return tuple(block.init_cache(batch, max_len, dtype) for block in self._blocks())

    def decode(self, x, caches, *, tokens=None, context=None, context_mask=None):
        """One decoding step through every layer: ``x [B, 1, dim]`` (``tokens int[B, 1]``, the
        step's token ids, for hash-routed FFNs) and ``caches`` from :meth:`init_cache` (a
        tuple, one cache per layer) -> ``(y, caches)``.

        The layers are unrolled, each reading and writing its own cache. A key/value cache is
        the bulk of a step's memory traffic: a stack of the caches on one leading layer axis,
        each layer's slice read out and written back inside a ``lax.scan``, made XLA copy a
        layer's cache twice per layer and step (measured at 16K tokens, 2 layers: 31 ms a
        token against 2.9 ms to read both caches once). Each layer's parameters are a slice of
        the stacked arrays, copied inside the step, unless the stack is :meth:`unstacked`."""
        if self.reversible:
            raise NotImplementedError("LayerStack.decode: reversible stacks do not decode")
        if not isinstance(caches, (tuple, list)) or len(caches) != self.num_layers:
            what = (f"a {type(caches).__name__} of {len(caches)}"
                    if isinstance(caches, (tuple, list)) else type(caches).__name__)
            raise ValueError(f"LayerStack.decode: caches must be a tuple of {self.num_layers} "
                             f"per-layer caches (LayerStack.init_cache), got {what}")
        new = []
        for i, (block, cache) in enumerate(zip(self._blocks(), caches)):
            if self.universal:
                x = x + sinusoid(jnp.asarray(i), x.shape[-1]).astype(x.dtype)
            x, cache = block.decode(x, cache, tokens=tokens, context=context,
                                    context_mask=context_mask)
            new.append(cache)
        return x, type(caches)(new) if isinstance(caches, tuple) else new

    def _blocks(self):
        """Every layer's block: an :meth:`unstacked` stack's own, else sliced out of the
        stacked arrays (a copy of each layer's parameters where this runs)."""
        if isinstance(self.layers, tuple):
            return self.layers
        dynamic, static = self.per_layer()
        return [eqx.combine(_layer(dynamic, i), static) for i in range(self.num_layers)]


def _layer(dynamic, i: int):
    """Layer ``i``'s parameters out of the stacked ones."""
    return jax.tree_util.tree_map(lambda a: a[i], dynamic)


def _carries(layers) -> bool:
    return bool(getattr(getattr(layers, "attn", None), "carries_between_layers", False))


def _dropped(key, rate):
    return jax.random.bernoulli(jax.random.fold_in(key, 0x4C44), rate)


def _state_indices(tree):
    is_index = lambda x: isinstance(x, eqx.nn.StateIndex)  # noqa: E731
    return [x for x in jax.tree_util.tree_leaves(tree, is_leaf=is_index) if is_index(x)]


def _branches(static, params, kv_mask):
    block = eqx.combine(params, static)

    def f(x):
        return block.attn(block.norms[0](x), kv_mask=kv_mask)

    def g(x):
        return block.ffn(block.norms[1](x))

    return f, g


# kv_mask (bool [B, L] or None) is an ordinary argument: the backward returns None for it
# (booleans have no cotangent).
@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _reversible(static, params, x1, x2, mask):
    def body(carry, p):
        a, b = carry
        f, g = _branches(static, p, mask)
        a = a + f(b)
        b = b + g(a)
        return (a, b), None

    (y1, y2), _ = jax.lax.scan(body, (x1, x2), params)
    return y1, y2


def _reversible_fwd(static, params, x1, x2, mask):
    y1, y2 = _reversible(static, params, x1, x2, mask)
    # Only the outputs are kept: the inputs of every layer are rebuilt in the backward pass.
    return (y1, y2), (params, y1, y2, mask)


def _reversible_bwd(static, res, cotangents):
    params, y1, y2, mask = res
    dy1, dy2 = cotangents

    def body(carry, p):
        y1, y2, dy1, dy2 = carry
        g_out, g_vjp = jax.vjp(lambda p, a: _branches(static, p, mask)[1](a), p, y1)
        x2 = y2 - g_out
        dp_g, da = g_vjp(dy2)
        dy1 = dy1 + da
        f_out, f_vjp = jax.vjp(lambda p, b: _branches(static, p, mask)[0](b), p, x2)
        x1 = y1 - f_out
        dp_f, db = f_vjp(dy1)
        dp = jax.tree_util.tree_map(jnp.add, dp_f, dp_g)
        return (x1, x2, dy1, dy2 + db), dp

    (_, _, dx1, dx2), dparams = jax.lax.scan(body, (y1, y2, dy1, dy2), params, reverse=True)
    return dparams, dx1, dx2, None


_reversible.defvjp(_reversible_fwd, _reversible_bwd)
