"""The FFN kinds (the block's ``ffn=`` slot) as :class:`~xformers_jax.kinds.Kind` records:
the dense FFN, the mixtures of experts (family ``experts``) and the capacity layers (family
``capacity``). ``decoding="token"``: the kind runs on one new token at a time; None: it cannot
(its routing ranks tokens against each other). The MoE kinds that claim ``causal`` hold it in
every mode a causal model accepts: dropless dispatch, and capacity dispatch with ``"sequence"``
groups (``capacity_group``; the causal default), whose counts are the decoding state; capacity
over a ``"batch"`` group is not causal and a causal layer refuses it. Each kind's layer (the
record's adapter) is the ``xformers_jax.nn`` module that declares it with ``nn.implements``;
the MoE kinds share ``nn.MoEFeedForward`` and differ by their ``router`` (a fixed layer
argument) and defaults."""

from __future__ import annotations

from ..kinds import Kind, Paper
from ._balanced import base_route
from ._dispatch import expert_choice_ffn, moe_ffn
from ._ffn import feed_forward, no_feed_forward, sparse_feed_forward
from ._product_keys import product_key_lookup
from ._routers import hash_route, prototype_route

_MOE_TIME, _MOE_MEMORY = "O(k * dim * hidden)", "O(E * dim * hidden) parameters"
_TINY = {"num_experts": 4}


def _dropless_only(hp):
    """Segment ids (packed rows) with a token-choice MoE: dropless dispatch routes each token
    alone, but capacity dispatch shares each expert's slots between the tokens of a group (a
    row, or the batch), so one document's tokens can crowd out another's."""
    if hp["mode"] == "dropless":
        return None
    return (f"mode={hp['mode']!r} shares expert capacity between the documents of a packed "
            "row; use mode='dropless' to train on packed rows")


def _moe(**defaults):
    """The hyperparameters of an MoE kind (every keyword of ``nn.MoEFeedForward`` but the
    block's and the router), with the kind's own ``defaults``."""
    hp = {
        "num_experts": (8, "experts E"),
        "k": (1, "experts per token (top-k router)"),
        "mode": ("dropless", "dispatch: 'dropless' (grouped matmul) or 'capacity'"),
        "capacity_factor": (1.25, "expert slots relative to an even share (capacity dispatch, "
                                  "expert choice)"),
        "priority": ("choice", "which assignments claim capacity first in a 'batch' group: "
                               "'choice' or 'token' ('sequence' groups need 'token' for k > 1)"),
        "capacity_group": (None, "tokens sharing a capacity: 'sequence' (each row alone, a "
                                 "running capacity by position: causal, decodes) or 'batch' "
                                 "(GShard's B x L group: mixes rows and sees later tokens, so "
                                 "NOT causal: refused in causal models); None: 'sequence' when "
                                 "causal, else 'batch'"),
        "renormalize": (True, "renormalise the top-k gates to sum to 1"),
        "second_policy": ("all", "the top-k router's later choices: 'all' or 'random' "
                                 "(GShard's random second expert)"),
        "groups": (1, "prototype groups, each routing top-1 (prototype router)"),
        "jitter": (0.0, "multiplicative router-input noise in training"),
        "gated": (False, "GLU-style experts (a gate projection per expert)"),
        "backend": (None, "the grouped matmul backend of dropless dispatch (None: default)"),
        "vocab_size": (256, "token ids the hash router's table covers"),
        "hash_seed": (0, "seed of the hash router's balanced table"),
        "base_eps": (1e-4, "epsilon of the BASE router's auction"),
    }
    for name, default in defaults.items():
        hp[name] = (default, hp[name][1])
    return hp


KINDS = (
    Kind("dense", feed_forward, "dense",
         Paper("Vaswani et al.", 2017, "Attention Is All You Need"),
         time="O(dim * hidden)", memory="O(hidden)", causal=True, decoding="token",
         segments=True,
         hyperparameters={"chunk_size": (None, "positions per chunk (Reformer's chunked FFN; "
                                               "None: all at once, or the block's chunk_size)")}),
    Kind("switch", moe_ffn, "experts",
         Paper("Fedus et al.", 2021, "Switch Transformers: Scaling to Trillion Parameter "
               "Models with Simple and Efficient Sparsity"),
         _MOE_TIME, _MOE_MEMORY, causal=True, decoding="token", segments=_dropless_only,
         test_hyperparameters=_TINY,
         hyperparameters=_moe(k=1, jitter=1e-2), layer_arguments={"router": "top_k"}),
    Kind("gshard", moe_ffn, "experts",
         Paper("Lepikhin et al.", 2020, "GShard: Scaling Giant Models with Conditional "
               "Computation and Automatic Sharding"),
         _MOE_TIME, _MOE_MEMORY, causal=True, decoding="token", segments=_dropless_only,
         test_hyperparameters=_TINY,
         hyperparameters=_moe(k=2, second_policy="random"), layer_arguments={"router": "top_k"}),
    Kind("st_moe", moe_ffn, "experts",
         Paper("Zoph et al.", 2022, "ST-MoE: Designing Stable and Transferable Sparse "
               "Expert Models"),
         _MOE_TIME, _MOE_MEMORY, causal=True, decoding="token", segments=_dropless_only,
         test_hyperparameters=_TINY,
         hyperparameters=_moe(k=2), layer_arguments={"router": "top_k"}),
    Kind("expert_choice", expert_choice_ffn, "experts",
         Paper("Zhou et al.", 2022, "Mixture-of-Experts with Expert Choice Routing"),
         "O(capacity_factor * dim * hidden)", _MOE_MEMORY, causal=False, decoding=None,
         mixes_rows=True,
         test_hyperparameters=_TINY, hyperparameters=_moe(capacity_factor=2.0),
         layer_arguments={"router": "expert_choice"}),
    Kind("hash", hash_route, "experts",
         Paper("Roller et al.", 2021, "Hash Layers For Large Sparse Models"),
         "O(dim * hidden)", _MOE_MEMORY, causal=True, decoding="token", segments=_dropless_only,
         test_hyperparameters=_TINY, hyperparameters=_moe(), layer_arguments={"router": "hash"}),
    Kind("prototype", prototype_route, "experts",
         Paper("Yang et al.", 2021, "M6-T: Exploring Sparse Expert Models and Beyond"),
         "O(groups * dim * hidden)", _MOE_MEMORY, causal=True, decoding="token",
         segments=_dropless_only,
         test_hyperparameters={"num_experts": 4, "groups": 2}, hyperparameters=_moe(groups=2),
         layer_arguments={"router": "prototype"}),
    Kind("base", base_route, "experts",
         Paper("Lewis et al.", 2021, "BASE Layers: Simplifying Training of Large, Sparse "
               "Models"),
         "O(dim * hidden) + the assignment's auction rounds", _MOE_MEMORY, causal=False,
         decoding=None, test_hyperparameters=_TINY, hyperparameters=_moe(),
         layer_arguments={"router": "base"}),
    Kind("product_key", product_key_lookup, "capacity",
         Paper("Lample et al.", 2019, "Large Memory Layers with Product Keys"),
         time="O(heads * (n * key_dim + k^2 + k * dim))", memory="O(n^2 * dim) parameters",
         causal=True, decoding="token", segments=True,
         test_hyperparameters={"n_keys": 8, "heads": 2, "k": 4, "key_dim": 8},
         hyperparameters={
             "n_keys": (128, "sub-keys n per half (the memory has n^2 rows of width dim)"),
             "heads": (4, "query heads"),
             "k": (32, "memory slots read per head"),
             "key_dim": (128, "query width (even)")}),
    Kind("sparse_ffn", sparse_feed_forward, "capacity",
         Paper("Jaszczur et al.", 2021, "Sparse is Enough in Scaling Transformers"),
         time="O(dim * (rank + hidden / block)) at inference", memory="O(dim * hidden)",
         causal=True, decoding="token", segments=True,
         test_hyperparameters={"block": 8, "rank": 8},
         hyperparameters={
             "block": (32, "hidden units per block, one kept per token"),
             "rank": (64, "rank of the low-rank controller")}),
    Kind("none", no_feed_forward, "capacity",
         Paper("Sukhbaatar et al.", 2019, "Augmenting Self-attention with Persistent Memory"),
         time="O(1)", memory="O(1)", causal=True, decoding="token", segments=True),
)
