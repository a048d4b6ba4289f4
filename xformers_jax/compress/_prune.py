"""Pruning: unstructured magnitude pruning (per layer or global) with the gradual schedule of
Zhu & Gupta, lottery-ticket rewinding, attention-head pruning by importance and layer pruning.

* Magnitude pruning keeps the largest ``|w|`` of each prunable matrix (``scope="layer"``; a
  layer stack's matrices are pruned per layer) or of all of them pooled (``"global"``).
* Gradual schedule (Zhu & Gupta, 2017, "To prune, or not to prune"): at steps
  ``t = t0 + k * dt`` up to ``t0 + n * dt`` the sparsity is
  ``s_t = s_f + (s_i - s_f) * (1 - (t - t0) / (n * dt))**3``; masks only ever shrink.
* Lottery tickets with rewinding (Frankle & Carbin, 2019, "The Lottery Ticket Hypothesis";
  Frankle et al., 2020, "Linear Mode Connectivity and the Lottery Ticket Hypothesis"): the
  mask found on the trained weights applied to the weights saved early in training.
* Head importance (Michel et al., 2019, "Are Sixteen Heads Really Better than One?"):
  ``I_h = E_x |dL(x)/d xi_h|`` for a gate ``xi_h`` on head ``h``'s output, which equals
  ``|sum(wo_h * dL/dwo_h)|`` over the rows of the output projection that head ``h`` feeds,
  normalised per layer; pruning a head zeroes those rows.
* Layer pruning (Fan et al., 2020, "Reducing Transformer Depth on Demand with Structured
  Dropout"): keep a subset of a layer stack's layers (e.g. every other one).

Masks are pytrees shaped like ``eqx.filter(model, eqx.is_inexact_array)`` with a boolean array
(True keeps) for every parameter. :func:`prune_transform` wraps an optax optimizer so that the
masks live in the optimizer state (checkpointed with it) and every update leaves pruned weights
exactly zero.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

from ._quant import MATMUL_WEIGHTS, get_path

SCOPES = ("layer", "global")


def gradual_sparsity(step, final: float, *, initial: float = 0.0, begin: int = 0,
                     end: int = 1000, frequency: int = 100) -> jax.Array:
    """Zhu & Gupta's cubic schedule: the sparsity in force at ``step`` (held between pruning
    steps ``begin + k * frequency``; ``initial`` before ``begin``, ``final`` from ``end``)."""
    if not 0 <= initial <= final < 1:
        raise ValueError(f"gradual_sparsity: need 0 <= initial <= final < 1, got {initial}, "
                         f"{final}")
    if end <= begin or frequency < 1:
        raise ValueError(f"gradual_sparsity: need begin < end and frequency >= 1, got "
                         f"begin={begin}, end={end}, frequency={frequency}")
    step = jnp.asarray(step)
    last = begin + (jnp.maximum(step - begin, 0) // frequency) * frequency
    frac = jnp.clip((last - begin) / (end - begin), 0.0, 1.0)
    s = final + (initial - final) * (1.0 - frac) ** 3
    return jnp.where(step < begin, initial, s).astype(jnp.float32)


def _is_prunable(path, leaf, names):
    last = path[-1] if path else None
    return (isinstance(last, jax.tree_util.GetAttrKey) and last.name in names
            and eqx.is_inexact_array(leaf) and leaf.ndim >= 2)


def _keep_top(mag, sparsity):
    """True for all but the ``floor(sparsity * n)`` smallest entries of ``mag`` (ties broken by
    position, so exactly that many are pruned)."""
    flat = mag.reshape(-1)
    k = jnp.floor(sparsity * flat.size).astype(jnp.int32)
    rank = jnp.argsort(jnp.argsort(flat, stable=True), stable=True)
    return (rank >= k).reshape(mag.shape)


def ones_masks(model):
    """All-True masks for every floating-point parameter of ``model``."""
    return jax.tree.map(lambda p: jnp.ones(p.shape, bool), eqx.filter(model, eqx.is_inexact_array))


def magnitude_masks(model, sparsity, *, scope: str = "layer", names=MATMUL_WEIGHTS,
                    masks=None):
    """Masks pruning the smallest magnitudes of ``model``'s matrices named in ``names``.

    ``scope="layer"``: ``floor(sparsity * size)`` entries of each matrix (of each layer's matrix
    in a stack: a 3-D stacked weight is pruned per leading index); ``"global"``: of all
    prunable entries pooled. ``masks`` (optional): previous masks, kept pruned (the pruned
    weights are zero anyway). Non-prunable parameters get all-True masks.
    """
    if scope not in SCOPES:
        raise ValueError(f"magnitude_masks: scope must be one of {SCOPES}, got {scope!r}")
    params = eqx.filter(model, eqx.is_inexact_array)
    flat, treedef = jax.tree_util.tree_flatten_with_path(params)
    prev = (jax.tree_util.tree_leaves(masks) if masks is not None
            else [None] * len(flat))
    if len(prev) != len(flat):
        raise ValueError(f"magnitude_masks: {len(prev)} masks for {len(flat)} parameters")
    sparsity = jnp.asarray(sparsity, jnp.float32)
    out = [jnp.ones(w.shape, bool) for _, w in flat]
    chosen = [i for i, (p, w) in enumerate(flat) if _is_prunable(p, w, names)]
    mags = {}
    for i in chosen:
        m = jnp.abs(flat[i][1].astype(jnp.float32))
        mags[i] = m if prev[i] is None else jnp.where(prev[i], m, -1.0)
    if scope == "layer":
        for i in chosen:
            m = mags[i]
            out[i] = (jax.vmap(lambda a: _keep_top(a, sparsity))(m) if m.ndim == 3
                      else _keep_top(m, sparsity))
    elif chosen:
        pooled = jnp.concatenate([mags[i].reshape(-1) for i in chosen])
        keep = _keep_top(pooled, sparsity)
        start = 0
        for i in chosen:
            n = mags[i].size
            out[i] = keep[start:start + n].reshape(mags[i].shape)
            start += n
    if masks is not None:
        out = [o & p for o, p in zip(out, prev)]
    return jax.tree_util.tree_unflatten(treedef, out)


def apply_masks(model, masks):
    """``model`` with every masked parameter entry set to zero."""
    params, rest = eqx.partition(model, eqx.is_inexact_array)
    params = jax.tree.map(lambda p, m: jnp.where(m, p, jnp.zeros((), p.dtype)), params, masks)
    return eqx.combine(params, rest)


def sparsity_report(model, names=MATMUL_WEIGHTS) -> dict[str, float | list[float]]:
    """The fraction of exact zeros of each prunable matrix (a list per layer for stacked
    weights) and ``"total"`` over all of them."""
    out, zeros, size = {}, 0, 0
    for path, w in jax.tree_util.tree_flatten_with_path(eqx.filter(model, eqx.is_array))[0]:
        if not _is_prunable(path, w, names):
            continue
        z = np.asarray(w) == 0  # on the host: no program compiled per weight shape
        zeros, size = zeros + int(z.sum()), size + w.size
        key = jax.tree_util.keystr(path)
        out[key] = ([float(v) for v in z.reshape(w.shape[0], -1).mean(1)] if w.ndim == 3
                    else float(z.mean()))
    out["total"] = zeros / max(size, 1)
    return out


# -- pruning inside the optimizer ----------------------------------------------------------------

class PruneState(NamedTuple):
    count: jax.Array
    masks: optax.Params
    inner: optax.OptState
    # The weights saved for lottery-ticket rewinding (``prune_transform(rewind_step=...)``).
    early: optax.Params | None = None


def _is_placeholder(params):
    # optax.tree_map_params initialises with a placeholder for the parameters: the masks then
    # stand in the parameters' place, so they are sharded like them.
    return type(params).__name__ == "_ParamsPlaceholder"


def prune_transform(inner: optax.GradientTransformation, *, schedule: Callable | None = None,
                    scope: str = "layer", names=MATMUL_WEIGHTS, masks=None,
                    rewind_step: int | None = None) -> optax.GradientTransformation:
    """``inner`` with pruning: gradients of pruned weights are zeroed, and after each update the
    weights are re-masked, so pruned weights stay exactly zero (also across a checkpoint
    resume: the masks are part of the optimizer state).

    Args:
      inner: the optimizer.
      schedule: ``schedule(step) -> sparsity`` (e.g. a partial of :func:`gradual_sparsity`);
        when the sparsity changes the masks are recomputed from the updated weights by
        magnitude (``scope``, ``names`` as in :func:`magnitude_masks`). None: fixed masks.
      masks: the initial masks (default all True), e.g. a lottery ticket's or pruned heads'.
      rewind_step: lottery-ticket rewinding (Frankle et al., 2020): the weights after this many
        updates (0: the initial weights) are kept in the state, and whenever the schedule
        prunes, the masks are found by magnitude on the trained weights and the weights are
        reset to the kept ones under them (training then goes on from there; the inner
        optimizer's state is kept). With a one-step schedule this is one-shot pruning with
        rewinding, with a staircase iterative magnitude pruning. None: no rewinding.
    """
    if scope not in SCOPES:
        raise ValueError(f"prune_transform: scope must be one of {SCOPES}, got {scope!r}")
    if rewind_step is not None and (rewind_step < 0 or schedule is None):
        raise ValueError(f"prune_transform: rewind_step must be >= 0 and needs a schedule, got "
                         f"rewind_step={rewind_step}, schedule={schedule}")

    def init(params):
        m = params if _is_placeholder(params) else (
            # a copy: a train step donates its state, which must not delete the caller's masks
            ones_masks(params) if masks is None else jax.tree.map(jnp.array, masks))
        early = None if rewind_step is None else (
            params if _is_placeholder(params) else jax.tree.map(jnp.array, params))
        return PruneState(jnp.zeros((), jnp.int32), m, inner.init(params), early)

    def update(grads, state, params=None):
        if params is None:
            raise ValueError("prune_transform needs the parameters in update()")
        grads = jax.tree.map(lambda g, m: jnp.where(m, g, jnp.zeros((), g.dtype)),
                             grads, state.masks)
        updates, inner_state = inner.update(grads, state.inner, params)
        new = optax.apply_updates(params, updates)
        new_masks, early = state.masks, state.early
        if schedule is not None:
            before, now = schedule(state.count), schedule(state.count + 1)
            recomputed = magnitude_masks(new, now, scope=scope, names=names, masks=state.masks)
            new_masks = jax.tree.map(lambda a, b: jnp.where(now > before, a, b),
                                     recomputed, state.masks)
            if rewind_step is not None:
                if rewind_step > 0:  # the weights after ``rewind_step`` updates
                    early = jax.tree.map(lambda n, e: jnp.where(state.count + 1 == rewind_step,
                                                                n, e), new, early)
                new = jax.tree.map(lambda e, n: jnp.where(now > before, e, n), early, new)
        new = jax.tree.map(lambda p, m: jnp.where(m, p, jnp.zeros((), p.dtype)), new, new_masks)
        updates = jax.tree.map(lambda n, p: n - p, new, params)
        return updates, PruneState(state.count + 1, new_masks, inner_state, early)

    return optax.GradientTransformation(init, update)


def masks_of(opt_state):
    """The masks held by a :func:`prune_transform` state (searched through chained states)."""
    found = []

    def visit(s):
        if isinstance(s, PruneState):
            found.append(s.masks)
        elif isinstance(s, (tuple, list)):
            for x in s:
                visit(x)
    visit(opt_state)
    if not found:
        raise ValueError("masks_of: no prune_transform state in this optimizer state")
    return found[0]


# -- lottery tickets --------------------------------------------------------------------------

def lottery_ticket(trained, early, sparsity: float, *, scope: str = "layer",
                   names=MATMUL_WEIGHTS):
    """``(rewound, masks)``: masks by magnitude on the ``trained`` weights, applied to ``early``
    (the weights saved at initialisation or early in training, same structure)."""
    masks = magnitude_masks(trained, sparsity, scope=scope, names=names)
    return rewind(early, masks), masks


def rewind(early, masks):
    """The saved weights ``early`` under ``masks``: where a mask keeps a weight, exactly its
    saved value."""
    return apply_masks(early, masks)


# -- heads and layers -------------------------------------------------------------------------

def _wo_paths(model):
    return [p for p, w in jax.tree_util.tree_flatten_with_path(
        eqx.filter(model, eqx.is_inexact_array))[0]
        if isinstance(p[-1], jax.tree_util.GetAttrKey) and p[-1].name == "wo"]


def _num_heads(model, path):
    attn = get_path(model, path[:-1])
    return attn.num_heads


@eqx.filter_jit
def _head_scores(model, loss_fn, paths, examples):
    def one(example):
        batch = jax.tree.map(lambda a: a[None], example)
        g = eqx.filter_grad(loss_fn)(model, batch)
        out = []
        for p in paths:
            wo, gw = get_path(model, p), get_path(g, p)
            prod = (wo * gw).reshape(*wo.shape[:-2], _num_heads(model, p), -1)
            out.append(jnp.abs(prod.sum(-1)))
        return out

    return jax.lax.map(one, examples)


def head_importance(model, loss_fn: Callable, examples, *, normalize: bool = True):
    """Michel et al.'s head importance for every attention layer.

    Args:
      model: an ``nn`` model.
      loss_fn: ``loss_fn(model, example_batch) -> scalar`` on a batch of ONE example (the
        leading axis of each array of ``examples`` is mapped over: per-example gradients).
      examples: a pytree of arrays ``[N, ...]``.
      normalize: divide each layer's importances by their l2 norm (as in the paper).

    Returns:
      ``{path of wo: float32[..., num_heads]}`` (a layer stack's wo gives ``[layers, heads]``).
    """
    paths = _wo_paths(model)
    if not paths:
        raise ValueError("head_importance: the model has no attention output projections (wo)")
    scores = _head_scores(model, loss_fn, tuple(paths), examples)
    result = {}
    for p, s in zip(paths, scores):
        imp = s.mean(0)
        if normalize:
            imp = imp / jnp.maximum(jnp.linalg.norm(imp, axis=-1, keepdims=True), 1e-12)
        result[jax.tree_util.keystr(p)] = imp
    return result


def head_masks(model, importance: dict, fraction: float):
    """Masks removing the ``round(fraction * total heads)`` least important heads over all
    layers (ties by position): the rows of each pruned head's output projection are masked, so
    the head contributes nothing. Returns ``(masks, {path: bool[..., heads] kept})``."""
    if not 0 <= fraction < 1:
        raise ValueError(f"head_masks: fraction must be in [0, 1), got {fraction}")
    keys = list(importance)
    pooled = jnp.concatenate([importance[k].reshape(-1) for k in keys])
    k = int(round(fraction * pooled.size))
    rank = jnp.argsort(jnp.argsort(pooled, stable=True), stable=True)
    keep_all = rank >= k
    masks = ones_masks(model)
    kept, start = {}, 0
    paths = {jax.tree_util.keystr(p): p for p in _wo_paths(model)}
    for key in keys:
        n = importance[key].size
        keep = keep_all[start:start + n].reshape(importance[key].shape)
        start += n
        kept[key] = keep
        wo = get_path(model, paths[key])
        h = keep.shape[-1]
        rows = jnp.repeat(keep, wo.shape[-2] // h, axis=-1)[..., None]
        masks = eqx.tree_at(lambda m: get_path(m, paths[key]), masks,
                            jnp.broadcast_to(rows, wo.shape))
    return masks, kept


def _stacks(model, who):
    from ..nn import LayerStack

    is_stack = lambda x: isinstance(x, LayerStack)  # noqa: E731
    if not any(is_stack(x) for x in jax.tree_util.tree_leaves(model, is_leaf=is_stack)):
        raise ValueError(f"{who}: the model has no LayerStack")
    return is_stack


def with_layerdrop(model, rate: float):
    """``model`` with every layer stack trained under LayerDrop at ``rate`` (Fan et al., 2020:
    each layer skipped with probability ``rate`` in training calls), so that layers can be
    dropped at inference (:func:`drop_layers`) with little loss. The parameters are
    unchanged."""
    is_stack = _stacks(model, "with_layerdrop")

    def one(stack):
        if not 0.0 <= rate < 1.0 or (rate and stack.reversible):
            raise ValueError(f"with_layerdrop: rate must be in [0, 1) (and 0 for reversible "
                             f"stacks), got {rate}")
        new = object.__new__(type(stack))
        for name in stack.__dataclass_fields__:
            object.__setattr__(new, name, getattr(stack, name))
        object.__setattr__(new, "layerdrop", float(rate))
        return new

    return jax.tree.map(lambda x: one(x) if is_stack(x) else x, model, is_leaf=is_stack)


def drop_layers(model, keep):
    """``model`` with only the layers ``keep`` (indices, in order) of its layer stack(s), e.g.
    ``range(0, n, 2)`` for every other layer (DistilBERT's student initialisation)."""
    keep = [int(i) for i in keep]
    is_stack = _stacks(model, "drop_layers")

    def cut(stack):
        if stack.sharing != "none":
            raise ValueError(f"drop_layers: a stack with sharing={stack.sharing!r} has one set "
                             "of parameters; there are no layers to drop")
        if not keep or min(keep) < 0 or max(keep) >= stack.num_layers:
            raise ValueError(f"drop_layers: layer indices {keep} out of range for "
                             f"{stack.num_layers} layers")
        return stack.prune(keep)

    return jax.tree.map(lambda x: cut(x) if is_stack(x) else x, model, is_leaf=is_stack)
