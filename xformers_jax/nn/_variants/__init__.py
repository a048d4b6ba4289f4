"""The registry entries, one module per attention family (see :mod:`.._registry`).

Each module reads its family's :class:`~xformers_jax.attention._kind.Kind` records (name,
causal and bias support, decoding mode) and adds what only the module knows: how the kind's
own arrays are created, which hyperparameters only shape them (``init_only``), how it decodes,
and, for kinds that need more than one per-head function of q, k, v, an adapter.
"""

from . import _exact as _exact
from . import _learned as _learned
from . import _linear as _linear
from . import _lowrank as _lowrank
from . import _priors as _priors
from . import _sparse as _sparse
from ._learned import RoutingCentroids as RoutingCentroids
from ._learned import routing_commitment_loss as routing_commitment_loss
