"""Ring attention: exact softmax attention with the sequence split over a mesh axis.

Liu, Zaharia, Abbeel, "Ring Attention with Blockwise Transformers for Near-Infinite Context"
(2023); the blockwise online softmax is flash attention's (Dao et al., 2022; Rabe & Staats,
2021). Each
device of the ``sequence`` axis keeps its query shard and passes its key/value shard around
the ring with ``lax.ppermute``; after n steps every query has met every key. Each step is one
:func:`~xformers_jax.attention.flash_attention` call returning ``(out, lse)``; partial results
are merged with the log-sum-exp weights ``exp(lse_b - lse)`` (the kernel layer's
``merge_by_lse``), so no device ever holds more
than its own ``[L/n, L/n]`` tiles, and memory per device is ``O(L/n)``.

Causal load balancing (the zig-zag layout of Brandon et al., "Striped Attention" and the
ring-flash-attention implementations): the sequence is cut into ``2n`` chunks and device i
holds chunks ``i`` and ``2n-1-i``. At every ring step each device then does the same amount of
work: its own block causally, an earlier device's first chunk for all its queries, or all of a
later device's keys for its second chunk only.

Gradients: flash attention's VJP treats its log-sum-exp output as a statistic (no cotangent),
so autodiff through the merge would be wrong. The backward pass is the ring again (a
``custom_vjp``): K/V travel with their gradient accumulators, and each step runs flash
attention's own tile backward with the *final* output and log-sum-exp, which gives that
block's exact share of dq, dk, dv.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Bool, Float

from .. import axes as X
from ..kernels import attend_layout_backward, merge_by_lse, pad_to
from . import _contract as C
from ._exact import DEFAULT_BLOCK_K, DEFAULT_BLOCK_Q, _block, flash_attention
from .patterns import Causal, Full

_NAME = "ring_attention"
_DIAGONAL, _EARLIER, _LATER = 0, 1, 2


@dataclasses.dataclass(frozen=True)
class _Ring:
    axis: str
    n: int
    causal: bool
    scale: float
    block_q: int | None
    block_k: int | None


def _flash(r: _Ring, q, k, v, mask, causal):
    out, lse = flash_attention(
        q, k, v, causal=causal, kv_mask=mask, scale=r.scale, block_q=r.block_q,
        block_k=r.block_k, return_lse=True,
    )
    return out.astype(C.STATS_DTYPE), lse


def _flash_grads(r: _Ring, q, k, v, mask, out, lse, d_out, causal):
    """Flash attention's tile backward for one block, given the final ``out`` and ``lse``."""
    lq, lk = q.shape[0], k.shape[0]
    bq = _block(_NAME, "block_q", r.block_q, lq, DEFAULT_BLOCK_Q)
    bk = _block(_NAME, "block_k", r.block_k, lk, DEFAULT_BLOCK_K)
    layout = (Causal() if causal else Full()).layout(lq, lk, bq, bk)
    return attend_layout_backward(q, k, v, layout, out, lse, d_out, kv_mask=mask, scale=r.scale)


def _case(r: _Ring, s, idx=None):
    """Which part of the block from ``s`` steps back in the ring device ``idx`` (default: this
    device) sees: its own (diagonal), an earlier device's or a later device's."""
    if not r.causal:
        return jnp.int32(_EARLIER)  # non-causal: everything, as one full block
    idx = lax.axis_index(r.axis) if idx is None else idx
    src = (idx - s) % r.n
    return jnp.where(src == idx, _DIAGONAL, jnp.where(src < idx, _EARLIER, _LATER))


def _block_forward(r: _Ring, case, q, k, v, mask):
    if not r.causal:  # every block is seen whole (shards need not split in two halves)
        return _flash(r, q, k, v, mask, False)
    c = q.shape[0] // 2

    def diagonal():
        return _flash(r, q, k, v, mask, True)

    def earlier():
        return _flash(r, q, k[:c], v[:c], mask[:c], False)

    def later():
        o, lse = _flash(r, q[c:], k, v, mask, False)
        return pad_to(o[::-1], 2 * c)[::-1], pad_to(lse[::-1], 2 * c, value=-jnp.inf)[::-1]

    return lax.switch(case, (diagonal, earlier, later))


def _block_backward(r: _Ring, case, q, k, v, mask, out, lse, d_out):
    if not r.causal:
        return _flash_grads(r, q, k, v, mask, out, lse, d_out, False)
    c = q.shape[0] // 2

    def diagonal():
        return _flash_grads(r, q, k, v, mask, out, lse, d_out, True)

    def earlier():
        dq, dk, dv = _flash_grads(r, q, k[:c], v[:c], mask[:c], out, lse, d_out, False)
        return dq, pad_to(dk, 2 * c), pad_to(dv, 2 * c)

    def later():
        dq, dk, dv = _flash_grads(r, q[c:], k, v, mask, out[c:], lse[c:], d_out[c:], False)
        return pad_to(dq[::-1], 2 * c)[::-1], dk, dv

    return lax.switch(case, (diagonal, earlier, later))


def _pass_on(r: _Ring, *xs):
    ring = [(i, (i + 1) % r.n) for i in range(r.n)]
    return tuple(lax.ppermute(x, r.axis, ring) for x in xs)


def _ring_forward(r: _Ring, q, k, v, mask):
    def step(carry, s):
        o, lse, k, v, mask = carry
        o_b, lse_b = _block_forward(r, _case(r, s), q, k, v, mask)
        o, lse = merge_by_lse(o, lse, o_b, lse_b)
        k, v, mask = _pass_on(r, k, v, mask)
        return (o, lse, k, v, mask), None

    o = jnp.zeros((q.shape[0], v.shape[1]), C.STATS_DTYPE)
    lse = jnp.full((q.shape[0],), -jnp.inf, C.STATS_DTYPE)
    (o, lse, *_), _ = lax.scan(step, (o, lse, k, v, mask), jnp.arange(r.n))
    return o.astype(q.dtype), lse


def _ring_backward(r: _Ring, q, k, v, mask, out, lse, d_out):
    def step(carry, s):
        dq, k, v, mask, dk, dv = carry
        dq_b, dk_b, dv_b = _block_backward(r, _case(r, s), q, k, v, mask, out, lse, d_out)
        # The gradient accumulators travel with their K/V block; after n hops they are home.
        k, v, mask, dk, dv = _pass_on(r, k, v, mask, dk + dk_b, dv + dv_b)
        return (dq + dq_b, k, v, mask, dk, dv), None

    zeros = lambda x: jnp.zeros(x.shape, C.STATS_DTYPE)  # noqa: E731
    init = (zeros(q), k, v, mask, zeros(k), zeros(v))
    (dq, _, _, _, dk, dv), _ = lax.scan(step, init, jnp.arange(r.n))
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


def _local_forward(r: _Ring, q, k, v, mask):
    """One device's part of the forward, on contiguous shards: under causal, reorder to the
    zig-zag layout, run the ring, and return the output in contiguous order (the log-sum-exp
    stays in the zig-zag order the backward reads it in)."""
    if r.causal:
        q, k, v, mask = (_to_zigzag(r.axis, r.n, a) for a in (q, k, v, mask))
    out, lse = _ring_forward(r, q, k, v, mask)
    return (_from_zigzag(r.axis, r.n, out) if r.causal else out), lse


def _local_backward(r: _Ring, q, k, v, mask, out, lse, d_out):
    if r.causal:
        q, k, v, mask, out, d_out = (_to_zigzag(r.axis, r.n, a)
                                     for a in (q, k, v, mask, out, d_out))
    grads = _ring_backward(r, q, k, v, mask, out, lse, d_out)
    return tuple(_from_zigzag(r.axis, r.n, g) for g in grads) if r.causal else grads


def _sharded(r: _Ring, mesh, fn, num_in: int, num_out: int):
    spec = P(r.axis)
    # jit: a shard_map over some of the mesh axes cannot run eagerly.
    return jax.jit(jax.shard_map(
        functools.partial(fn, r), mesh=mesh, in_specs=(spec,) * num_in,
        out_specs=(spec,) * num_out, axis_names=frozenset({r.axis}), check_vma=False))


# The custom VJP wraps the two shard_maps (one for the forward ring, one for the backward ring),
# built once per ring and mesh. Differentiating it inside a lax.scan still keeps each ring
# step's tiles (measured in JAX 0.10: memory quadratic in the length), so layer stacks unroll
# under a sequence split (nn._stack).
@functools.lru_cache(maxsize=64)
def _ring_fn(r: _Ring, mesh):
    forward = _sharded(r, mesh, _local_forward, 4, 2)
    backward = _sharded(r, mesh, _local_backward, 7, 3)

    @jax.custom_vjp
    def ring(q, k, v, mask):
        return forward(q, k, v, mask)[0]

    def fwd(q, k, v, mask):
        out, lse = forward(q, k, v, mask)
        return out, (q, k, v, mask, out, lse)

    def bwd(res, d_out):
        dq, dk, dv = backward(*res, d_out)
        return dq, dk, dv, None

    ring.defvjp(fwd, bwd)
    return ring


def zigzag_order(length: int, n: int):
    """The causal load-balancing order: chunk ``i`` and ``2n-1-i`` of ``2n`` go to device i.

    Returns the permutation ``perm`` (an int array ``[length]``, ``length`` divisible by
    ``2n``) such that ``x[perm]`` is the layout ring attention shards; ``argsort(perm)``
    undoes it.
    """
    if length % (2 * n):
        raise ValueError(f"zigzag_order: length {length} is not divisible by 2n = {2 * n}")
    c = length // (2 * n)
    chunks = [j for i in range(n) for j in (i, 2 * n - 1 - i)]
    return jnp.concatenate([jnp.arange(j * c, (j + 1) * c) for j in chunks])


def _owner(j: int, n: int) -> int:
    """The device that holds chunk ``j`` of ``2n`` in the zig-zag layout."""
    return j if j < n else 2 * n - 1 - j


def _to_zigzag(axis: str, n: int, x):
    """A contiguous shard (chunks ``2i, 2i+1`` on device i) -> the zig-zag shard (chunks ``i,
    2n-1-i``), by two ``ppermute``s: every device sends each half to its owner, and each owner
    receives one chunk from each (which one comes first depends on its parity)."""
    c = x.shape[0] // 2
    first = lax.ppermute(x[:c], axis, [(i, _owner(2 * i, n)) for i in range(n)])
    second = lax.ppermute(x[c:], axis, [(i, _owner(2 * i + 1, n)) for i in range(n)])
    # Device d gets chunk d from `first` when d is even (else from `second`).
    even = lax.axis_index(axis) % 2 == 0
    return jnp.where(even, jnp.concatenate([first, second]), jnp.concatenate([second, first]))


def _from_zigzag(axis: str, n: int, x):
    """The inverse of :func:`_to_zigzag`."""
    c = x.shape[0] // 2
    even = lax.axis_index(axis) % 2 == 0
    # Device d holds chunks d and 2n-1-d; the even-numbered one goes back as a first half.
    for_first = jnp.where(even, x[:c], x[c:])
    for_second = jnp.where(even, x[c:], x[:c])
    first = lax.ppermute(for_first, axis, [(_owner(2 * i, n), i) for i in range(n)])
    second = lax.ppermute(for_second, axis, [(_owner(2 * i + 1, n), i) for i in range(n)])
    return jnp.concatenate([first, second])


def ring_attention(
    q: Float[Array, "q_seq qk_dim"],
    k: Float[Array, "kv_seq qk_dim"],
    v: Float[Array, "kv_seq v_dim"],
    *,
    causal: bool = False,
    kv_mask: Bool[Array, "kv_seq"] | None = None,
    scale: float | None = None,
    mesh=None,
    axis_name: str = X.SEQUENCE,
    block_q: int | None = None,
    block_k: int | None = None,
) -> Float[Array, "q_seq v_dim"]:
    """Exact attention with the sequence sharded over the ``axis_name`` mesh axis.

    Equal to :func:`~xformers_jax.attention.flash_attention` (and so to
    ``dot_product_attention``) with the same arguments, gradients included. Any lengths: the
    sequence is padded to a multiple of the ring size (``2 x`` under ``causal``) with masked
    keys, and the padding is dropped from the output. Lift it to ``[B, L, H, D]`` with
    :func:`~xformers_jax.attention.multihead` (``shard_map`` composes with ``vmap``).

    Args:
      q: ``[Lq, Dk]``. k: ``[Lk, Dk]``. v: ``[Lk, Dv]``.
      causal: query i sees keys ``j <= i`` only (needs ``Lq == Lk``), zig-zag load balanced.
      kv_mask: ``bool[Lk]``, True for real keys.
      scale: score scale, ``1/sqrt(Dk)`` by default.
      mesh: the mesh; default the one active in :func:`use_mesh`. Without a mesh, or with a
        ring of size 1, this is ``flash_attention``.
      axis_name: the mesh axis the sequence is split over.
      block_q, block_k: flash attention tile sizes within each ring step.

    Returns:
      ``[Lq, Dv]`` in q's dtype.
    """
    x = C.check_qkv(_NAME, q, k, v)
    kv_mask = C.check_kv_mask(_NAME, kv_mask, x.lk)
    scale = C.resolve_scale(x.dk, scale)
    if causal and x.lq != x.lk:
        raise ValueError(f"{_NAME}: causal=True needs Lq == Lk but got q{x.q.shape}, k{x.k.shape}")
    mesh, n = X.mesh_for(axis_name, mesh)
    if n == 1:
        return flash_attention(x.q, x.k, x.v, causal=causal, kv_mask=kv_mask, scale=scale,
                               block_q=block_q, block_k=block_k)
    chunks = 2 * n if causal else n
    lq_p, lk_p = (-(-length // chunks) * chunks for length in (x.lq, x.lk))
    mask = jnp.ones((x.lk,), bool) if kv_mask is None else kv_mask
    q_, k_, v_ = pad_to(x.q, lq_p), pad_to(x.k, lk_p), pad_to(x.v, lk_p)
    mask = pad_to(mask, lk_p, value=False)
    r = _Ring(axis_name, n, bool(causal), float(scale), block_q, block_k)
    # Shards stay contiguous outside (the layout the model's activations have); under causal
    # they are reordered to the zig-zag layout between neighbours inside the shard_map.
    out = _ring_fn(r, mesh)(q_, k_, v_, mask)
    return out[: x.lq]
