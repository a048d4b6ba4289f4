"""The attention contract: argument checks, dtype policy and scaling shared by every variant.

Every attention variant in :mod:`xformers_jax.attention` is a pure function over one sequence
and one head::

    out = variant(q, k, v, *variant_arrays, causal=False, kv_mask=None, scale=None, key=None,
                  **static_hyperparameters)        # and q_mask=None, see below
    # q: [Lq, Dk]  k: [Lk, Dk]  v: [Lk, Dv]  ->  out: [Lq, Dv]

Padding. ``kv_mask: bool[Lk]`` is True for real keys, ``q_mask: bool[Lq]`` True for real
queries. The rule every variant keeps, and users rely on: padding content and padding amount
change no output at a real position and no gradient reaching a real token's parameters.

- Masked keys have no influence on any output or gradient (every variant honours ``kv_mask``).
  Variants that pool, bucket, sort or normalise over key positions do so over the real keys:
  padding is zeroed before pooling and a slot of padding only is masked (Linformer, Luna's
  pack, memory-compressed and Poolingformer memories, Sinkhorn's block sums), or it goes to a
  bucket or cluster of its own after every real token (LSH, causal routing).
- Masked queries take part in no statistic that a real query's output depends on. Most
  variants compute each query's output from that query alone (softmax, kernelized, sparse and
  learned-sparsity attention), so a padded query cannot reach a real output and they need no
  ``q_mask``. Variants that compute statistics over the queries (the clusters of clustered
  attention, Nystromformer's query landmarks, ProbSparse's top-u selection, routing's k-means
  update, Funnel's pooled queries) take ``q_mask`` (:func:`check_q_mask`): masked queries are
  left out of those statistics, the statistics are computed over the real positions alone
  (sizes, samples and random draws depend on the number of real tokens and their order, not
  on the padded length), and masked queries' own outputs are zeros (:func:`zero_masked_rows`).
- Padding amount means padding after the real tokens, as the models' ``mask`` has it (with
  absolute positions, padding before them moves their positions, and so position-windowed
  pools); the same real tokens padded to any length give the same real outputs.
- ``q_mask`` defaults to ``kv_mask`` when ``Lq == Lk``: in self-attention q and k are the same
  padded sequence. For cross attention between sequences of equal length, pass ``q_mask``
  explicitly (all True when the queries are not padded).
- Modules resolve the masks once (:class:`xformers_jax.nn.MultiHeadAttention`: ``q_mask`` is
  the padding mask in self-attention, given explicitly for cross attention) and pass both to
  every variant's ``attend``; :func:`~xformers_jax.attention.multihead` splits both over the
  batch. ``tests/test_padding.py`` checks the rule for every registered kind.

The helpers here are what each variant calls first, so that every family checks its input the
same way and says the same thing when the input is wrong. Static problems raise ``ValueError``
at trace time with the shapes in the message; data-dependent checks use ``eqx.error_if``.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ..kernels import STATS_DTYPE as STATS_DTYPE  # the kernel layer owns the dtype policy
from ..kernels import select_real_keys


class QKV(NamedTuple):
    """Checked attention inputs and their sizes."""

    q: jax.Array
    k: jax.Array
    v: jax.Array
    lq: int
    lk: int
    dk: int
    dv: int


def _shape(x) -> tuple:
    return tuple(getattr(x, "shape", ()))


def check_qkv(name: str, q, k, v) -> QKV:
    """Checks one-sequence one-head inputs ``q: [Lq, Dk], k: [Lk, Dk], v: [Lk, Dv]``.

    Returns the arrays (as jax arrays) with their sizes. Raises ``ValueError`` naming the shapes
    when ranks or sizes disagree or when an input is not floating point.
    """
    q, k, v = jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)
    shapes = f"q{_shape(q)}, k{_shape(k)}, v{_shape(v)}"
    for arg_name, x in (("q", q), ("k", k), ("v", v)):
        if x.ndim != 2:
            hint = (
                " (batch and heads come from jax.vmap: lift the function with "
                "xformers_jax.attention.multihead)" if x.ndim > 2 else ""
            )
            raise ValueError(
                f"{name}: {arg_name} must have rank 2 ([length, dim]) but got shape "
                f"{_shape(x)}; inputs were {shapes}{hint}"
            )
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise ValueError(
                f"{name}: {arg_name} must be floating point but has dtype {x.dtype}; "
                f"inputs were {shapes}"
            )
    if q.shape[1] != k.shape[1]:
        raise ValueError(
            f"{name}: q and k must share their last dimension (Dk) but got {shapes}"
        )
    if k.shape[0] != v.shape[0]:
        raise ValueError(
            f"{name}: k and v must have the same length (Lk) but got {shapes}"
        )
    if q.shape[0] == 0 or k.shape[0] == 0:
        raise ValueError(f"{name}: empty sequences are not supported; inputs were {shapes}")
    return QKV(q, k, v, q.shape[0], k.shape[0], q.shape[1], v.shape[1])


def check_token(name: str, q, k, v) -> QKV:
    """Checks one decoding step's token ``q: [Dk], k: [Dk], v: [Dv]``; sizes as check_qkv."""
    q, k, v = jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)
    if q.ndim != 1 or k.ndim != 1 or v.ndim != 1:
        raise ValueError(
            f"{name}: q, k, v must be single tokens [D] but got q{q.shape}, k{k.shape}, v{v.shape}"
        )
    return check_qkv(name, q[None], k[None], v[None])


def _check_mask(name: str, arg: str, mask, length: int, what: str, size: str):
    mask = jnp.asarray(mask)
    if mask.dtype != jnp.bool_:
        raise ValueError(
            f"{name}: {arg} must be boolean (True marks real {what}) but has dtype "
            f"{mask.dtype} and shape {_shape(mask)}; convert it with `mask > 0` or "
            "`mask.astype(bool)`"
        )
    if mask.shape != (length,):
        raise ValueError(
            f"{name}: {arg} must have shape ({size},) = ({length},) but got {_shape(mask)}"
        )
    return mask


def check_kv_mask(name: str, kv_mask, lk: int):
    """Checks ``kv_mask: bool[Lk]`` (True for real tokens). Returns it as a jax array or None."""
    if kv_mask is None:
        return None
    return _check_mask(name, "kv_mask", kv_mask, lk, "tokens", "Lk")


def check_q_mask(name: str, q_mask, kv_mask, lq: int, lk: int):
    """Checks ``q_mask: bool[Lq]`` (True for real queries) and resolves its default.

    Returns ``q_mask`` as a jax array; when it is None, ``kv_mask`` if ``Lq == Lk`` (padded
    self-attention: the same positions are padded on both sides), else None (no query is
    padded). Call it after :func:`check_kv_mask`.
    """
    if q_mask is None:
        return kv_mask if lq == lk else None
    return _check_mask(name, "q_mask", q_mask, lq, "queries", "Lq")


def zero_masked_rows(out, q_mask):
    """``out [Lq, ...]`` with the rows of masked queries set to zero (``q_mask`` None: as is)."""
    if q_mask is None:
        return out
    return jnp.where(q_mask.reshape(q_mask.shape + (1,) * (out.ndim - q_mask.ndim)), out,
                     jnp.zeros((), out.dtype))


def rank_keys(key, n: int):
    """``n`` PRNG keys, the i-th drawn for the i-th real position: ``fold_in(key, i)``.

    Variants that sample over positions index their draws by a position's rank among the real
    positions (``jnp.cumsum(mask) - 1``), never by the padded length, so the same real tokens
    draw the same numbers however much padding follows or precedes them (a draw of shape
    ``[L]`` would change with ``L``).
    """
    return jax.vmap(lambda i: jax.random.fold_in(key, i))(jnp.arange(n, dtype=jnp.uint32))


def real_positions(mask, length: int):
    """``(order int32[L], count int32)``: the positions of the real entries of
    ``mask bool[L]`` in order, then the padded ones, and how many are real (``mask`` None:
    every position)."""
    if mask is None:
        return jnp.arange(length, dtype=jnp.int32), jnp.asarray(length, jnp.int32)
    order = jnp.argsort(~mask, stable=True).astype(jnp.int32)
    return order, jnp.sum(mask, dtype=jnp.int32)


def check_qkv_mask(name: str, q, k, v, kv_mask):
    """:func:`check_qkv` and :func:`check_kv_mask` together, the prologue of most variants:
    returns ``(QKV, kv_mask or None)``, the masked keys and values selected out (zeros), so
    that no product of a variant sees their content (``0 * nan`` is NaN)."""
    x = check_qkv(name, q, k, v)
    kv_mask = check_kv_mask(name, kv_mask, x.lk)
    return _real_keys(x, kv_mask), kv_mask


def _real_keys(x: QKV, kv_mask) -> QKV:
    if kv_mask is None:
        return x
    return x._replace(k=select_real_keys(x.k, kv_mask), v=select_real_keys(x.v, kv_mask))


def check_segment_ids(name: str, segment_ids, lq: int, lk: int):
    """Checks packed-sequence ids; returns ``(q_segment_ids, kv_segment_ids)`` or ``None``.

    ``segment_ids`` is one integer array ``[L]`` (self-attention, ``Lq == Lk``) or a pair
    ``(q_segment_ids [Lq], kv_segment_ids [Lk])``. Query i may see key j only when their ids
    are equal, which makes the attention block-diagonal over packed sequences.
    """
    if segment_ids is None:
        return None
    if isinstance(segment_ids, (tuple, list)):
        if len(segment_ids) != 2:
            raise ValueError(
                f"{name}: segment_ids must be one array [L] or a pair (q_ids [Lq], kv_ids [Lk]); "
                f"got a sequence of {len(segment_ids)}"
            )
        q_ids, kv_ids = (jnp.asarray(s) for s in segment_ids)
    else:
        q_ids = kv_ids = jnp.asarray(segment_ids)
        if lq != lk:
            raise ValueError(
                f"{name}: a single segment_ids array needs Lq == Lk, but Lq={lq}, Lk={lk}; pass a "
                "pair (q_segment_ids, kv_segment_ids) for cross attention"
            )
    for arg, ids, length in (("q segment ids", q_ids, lq), ("kv segment ids", kv_ids, lk)):
        if not jnp.issubdtype(ids.dtype, jnp.integer):
            raise ValueError(f"{name}: {arg} must be integers but have dtype {ids.dtype}")
        if ids.shape != (length,):
            raise ValueError(
                f"{name}: {arg} must have shape ({length},) but got {_shape(ids)}"
            )
    return q_ids.astype(jnp.int32), kv_ids.astype(jnp.int32)


def check_bias(name: str, bias, lq: int, lk: int):
    """Checks an additive score bias: an array ``[Lq, Lk]`` or a callable of positions.

    A callable is called as ``bias(q_positions [bq, 1], k_positions [1, bk])`` with int32
    positions and must broadcast to ``[bq, bk]``; exact kernels call it per block, so no L x L
    array is built. A callable with trainable parameters should be a pytree (an ``eqx.Module``
    or ``jax.tree_util.Partial``) or close over them; either way gradients reach them.
    """
    if bias is None or callable(bias):
        return bias
    bias = jnp.asarray(bias)
    if bias.shape != (lq, lk):
        raise ValueError(
            f"{name}: an array bias must have shape (Lq, Lk) = ({lq}, {lk}) but got "
            f"{_shape(bias)}; for a bias that depends only on positions pass a callable "
            "bias(q_positions, k_positions)"
        )
    if not jnp.issubdtype(bias.dtype, jnp.floating):
        raise ValueError(f"{name}: bias must be floating point but has dtype {bias.dtype}")
    return bias


def check_dropout(name: str, dropout_rate: float, key):
    if not 0.0 <= float(dropout_rate) < 1.0:
        raise ValueError(f"{name}: dropout_rate must be in [0, 1) but got {dropout_rate}")
    if dropout_rate > 0.0 and key is None:
        raise ValueError(
            f"{name}: dropout_rate={dropout_rate} needs an explicit PRNG `key` (randomness in "
            "this library always comes from an explicit key)"
        )


def resolve_scale(dk: int, scale) -> float:
    """The score scale: ``1/sqrt(Dk)`` unless given."""
    return float(1.0 / np.sqrt(dk)) if scale is None else scale


def check_same_length(name: str, x: QKV, reason: str) -> None:
    """Raises ``ValueError`` unless ``Lq == Lk``. ``reason`` says why the variant needs it and
    names the requirement (e.g. ``"needs self-attention (Lq == Lk)"``); the shapes follow."""
    if x.lq != x.lk:
        raise ValueError(f"{name}: {reason}; got q{tuple(x.q.shape)}, k{tuple(x.k.shape)}")


def causal_unsupported(name: str, reason: str):
    """Raises the error a non-decodable variant gives for ``causal=True``."""
    raise NotImplementedError(f"{name} does not support causal=True: {reason}")


def check_positive_int(name: str, arg: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
        raise ValueError(f"{name}: {arg} must be a positive integer but got {value!r}")
    return int(value)


def check_softmax_args(name: str, q, k, v, kv_mask, segment_ids, bias, dropout_rate, key, scale):
    """The checks every exact softmax attention makes; returns
    ``(qkv, kv_mask, segments, bias, scale)``."""
    x = check_qkv(name, q, k, v)
    kv_mask = check_kv_mask(name, kv_mask, x.lk)
    segs = check_segment_ids(name, segment_ids, x.lq, x.lk)
    bias = check_bias(name, bias, x.lq, x.lk)
    check_dropout(name, dropout_rate, key)
    return _real_keys(x, kv_mask), kv_mask, segs, bias, resolve_scale(x.dk, scale)
