"""``MultiHeadAttention``: projections, heads, masks and decoding around any registered kind.

The attention itself is whatever :class:`~xformers_jax.nn.AttentionSpec` names (see
:mod:`._slots`), run by its record's :class:`~xformers_jax.kinds.AttentionAdapter`; everything
else (q/k/v/output projections, grouped-query heads, padding, causal masking, cross attention,
position schemes, decoding caches) is shared, so swapping one argument gives a different
X-former.
"""

from __future__ import annotations

import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from .. import attention as A
from .. import axes as X
from .. import kernels as K
from ..axes import constrain
from ..kinds import AttentionAdapter, Kind, KVDecoding, RecurrentDecoding, WindowDecoding
from ._cache import KVCache, PagedKVCache, RecurrentCache
from ._carry import Carry
from ._mixer._base import MixerModule
from ._positions import BiasScheme, InputScheme, PositionScheme, QKScheme
from ._slots import AttentionSpec, check_causal, sequence_problem


def _dense_init(key, fan_in, fan_out):
    return jax.random.normal(key, (fan_in, fan_out)) / math.sqrt(fan_in)


_HEADS, _EMBED = X.HEADS_LAYOUT, X.TOKENS  # activation layouts (xformers_jax.axes)


def _positions(batch, length, offset=0):
    return jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32) + offset, (batch, length))


class MultiHeadAttention(eqx.Module):
    """Multi-head (self or cross) attention over any registered attention kind.

    Inputs are batched, ``x: [B, Lq, dim]``: batch statistics (PowerNorm) and decoding caches
    are per batch, so modules here take the batch axis rather than being ``vmap``-ed over it.

    Args:
      dim: model width. num_heads: query heads. num_kv_heads: key/value heads (divides
        ``num_heads``: grouped-query attention, Ainslie et al., 2023; 1 is multi-query attention,
        Shazeer, 2019). head_dim: per-head width (``dim // num_heads`` by default). kv_dim: width of the cross-attention context.
      spec: the attention kind (:class:`AttentionSpec`; its hyperparameters are resolved
        with their declared defaults). causal: self-attention is causal.
      position: a :class:`QKScheme` or :class:`BiasScheme` (input schemes belong on the
        embeddings). max_len: the longest sequence (for variants with length-sized parameters).
      key: PRNG key for the parameters.
    """

    wq: jax.Array = X.param(X.EMBED, X.HEADS)
    wk: jax.Array = X.param(X.EMBED, X.HEADS)
    wv: jax.Array = X.param(X.EMBED, X.HEADS)
    wo: jax.Array = X.param(X.HEADS, X.EMBED)
    variant_params: object
    position: PositionScheme | None
    state_index: eqx.nn.StateIndex | None
    spec: AttentionSpec = eqx.field(static=True)
    num_heads: int = eqx.field(static=True)
    num_kv_heads: int = eqx.field(static=True)
    head_dim: int = eqx.field(static=True)
    causal: bool = eqx.field(static=True)

    def __init__(self, dim: int, num_heads: int, *, spec: AttentionSpec = AttentionSpec(),
                 num_kv_heads: int | None = None, head_dim: int | None = None,
                 kv_dim: int | None = None, causal: bool = False,
                 position: PositionScheme | None = None, max_len: int = 512, key):
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        if num_heads % num_kv_heads:
            raise ValueError(
                f"MultiHeadAttention: num_heads={num_heads} must be a multiple of "
                f"num_kv_heads={num_kv_heads}"
            )
        if head_dim is None:
            if dim % num_heads:
                raise ValueError(
                    f"MultiHeadAttention: dim={dim} is not divisible by num_heads={num_heads}; "
                    "pass head_dim"
                )
            head_dim = dim // num_heads
        if not isinstance(spec, AttentionSpec):
            raise ValueError(f"MultiHeadAttention: spec must be an AttentionSpec, got {spec!r}")
        kind = spec.record
        hp = kind.resolve(spec.params)
        check_causal(kind, causal)
        adapter = kind.adapter
        if adapter is None:
            raise ValueError(f"MultiHeadAttention: attention kind {spec.kind!r} has no adapter "
                             "(give its Kind record an AttentionAdapter)")
        if position is not None:
            if isinstance(position, InputScheme):
                raise ValueError(
                    f"MultiHeadAttention: {type(position).__name__} is added to the inputs; give "
                    "it to the model's embedding, not to the attention"
                )
            if isinstance(position, BiasScheme) and not kind.bias:
                raise ValueError(
                    f"MultiHeadAttention: {type(position).__name__} is an additive score bias, "
                    f"which attention kind {spec.kind!r} cannot take (it never forms softmax "
                    "scores q.k); use RotaryPositions or an input position scheme"
                )
        kv_dim = dim if kv_dim is None else kv_dim
        kq, kk, kv, ko, kp = jax.random.split(key, 5)
        self.wq = _dense_init(kq, dim, num_heads * head_dim)
        self.wk = _dense_init(kk, kv_dim, num_kv_heads * head_dim)
        self.wv = _dense_init(kv, kv_dim, num_kv_heads * head_dim)
        self.wo = _dense_init(ko, num_heads * head_dim, dim)
        self.variant_params = adapter.init(
            kp, hp, num_heads=num_heads, head_dim=head_dim, max_len=max_len,
            **({"dim": dim, "num_kv_heads": num_kv_heads} if adapter.takes_input else {}),
        )
        # Non-gradient state of the kind (routing centroids), kept in eqx.nn.State.
        self.state_index = None if adapter.state is None else eqx.nn.StateIndex(adapter.state(
            jax.random.fold_in(kp, 1), hp, num_heads=num_heads, head_dim=head_dim))
        self.position = position
        self.spec, self.causal = spec, causal
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim

    @property
    def record(self) -> Kind:
        """The attention kind's registered record."""
        return self.spec.record

    @property
    def params(self):
        """The kind's arrays as its adapter takes them: ``variant_params`` with fixed buffers
        (``axes.Buffer``: random features, LSH rotations) unwrapped, under ``stop_gradient``."""
        return X.unbuffer(self.variant_params)

    @property
    def adapter(self) -> AttentionAdapter:
        """How this layer runs its kind (the record's adapter)."""
        return self.record.adapter

    @property
    def rewrites_cache(self) -> bool:
        """Whether a decoding step changes cached entries besides the one it appends
        (``KVDecoding.update``: PaTH's transforms of every cached key)."""
        decoding = self.adapter.decoding
        return isinstance(decoding, KVDecoding) and decoding.update is not None

    def _call_hyperparameters(self) -> dict:
        """The spec's hyperparameters, defaults filled, without the ``init_only`` ones."""
        return self.adapter.call_hyperparameters(self.spec.resolved)

    def project(self, x, context=None):
        """The heads of ``x [B, Lq, dim]`` (and of ``context [B, Lk, kv_dim]`` for cross
        attention): ``q [B, Lq, H, Dk]``, ``k [B, Lk, Hkv, Dk]``, ``v [B, Lk, Hkv, Dv]``, for
        callers that attend their own way (memories, feedback, decoding)."""
        b, lq, _ = x.shape
        src = x if context is None else context
        q = (x @ self.wq.astype(x.dtype)).reshape(b, lq, self.num_heads, self.head_dim)
        k = (src @ self.wk.astype(x.dtype)).reshape(b, src.shape[1], self.num_kv_heads, -1)
        v = (src @ self.wv.astype(x.dtype)).reshape(b, src.shape[1], self.num_kv_heads, -1)
        return constrain(q, _HEADS), constrain(k, _HEADS), constrain(v, _HEADS)

    def _bias(self, q, k, q_pos, k_pos):
        if not isinstance(self.position, BiasScheme):
            return None
        return self.position.bias(q, k, q_pos, k_pos, 1.0 / math.sqrt(self.head_dim))

    def exact_heads(self, q, k, v, q_pos, k_pos, kv_mask, pattern=None):
        """Exact softmax attention of heads ``q [B, Lq, H, Dk]`` over ``k, v [B, Lk, Hkv, D]``
        at positions ``q_pos [B, Lq]``, ``k_pos [B, Lk]`` (this layer's q/k rotation or score
        bias), keys ``kv_mask [B, Lk]`` and ``pattern`` (None: every unmasked key) ->
        ``[B, Lq, H, Dv]``: how a memory (``nn.memory_attention``, decoding across segments)
        attends with the layer's positions; ``flash`` for the ``flash`` kind, the dense
        reference otherwise."""
        if isinstance(self.position, QKScheme):
            q, k = self.position.rotate(q, q_pos), self.position.rotate(k, k_pos)
        kw = {}
        if isinstance(self.position, BiasScheme):
            kw["bias"] = self._bias(q, k, q_pos, k_pos)
        fn = A.flash_attention if self.spec.kind == "flash" else A.dot_product_attention
        return A.multihead(lambda *a, **k_: fn(*a, pattern=pattern, **k_),
                           kwarg_axes={"bias": "batch_heads"})(q, k, v, kv_mask=kv_mask, **kw)

    def sequence_problem(self) -> str | None:
        """Why this layer cannot run with its sequence split over devices, or None."""
        if isinstance(self.position, BiasScheme):
            return (f"{type(self.position).__name__} adds a score bias, which the "
                    "sequence-parallel forms do not take; use RotaryPositions or an input "
                    "position scheme")
        return sequence_problem(self.record, self.spec.resolved, causal=self.causal)

    def segment_problem(self) -> str | None:
        """Why this layer cannot run packed rows (``segment_ids``: several documents in one
        row, none attending to another), or None (``Kind.segments``)."""
        return self.record.segment_problem(self.spec.resolved)

    def _attend(self, causal):
        """The kind's attend, or its sequence-parallel form when the active mesh splits the
        sequence (``xformers_jax.axes.sequence_shards``); raises ``NotImplementedError`` when
        the kind cannot run split."""
        shards = X.sequence_shards()
        if shards == 1:
            return self.adapter.attend
        if isinstance(self.position, BiasScheme):
            raise NotImplementedError(f"MultiHeadAttention: {self.sequence_problem()}")
        problem = sequence_problem(self.record, self.spec.resolved, causal=causal)
        if problem is not None:
            raise NotImplementedError(f"{problem}; the active mesh splits the sequence over "
                                      f"{shards} devices")
        return self.adapter.sequence.attend

    def output(self, o):
        """The output projection of heads ``o [B, Lq, H, Dv]`` -> ``[B, Lq, dim]``."""
        b, lq = o.shape[:2]
        o = constrain(o, _HEADS)
        return constrain(o.reshape(b, lq, -1) @ self.wo.astype(o.dtype), _EMBED)

    def __call__(self, x: Float[Array, "batch q_seq dim"],
                 context: Float[Array, "batch kv_seq kv_dim"] | None = None, *,
                 kv_mask: Bool[Array, "batch kv_seq"] | None = None,
                 q_mask: Bool[Array, "batch q_seq"] | None = None,
                 positions: Int[Array, "batch q_seq"] | None = None,
                 segment_ids: Int[Array, "batch q_seq"] | None = None, key=None,
                 inference=False, carry: Carry | None = None):
        """x: ``[B, Lq, dim]``; context: ``[B, Lk, kv_dim]`` for cross attention (None for
        self attention); kv_mask: ``bool[B, Lk]``; q_mask: ``bool[B, Lq]``, the real queries
        (default: ``kv_mask`` in self-attention, none padded in cross attention); positions:
        int ``[B, Lq]`` (default ``0..Lq-1``; packed rows restart them at each document,
        ``nn.document_positions``); segment_ids: int ``[B, Lq]`` for packed rows of self
        attention, the document of each token (0: padding, whose keys are then masked): a
        query sees only keys of its own document, for kinds that honour them
        (``Kind.segments``; any other raises ``ValueError`` naming the kind); key:
        randomness for the kind. Returns
        ``[B, Lq, dim]``, zero at padded queries: padding changes no real output (the
        attention contract, :mod:`xformers_jax.attention._contract`); with a ``carry``
        (:class:`~xformers_jax.nn.Carry`) ``(out, carry)``.

        A kind with state (routing attention: ``state_index`` is set) needs the
        ``eqx.nn.State`` from ``eqx.nn.make_with_state`` as ``carry.state`` and returns it
        updated; with ``inference=True`` it leaves its state unchanged.

        A kind that reports auxiliary losses (``AttentionAdapter.aux``: DeepSeek sparse
        attention's ``indexer_kl``) computes them only in a training call (``inference``
        False) with a ``carry``, and writes them into ``carry.aux`` (the block adds the FFN
        slot's beside them).

        A kind that passes scores between layers (``carries_between_layers``: Realformer,
        Predictive attention, Lazyformer) needs the previous layer's as ``carry.scores``
        (:meth:`init_layer_carry` for the first) and returns its own there;
        :class:`~xformers_jax.nn.LayerStack` threads them."""
        extra = {}
        if self.carries_between_layers:
            if carry is None or carry.scores is None or context is not None:
                raise ValueError(f"MultiHeadAttention: attention kind {self.spec.kind!r} passes "
                                 "scores from layer to layer: use it for self attention inside "
                                 "a LayerStack (any model), or pass carry=nn.Carry(scores=...) "
                                 "(init_layer_carry for the first layer)")
            extra["carry"] = carry.scores
        if self.adapter.takes_input:
            if context is not None:
                raise ValueError(f"MultiHeadAttention: attention kind {self.spec.kind!r} is self "
                                 "attention only (it projects global tokens from the input)")
            extra["inputs"] = x
        if self.state_index is not None:
            if carry is None or carry.state is None:
                raise ValueError(f"MultiHeadAttention: attention kind {self.spec.kind!r} keeps "
                                 "state; build the model with eqx.nn.make_with_state and pass "
                                 "its state (carry=nn.Carry(state=state))")
            extra.update(state=carry.state.get(self.state_index), inference=inference)
        q, k, v = self.project(x, context)
        b, lq = x.shape[:2]
        q_mask = kv_mask if q_mask is None and context is None else q_mask
        if q_mask is not None and q_mask.shape != (b, lq):
            raise ValueError(f"MultiHeadAttention: q_mask must be bool[B, Lq] = [{b}, {lq}] but "
                             f"has shape {q_mask.shape}")
        if segment_ids is not None:
            segment_ids = jnp.asarray(segment_ids)
            extra["segment_ids"] = segment_ids
            kv_mask = self._check_segments(segment_ids, context, kv_mask, b, lq)
            # Self attention: the queries are the keys, so padding (segment 0) is out of both.
            q_mask = kv_mask if q_mask is None else q_mask & kv_mask
        q_pos = _positions(b, lq) if positions is None else positions
        k_pos = q_pos if context is None else _positions(b, k.shape[1])
        if isinstance(self.position, QKScheme):
            q, k = self.position.rotate(q, q_pos), self.position.rotate(k, k_pos)
        causal = self.causal and context is None
        reports = bool(self.adapter.aux) and carry is not None and not inference
        if self.adapter.aux:
            extra["return_aux"] = reports
        o = self._attend(causal)(
            q, k, v, self.params, causal=causal, kv_mask=kv_mask, q_mask=q_mask,
            bias=self._bias(q, k, q_pos, k_pos), key=key, **extra, **self._call_hyperparameters(),
        )
        carried = self.state_index is not None or self.carries_between_layers or reports
        o, value = o if carried else (o, None)
        if q_mask is not None:
            o = jnp.where(q_mask[:, :, None, None], o, jnp.zeros((), o.dtype))
        out = self.output(o)
        if carry is None:
            return out
        if self.carries_between_layers:
            return out, carry.replace(scores=value)
        if self.state_index is not None:
            return out, carry.replace(state=carry.state.set(self.state_index, value))
        if reports:
            return out, carry.replace(aux={**carry.aux, **value})
        return out, carry

    def _check_segments(self, segment_ids, context, kv_mask, b, lq):
        """The checks of packed rows; returns the key mask with segment 0 (padding) out."""
        problem = self.segment_problem()
        if problem is not None:
            raise ValueError(f"MultiHeadAttention: {problem}")
        if context is not None:
            raise ValueError("MultiHeadAttention: segment_ids are for self attention (packed "
                             "rows); cross attention takes kv_mask")
        if segment_ids.shape != (b, lq) or not jnp.issubdtype(segment_ids.dtype, jnp.integer):
            raise ValueError(f"MultiHeadAttention: segment_ids must be int[B, Lq] = [{b}, {lq}], "
                             f"got {segment_ids.dtype}{list(segment_ids.shape)}")
        if X.sequence_shards() > 1:
            raise NotImplementedError("MultiHeadAttention: the sequence-parallel forms (ring, "
                                      "halo) take no segment_ids; train packed rows without a "
                                      "sequence split")
        real = segment_ids > 0
        return real if kv_mask is None else kv_mask & real

    @property
    def carries_between_layers(self) -> bool:
        """Whether the kind passes scores from one layer to the next
        (``AttentionAdapter.layer_carry``)."""
        return self.adapter.layer_carry is not None

    def init_layer_carry(self, batch: int, length: int, num_layers: int):
        """The carry the first layer of a ``num_layers`` stack receives (self attention over
        ``length`` tokens)."""
        return self.adapter.layer_carry(
            batch, length, length, self._call_hyperparameters(), num_heads=self.num_heads,
            head_dim=self.head_dim, num_layers=num_layers)

    # -- decoding ------------------------------------------------------------------------------

    def init_cache(self, batch: int, max_len: int, dtype=jnp.float32):
        """An empty decoding cache for causal self-attention (kind given by the registry)."""
        decoding = self.adapter.decoding
        hp = self._call_hyperparameters()
        if not self.causal:
            raise ValueError("MultiHeadAttention.init_cache: only causal self-attention decodes")
        if isinstance(decoding, (KVDecoding, WindowDecoding)):
            ring = isinstance(decoding, WindowDecoding)
            capacity = decoding.left(hp) + 1 if ring else max_len
            heads, dk, dv = self.num_kv_heads, self.head_dim, self.head_dim
            if not ring and decoding.widths is not None:
                heads, dk, dv = decoding.widths(hp, num_heads=self.num_heads, num_kv_heads=heads,
                                                head_dim=dk)
            return KVCache.empty(batch, capacity, heads, dk, dv, dtype, ring=ring)
        if isinstance(decoding, RecurrentDecoding):
            state = decoding.init_state(batch, self.num_heads, self.head_dim, self.head_dim,
                                        self.params, **hp)
            return RecurrentCache(state, jnp.zeros((), jnp.int32))
        raise NotImplementedError(f"attention kind {self.spec.kind!r} has no decoding cache")

    def decode(self, x, cache):
        """One causal decoding step: x ``[B, 1, dim]`` at position ``cache.index``.
        Returns ``(out [B, 1, dim], new_cache)``."""
        b = x.shape[0]
        q, k, v = self.project(x, None)
        t_pos = jnp.broadcast_to(cache.index, (b, 1))
        if isinstance(self.position, QKScheme):
            q, k = self.position.rotate(q, t_pos), self.position.rotate(k, t_pos)
        if isinstance(cache, RecurrentCache):
            o, state = self.adapter.decoding.step(
                cache.state, q[:, 0], k[:, 0], v[:, 0], self.params,
                **self._call_hyperparameters())
            return self.output(o[:, None]), RecurrentCache(state, cache.index + 1)
        decoding = self.adapter.decoding
        own = isinstance(decoding, KVDecoding) and decoding.attend is not None
        rewrites = self.rewrites_cache
        if isinstance(cache, PagedKVCache):
            if own or rewrites:
                raise NotImplementedError(
                    f"MultiHeadAttention: attention kind {self.spec.kind!r} decodes over a cache "
                    "of its own (KVDecoding.attend or .update), which a paged cache does not "
                    "hold; serve it with one cache per slot (page_size=None)")
            return self._decode_paged(q, k, v, t_pos, cache)
        if rewrites:
            # Cached keys that change with every new token (PaTH's transforms), before the
            # token's own entry is appended.
            new_k = decoding.update(
                cache.keys(), self.params, inputs=x, index=cache.index,
                valid=jnp.broadcast_to(cache.valid, (b, cache.pos.shape[0])),
                **self._call_hyperparameters())
            cache = eqx.tree_at(lambda c: c.k, cache,
                                jnp.swapaxes(new_k, 1, 2).astype(cache.k.dtype))
        if own:
            # The kind's own attention over its own cache (two maps, a selection of cached
            # blocks, a compressed latent): KVDecoding's hooks.
            hp = self._call_hyperparameters()
            if decoding.entry is not None:
                k, v = decoding.entry(x, k, v, self.params, position=cache.index, **hp)
            cache = cache.append(k, v)
            valid = jnp.broadcast_to(cache.valid, (b, cache.pos.shape[0]))
            if self.adapter.takes_input:
                hp = {**hp, "inputs": x}
            o = decoding.attend(q, cache.keys(), cache.values(), self.params, valid=valid,
                                index=cache.index, **hp)
            return self.output(o), cache
        pattern = decoding.pattern_for(self.spec.resolved) if isinstance(
            decoding, KVDecoding) else None
        if not isinstance(self.position, BiasScheme):
            # The held keys are read before the step's key is written (into the slot it
            # overwrites: empty, or for a ring the one just out of the window), so the cache is
            # updated in place rather than copied to be read after the write.
            t, n = cache.index, cache.pos.shape[0]
            valid = cache.valid & (jnp.arange(n) != t % n)
            own = jnp.ones((), bool)
            if pattern is not None and not cache.ring:
                row = jnp.asarray(pattern.dense(n, n))[jnp.minimum(t, n - 1)]
                valid, own = valid & row[jnp.maximum(cache.pos, 0)], row[jnp.minimum(t, n - 1)]
            o = _one_query(q[:, 0], cache.k, cache.v, valid[None], new=(k[:, 0], v[:, 0], own))
            return self.output(o[:, None]), cache.append(k, v)
        cache = cache.append(k, v)
        valid = cache.valid
        if pattern is not None and not cache.ring:
            n = cache.pos.shape[0]
            row = jnp.asarray(pattern.dense(n, n))[cache.index - 1]
            valid = valid & row[jnp.maximum(cache.pos, 0)]
        # A score bias is a function of the query and key positions over the [B, C, H, D]
        # layout of the attention functions: the general path (a copy of the cache).
        k_pos = jnp.broadcast_to(jnp.maximum(cache.pos, 0), (b, cache.pos.shape[0]))
        keys = cache.keys()
        o = A.multihead(A.dot_product_attention, kwarg_axes={"bias": "batch_heads"})(
            q, keys, cache.values(), kv_mask=jnp.broadcast_to(valid, k_pos.shape),
            bias=self._bias(q, keys, t_pos, k_pos))
        return self.output(o), cache

    def _decode_paged(self, q, k, v, t_pos, cache: PagedKVCache):
        """The step over a paged cache: exact softmax over the sequence's held keys (those
        its kind's window or pattern admits) and the step's own key, which comes back in
        ``cache.new_k`` / ``new_v`` for the caller to write."""
        decoding = self.adapter.decoding
        if not isinstance(decoding, (KVDecoding, WindowDecoding)):
            raise ValueError(f"MultiHeadAttention: attention kind {self.spec.kind!r} decodes "
                             f"with a {type(decoding).__name__}, not a key/value cache; only "
                             "exact and windowed kinds take a paged cache")
        if q.shape[0] != 1:
            raise ValueError(f"MultiHeadAttention: a paged cache is one sequence's view (batch "
                             f"1; vmap over sequences), got a batch of {q.shape[0]}")
        t = cache.length
        m, p = cache.table.shape[0], cache.k_pages.shape[1]
        n = m * p  # the positions the page table can hold
        left = row = None
        own = jnp.ones((), bool)
        if isinstance(decoding, WindowDecoding):
            left = decoding.left(self._call_hyperparameters())
        else:
            pattern = decoding.pattern_for(self.spec.resolved)
            if pattern is not None:
                row = jnp.asarray(pattern.dense(n, n))[jnp.minimum(t, n - 1)]
                own = row[jnp.minimum(t, n - 1)]

        def admitted(pos):
            """Which held positions ``pos int[...] < n`` the step's query sees."""
            ok = pos < t
            if left is not None:
                ok = ok & (pos >= t - left)
            if row is not None:
                ok = ok & row[jnp.minimum(pos, n - 1)]
            return ok

        if isinstance(self.position, BiasScheme):
            # A score bias over the [B, C, H, D] layout: the sequence's pages gathered (a copy).
            held_k, held_v, held_pos = cache.gather()
            keys = jnp.concatenate([held_k, k.astype(held_k.dtype)], axis=1)
            values = jnp.concatenate([held_v, v.astype(held_v.dtype)], axis=1)
            k_pos = jnp.concatenate([held_pos, t[None]])[None]
            kv_mask = jnp.concatenate([admitted(held_pos), own[None]])[None]
            o = A.multihead(A.dot_product_attention, kwarg_axes={"bias": "batch_heads"})(
                q, keys, values, kv_mask=kv_mask, bias=self._bias(q, keys, t_pos, k_pos))
        else:
            first = 0 if left is None else jnp.maximum(t - left, 0)
            o = _paged_one_query(q[0, 0], cache.k_pages, cache.v_pages, cache.table, first, t,
                                 admitted, new=(k[0, 0], v[0, 0], own))[None, None]
        new = eqx.tree_at(lambda c: (c.new_k, c.new_v), cache,
                          (k[0].astype(cache.new_k.dtype), v[0].astype(cache.new_v.dtype)))
        return self.output(o), new


# Slots of a paged cache read per iteration of the paged step: pages are taken this many
# slots at a time (a small gather), so that small pages do not make the loop's overhead the
# step's cost while the copy stays far smaller than the sequence's cache.
_PAGED_SLOTS = 512


def _paged_one_query(q, k_pages, v_pages, table, first, t, admitted, new, *,
                     slots: int = _PAGED_SLOTS):
    """Exact softmax attention of one query per head over one sequence's pages, read where
    they lie: ``q [H, Dk]``, the pool ``k_pages [N, P, Hkv, Dk]``, ``v_pages [N, P, Hkv, Dv]``,
    the sequence's ``table int[M]`` (entry ``j`` holds positions ``j P .. j P + P - 1``),
    ``first``/``t`` (int: the first position it may see and the number held), ``admitted(pos
    int[S]) -> bool[S]`` (the positions the query sees: its window or pattern) and ``new =
    (k_t [Hkv, Dk], v_t [Hkv, Dv], own bool[])``, the step's own key and value -> ``[H, Dv]``
    in q's dtype.

    The table's entries from ``first``'s page to ``t``'s are visited a few pages at a time
    (``slots`` slots) by the online softmax (Milakov & Gimelshein, 2018; Kwon et al.,
    2023, read a sequence's pages where they lie in the same way): the sequence's keys and
    values are read once, and the pages past its length or before its window not at all,
    where gathering them into a dense copy first read and wrote the whole table's worth.
    Scores and statistics are float32; the values of positions not admitted are zeroed (a
    page handed out again holds what its last owner wrote, or NaN when poisoned)."""
    h, dk = q.shape
    _, p, hkv, dv = v_pages.shape
    g = max(1, slots // p)  # pages per iteration
    blocks = -(-table.shape[0] // g)
    table = jnp.pad(table, (0, blocks * g - table.shape[0]))  # scratch page 0: not admitted
    qg = q.reshape(hkv, h // hkv, dk)
    scale = 1.0 / math.sqrt(dk)
    f32 = K.STATS_DTYPE

    def body(j, carry):
        pages = jax.lax.dynamic_slice_in_dim(table, j * g, g)
        pos = j * g * p + jnp.arange(g * p)
        ok = admitted(pos)
        kb = k_pages[pages].reshape(g * p, hkv, dk)
        vb = K.select_real_keys(v_pages[pages].reshape(g * p, hkv * dv), ok)
        s = jnp.einsum("kgd,ckd->kgc", qg, kb.astype(q.dtype), preferred_element_type=f32)
        s = jnp.where(ok, s * scale, -jnp.inf)
        return K.online_step(s, *carry, lambda pr: jnp.einsum(
            "kgc,ckd->kgd", pr.astype(vb.dtype), vb.reshape(g * p, hkv, dv),
            preferred_element_type=f32))

    init = (jnp.full((hkv, h // hkv, 1), -jnp.inf, f32), jnp.zeros((hkv, h // hkv, 1), f32),
            jnp.zeros((hkv, h // hkv, dv), f32))
    start, stop = first // (g * p), (t + g * p - 1) // (g * p)
    carry = jax.lax.fori_loop(start, stop, body, init)
    k_t, v_t, own = new
    s_t = jnp.einsum("kgd,kd->kg", qg, k_t.astype(q.dtype), preferred_element_type=f32)
    s_t = jnp.where(own, s_t * scale, -jnp.inf)[..., None]
    carry = K.online_step(s_t, *carry, lambda pr: pr * v_t[:, None, :].astype(f32))
    out, _ = K.finish(*carry)
    return out.reshape(h, dv).astype(q.dtype)


def _one_query(q, k, v, valid, new=None):
    """Exact softmax attention of one query per head over a heads-first key/value cache:
    ``q [B, H, Dk]``, ``k [B, Hkv, C, Dk]``, ``v [B, Hkv, C, Dv]``, ``valid bool[1 or B, C]``
    and, when given, ``new = (k_t [B, Hkv, Dk], v_t [B, Hkv, Dv], own bool[])``: the step's
    own key and value, attended when ``own``, without being written into the cache first
    -> ``[B, H, Dv]`` in q's dtype (Vaswani et al., 2017, at ``Lq = 1``).

    A decoding step is bound by reading the cache, not by arithmetic: each key/value head's
    ``[C, D]`` block is read once, contiguously, as a matrix-vector product with its group of
    ``H / Hkv`` query heads (grouped-query attention, Ainslie et al., 2023, folded into the
    product rather than repeating the cache), and invalid slots are masked on the ``[C]`` score
    row (no ``[C, D]`` mask). The tiled kernel and ``multihead``'s per-head map are for many
    queries; at one query they transpose or re-read the cache. Scores, the softmax and the
    accumulation are float32; a query that sees no key gets zeros, as in
    ``attention.dot_product_attention``."""
    b, h, dk = q.shape
    hkv = k.shape[1]
    qg = q.reshape(b, hkv, h // hkv, dk)
    scale = 1.0 / math.sqrt(dk)
    s = jnp.einsum("bkgd,bkcd->bkgc", qg, k.astype(q.dtype),
                   preferred_element_type=jnp.float32) * scale
    mask = valid[:, None, None, :]
    s = jnp.where(mask, s, -jnp.inf)
    m = jnp.max(s, axis=-1)
    if new is not None:
        k_t, v_t, own = new
        s_t = jnp.einsum("bkgd,bkd->bkg", qg, k_t.astype(q.dtype),
                         preferred_element_type=jnp.float32) * scale
        s_t = jnp.where(own, s_t, -jnp.inf)
        m = jnp.maximum(m, s_t)
    m = jax.lax.stop_gradient(jnp.where(jnp.isfinite(m), m, 0.0))
    p = jnp.where(mask, jnp.exp(s - m[..., None]), 0.0)
    den = p.sum(-1)
    o = jnp.einsum("bkgc,bkcd->bkgd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    if new is not None:
        p_t = jnp.where(own, jnp.exp(s_t - m), 0.0)
        den = den + p_t
        o = o + p_t[..., None] * v_t[:, :, None, :].astype(jnp.float32)
    o = o / jnp.where(den == 0, 1.0, den)[..., None]
    return o.reshape(b, h, v.shape[-1]).astype(q.dtype)


def redraw_random_features(model, key):
    """Returns ``model`` with fresh Performer random features in every ``performer`` attention
    (Choromanski et al., 2021: periodic redrawing), each drawn from its own fold of ``key``.
    Works on stacked layers (a leading layer axis on the projection)."""
    count = [0]

    def redraw(node):
        if not isinstance(node, MultiHeadAttention) or node.spec.kind != "performer":
            return node
        old = node.variant_params.value
        count[0] += 1
        sub = jax.random.fold_in(key, count[0])
        lead = old.shape[:-2]
        keys = jax.random.split(sub, int(np.prod(lead, dtype=int))).reshape(*lead, -1) if lead \
            else sub
        draw = lambda k: A.init_random_projection(k, old.shape[-2], old.shape[-1])  # noqa: E731
        for _ in lead:
            draw = jax.vmap(draw)
        return eqx.tree_at(lambda m: m.variant_params, node,
                           X.Buffer(draw(keys).astype(old.dtype)))

    return jax.tree_util.tree_map(redraw, model,
                                  is_leaf=lambda x: isinstance(x, MultiHeadAttention))


def check_sequence_parallel(model, shards: int) -> None:
    """Raises ``ValueError`` unless every attention layer of ``model`` can run with its
    sequence split over ``shards`` devices (the ``sequence`` strategy), naming each kind (and
    reason) that cannot. Models call the sequence-parallel forms by themselves when the active
    mesh splits the sequence; this check lets a trainer fail when the model is built, not at
    the first step. Token mixers (``nn.MixerSpec``) have no sequence-parallel form yet: a
    model with one fails here, naming the mixer."""
    if shards == 1:
        return
    layer_types = (MultiHeadAttention, MixerModule)
    layers = [m for m in jax.tree_util.tree_leaves(
        model, is_leaf=lambda x: isinstance(x, layer_types)) if isinstance(m, layer_types)]
    problems = sorted({p for p in (m.sequence_problem() for m in layers) if p is not None})
    if problems:
        raise ValueError(f"this model cannot run with its sequence split over {shards} "
                         "devices: " + "; ".join(problems))


def routing_commitment_loss(model, state):
    """The sum over every routing attention in ``model`` (layers of a stack included) of the
    commitment loss its last call recorded in ``state`` (Roy et al.'s auxiliary term, which
    pulls routed queries and keys towards their centroids; the state is the kind's
    ``RoutingCentroids``). Add it, weighted, to the loss."""
    total = jnp.zeros((), jnp.float32)
    modules = jax.tree_util.tree_leaves(model,
                                        is_leaf=lambda x: isinstance(x, MultiHeadAttention))
    for m in modules:
        if isinstance(m, MultiHeadAttention) and m.state_index is not None:
            total = total + jnp.sum(state.get(m.state_index).commitment_loss)
    return total
