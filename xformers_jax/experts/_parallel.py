"""Expert parallelism (Lepikhin et al., 2020, GShard; Fedus et al., 2021, Switch): the experts
are split over the ``expert`` mesh axis and the tokens over the token axes (``data``, ``fsdp``
and ``expert`` itself); inside a ``shard_map`` every device routes its own tokens (one routing
group per device), fills a capacity buffer per expert, and one ``all_to_all`` over ``expert``
sends each buffer to the device holding that expert; a second brings the outputs back.

It computes exactly capacity dispatch applied to each device's tokens as one group
(:func:`grouped_moe`, the one-device form it is tested against): the capacity
``C = ceil(capacity_factor * T_group * k / E)`` is per group, as in GShard. With ``length``
(``"sequence"`` capacity, see ``_dispatch``) each device's tokens are whole rows of ``length``,
each row routed on its own, so the result does not depend on the mesh at all. Lives with the
routing functions (not in ``parallel``) so that the layers in ``nn`` can call it under an
active mesh (``axes.mesh_for``); ``xformers_jax.parallel`` re-exports it.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from .. import axes as X
from ._dispatch import (ACTIVATIONS, ExpertWeights, _mlp, capacity_slots,
                        sequence_capacity_slots)
from ._losses import expert_load, load_balancing_loss, router_z_loss
from ._routers import router_logits, top_k_route


def _group_moe(x, mask, w_router, weights: ExpertWeights, *, k, capacity_factor, priority,
               renormalize, activation, expert_fn, length=None):
    """One routing group: route, fill the ``[E, C, d]`` buffer, ``expert_fn(buffer)``,
    combine (``length``: rows of that length, each under ``"sequence"`` capacity). Returns
    ``(y, aux)``."""
    t, d = x.shape
    e = w_router.shape[1]
    r = top_k_route(router_logits(x, w_router), k, renormalize=renormalize, mask=mask)
    if length is None:
        pos, kept, c = capacity_slots(r, e, capacity_factor, priority=priority, mask=mask)
    else:
        pos, kept, c, _ = sequence_capacity_slots(r, e, capacity_factor, length=length,
                                                  mask=mask)
    slot = jnp.where(kept, r.experts * c + pos, e * c)
    buf = jnp.zeros((e * c + 1, d), x.dtype).at[slot.reshape(-1)].add(jnp.repeat(x, k, 0))
    out = expert_fn(buf[:-1].reshape(e, c, d))
    out = jnp.concatenate([out.reshape(e * c, d), jnp.zeros((1, d), out.dtype)])
    y = (out[slot] * (r.gates * kept).astype(x.dtype)[..., None]).sum(1)
    active = (r.gates != 0) if mask is None else (r.gates != 0) & mask[:, None]
    aux = dict(load_balancing=load_balancing_loss(r.probs, r.experts, mask=mask),
               router_z=router_z_loss(r.logits, mask=mask),
               dropped_fraction=1.0 - kept.sum() / jnp.maximum(active.sum(), 1),
               expert_load=expert_load(r.experts, e, mask=mask, kept=active))
    return y, aux


def _local_experts(buf, weights, activation):
    batched = lambda a, w: jnp.einsum("ecd,edh->ech", a, w.astype(a.dtype))  # noqa: E731
    return _mlp(buf, weights.w1, weights.w2, weights.w_gate, activation, batched)


def grouped_moe(x, w_router, weights: ExpertWeights, *, groups: int, k: int = 1,
                capacity_factor: float = 1.25, priority: str = "choice",
                renormalize: bool = True, activation: str = "gelu", mask=None,
                length: int | None = None):
    """One device: ``x [T, d]`` cut into ``groups`` equal consecutive groups, top-``k``
    capacity dispatch in each (``length``: ``"sequence"`` capacity over rows of that length,
    which each group must hold whole); aux averaged over groups. ``(y [T, d], aux)``."""
    t, d = x.shape
    if t % groups:
        raise ValueError(f"grouped_moe: {t} tokens do not split into {groups} groups")
    _whole_rows("grouped_moe", t // groups, length)
    xs = x.reshape(groups, t // groups, d)
    ms = None if mask is None else mask.reshape(groups, -1)
    fn = functools.partial(_group_moe, k=k, capacity_factor=capacity_factor, priority=priority,
                           renormalize=renormalize, activation=activation, length=length,
                           expert_fn=lambda b: _local_experts(b, weights, activation))
    y, aux = jax.vmap(lambda a, m: fn(a, m, w_router, weights))(xs, ms)
    return y.reshape(t, d), jax.tree.map(lambda a: a.mean(0), aux)


def _whole_rows(name, group_tokens, length):
    if length is not None and (length < 1 or group_tokens % length):
        raise ValueError(f"{name}: 'sequence' capacity routes whole rows of {length} tokens, "
                         f"but a group holds {group_tokens} tokens")


def token_axes(mesh) -> tuple[str, ...]:
    """The mesh axes the tokens of an expert-parallel layer are split over: ``data``,
    ``fsdp`` and ``expert`` where present."""
    return tuple(a for a in (X.DATA, X.FSDP, X.EXPERT) if a in mesh.axis_names)


def expert_parallel_moe(x, w_router, weights: ExpertWeights, *, mesh=None, k: int = 1,
                        capacity_factor: float = 1.25, priority: str = "choice",
                        renormalize: bool = True, activation: str = "gelu", mask=None,
                        length: int | None = None):
    """Expert-parallel top-``k`` capacity MoE over ``mesh`` (or the active one): ``x [T, d]``
    (any sharding) -> ``(y [T, d], aux)``, equal to :func:`grouped_moe` with one group per
    device of the token axes (``length``: ``"sequence"`` capacity over rows of that length,
    each device holding whole rows). ``weights`` have ``E`` divisible by the ``expert`` axis
    size."""
    mesh, n = X.mesh_for(X.EXPERT, mesh)
    if mesh is None:
        raise ValueError("expert_parallel_moe: needs a mesh (argument or parallel.use_mesh)")
    if activation not in ACTIVATIONS:
        raise ValueError(f"expert_parallel_moe: unknown activation {activation!r}")
    e = w_router.shape[1]
    if e % n:
        raise ValueError(f"expert_parallel_moe: {e} experts do not split over the expert axis "
                         f"of size {n}")
    axes = token_axes(mesh)
    groups = 1
    for a in axes:
        groups *= dict(mesh.shape)[a]
    if x.shape[0] % groups:
        raise ValueError(f"expert_parallel_moe: {x.shape[0]} tokens do not split over the "
                         f"token axes {axes} ({groups} groups)")
    _whole_rows("expert_parallel_moe", x.shape[0] // groups, length)
    if mask is None:
        mask = jnp.ones(x.shape[:1], bool)
    has_gate = weights.w_gate is not None
    e_loc = e // n

    def exchange(buf, w1, w2, wg):
        c, d = buf.shape[1:]
        if n == 1:
            return _local_experts(buf, ExpertWeights(w1, w2, wg), activation)
        # [E, C, d] -> [n, E_loc, C, d]: block j goes to device j of the expert axis, which
        # receives one block per source device: [n (source), E_loc, C, d].
        got = jax.lax.all_to_all(buf.reshape(n, e_loc, c, d), X.EXPERT, 0, 0)
        local = got.transpose(1, 0, 2, 3).reshape(e_loc, n * c, d)
        out = _local_experts(local, ExpertWeights(w1, w2, wg), activation)
        out = out.reshape(e_loc, n, c, d).transpose(1, 0, 2, 3)
        return jax.lax.all_to_all(out, X.EXPERT, 0, 0).reshape(e, c, d)

    def body(x, m, wr, w1, w2, *wg):
        wg = wg[0] if has_gate else None
        y, aux = _group_moe(x, m, wr, None, k=k, capacity_factor=capacity_factor,
                            priority=priority, renormalize=renormalize, activation=activation,
                            expert_fn=lambda b: exchange(b, w1, w2, wg), length=length)
        return y, jax.tree.map(lambda a: jax.lax.pmean(a, axes), aux)

    tok, wspec = P(axes), P(X.EXPERT)
    args = (x, mask, w_router, weights.w1, weights.w2) + ((weights.w_gate,) if has_gate else ())
    specs = (tok, tok, P(), wspec, wspec) + ((wspec,) if has_gate else ())
    aux_spec = dict(load_balancing=P(), router_z=P(), dropped_fraction=P(), expert_load=P())
    fn = jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=(tok, aux_spec),
                       check_vma=False)
    return fn(*args)
