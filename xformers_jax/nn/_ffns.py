"""The feed-forward slot of a block: how FFN layers are called and how their auxiliary outputs
leave the model. The kinds are named by ``nn.FFNSpec`` (the one slot registry, :mod:`._slots`):
``TransformerBlock(..., ffn=FFNSpec("switch", {"num_experts": 8}))`` (or through models,
``block=dict(ffn=FFNSpec(...))``) builds the registered kind in place of the dense
:class:`FeedForward`, which stays the default (``FFNSpec()``, kind ``"dense"``).

**The FFN call contract.** Every FFN layer a kind implements (``nn.implements``) is called
``ffn(x [B, L, dim], *, mask=None, tokens=None, key=None, inference=False) -> (y, aux)``:
``mask bool[B, L]`` (False for padding), ``tokens int[B, L]`` (hash routing reads token ids),
``key`` (router jitter, GShard's random second choice, Gumbel noise; None in evaluation).
``aux`` is a dict of arrays, the same keys for every call of one kind (``{}`` for the dense
FFN); the MoE kinds return :data:`MOE_AUX` keys: ``load_balancing`` and ``router_z`` (the
losses of ``xformers_jax.experts``, scalars), ``dropped_fraction`` (scalar) and
``expert_load`` (``float32[E]``).

**Decoding.** An FFN whose routing keeps a state across positions (capacity MoE with
``"sequence"`` groups: the per-row per-expert counts) has ``init_cache(batch)`` and
``decode(x [B, 1, dim], cache, *, tokens) -> (y, cache)``; :func:`init_ffn_cache` and
:func:`decode_ffn` call them, and every other FFN runs on the step's token as in a forward call
(cache None). A block whose FFN keeps a state decodes with a ``nn.BlockCache``.

**How auxiliary outputs leave the model.** A block called with a carry (``nn.Carry``) writes
its FFN's ``aux`` into the carry it returns; ``LayerStack`` stacks every layer's as a
``lax.scan`` output (a leading layer axis); models take ``return_aux=True`` and return
``(logits, aux)``. :func:`aux_terms` turns it into named scalar terms for a loss and a log
(each router loss summed over layers, each layer's from its own router; the statistics
averaged), which a model kind weighs with its default weights (:data:`AUX_WEIGHTS`, Switch's
and ST-MoE's coefficients) and the config's ``loss`` section.

The attention slot reports its kinds' losses into the same ``aux`` (``AttentionAdapter.aux``,
:data:`ATTENTION_AUX_LOSSES`: DeepSeek sparse attention's ``indexer_kl``, the KL divergence
that trains its lightning indexer), summed over layers by :func:`aux_terms` and weighed the
same way (a config's ``loss.indexer_kl``).
"""

from __future__ import annotations

from typing import Mapping

import jax.numpy as jnp

from ..experts import LOAD_BALANCING_COEF, Z_LOSS_COEF
from ._ffn import FeedForward

MOE_AUX = ("load_balancing", "router_z", "dropped_fraction", "expert_load")
AUX_LOSSES = ("load_balancing", "router_z")
# Per-layer losses of attention kinds (AttentionAdapter.aux), each summed over layers.
ATTENTION_AUX_LOSSES = ("indexer_kl",)


def call_ffn(ffn, x, *, mask=None, tokens=None, key=None, inference=False):
    """Calls an FFN by the contract: ``(y, aux)`` (the dense ``FeedForward`` gives ``{}``)."""
    if isinstance(ffn, FeedForward):
        return ffn(x), {}
    return ffn(x, mask=mask, tokens=tokens, key=key, inference=inference)


def init_ffn_cache(ffn, batch: int):
    """The FFN's decoding state for ``batch`` rows, or None when it keeps none."""
    init = getattr(ffn, "init_cache", None)
    return None if init is None else init(batch)


def decode_ffn(ffn, x, cache, *, tokens=None):
    """One decoding step of an FFN, ``x [B, 1, dim]`` (``tokens int[B, 1]``): ``(y,
    cache)``."""
    if cache is None:
        return call_ffn(ffn, x, tokens=tokens, inference=True)[0], None
    return ffn.decode(x, cache, tokens=tokens)


def aux_losses(aux: Mapping) -> dict:
    """The auxiliary losses of a model's ``aux`` (leading layer axis), each summed over
    layers; absent ones are 0."""
    return {name: jnp.sum(aux[name]) if name in aux else jnp.zeros(())
            for name in AUX_LOSSES}


# The default weights of the slots' loss terms in a training loss (Switch's load balancing,
# ST-MoE's router z-loss; the DSA indexer's KL, which no other parameter sees, so its weight
# only scales the indexer's gradient): model kinds declare them with their own terms.
AUX_WEIGHTS = {"load_balancing": LOAD_BALANCING_COEF, "router_z": Z_LOSS_COEF,
               "indexer_kl": 1.0}


def aux_terms(aux: Mapping) -> dict:
    """A model's auxiliary outputs as named scalars for a loss and a log: the FFN slot's
    (:data:`MOE_AUX`, leading layer axis) reduced, ``load_balancing`` and ``router_z`` summed
    over layers (each layer's loss from its own router), ``tokens_dropped`` (the mean dropped
    fraction over layers) and ``max_expert_load`` (the largest expert load relative to
    uniform, averaged over layers: 1 at perfect balance, ``E`` if one expert takes
    everything); the attention slot's (:data:`ATTENTION_AUX_LOSSES`) summed over layers;
    every other scalar entry as it is (a ponder cost, a reconstruction loss). Entries that
    are neither (per-exit logits) are not terms."""
    out = {}
    if "load_balancing" in aux:
        out.update(aux_losses(aux))
    for name in ATTENTION_AUX_LOSSES:
        if name in aux:
            out[name] = jnp.sum(aux[name])
    if "dropped_fraction" in aux:
        out["tokens_dropped"] = jnp.mean(aux["dropped_fraction"])
    if "expert_load" in aux:
        load = aux["expert_load"]
        out["max_expert_load"] = jnp.mean(load.max(-1) * load.shape[-1])
    for name, value in aux.items():
        if name not in MOE_AUX and name not in out and jnp.ndim(value) == 0:
            out[name] = value
    return out
