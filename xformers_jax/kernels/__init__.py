"""The kernel layer: tile numerics, block layouts, the XLA tiled back end, the planner, dispatch.

Everything that computes attention tile by tile sits on this layer, and it imports nothing
above it: ``xformers_jax.attention`` (flash, block-sparse, LSH and Long-Short chunks),
``xformers_jax.parallel`` (ring attention) and the top-level ``pallas_kernels`` package all
build on it.

- ``BlockLayout`` and its tile kinds ``EMPTY``/``PARTIAL``/``FULL``: which tiles of a score
  matrix are computed (patterns produce them).
- ``attend_layout``: the XLA tiled online-softmax kernel over a layout, with a custom VJP that
  recomputes tiles in the backward pass (Dao et al., 2022, "FlashAttention").
- ``register``/``kernels_for``: the ``implementation=None | "xla" | "pallas"`` dispatch's
  kernel registry (``_dispatch.choose`` picks one for a call).
- The tile math every tiled kernel (XLA and Pallas) runs: ``online_step``/``finish`` (the
  online softmax, Milakov & Gimelshein, 2018) and ``lse_vjp`` (the custom VJP that saves
  ``out`` and ``lse`` and recomputes tiles); the recomputing backward's pieces, the static
  ``TileConfig`` and ``pad_to`` are in ``_tiles`` for kernel authors.
- ``merge_by_lse``/``merge_all_by_lse``: one softmax attention from partial attentions over
  disjoint key sets and their log-sum-exps (flash and ring attention's blockwise merge, Liu
  et al., 2023).
- For kernel authors (the attention families, the mixers' scans, ``pallas_kernels``): the rest
  of the tile numerics (``pad_to``, ``safe_max``, ``normalise``, ``log_sum_exp``,
  ``and_masks``, ``dynamic_mask``, positional dropout's ``dropout_seed``/``dropout_keep``, the
  recomputing backward's ``backward_stats``, ``tile_probs``, ``score_grad``,
  ``merge_weighted``, the static ``TileConfig``), the Pallas planner (``plan``, ``Blocks``),
  the tile autotuner (``default_block``, ``tile_costs``, ``DEFAULT_TILE_COST``), the
  dispatch's ``choose`` and ``cdiv``.
"""

from ._dispatch import kernels_for as kernels_for
from ._dispatch import register as register
from ._layout import EMPTY as EMPTY
from ._layout import FULL as FULL
from ._layout import PARTIAL as PARTIAL
from ._layout import BlockLayout as BlockLayout
from ._tiled import attend_layout as attend_layout
from ._tiled import attend_layout_backward as attend_layout_backward
from ._tiled import convert_flex as convert_flex
from ._tiled import _orientation_free as orientation_free
from ._tiled import flex_primitives as flex_primitives
from ._tiles import STATS_DTYPE as STATS_DTYPE
from ._tiles import finish as finish
from ._tiles import merge_all_by_lse as merge_all_by_lse
from ._tiles import merge_by_lse as merge_by_lse
from ._tiles import online_step as online_step
from ._vjp import lse_vjp as lse_vjp
from ._autotune import DEFAULT_TILE_COST as DEFAULT_TILE_COST
from ._autotune import default_block as default_block
from ._autotune import tile_costs as tile_costs
from ._dispatch import choose as choose
from ._layout import cdiv as cdiv
from ._planner import Blocks as Blocks
from ._planner import plan as plan
from ._tiles import TileConfig as TileConfig
from ._tiles import and_masks as and_masks
from ._tiles import backward_stats as backward_stats
from ._tiles import dropout_keep as dropout_keep
from ._tiles import dropout_seed as dropout_seed
from ._tiles import dynamic_mask as dynamic_mask
from ._tiles import log_sum_exp as log_sum_exp
from ._tiles import merge_weighted as merge_weighted
from ._tiles import normalise as normalise
from ._tiles import pad_to as pad_to
from ._tiles import safe_max as safe_max
from ._tiles import select_real_keys as select_real_keys
from ._tiles import score_grad as score_grad
from ._tiles import tile_probs as tile_probs
