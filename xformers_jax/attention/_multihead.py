"""Lifting one-sequence one-head attention to ``[batch, length, heads, dim]`` with ``jax.vmap``."""

from __future__ import annotations

import functools
from typing import Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

# How an argument is laid out relative to batch and heads:
#   None           shared by every batch element and head
#   "batch"        leading axis indexes the batch
#   "heads"        leading axis indexes the (query) heads
#   "batch_heads"  leading axes are [batch, heads]
#   "batch_kv_heads"  leading axes are [batch, kv heads]: shared by the query heads of a group
#                  (what a kind computes per key/value head, e.g. PaTH's transforms of the keys)
_AXES = (None, "batch", "heads", "batch_heads", "batch_kv_heads")

# Keyword arguments of the contract whose layout is known.
# ``batch_index``/``head_index``: the ``b`` and ``h`` of flex attention's score and mask
# functions (``jnp.arange(B)``, ``jnp.arange(H)``), one scalar per call.
_DEFAULT_KWARG_AXES = {"kv_mask": "batch", "q_mask": "batch", "segment_ids": "batch",
                       "batch_index": "batch", "head_index": "heads"}


def _take0(x, axis: int):
    return x[(slice(None),) * axis + (0,)]


def _map_level(f: Callable[..., Any], size: int, in_axes: tuple) -> Callable[..., Any]:
    """``jax.vmap(f, in_axes)``, except over an axis of size 1, which is indexed away and put
    back on the outputs instead.

    A size-1 vmap level is not free on XLA:CPU: measured fwd+bwd at B=1, H=4, D=64 on the
    2-core EPYC, a size-1 group level (k and v unmapped) made causal dense attention at L=2048
    2.7x slower (494 against 180 ms; 960 against 342 ms at B=2) and a size-1 batch level made
    the causal chunked linear attention at L=8192 25-35% slower (150 against 110-118 ms).
    """
    if size != 1:
        return jax.vmap(f, in_axes=in_axes)

    def unit(*xs):
        xs = [x if ax is None else jax.tree_util.tree_map(lambda l, ax=ax: _take0(l, ax), x)
              for x, ax in zip(xs, in_axes)]
        return jax.tree_util.tree_map(lambda o: jnp.expand_dims(o, 0), f(*xs))

    return unit


def multihead(
    fn: Callable[..., Any],
    *,
    arg_axes: Sequence[str | None] = (),
    kwarg_axes: Mapping[str, str | None] | None = None,
) -> Callable[..., Any]:
    """Lifts a one-sequence one-head attention function to batched multi-head inputs.

    The lifted function takes ``q: [B, Lq, H, Dk]``, ``k: [B, Lk, Hkv, Dk]``,
    ``v: [B, Lk, Hkv, Dv]`` and returns ``[B, Lq, H, Dv]``. ``Hkv`` may divide ``H``
    (grouped-query attention; ``Hkv == 1`` is multi-query attention): each group of
    ``H // Hkv`` query heads shares one key/value head, without copying it.

    Other arguments are passed through. ``kv_mask: [B, Lk]``, ``q_mask: [B, Lq]`` (for
    variants that take it, see :mod:`._contract`) and ``segment_ids: [B, L]`` (or a pair) are
    split over the batch; a ``key`` is split so every batch element and head draws
    its own randomness. Extra positional arguments are shared unless ``arg_axes`` says
    otherwise; keyword arguments likewise through ``kwarg_axes`` (a callable bias that is a
    pytree, e.g. an ``eqx.Module`` with per-head slopes, can be mapped over ``"heads"``).

    When ``fn`` returns a tuple (e.g. ``(out, lse)``), the first element is laid out as
    ``[B, Lq, H, Dv]`` and the others as ``[B, H, ...]``.

    Args:
      fn: an attention function obeying the contract of :mod:`xformers_jax.attention`.
      arg_axes: layout of each extra positional argument: ``None`` (shared), ``"batch"``,
        ``"heads"``, ``"batch_heads"`` (leading axes of the argument) or ``"batch_kv_heads"``
        (leading axes ``[B, Hkv]``: one per key/value head, shared by its query group as
        ``k`` and ``v`` are; what ``fn`` computes from such arguments alone is computed once
        per group).
      kwarg_axes: the same for keyword arguments; merged over the defaults
        ``{"kv_mask": "batch", "q_mask": "batch", "segment_ids": "batch", "batch_index":
        "batch", "head_index": "heads"}`` (the last two: flex attention's ``b`` and ``h``).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from xformers_jax.attention import dot_product_attention, multihead
      >>> q = k = v = jnp.ones((2, 16, 4, 8))
      >>> multihead(dot_product_attention)(q, k, v, causal=True).shape
      (2, 16, 4, 8)
    """
    arg_axes = tuple(arg_axes)
    kw_axes = dict(_DEFAULT_KWARG_AXES)
    kw_axes.update(kwarg_axes or {})
    for axes in (*arg_axes, *kw_axes.values()):
        if axes not in _AXES:
            raise ValueError(f"multihead: axis layout must be one of {_AXES}, got {axes!r}")
    fn_name = getattr(fn, "__name__", repr(fn))

    @functools.wraps(fn)
    def lifted(q, k, v, *args, key=None, **kwargs):
        q, k, v = jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)
        if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
            raise ValueError(
                f"multihead({fn_name}): q, k, v must have rank 4 ([batch, length, heads, dim]) "
                f"but got q{q.shape}, k{k.shape}, v{v.shape}"
            )
        b, _, h, _ = q.shape
        hkv = k.shape[2]
        if k.shape[0] != b or v.shape[0] != b or v.shape[2] != hkv:
            raise ValueError(
                f"multihead({fn_name}): batch and kv-head sizes must agree but got "
                f"q{q.shape}, k{k.shape}, v{v.shape}"
            )
        if h % hkv:
            raise ValueError(
                f"multihead({fn_name}): the {h} query heads must be a multiple of the {hkv} "
                f"key/value heads (grouped-query attention); got q{q.shape}, k{k.shape}"
            )
        if len(args) > len(arg_axes) and arg_axes:
            raise ValueError(
                f"multihead({fn_name}): got {len(args)} extra positional arguments but "
                f"arg_axes describes {len(arg_axes)}"
            )
        groups = h // hkv
        pos_axes = arg_axes if arg_axes else (None,) * len(args)

        def split(x, axes, what):
            """Brings x to leading axes [B, Hkv, G] where it is mapped, returning (x, in_axes)."""
            if axes is None:
                return x, (None, None, None)
            # NumPy leaves become JAX arrays before vmap: a NumPy array batched by vmap reaches
            # a custom_vjp (the tiled kernel's) under jit or scan as a raw constant, which
            # JAX's tracer rejects ("non-canonical constant").
            x = jax.tree_util.tree_map(
                lambda leaf: jnp.asarray(leaf) if isinstance(leaf, np.ndarray) else leaf, x)
            leaves = jax.tree_util.tree_leaves(x)
            lead = {"batch": (b,), "heads": (h,), "batch_heads": (b, h),
                    "batch_kv_heads": (b, hkv)}[axes]
            for leaf in leaves:
                if tuple(jnp.shape(leaf)[: len(lead)]) != lead:
                    raise ValueError(
                        f"multihead({fn_name}): {what} is laid out as {axes!r}, so its leading "
                        f"axes must be {lead}, but a leaf has shape {jnp.shape(leaf)}"
                    )
            if axes == "batch":
                return x, (0, None, None)
            if axes == "batch_kv_heads":
                return x, (0, 0, None)

            def to_groups(leaf):
                shape = jnp.shape(leaf)
                n = len(lead) - 1
                return jnp.reshape(leaf, shape[:n] + (hkv, groups) + shape[n + 1 :])

            x = jax.tree_util.tree_map(to_groups, x)
            return x, ((None, 0, 0) if axes == "heads" else (0, 0, 0))

        mapped_args, args_in = [], []
        for i, (a, axes) in enumerate(zip(args, pos_axes)):
            a, ax = split(a, axes, f"positional argument {i}")
            mapped_args.append(a)
            args_in.append(ax)
        kw_names = [n for n, val in kwargs.items() if val is not None and kw_axes.get(n)]
        kw_mapped = {}
        for n in kw_names:
            kw_mapped[n], ax = split(kwargs[n], kw_axes[n], f"keyword argument {n!r}")
            args_in.append(ax)
        static_kwargs = {n: val for n, val in kwargs.items() if n not in kw_mapped}
        if key is not None:
            keys = jax.random.split(key, b * h).reshape(b, hkv, groups, *key.shape)
            keys_in = (0, 0, 0)
        else:
            keys, keys_in = None, (None, None, None)

        def one(q1, k1, v1, key1, *rest):
            pos = rest[: len(mapped_args)]
            kw = dict(zip(kw_names, rest[len(mapped_args) :]))
            if key1 is not None:
                kw["key"] = key1
            return fn(q1, k1, v1, *pos, **kw, **static_kwargs)

        qg = q.reshape(q.shape[0], q.shape[1], hkv, groups, q.shape[3])
        # Innermost: query heads of one group share k and v. Then kv heads, then batch.
        f = _map_level(one, groups, (1, None, None, keys_in[2], *[a[2] for a in args_in]))
        f = _map_level(f, hkv, (1, 1, 1, keys_in[1], *[a[1] for a in args_in]))
        f = _map_level(f, b, (0, 0, 0, keys_in[0], *[a[0] for a in args_in]))
        result = f(qg, k, v, keys, *mapped_args, *kw_mapped.values())

        def merge_heads(x):  # [B, Hkv, G, ...] -> [B, H, ...]
            return x.reshape(x.shape[0], h, *x.shape[3:])

        if isinstance(result, tuple):
            out, *aux = result
            aux = [jax.tree_util.tree_map(merge_heads, a) for a in aux]
            return (jnp.moveaxis(merge_heads(out), 1, 2), *aux)
        return jnp.moveaxis(merge_heads(result), 1, 2)

    return lifted
