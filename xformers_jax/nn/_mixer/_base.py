"""What every token mixer module shares: the :class:`MixerModule` interface a block calls, the
state space parameter groups of the optimizer, and small helpers of the mixer modules. The
mixers are named by ``nn.MixerSpec`` (the one slot registry, :mod:`.._slots`); each module
declares the kinds it implements with ``nn.implements``.
"""

from __future__ import annotations

import math

import equinox as eqx
import jax
import jax.numpy as jnp

from .._cache import RecurrentCache


class MixerModule(eqx.Module):
    """What a block needs from a mixer: ``mixer(x [B, L, dim], kv_mask=bool[B, L] | None,
    positions=None, key=None) -> [B, L, dim]`` (zero at padded positions; a mixer whose kind
    honours segment ids, ``Kind.segments``, also takes ``segment_ids=int[B, L]`` for packed
    rows and keeps each document's outputs its own) and, for mixers
    that decode, ``init_cache(batch, max_len, dtype)`` and ``decode(x [B, 1, dim], cache) ->
    (y, cache)``. Mixers keep no ``eqx.nn.State`` (``state_index`` is None)."""

    state_index = None  # read by TransformerBlock like MultiHeadAttention's

    def init_cache(self, batch: int, max_len: int, dtype=jnp.float32):
        raise NotImplementedError(f"{type(self).__name__} has no decoding cache (its mixer "
                                  "is not a recurrence)")

    def decode(self, x, cache):
        raise NotImplementedError(f"{type(self).__name__} cannot decode step by step")

    def sequence_problem(self) -> str | None:
        return (f"mixer {type(self).__name__} has no sequence-parallel form")


# -- shared pieces of the mixer modules ---------------------------------------------------------

# Field names of state space parameters (discretisation steps, state matrices, input
# matrices): the optimizer gives them their own learning rate and no weight decay (Gu et al.
# 2022; Gu and Dao 2023 keep A_log, D and dt out of weight decay).
SSM_PARAMETERS = frozenset({"log_dt", "log_a_re", "a_im", "b_re", "b_im", "a_log", "dt_bias"})


def ssm_parameters(tree):
    """A tree of bools like ``tree``: True for the arrays of state space parameters (fields
    named in :data:`SSM_PARAMETERS`)."""
    def label(path, _):
        return any(isinstance(p, jax.tree_util.GetAttrKey) and p.name in SSM_PARAMETERS
                   for p in path)

    return jax.tree_util.tree_map_with_path(label, tree)


def dense(key, fan_in, fan_out):
    return jax.random.normal(key, (fan_in, fan_out)) / jnp.sqrt(fan_in)


def log_uniform(key, shape, low, high):
    """``log`` of step sizes drawn log-uniformly in ``[low, high]`` (S4's ``dt_min/dt_max``)."""
    if not 0 < low <= high:
        raise ValueError(f"need 0 < dt_min <= dt_max, got dt_min={low}, dt_max={high}")
    u = jax.random.uniform(key, shape)
    return jnp.log(low) + u * (jnp.log(high) - jnp.log(low))


def s4d_lin(shape):
    """S4D-Lin's diagonal state matrix (Gu et al. 2022): ``(log_a_re, a_im)`` of shape
    ``shape`` (last axis the ``N/2`` states), ``A_n = -1/2 + i pi n``."""
    return (jnp.full(shape, math.log(0.5)),
            jnp.broadcast_to(math.pi * jnp.arange(shape[-1], dtype=jnp.float32), shape))


def zero_padded(y, kv_mask):
    if kv_mask is None:
        return y
    return jnp.where(kv_mask[:, :, None], y, jnp.zeros((), y.dtype))


def check_mask(name, x, kv_mask):
    """``x`` with its padded positions set to zero by a select, after checking the shapes:
    every mixer starts from it, so no content of a padded position (NaN and infinities
    included) reaches a real output or gradient through a product with a zero mask."""
    if x.ndim != 3:
        raise ValueError(f"{name}: x must be [B, L, dim], got shape {x.shape}")
    if kv_mask is not None and kv_mask.shape != x.shape[:2]:
        raise ValueError(f"{name}: kv_mask must be bool[B, L] = {list(x.shape[:2])}, got shape "
                         f"{kv_mask.shape}")
    return zero_padded(x, kv_mask)


def both_ways(fn, arrays, kv_mask, causal, segment_ids=None):
    """``fn(*arrays, kv_mask)`` over one sequence, plus the same run from the last position
    when not causal (bidirectional forms: the backward pass's outputs flipped back). With
    ``segment_ids int[L]`` (packed documents) ``fn`` also gets ``segment_ids=`` (flipped with
    the arrays in the backward run)."""
    def run(arrays, m, seg):
        return fn(*arrays, m) if seg is None else fn(*arrays, m, segment_ids=seg)

    out = run(arrays, kv_mask, segment_ids)
    if causal:
        return out
    flip = lambda a: None if a is None else a[::-1]  # noqa: E731
    return out + flip(run(tuple(flip(a) for a in arrays), flip(kv_mask), flip(segment_ids)))


def recurrent_cache(state):
    return RecurrentCache(state, jnp.zeros((), jnp.int32))
