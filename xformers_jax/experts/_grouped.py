"""The grouped matmul of dropless dispatch, one switchable backend.

``grouped_matmul(x [m, k], w [G, k, n], group_sizes int[G]) -> [m, n]``: rows
``[s_g, s_g + group_sizes[g])`` of ``x`` (``s_g`` the cumulative sizes) are multiplied by
``w[g]``; rows past ``sum(group_sizes)`` give 0. Backends:

* ``"ragged_dot"``: XLA's ``jax.lax.ragged_dot`` (the default on GPU and TPU).
* ``"tiled"``: each group padded to a multiple of ``TILE`` rows (at most ``G * (TILE - 1)``
  padding rows, a static bound), then :func:`block_matmul`: one ``[TILE, k] x [k, n]`` matmul
  per tile that holds rows, by its group's weights (MegaBlocks' block layout, Gale et al.,
  2022). The default on CPU: measured here, XLA:CPU's ``ragged_dot`` ran 8 experts' fwd+bwd
  at 4K tokens x top-2 as slowly as computing every expert on every token (19.5 s against
  18.7 s; a dense FFN with the same active parameters: 1.8 s), i.e. it does G times the work.
* ``"dense"``: a masked einsum computing every group on every row (the reference).

A Pallas kernel registers itself with :func:`register_grouped_matmul` and is picked by name.

:func:`block_mlp` is the CPU dropless layer's whole expert MLP on the ``"tiled"`` layout: both
matmuls of a run of blocks in one loop step, so its hidden activations stay in cache.
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp


def _ragged(x, w, group_sizes):
    return jax.lax.ragged_dot(x, w, group_sizes.astype(jnp.int32))


def _dense(x, w, group_sizes):
    ends = jnp.cumsum(group_sizes)
    starts = ends - group_sizes
    rows = jnp.arange(x.shape[0])
    member = (rows[None] >= starts[:, None]) & (rows[None] < ends[:, None])  # [G, m]
    out = jnp.einsum("mk,gkn->gmn", x, w)
    return jnp.einsum("gm,gmn->mn", member.astype(out.dtype), out)


TILE = 128
# Runs of MERGE consecutive tiles of one group are multiplied as one [MERGE * TILE, k] matmul:
# the layout keeps 128-row padding (at most G * 127 padding rows) while most rows go through
# 512-row matmuls, which XLA:CPU runs faster per row. Dropless fwd+bwd over the dense FFN on
# the 2-core Sapphire Rapids (moe suite, one quiet run each): 128-row tiles alone 1.97x;
# runs of 2 / 4 / 8 tiles 1.71x / 1.58x / 1.55x (512-row tiles alone, with their padding,
# had given 1.58x); with block_mlp, 1.26x / 1.13x / 1.13x in one process.
MERGE = 4


def _runs(tile_group, n_used, groups: int, merge: int):
    """The used tiles as runs: ``[(starts, run_group, count, length)]``, ``length`` tiles per
    run, first the runs of ``merge`` tiles (``count`` of them, ``starts`` their first tiles),
    then single tiles. Tiles of a group are consecutive (``block_layout``)."""
    n_tiles = tile_group.shape[0]
    merge = max(1, min(merge, n_tiles))
    used = jnp.arange(n_tiles) < n_used
    counts = jnp.bincount(jnp.where(used, tile_group, groups), length=groups + 1)[:groups]
    first = jnp.cumsum(counts) - counts
    out = []
    for length, per_group, offset in (
            (merge, counts // merge, first),
            (1, counts % merge, first + counts // merge * merge)):
        bound = n_tiles // length
        ends = jnp.cumsum(per_group)
        idx = jnp.arange(bound)
        g = jnp.minimum(jnp.searchsorted(ends, idx, side="right"), groups - 1)
        starts = offset[g] + (idx - (ends[g] - per_group[g])) * length
        out.append((starts.astype(jnp.int32), g.astype(jnp.int32), ends[-1], length))
    return out


def _over_runs(runs, tile: int, step, carry):
    """``carry = step(carry, row0, rows, group)`` for every run (:func:`_runs`), ``rows`` (a
    static row count) from row ``row0`` belonging to ``group``."""
    for starts, groups, count, length in runs:
        def body(i, c, starts=starts, groups=groups, rows=length * tile):
            return step(c, starts[i] * tile, rows, groups[i])

        carry = jax.lax.fori_loop(0, count, body, carry)
    return carry


def _block_loop(a, w, runs, tile: int, contract_w: int):
    """``out[rows of run i] = a[rows of run i] @ w[group of run i]`` (``contract_w = 0``) or
    ``@ w[...].T`` (``contract_w = 1``) for every run (:func:`_runs`); other rows are 0."""
    def step(out, row0, rows, group):
        blk = jax.lax.dynamic_slice_in_dim(a, row0, rows, 0)
        wi = jax.lax.dynamic_index_in_dim(w, group, 0, keepdims=False)
        y = jax.lax.dot_general(blk, wi, (((1,), (contract_w,)), ((), ())))
        return jax.lax.dynamic_update_slice_in_dim(out, y.astype(out.dtype), row0, 0)

    return _over_runs(runs, tile, step, jnp.zeros((a.shape[0], w.shape[2 - contract_w]),
                                                  a.dtype))


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def block_matmul(a, w, tile_group, n_used, tile: int = TILE, merge: int = MERGE):
    """The block-layout grouped matmul: ``a [n_tiles * tile, k]`` (tiles of rows, each tile
    in one group, a group's tiles consecutive), ``w [G, k, m]``, ``tile_group int[n_tiles]``,
    ``n_used`` the number of leading tiles that hold rows -> ``[n_tiles * tile, m]``, tile
    ``i < n_used`` multiplied by ``w[tile_group[i]]`` and the unused tiles 0. Loops of one 2-D
    matmul per run of ``merge`` tiles of a group, then per remaining tile (:func:`_runs`): no
    ``[n_tiles, k, m]`` copy of the weights (``w[tile_group]``, which with a batched matmul
    cost more than the matmuls on XLA:CPU) and no work on the unused tiles of the static
    bound. Its backward is the same loops for ``da`` and, for ``dw``, one ``[k, rows] x
    [rows, m]`` matmul per run accumulated into its group's slot (float32 accumulation), so
    the weight gradient never exists per run."""
    runs = _runs(tile_group, n_used, w.shape[0], merge)
    return _block_loop(a, w, runs, tile, 0)


def _block_matmul_fwd(a, w, tile_group, n_used, tile, merge):
    runs = _runs(tile_group, n_used, w.shape[0], merge)
    return _block_loop(a, w, runs, tile, 0), (a, w, runs)


def _block_matmul_bwd(tile, merge, res, g):
    a, w, runs = res
    da = _block_loop(g, w, runs, tile, 1)

    def step(dw, row0, rows, group):
        blk = jax.lax.dynamic_slice_in_dim(a, row0, rows, 0)
        gb = jax.lax.dynamic_slice_in_dim(g, row0, rows, 0)
        part = jax.lax.dot_general(blk, gb, (((0,), (0,)), ((), ())),
                                   preferred_element_type=jnp.float32)
        return jax.lax.dynamic_update_index_in_dim(
            dw, jax.lax.dynamic_index_in_dim(dw, group, 0, keepdims=False) + part, group, 0)

    dw = _over_runs(runs, tile, step, jnp.zeros(w.shape, jnp.float32))
    return da, dw.astype(w.dtype), None, None


block_matmul.defvjp(_block_matmul_fwd, _block_matmul_bwd)


def mlp_parts(x, w1, w2, wg, act, matmul=jnp.matmul):
    """The expert MLP ``act(x w1) [* (x wg)] w2`` (Shazeer, 2020, when gated) with ``matmul``:
    ``(pre-activation, gate or None, output)``."""
    pre = matmul(x, w1)
    gate = None if wg is None else matmul(x, wg)
    h = act(pre) if gate is None else act(pre) * gate
    return pre, gate, matmul(h, w2)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8))
def block_mlp(a, w1, w2, wg, tile_group, n_used, act, tile: int = TILE, merge: int = MERGE):
    """The whole expert MLP in the block layout: ``act(a W1[g]) [* (a Wg[g])] W2[g]`` for each
    run of rows (:func:`block_matmul`'s layout and runs; ``a [n_tiles * tile, d]``, ``w1, wg
    [G, d, h]``, ``w2 [G, h, d]``, ``wg`` None for an ungated MLP, ``act`` elementwise) ->
    ``[n_tiles * tile, d]``, unused tiles 0. Equal to :func:`block_matmul` applied per weight,
    but each run goes through both matmuls while its hidden block is in cache: the forward
    keeps only the pre-activations (and gate) as residuals, and the backward walks the runs
    once, recomputing ``act`` per run and forming ``da`` and every weight gradient from
    blocks in cache, so no ``[rows, h]`` array of hidden gradients, activations or copied
    slices is ever written."""
    return _block_mlp_fwd(a, w1, w2, wg, tile_group, n_used, act, tile, merge)[0]


def _block_mlp_fwd(a, w1, w2, wg, tile_group, n_used, act, tile, merge):
    runs = _runs(tile_group, n_used, w1.shape[0], merge)
    rows, hidden = a.shape[0], w1.shape[2]

    def step(carry, row0, r, group):
        pick = lambda w: jax.lax.dynamic_index_in_dim(w, group, 0, keepdims=False)  # noqa
        blk = jax.lax.dynamic_slice_in_dim(a, row0, r, 0)
        pre, gate, y = mlp_parts(blk, pick(w1), pick(w2), None if wg is None else pick(wg),
                                 act)
        put = lambda buf, v: jax.lax.dynamic_update_slice_in_dim(  # noqa: E731
            buf, v.astype(buf.dtype), row0, 0)
        out, pres, gates = carry
        return put(out, y), put(pres, pre), None if wg is None else put(gates, gate)

    zeros = lambda n: jnp.zeros((rows, n), a.dtype)  # noqa: E731
    out, pres, gates = _over_runs(runs, tile, step,
                                  (zeros(a.shape[1]), zeros(hidden),
                                   None if wg is None else zeros(hidden)))
    return out, (a, w1, w2, wg, pres, gates, runs)


def _block_mlp_bwd(act, tile, merge, res, g):
    a, w1, w2, wg, pres, gates, runs = res
    tn = (((0,), (0,)), ((), ()))  # x^T y, accumulated in float32
    nt = (((1,), (1,)), ((), ()))  # x y^T

    def step(carry, row0, r, group):
        da, dw1, dw2, dwg = carry
        pick = lambda w: jax.lax.dynamic_index_in_dim(w, group, 0, keepdims=False)  # noqa
        rows = lambda v: jax.lax.dynamic_slice_in_dim(v, row0, r, 0)  # noqa: E731
        blk, pre, gb = rows(a), rows(pres), rows(g)
        act_out, act_vjp = jax.vjp(act, pre)
        gate = None if wg is None else rows(gates)
        h = act_out if gate is None else act_out * gate
        dh = jax.lax.dot_general(gb, pick(w2), nt)
        d_act = dh if gate is None else dh * gate
        (dpre,) = act_vjp(d_act.astype(pre.dtype))
        dblk = jax.lax.dot_general(dpre, pick(w1), nt)
        add = lambda acc, x, y: jax.lax.dynamic_update_index_in_dim(  # noqa: E731
            acc, pick(acc) + jax.lax.dot_general(x, y, tn, preferred_element_type=jnp.float32),
            group, 0)
        dw1, dw2 = add(dw1, blk, dpre), add(dw2, h, gb)
        if wg is not None:
            dgate = (dh * act_out).astype(blk.dtype)
            dblk = dblk + jax.lax.dot_general(dgate, pick(wg), nt)
            dwg = add(dwg, blk, dgate)
        da = jax.lax.dynamic_update_slice_in_dim(da, dblk.astype(da.dtype), row0, 0)
        return da, dw1, dw2, dwg

    f32 = lambda w: None if w is None else jnp.zeros(w.shape, jnp.float32)  # noqa: E731
    da, dw1, dw2, dwg = _over_runs(runs, tile, step,
                                   (jnp.zeros_like(a), f32(w1), f32(w2), f32(wg)))
    cast = lambda d, w: None if w is None else d.astype(w.dtype)  # noqa: E731
    return da, cast(dw1, w1), cast(dw2, w2), cast(dwg, wg), None, None


block_mlp.defvjp(_block_mlp_fwd, _block_mlp_bwd)


def block_layout(sizes, num_rows: int, tile: int = TILE):
    """MegaBlocks' padded layout for ``num_rows`` rows in groups of ``sizes int32[G]`` (rows
    past ``sum(sizes)`` belong to no group): ``(pstarts int32[G]`` each group's first row in
    the layout, ``tile_group int32[n_tiles]``, ``n_used`` the tiles holding rows, ``n_tiles``
    the static bound ``ceil((num_rows + G * (tile - 1)) / tile))``."""
    g = sizes.shape[0]
    padded = (sizes + tile - 1) // tile * tile
    pends = jnp.cumsum(padded)
    n_tiles = -(-(num_rows + g * (tile - 1)) // tile)
    tile_group = jnp.minimum(jnp.searchsorted(pends, jnp.arange(n_tiles) * tile,
                                              side="right"), g - 1).astype(jnp.int32)
    return (pends - padded).astype(jnp.int32), tile_group, pends[-1] // tile, n_tiles


def _tiled(x, w, group_sizes, tile: int = TILE, merge: int = MERGE):
    m, kd = x.shape
    g, _, n = w.shape
    sizes = group_sizes.astype(jnp.int32)
    ends = jnp.cumsum(sizes)
    starts = ends - sizes
    pstarts, tile_group, n_used, n_tiles = block_layout(sizes, m, tile)
    rows = jnp.arange(m)
    group = jnp.searchsorted(ends, rows, side="right")
    valid = group < g
    gc = jnp.minimum(group, g - 1)
    trash = n_tiles * tile
    dest = jnp.where(valid, pstarts[gc] + rows - starts[gc], trash)
    buf = jnp.zeros((trash + 1, kd), x.dtype).at[dest].set(x)[:-1]
    out = block_matmul(buf, w, tile_group, n_used, tile, merge)
    out = jnp.concatenate([out, jnp.zeros((1, n), out.dtype)])
    return out[dest]


_BACKENDS: dict[str, Callable] = {"ragged_dot": _ragged, "tiled": _tiled, "dense": _dense}


def default_backend() -> str:
    """``"tiled"`` on CPU (see the module docstring), ``"ragged_dot"`` elsewhere."""
    return "tiled" if jax.default_backend() == "cpu" else "ragged_dot"


def register_grouped_matmul(name: str, fn: Callable, *, replace: bool = False) -> None:
    """Adds a backend ``fn(x, w, group_sizes) -> [m, n]``."""
    if name in _BACKENDS and not replace:
        raise ValueError(f"grouped matmul backend {name!r} exists; pass replace=True")
    _BACKENDS[name] = fn


def grouped_matmul_backends() -> tuple[str, ...]:
    return tuple(_BACKENDS)


def grouped_matmul(x, w, group_sizes, *, backend: str | None = None):
    """See the module docstring. ``backend`` None uses :func:`default_backend`."""
    backend = backend or default_backend()
    if backend not in _BACKENDS:
        raise ValueError(f"grouped_matmul: backend must be one of {tuple(_BACKENDS)}, got "
                         f"{backend!r}")
    if x.ndim != 2 or w.ndim != 3 or w.shape[1] != x.shape[1] or group_sizes.shape != (
            w.shape[0],):
        raise ValueError(f"grouped_matmul: need x [m, k], w [G, k, n], group_sizes [G]; got "
                         f"{x.shape}, {w.shape}, {group_sizes.shape}")
    return _BACKENDS[backend](x, w, group_sizes)
