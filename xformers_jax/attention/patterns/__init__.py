"""Attention patterns as data: static descriptions of who attends to whom.

Each pattern gives ``dense(lq, lk)`` (the boolean connectivity matrix) and
``layout(lq, lk, block_q, block_k)`` (a :class:`BlockLayout` of empty, full and partial tiles)
and composes with ``|`` and ``&``. See ``_base`` for the protocol.
"""

from ._base import EMPTY as EMPTY
from ._base import FULL as FULL
from ._base import PARTIAL as PARTIAL
from ._base import BlockLayout as BlockLayout
from ._base import Intersection as Intersection
from ._base import Pattern as Pattern
from ._base import Union as Union
from ._basic import Causal as Causal
from ._basic import Full as Full
from ._basic import KeyPadding as KeyPadding
from ._basic import Local as Local
from ._basic import Segments as Segments
from ._mask_mod import MaskMod as MaskMod
from ._mask_mod import document_mask as document_mask
# --- sparse patterns ---
from ._sparse import BlockBERT as BlockBERT
from ._sparse import BlockLocal as BlockLocal
from ._sparse import BPTree as BPTree
from ._sparse import Cascade as Cascade
from ._sparse import Dilated as Dilated
from ._sparse import Fixed as Fixed
from ._sparse import Global as Global
from ._sparse import ImageLocal1D as ImageLocal1D
from ._sparse import ImageLocal2D as ImageLocal2D
from ._sparse import LogSparse as LogSparse
from ._sparse import Longformer as Longformer
from ._sparse import PerHead as PerHead
from ._sparse import Star as Star
from ._sparse import Strided as Strided
from ._sparse_random import BigBird as BigBird
from ._sparse_random import Random as Random
