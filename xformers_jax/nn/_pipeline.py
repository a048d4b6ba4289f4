"""GPipe pipeline parallelism (Huang et al., 2019, "GPipe: Efficient Training of Giant Neural
Networks using Pipeline Parallelism"): the layers are split into ``S`` consecutive stages over
the ``stage`` mesh axis, the batch into ``M`` micro-batches, and at tick ``t`` stage ``s``
runs micro-batch ``t - s``, handing its output to stage ``s + 1`` with a ``ppermute``. All
``M`` micro-batches pass through in ``M + S - 1`` ticks, so each device idles for the bubble
fraction ``(S - 1) / (M + S - 1)`` of them (:func:`bubble_fraction`). Gradients come from
differentiating the forward schedule (the ``ppermute`` transposes to the reverse shift), i.e.
GPipe's all-forward-then-all-backward order; activations of every tick are kept.

Auxiliary outputs of the layers (a mixture of experts' router losses, tokens dropped, expert
load) are computed per micro-batch and averaged over the micro-batches, layer by layer: a
micro-batch is a routing group, as in GShard's grouped dispatch (``experts.grouped_moe``
averages its groups' aux the same way). Capacity and balance statistics are those of each
micro-batch, so a pipelined MoE stack equals the unpipelined stack run on each micro-batch
separately (not on the whole batch at once, unless dispatch is dropless and there is one
micro-batch).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from ..axes import STAGE as STAGE  # the mesh axis the stages are split over
from ._carry import Carry


def bubble_fraction(num_stages: int, num_microbatches: int) -> float:
    """``(S - 1) / (M + S - 1)``: the fraction of ticks a stage idles."""
    return (num_stages - 1) / (num_microbatches + num_stages - 1)


def gpipe(stage_fn, stage_params, x, *, mesh, num_microbatches: int, axis: str = STAGE,
          with_aux: bool = False):
    """Runs ``x`` through ``S`` stages: ``y = f_{S-1}(... f_0(x))`` with
    ``f_s = stage_fn(stage_params[s], .)`` (a pytree with a leading stage axis ``S`` = the size
    of ``axis``), pipelined over ``num_microbatches`` equal micro-batches of the leading batch
    axis of ``x``. ``stage_fn`` must keep the shape of its input. Returns ``y`` (replicated).

    With ``with_aux``, ``stage_fn`` returns ``(y, aux)`` (a pytree of arrays) and the result is
    ``(y, aux)`` with each leaf the mean over micro-batches of that stage's aux, stacked on a
    leading stage axis ``[S, ...]``. Idle ticks' aux is not counted."""
    s_count = dict(mesh.shape).get(axis, 1)
    leaves = jax.tree.leaves(stage_params)
    if not leaves or any(a.shape[0] != s_count for a in leaves):
        raise ValueError(f"gpipe: stage_params need a leading axis of {s_count} (the "
                         f"{axis!r} mesh axis), got {[a.shape for a in leaves]}")
    m = num_microbatches
    if x.shape[0] % m:
        raise ValueError(f"gpipe: batch {x.shape[0]} is not divisible by "
                         f"num_microbatches={m}")
    xs = x.reshape(m, x.shape[0] // m, *x.shape[1:])
    perm = [(i, i + 1) for i in range(s_count - 1)]

    def body(params, xs):
        params = jax.tree.map(lambda a: a[0], params)
        s = jax.lax.axis_index(axis)
        last = s == s_count - 1

        def tick(carry, t):
            held, outs, aux_sum = carry
            inp = jnp.where(s == 0, xs[jnp.minimum(t, m - 1)], held)
            out = stage_fn(params, inp)
            if with_aux:
                out, aux = out
                busy = (t >= s) & (t - s < m)  # this stage holds micro-batch t - s
                aux_sum = jax.tree.map(lambda a, b: a + jnp.where(busy, b, 0).astype(a.dtype),
                                       aux_sum, aux)
            i = t - (s_count - 1)
            write = last & (i >= 0)
            outs = outs.at[jnp.maximum(i, 0)].set(
                jnp.where(write, out, outs[jnp.maximum(i, 0)]))
            held = jax.lax.ppermute(out, axis, perm) if perm else out
            return (held, outs, aux_sum), None

        aux0 = None
        if with_aux:
            shapes = jax.eval_shape(stage_fn, params, xs[0])[1]
            aux0 = jax.tree.map(lambda a: jnp.zeros(a.shape, jnp.promote_types(
                a.dtype, jnp.float32)), shapes)
        init = (jnp.zeros_like(xs[0]), jnp.zeros_like(xs), aux0)
        (_, outs, aux_sum), _ = jax.lax.scan(tick, init, jnp.arange(m + s_count - 1))
        y = jax.lax.psum(jnp.where(last, outs, 0), axis)
        if not with_aux:
            return y
        return y, jax.tree.map(lambda a: (a / m)[None], aux_sum)

    out_specs = (P(), P(axis)) if with_aux else P()
    fn = jax.shard_map(body, mesh=mesh, in_specs=(P(axis), P()), out_specs=out_specs,
                       axis_names=frozenset({axis}), check_vma=False)
    if not with_aux:
        return fn(stage_params, xs).reshape(x.shape)
    y, aux = fn(stage_params, xs)
    return y.reshape(x.shape), aux


def pipeline_layers(stack, x, carry: Carry | None = None, *, mesh, num_microbatches: int,
                    kv_mask=None, axis: str = STAGE, key=None, inference: bool = False):
    """An ``nn.LayerStack`` (``num_layers`` divisible by the stage count, no stateful layers)
    run as a GPipe pipeline over ``axis``: stage ``s`` runs layers
    ``[s * n / S, (s + 1) * n / S)``, each through the stack's own step body
    (``LayerStack.step``). ``x [B, L, dim]`` -> ``[B, L, dim]`` (equal to
    ``stack(x, kv_mask=kv_mask)``; ``kv_mask [B, L]`` is split into the same micro-batches).
    With a ``key`` (training: dropout, router noise, LayerDrop) layer ``i`` gets the ``i``-th
    of ``split(key, num_layers)``, shared by the micro-batches. With a ``carry``
    (``nn.Carry``, holding no state or memory) the result is ``(y, carry)`` whose ``aux`` is
    every layer's auxiliary outputs on a leading layer axis, as the stack returns them, each
    the mean over micro-batches (see the module docstring)."""
    if carry is not None and (carry.state is not None or carry.memory is not None):
        raise ValueError("pipeline_layers: a pipelined stack carries no state or memory")
    s_count = dict(mesh.shape).get(axis, 1)
    if stack.num_layers % s_count:
        raise ValueError(f"pipeline_layers: {stack.num_layers} layers do not split into "
                         f"{s_count} stages")
    dynamic, static = stack.per_layer()
    per = stack.num_layers // s_count
    keys = None if key is None else jax.random.key_data(jax.random.split(key,
                                                                         stack.num_layers))
    staged = jax.tree.map(lambda a: a.reshape(s_count, per, *a.shape[1:]),
                          (dynamic, jnp.arange(stack.num_layers), keys))
    packed = x if kv_mask is None else jnp.concatenate(
        [x, kv_mask[..., None].astype(x.dtype)], -1)
    with_aux = carry is not None

    def stage_fn(params, h):
        h, m = (h, None) if kv_mask is None else (h[..., :-1], h[..., -1] > 0.5)
        step = stack.step(static, kv_mask=m, inference=inference)

        def layer(xc, ptk):
            p, t, k = ptk
            k = None if k is None else jax.random.wrap_key_data(k)
            xc, (_, _, aux) = step(xc, (p, t, k, None, None))
            return xc, aux

        (h, _), aux = jax.lax.scan(layer, (h, None), params)
        h = h if m is None else jnp.concatenate([h, m[..., None].astype(h.dtype)], -1)
        return (h, aux) if with_aux else h

    y = gpipe(stage_fn, staged, packed, mesh=mesh, num_microbatches=num_microbatches,
              axis=axis, with_aux=with_aux)
    if with_aux:
        y, aux = y
        aux = jax.tree.map(lambda a: a.reshape(stack.num_layers, *a.shape[2:]), aux)
    y = y if kv_mask is None else y[..., :-1]
    return (y, Carry(aux=aux)) if with_aux else y


def microbatches_for(batch: int, stages: int) -> int:
    """The default micro-batch count of a pipelined stack: ``2 S`` when it divides the batch
    (bubble ``(S - 1) / (3 S - 1)``), else ``S``; raises when neither does."""
    for m in (2 * stages, stages):
        if batch % m == 0:
            return m
    raise ValueError(f"pipeline: batch {batch} is divisible by neither 2 x {stages} nor "
                     f"{stages} stages' micro-batches")


def stack_on_stages(stack, x, carry: Carry, *, kv_mask=None, context=None, context_mask=None,
                    positions=None, key=None, inference=False, tokens=None,
                    segment_ids=None, num_microbatches=None):
    """``LayerStack.__call__`` under an active mesh whose ``stage`` axis is larger than 1: the
    stack runs as :func:`pipeline_layers` with :func:`microbatches_for` micro-batches, so a
    trainer whose ``mesh`` config names a ``stage`` size pipelines its model. Returns ``(y,
    carry)``. Supports stacks of blocks whose inputs are the activations and their mask
    (raises for state, memory, cross attention, positions, packed rows (segment ids) and
    reversible stacks; token ids
    do not reach the stages, so a hash-routed FFN raises for want of them). A mixture of
    experts' auxiliary outputs are per micro-batch, averaged (see the module docstring)."""
    from ..axes import activated, active

    bad = [name for name, on in (
        ("stateful layers", carry.state is not None), ("memory", carry.memory is not None),
        ("cross attention", context is not None), ("positions", positions is not None),
        ("segment ids", segment_ids is not None), ("reversible", stack.reversible)) if on]
    if bad:
        raise ValueError(f"LayerStack on a 'stage' mesh axis (GPipe) does not support {bad}")
    mesh = active().mesh
    m = num_microbatches or microbatches_for(x.shape[0], dict(mesh.shape)[STAGE])
    # Inside the stage shard_map the blocks' activation constraints are left to XLA (the
    # logical rules name axes of the whole mesh, of which 'stage' is manual there).
    with activated(None):
        return pipeline_layers(stack, x, Carry(), mesh=mesh, num_microbatches=m,
                               kv_mask=kv_mask, key=key, inference=inference)
