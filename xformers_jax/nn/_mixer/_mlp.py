"""Modules of the MLP, Fourier, pooling and lambda mixers (see :mod:`xformers_jax.mixers`).

Each replaces a block's attention sublayer; the block's norm and FFN stay around it.
"""

from __future__ import annotations

import math

import equinox as eqx
import jax
import jax.numpy as jnp

from ... import attention as A
from ... import mixers as M
from .._norms import LayerNorm
from .._slots import implements
from ._base import MixerModule, check_mask, dense, recurrent_cache, zero_padded


def _per_sequence(fn, x, kv_mask, *args):
    return jax.vmap(fn, in_axes=(0, None if kv_mask is None else 0) + (None,) * len(args))(
        x, kv_mask, *args)


@implements("mlp_mixer")
class MLPMixer(MixerModule):
    """MLP-Mixer's token-mixing MLP (Tolstikhin et al. 2021) with ``token_hidden`` units,
    weights sized by ``max_len`` (sequences up to it). Hyperparameter: ``token_hidden``."""

    w1: jax.Array
    b1: jax.Array
    w2: jax.Array
    b2: jax.Array

    def __init__(self, dim, num_heads, *, causal, max_len, key, token_hidden=256):
        k1, k2 = jax.random.split(key)
        self.w1 = dense(k1, max_len, token_hidden).T
        self.b1 = jnp.zeros((token_hidden,))
        self.w2 = dense(k2, token_hidden, max_len).T
        self.b2 = jnp.zeros((max_len,))

    def __call__(self, x, *, kv_mask=None, positions=None, key=None):
        x = check_mask("MLPMixer", x, kv_mask)
        y = _per_sequence(lambda x, m: M.token_mixing_mlp(x, self.w1, self.b1, self.w2,
                                                          self.b2, kv_mask=m), x, kv_mask)
        return zero_padded(y, kv_mask)


@implements("gmlp", "amlp")
class GMLP(MixerModule):
    """gMLP's unit (Liu et al. 2021): ``x -> gelu(x U) = [z1, z2] -> z1 * (W norm(z2) + b)
    (+ tiny attention for aMLP) -> V``, with ``W`` uniform in ``+-1e-3 / max_len`` and ``b = 1``
    (near identity), lower-triangular ``W`` when causal. Hyperparameters: ``expansion``
    (``d_ffn = expansion * dim``), ``attention_dim`` (aMLP's single head; 0: gMLP)."""

    w_in: jax.Array
    norm: LayerNorm
    w_spatial: jax.Array
    b_spatial: jax.Array
    w_out: jax.Array
    w_attn: jax.Array | None
    w_attn_out: jax.Array | None
    causal: bool = eqx.field(static=True)

    def __init__(self, dim, num_heads, *, causal, max_len, key, expansion=6, attention_dim=0):
        e = expansion * dim
        ks = jax.random.split(key, 5)
        self.w_in = dense(ks[0], dim, 2 * e)
        self.norm = LayerNorm(e)
        eps = 1e-3 / max_len
        self.w_spatial = jax.random.uniform(ks[1], (max_len, max_len), minval=-eps, maxval=eps)
        self.b_spatial = jnp.ones((max_len,))
        self.w_out = dense(ks[2], e, dim)
        self.w_attn = dense(ks[3], dim, 3 * attention_dim) if attention_dim else None
        self.w_attn_out = dense(ks[4], attention_dim, e) if attention_dim else None
        self.causal = causal

    def _tiny_attention(self, x, kv_mask):
        qkv = x @ self.w_attn.astype(x.dtype)
        q, k, v = jnp.split(qkv[:, :, None], 3, axis=-1)
        o = A.multihead(A.dot_product_attention)(q, k, v, causal=self.causal, kv_mask=kv_mask)
        return o[:, :, 0] @ self.w_attn_out.astype(x.dtype)

    def _gated_input(self, x):
        z = jax.nn.gelu(x @ self.w_in.astype(x.dtype))
        e = z.shape[-1] // 2
        return jnp.concatenate([z[..., :e], self.norm(z[..., e:]).astype(z.dtype)], -1)

    def __call__(self, x, *, kv_mask=None, positions=None, key=None):
        x = check_mask("GMLP", x, kv_mask)
        z = self._gated_input(x)
        extra = None if self.w_attn is None else self._tiny_attention(x, kv_mask)
        y = jax.vmap(lambda z, m, a: M.spatial_gating(
            z, self.w_spatial, self.b_spatial, causal=self.causal, kv_mask=m, extra=a),
            in_axes=(0, None if kv_mask is None else 0, None if extra is None else 0))(
            z, kv_mask, extra)
        return zero_padded(y @ self.w_out.astype(y.dtype), kv_mask)

    def init_cache(self, batch, max_len, dtype=jnp.float32):
        """The causal form's cache: every past ``norm(z2)`` row ``[B, max_len, E]`` (the
        spatial matrix's row t reads them all) and, for aMLP, the tiny attention's keys and
        values ``[B, max_len, d_attn]``; ``max_len`` is at most the weights' length."""
        if not self.causal:
            raise ValueError("GMLP.init_cache: only the causal form (lower-triangular spatial "
                             "matrix) decodes")
        _check_cache_len(max_len, self.b_spatial.shape[0])
        e = self.w_out.shape[0]
        rows = jnp.zeros((batch, max_len, e), jnp.float32)
        kv = None
        if self.w_attn is not None:
            a = self.w_attn_out.shape[0]
            kv = (jnp.zeros((batch, max_len, a), jnp.float32),) * 2
        return recurrent_cache((rows, kv))

    def decode(self, x, cache):
        """One step of the causal unit: ``gate_t = sum_{j <= t} W[t, j] norm(z2)_j + b_t``
        (plus aMLP's attention of token t over tokens <= t), ``y_t = z1_t gate_t``."""
        rows, kv = cache.state
        t = cache.index
        z = self._gated_input(x)[:, 0]  # [B, 2E]
        e = z.shape[-1] // 2
        put = lambda buf, r: jax.lax.dynamic_update_slice_in_dim(  # noqa: E731
            buf, r[:, None].astype(buf.dtype), t, axis=1)
        rows = put(rows, z[:, e:])
        n = rows.shape[1]
        seen = jnp.arange(n) <= t
        w_t = jnp.where(seen, jax.lax.dynamic_slice_in_dim(self.w_spatial, t, 1)[0, :n], 0)
        gate = (jnp.einsum("j,bje->be", w_t.astype(rows.dtype), rows)
                + jax.lax.dynamic_index_in_dim(self.b_spatial, t, keepdims=False)).astype(z.dtype)
        if kv is not None:
            q, k, v = jnp.split(x[:, 0] @ self.w_attn.astype(x.dtype), 3, axis=-1)
            kv = (put(kv[0], k), put(kv[1], v))
            scores = jnp.einsum("ba,bja->bj", q.astype(jnp.float32), kv[0]) / jnp.sqrt(
                q.shape[-1]).astype(jnp.float32)
            p = jax.nn.softmax(jnp.where(seen, scores, -jnp.inf), axis=-1)
            o = jnp.einsum("bj,bja->ba", p, kv[1]).astype(x.dtype)
            gate = gate + o @ self.w_attn_out.astype(x.dtype)
        y = z[:, :e] * gate
        out = (y @ self.w_out.astype(y.dtype))[:, None]
        return out, type(cache)((rows, kv), t + 1)


def _check_cache_len(max_len, weights_len):
    if max_len > weights_len:
        raise ValueError(f"GMLP.init_cache: max_len={max_len} exceeds the {weights_len} "
                         "positions its spatial weights were built for")


@implements("fnet")
class FNet(MixerModule):
    """FNet's Fourier mixing (Lee-Thorp et al. 2022): ``Re(FFT2(x))`` over ``max_len``
    positions (as the paper pads to its maximum length), no parameters."""

    max_len: int = eqx.field(static=True)

    def __init__(self, dim, num_heads, *, causal, max_len, key):
        self.max_len = max_len

    def __call__(self, x, *, kv_mask=None, positions=None, key=None):
        x = check_mask("FNet", x, kv_mask)
        y = _per_sequence(lambda x, m: M.fourier_mixing(x, max_len=self.max_len, kv_mask=m),
                          x, kv_mask)
        return zero_padded(y, kv_mask)


@implements("poolformer")
class PoolFormer(MixerModule):
    """PoolFormer's ``AvgPool(x) - x`` (Yu et al. 2022). Hyperparameter: ``pool_size``."""

    pool_size: int = eqx.field(static=True)

    def __init__(self, dim, num_heads, *, causal, max_len, key, pool_size=3):
        self.pool_size = pool_size

    def __call__(self, x, *, kv_mask=None, positions=None, key=None):
        x = check_mask("PoolFormer", x, kv_mask)
        y = _per_sequence(lambda x, m: M.pool_mixing(x, pool_size=self.pool_size, kv_mask=m),
                          x, kv_mask)
        return zero_padded(y, kv_mask)


@implements("lambda")
class Lambda(MixerModule):
    """A lambda layer (Bello 2021): ``num_heads`` query heads of width ``key_dim`` sharing
    one content lambda and the position lambdas; values of width ``dim / num_heads``.
    Hyperparameters: ``key_dim``, ``window`` (local-context radius; None: global, with
    ``2 max_len - 1`` relative embeddings). The paper's batch norms on q and v are omitted."""

    wq: jax.Array
    wk: jax.Array
    wv: jax.Array
    rel: jax.Array
    num_heads: int = eqx.field(static=True)
    window: int | None = eqx.field(static=True)

    def __init__(self, dim, num_heads, *, causal, max_len, key, key_dim=16, window=None):
        if dim % num_heads:
            raise ValueError(f"Lambda: dim={dim} is not divisible by num_heads={num_heads}")
        ks = jax.random.split(key, 4)
        self.wq = dense(ks[0], dim, num_heads * key_dim)
        self.wk = dense(ks[1], dim, key_dim)
        self.wv = dense(ks[2], dim, dim // num_heads)
        radius = max_len - 1 if window is None else window
        self.rel = jax.random.normal(ks[3], (2 * radius + 1, key_dim)) / math.sqrt(key_dim)
        self.num_heads, self.window = num_heads, window

    def __call__(self, x, *, kv_mask=None, positions=None, key=None):
        x = check_mask("Lambda", x, kv_mask)
        b, length, dim = x.shape
        q = (x @ self.wq.astype(x.dtype)).reshape(b, length, self.num_heads, -1)
        k, v = x @ self.wk.astype(x.dtype), x @ self.wv.astype(x.dtype)
        y = jax.vmap(lambda q, k, v, m: M.lambda_mixing(q, k, v, self.rel, window=self.window,
                                                        kv_mask=m),
                     in_axes=(0, 0, 0, None if kv_mask is None else 0))(q, k, v, kv_mask)
        return zero_padded(y.reshape(b, length, dim).astype(x.dtype), kv_mask)
