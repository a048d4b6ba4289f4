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
# --- sparse patterns (issue 3) ---
