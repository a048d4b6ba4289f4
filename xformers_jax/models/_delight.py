"""DeLighT (Mehta et al., 2021, "DeLighT: Deep and Light-weight Transformer").

* The DeLighT transformation (:class:`DeLighTTransform`, the DeFINE unit of Mehta et al.,
  2020) maps ``d_m`` to ``d_o`` through ``N`` group linear transformations (GLTs,
  :class:`GroupLinear`): the first ``ceil(N/2)`` layers expand the width linearly from ``d_m``
  to ``w_m d_m``, the rest reduce it linearly to ``d_o``. Layer ``l`` (1-based) has
  ``g^l = min(2^(l-1), g_max)`` groups for ``l <= ceil(N/2)`` and ``g^l = g^(N-l+1)`` after
  (mirrored; eq. 3 prints ``g^(N-l)``, one layer off, and the authors' code mirrors), each
  group a separate linear map of its slice of the features (eq. 3's ``2^(l-1)``: the authors'
  code starts at ``2^l``). Between layers
  the features are shuffled across groups, and the input mixer feeds every layer after the
  first the group-wise concatenation of the input ``X`` and the previous output
  ``Y^(l-1)``: ``Y^l = F(H(X, Y^(l-1)), W^l, g^l)``. A GELU follows every layer but the last.
* The DeLighT block (:class:`DeLighTBlock`): the transformation reduces to ``d_o = d_m / 2``,
  a single-head attention works at that width, a linear map goes back to ``d_m``; the light
  FFN reduces ``d_m -> d_m / r`` and expands back (``r = 4``), the reverse of the usual FFN.
* Block-wise scaling (:func:`delight_scaling`, eq. 4): block ``b`` of ``B`` has depth
  ``N^b = N_min + (N_max - N_min) b / (B - 1)`` and width multiplier
  ``w_m^b = w_m + (N_max - N_min) b / (N_min (B - 1))``: shallow and narrow near the input,
  deep and wide near the output (:class:`DeLighTStack`; the blocks differ in shape, so they
  are a tuple run in order, not a scanned stack). Eq. 4 leaves ``N^b`` fractional; the
  authors' code takes its integer part (``np.linspace(N_min, N_max, B, dtype=int)``) and
  spaces the multipliers linearly from ``w_m`` to ``w_m + N_max / N_min - 1``, the same
  values as eq. 4's ``w_m^b``; this module does both.

The expansion widths between ``d_m`` and ``w_m d_m`` are "linear" in the paper without a
formula; here layer ``l <= ceil(N/2)`` has width ``d_m + (w_m d_m - d_m) l / ceil(N/2)`` (the
authors' code instead spaces ``ceil(N/2)`` widths from ``d_m`` itself to ``w_m d_m``, and
wraps the GLTs in a linear input projection and a linear output layer over the mixed input).
"""

from __future__ import annotations

import math

import equinox as eqx
import jax
import jax.numpy as jnp

from ..nn import AttentionSpec, LayerNorm, MultiHeadAttention


def shuffle(y, groups: int):
    """Feature shuffling across ``groups``: ``[..., g * c] -> [..., c * g]`` (the channel
    ``j`` of group ``i`` moves to position ``j * g + i``)."""
    if groups == 1:
        return y
    *lead, w = y.shape
    return y.reshape(*lead, groups, w // groups).swapaxes(-1, -2).reshape(*lead, w)


def group_concat(a, b, groups: int):
    """The input mixer ``H``: group ``i`` of the result is group ``i`` of ``a`` followed by
    group ``i`` of ``b``."""
    *lead, wa = a.shape
    wb = b.shape[-1]
    ga = a.reshape(*lead, groups, wa // groups)
    gb = b.reshape(*lead, groups, wb // groups)
    return jnp.concatenate([ga, gb], -1).reshape(*lead, wa + wb)


class GroupLinear(eqx.Module):
    """A group linear transformation: ``[..., d_in] -> [..., d_out]``, the input split into
    ``groups`` slices, each mapped by its own ``[d_in/g, d_out/g]`` matrix (plus a bias)."""

    weight: jax.Array
    bias: jax.Array
    groups: int = eqx.field(static=True)

    def __init__(self, d_in: int, d_out: int, groups: int, *, key):
        if d_in % groups or d_out % groups:
            raise ValueError(f"GroupLinear: d_in={d_in} and d_out={d_out} must be divisible by "
                             f"groups={groups}")
        self.weight = jax.random.normal(key, (groups, d_in // groups, d_out // groups)) / \
            math.sqrt(d_in // groups)
        self.bias = jnp.zeros((d_out,))
        self.groups = groups

    def __call__(self, x):
        *lead, d = x.shape
        g = self.groups
        xs = x.reshape(*lead, g, d // g)
        y = jnp.einsum("...gi,gio->...go", xs, self.weight.astype(x.dtype))
        return y.reshape(*lead, -1) + self.bias.astype(x.dtype)


def delight_widths(d_m: int, d_o: int, depth: int, width_mult: float, max_groups: int):
    """``(widths, groups)`` of the ``depth`` GLT layers: the output width of each (the last is
    ``d_o``; the others rounded to a multiple of ``max_groups``) and its number of groups."""
    half = math.ceil(depth / 2)
    grow = [min(2 ** i, max_groups) for i in range(half)]
    groups = grow + grow[:depth - half][::-1]
    wide = width_mult * d_m
    widths = []
    for layer in range(1, depth + 1):
        if layer <= half:
            w = d_m + (wide - d_m) * layer / half
        else:
            w = wide + (d_o - wide) * (layer - half) / (depth - half)
        widths.append(max(max_groups, int(round(w / max_groups)) * max_groups))
    widths[-1] = d_o
    return widths, groups


class DeLighTTransform(eqx.Module):
    """The expand-reduce DeLighT transformation ``[..., d_m] -> [..., d_o]`` (module
    docstring). Args: d_m, d_o: widths. depth: ``N`` GLT layers. width_mult: ``w_m``.
    max_groups: ``g_max`` (``d_m`` and ``d_o`` must be multiples of it when ``depth > 1``)."""

    layers: tuple
    widths: tuple = eqx.field(static=True)

    def __init__(self, d_m: int, d_o: int, *, depth: int, width_mult: float = 2.0,
                 max_groups: int = 4, key):
        if depth < 1 or max_groups < 1 or (depth > 1 and (d_m % max_groups or d_o % max_groups)):
            raise ValueError(f"DeLighTTransform: depth={depth} >= 1 and d_m={d_m}, d_o={d_o} "
                             f"multiples of max_groups={max_groups} expected")
        widths, groups = delight_widths(d_m, d_o, depth, width_mult, max_groups)
        keys = jax.random.split(key, depth)
        layers, d_in = [], d_m
        for i, (w, g) in enumerate(zip(widths, groups)):
            layers.append(GroupLinear(d_in if i == 0 else d_m + d_in, w, g, key=keys[i]))
            d_in = w
        self.layers, self.widths = tuple(layers), tuple(widths)

    def __call__(self, x):
        y = None
        for i, layer in enumerate(self.layers):
            inp = x if i == 0 else group_concat(x, y, layer.groups)
            y = layer(inp)
            if i < len(self.layers) - 1:
                y = shuffle(jax.nn.gelu(y), layer.groups)
        return y


class DeLighTBlock(eqx.Module):
    """One DeLighT block over ``[B, L, dim]``: ``x + W_o(attn_1head(DeLighT(LN(x))))`` (the
    transformation to ``dim / 2``), then the light FFN ``x + W_2 gelu(W_1 LN(x))`` with
    ``W_1: dim -> dim / ffn_reduction``. Any registered attention kind (``spec``) works as the
    single head."""

    norm1: LayerNorm
    transform: DeLighTTransform
    attn: MultiHeadAttention
    w_out: jax.Array
    norm2: LayerNorm
    w1: jax.Array
    w2: jax.Array

    def __init__(self, dim: int, *, depth: int, width_mult: float = 2.0, max_groups: int = 4,
                 ffn_reduction: int = 4, spec: AttentionSpec = AttentionSpec(),
                 causal: bool = False, max_len: int = 512, key):
        if dim % 2 or dim % ffn_reduction:
            raise ValueError(f"DeLighTBlock: dim={dim} must be even and divisible by "
                             f"ffn_reduction={ffn_reduction}")
        k1, k2, k3, k4, k5 = jax.random.split(key, 5)
        d_o = dim // 2
        self.norm1, self.norm2 = LayerNorm(dim), LayerNorm(dim)
        self.transform = DeLighTTransform(dim, d_o, depth=depth, width_mult=width_mult,
                                          max_groups=max_groups, key=k1)
        self.attn = MultiHeadAttention(d_o, 1, spec=spec, causal=causal, max_len=max_len,
                                       key=k2)
        self.w_out = jax.random.normal(k3, (d_o, dim)) / math.sqrt(d_o)
        r = dim // ffn_reduction
        self.w1 = jax.random.normal(k4, (dim, r)) / math.sqrt(dim)
        self.w2 = jax.random.normal(k5, (r, dim)) / math.sqrt(r)

    def __call__(self, x, *, kv_mask=None, key=None):
        h = self.transform(self.norm1(x))
        x = x + self.attn(h, kv_mask=kv_mask, key=key) @ self.w_out.astype(x.dtype)
        h = jax.nn.gelu(self.norm2(x) @ self.w1.astype(x.dtype))
        return x + h @ self.w2.astype(x.dtype)


def delight_scaling(num_blocks: int, min_depth: int, max_depth: int, width_mult: float):
    """Block-wise scaling (Mehta et al., 2021, eq. 4): ``[(N^b, w_m^b)]`` for ``b = 0 ..
    B-1``, the depth's integer part (as the authors' code takes it)."""
    if num_blocks < 1 or not 1 <= min_depth <= max_depth:
        raise ValueError(f"delight_scaling: num_blocks={num_blocks} >= 1 and 1 <= min_depth="
                         f"{min_depth} <= max_depth={max_depth} expected")
    if num_blocks == 1:
        return [(min_depth, float(width_mult))]
    out = []
    for b in range(num_blocks):
        frac = b / (num_blocks - 1)
        # The integer part of eq. 4's depth (the small margin keeps b / (B - 1) rounding
        # error from taking 6 to 5.999...).
        out.append((int(math.floor(min_depth + (max_depth - min_depth) * frac + 1e-9)),
                    width_mult + (max_depth - min_depth) * frac / min_depth))
    return out


class DeLighTStack(eqx.Module):
    """``num_blocks`` DeLighT blocks with block-wise scaling (:func:`delight_scaling`) and a
    final LayerNorm: ``[B, L, dim] -> [B, L, dim]``. Other keywords go to every
    :class:`DeLighTBlock` (``spec``, ``causal``, ``max_groups``, ...)."""

    blocks: tuple
    norm: LayerNorm
    scaling: tuple = eqx.field(static=True)

    def __init__(self, dim: int, num_blocks: int, *, min_depth: int = 2, max_depth: int = 4,
                 width_mult: float = 2.0, key, **block):
        self.scaling = tuple(delight_scaling(num_blocks, min_depth, max_depth, width_mult))
        keys = jax.random.split(key, num_blocks)
        self.blocks = tuple(DeLighTBlock(dim, depth=n, width_mult=w, key=k, **block)
                            for (n, w), k in zip(self.scaling, keys))
        self.norm = LayerNorm(dim)

    def __call__(self, x, *, kv_mask=None, key=None):
        for i, block in enumerate(self.blocks):
            x = block(x, kv_mask=kv_mask, key=None if key is None else jax.random.fold_in(key, i))
        return self.norm(x)
