"""The embedding layer of every model: token ids (a table) or continuous features (a linear map)
to ``[B, L, dim]``, an input position scheme and an optional learned CLS token."""

from __future__ import annotations

import math

import equinox as eqx
import jax
import jax.numpy as jnp

from .. import axes as X
from ..axes import constrain
from ._positions import ConvPositions, InputScheme, SinusoidalPositions


# The token id the CLS position carries for layers that read ids (hash routing): the CLS
# token is a learned vector outside the vocabulary, so it is routed as id 0.
CLS_TOKEN_ID = 0


class Embedder(eqx.Module):
    """Token ids (a table) or continuous features (a linear map) to ``[B, L, dim]``, plus an
    input position scheme and an optional learned CLS token prepended to the sequence.

    ``scale_tokens``: the looked-up token embeddings are multiplied by ``sqrt(dim)`` before the
    positions are added (Vaswani et al. 2017, section 3.4). The table is drawn N(0, 1/dim), so
    its rows have norm about 1 while a sinusoid adds about ``sqrt(dim / 2)``; scaled, a token
    is not drowned by its own position. The table (which a tied output layer reads) is left
    as it is.

    ``table_std``: the table's initial standard deviation (default ``1 / sqrt(dim)``, rows of
    norm about 1); ``1.0`` is PyTorch's ``nn.Embedding`` default, rows of norm about
    ``sqrt(dim)``, which scales the tokens against their positions and a tied output layer's
    logits together."""

    table: jax.Array | None = X.param(X.VOCAB, X.EMBED)
    proj: jax.Array | None = X.param(None, X.EMBED)
    cls: jax.Array | None = X.param(X.EMBED)
    positions: InputScheme
    token_scale: float = eqx.field(static=True)

    def __init__(self, dim: int, *, vocab_size: int | None = None,
                 input_dim: int | None = None, cls_token: bool = False,
                 positions: InputScheme | None = None, scale_tokens: bool = False,
                 table_std: float | None = None, key):
        if (vocab_size is None) == (input_dim is None):
            raise ValueError("Embedder: give exactly one of vocab_size (token ids) or input_dim "
                             "(continuous inputs)")
        if table_std is not None and not table_std > 0:
            raise ValueError(f"Embedder: table_std must be positive (or None for "
                             f"1 / sqrt(dim)), got {table_std}")
        k1, k2 = jax.random.split(key)
        if vocab_size is None:
            self.table = None
        elif table_std is None:
            self.table = jax.random.normal(k1, (vocab_size, dim)) / math.sqrt(dim)
        else:
            self.table = jax.random.normal(k1, (vocab_size, dim)) * table_std
        self.proj = (jax.random.normal(k1, (input_dim, dim)) / math.sqrt(input_dim)
                     if input_dim is not None else None)
        self.cls = 0.02 * jax.random.normal(k2, (dim,)) if cls_token else None
        self.positions = SinusoidalPositions() if positions is None else positions
        # Vaswani et al. 2017, section 3.4: the token embeddings times sqrt(dim) before the
        # positions are added (the table itself, which an output layer may share, is not).
        self.token_scale = math.sqrt(dim) if scale_tokens else 1.0
        if not isinstance(self.positions, InputScheme):
            raise ValueError(f"Embedder: {type(self.positions).__name__} is not an input position "
                             "scheme; give it to the blocks (block=dict(position=...))")

    def token_ids(self, inputs):
        """The token ids aligned with the embedded sequence, for layers that read them (hash
        routing): ``inputs int[B, L]`` with :data:`CLS_TOKEN_ID` prepended when ``cls``
        (``int[B, L + 1]``); None for continuous inputs."""
        if self.table is None:
            return None
        if self.cls is None:
            return inputs
        return jnp.concatenate([jnp.full((inputs.shape[0], 1), CLS_TOKEN_ID, inputs.dtype),
                                inputs], axis=1)

    def segment_problem(self) -> str | None:
        """Why this embedding cannot run packed rows (several documents per row), or None:
        every input scheme sees the restarted positions it is given, but CPE's convolution
        reaches across a document boundary."""
        if isinstance(self.positions, ConvPositions):
            return ("ConvPositions (CPE) convolves across neighbouring tokens, so across "
                    "documents")
        return None

    def __call__(self, inputs, *, mask=None, causal=False, offset=0, positions=None):
        """inputs: ``int[B, L]`` or ``[B, L, F]``; mask ``bool[B, L]``; positions ``int[B, L]``
        for the input scheme (default ``offset + 0 .. L-1``; packed rows restart them per
        document, ``nn.document_positions``). Returns ``(x, mask)`` (with the CLS position
        added when ``cls``)."""
        if self.table is not None:
            if not jnp.issubdtype(inputs.dtype, jnp.integer):
                raise ValueError(f"Embedder: token ids must be integers, got {inputs.dtype}")
            x = self.table[inputs]
            if self.token_scale != 1.0:
                x = x * self.token_scale
        else:
            if inputs.ndim != 3 or inputs.shape[-1] != self.proj.shape[0]:
                raise ValueError(f"Embedder: continuous inputs must be [B, L, "
                                 f"{self.proj.shape[0]}], got {inputs.shape}")
            x = inputs.astype(self.proj.dtype) @ self.proj
        b = x.shape[0]
        if self.cls is not None:
            x = jnp.concatenate([jnp.broadcast_to(self.cls, (b, 1, x.shape[-1])), x], axis=1)
            if mask is not None:
                mask = jnp.concatenate([jnp.ones((b, 1), bool), mask], axis=1)
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(x.shape[1]) + offset, x.shape[:2])
        elif self.cls is not None or positions.shape != x.shape[:2]:
            raise ValueError(f"Embedder: positions must be int[B, L] = {list(x.shape[:2])} "
                             f"without a CLS token, got {list(positions.shape)} "
                             f"(cls={self.cls is not None})")
        x = self.positions.embed(x, positions, mask=mask, causal=causal)
        return constrain(x, X.TOKENS), mask
