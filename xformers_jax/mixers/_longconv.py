"""Long convolutions trained by FFT: H3 and Hyena.

- H3 (Fu, Dao, Saab, Thomas, Rudra and Re 2023, "Hungry Hungry Hippos: Towards Language
  Modeling with State Space Models", Algorithm 1): projections ``q, k, v``; a shift SSM on
  ``k`` (state matrix the shift, ``B = e_1``: its kernel is its ``S`` output taps, a short
  causal convolution ``kbar_t = sum_{i < S} C_i k_{t-i}``); per head ``h`` (width ``P``) the
  outer products ``kbar_t v_t^T [P, P]`` through a diagonal SSM (S4D, one kernel per head, with
  its ``D`` skip), ``KV_t``; then ``o_t = q_t KV_t``. Both SSMs are linear time-invariant, so
  training materialises their kernels as length-``L`` filters and convolves by FFT of size
  ``2L`` (causal); decoding runs them as the state space models they are: the last ``S - 1``
  keys and a complex ``[P, P, N/2]`` state per head, ``O(1)`` per step.
- Hyena (Poli et al. 2023, "Hyena Hierarchy: Towards Larger Convolutional Language Models",
  Section 3.1): ``N + 1`` projections of the input, each through a short causal
  convolution, ``v, x_1 .. x_N``; ``z_1 = v``, ``z_{n+1} = x_n * (h_n * z_n + b_n z_n)``,
  ``y = z_{N+1}``, with long causal filters ``h_n [D, L]`` (implicit: materialised by the
  layer from positions, ``nn.Hyena``) convolved by FFT of size ``2L``. The paper gives no
  recurrence for the implicit filters, so decoding is a cache: each stage's past inputs
  ``z_n`` (``N D`` numbers per token, like a KV cache) and one ``O(L D)`` dot product per
  stage and step, which equals the forward pass.

Padding (``kv_mask``): the real positions are gathered to the front in order before the
convolutions (distances between real tokens do not change with holes or padding amount), the
padded ones follow them with zero inputs to every convolution, and outputs are scattered back.

Packed documents (``segment_ids``): every convolution, short and long, runs within documents
(``causal_convolve`` with segment ids, ``causal_depthwise_conv`` with segment ids) and the
gates are per token, so each document's outputs are those of the document alone; H3's
recurrent form restarts both SSMs' states at each document's first position.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from ._conv import causal_depthwise_conv, causal_depthwise_step
from ._document_conv import document_starts, gathered_documents
from ._ssm import SSM_FORMS, _check_form, causal_convolve, s4d_kernel, zoh


def _front(name, kv_mask, length):
    """``(order, real)``: the permutation putting real positions first (stable) and
    ``bool[L]`` of the gathered positions that are real; ``(None, None)`` without a mask."""
    if kv_mask is None:
        return None, None
    if kv_mask.shape != (length,):
        raise ValueError(f"{name}: kv_mask must be bool[{length}], got shape {kv_mask.shape}")
    order = jnp.argsort(~kv_mask, stable=True)
    return order, jnp.arange(length) < jnp.sum(kv_mask)


def _zero_where_padded(x, real):
    if real is None:
        return x
    return jnp.where(real.reshape(-1, *[1] * (x.ndim - 1)), x, jnp.zeros((), x.dtype))


def _length_kernel(taps, length):
    """Taps ``[..., S]`` as a length-``L`` kernel ``[..., L]`` (zero after ``S``)."""
    s = taps.shape[-1]
    if s >= length:
        return taps[..., :length]
    return jnp.pad(taps, [(0, 0)] * (taps.ndim - 1) + [(0, length - s)])


def h3(q, k, v, shift, dt, a, b, c, d, *, kv_mask=None, segment_ids=None,
       implementation: str = "fft"):
    """H3 over one sequence (causal).

    Args:
      q, k, v: ``[L, H, P]`` (``H`` heads of width ``P``).
      shift: ``[H, P, S]`` the shift SSM's output taps per channel of ``k`` (tap 0 reads the
        current key).
      dt: ``[H]`` step sizes; a, b, c: ``[H, N/2]`` complex: the diagonal SSM of each head
        (S4D, zero-order hold), shared by the ``P^2`` channels of the head's outer products.
      d: ``[H]`` the diagonal SSM's skip.
      kv_mask: ``bool[L]`` or None: padded positions reach no real output.
      segment_ids: ``int[L]`` or None: packed documents (contiguous, 0 for padding), each
        run as if alone.
      implementation: ``"fft"`` (both kernels of length ``L``, FFT convolutions of size
        ``2L``) or ``"recurrent"`` (a scan over positions with :func:`h3_step`).

    Returns:
      ``[L, H, P]`` float32: ``o_t[h] = q_t[h] KV_t[h]``, ``KV_t[h] = sum_{s <= t} K_h[t - s]
      kbar_s v_s^T + d_h kbar_t v_t^T``.
    """
    name = "h3"
    _check_form(name, implementation, SSM_FORMS)
    length, heads, p = q.shape
    if k.shape != q.shape or v.shape != q.shape or shift.shape[:2] != (heads, p) or \
            dt.shape != (heads,) or a.shape[0] != heads or d.shape != (heads,):
        raise ValueError(f"h3: need q, k, v [L, H, P], shift [H, P, S], dt, d [H], a, b, c "
                         f"[H, N/2]; got q {q.shape}, k {k.shape}, v {v.shape}, shift "
                         f"{shift.shape}, dt {dt.shape}, a {a.shape}, d {d.shape}")
    q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
    order, real = _front(name, kv_mask, length)
    seg = gathered_documents(name, segment_ids, kv_mask, order)
    if order is not None:
        q, k, v = q[order], k[order], v[order]
    # Queries too: a padded query's output is dropped, but its content must reach no gradient.
    q, k, v = (_zero_where_padded(x, real) for x in (q, k, v))
    if implementation == "recurrent":
        init = h3_init_state(shift, a)

        def step(state, inputs):
            *qkv, start = inputs
            if start is not None:  # a document's first position: both SSMs start afresh
                state = jax.tree.map(lambda s, s0: jnp.where(start, s0, s), state, init)
            return h3_step(state, *qkv, shift, dt, a, b, c, d)[::-1]

        starts = None if seg is None else document_starts(seg)
        y = lax.scan(step, init, (q, k, v, starts))[1]
    else:
        kbar = causal_convolve(k, _length_kernel(shift, length), seg)
        kv = _zero_where_padded(kbar[..., :, None] * v[..., None, :], real)  # [L, H, P, P]
        kernel = s4d_kernel(dt, a, b, c, length)[:, None, None]  # [H, 1, 1, L]
        kv = causal_convolve(kv, kernel, seg) + d[:, None, None] * kv
        y = jnp.einsum("lhi,lhij->lhj", q, kv)
    if order is not None:
        y = jnp.zeros_like(y).at[order].set(y)
    return y


def h3_init_state(shift, a):
    """H3's decoding state before the first step: the last ``S - 1`` keys ``[S - 1, H, P]``
    (most recent first) and the diagonal SSM's ``[H, P, P, N/2]`` complex state, zero."""
    heads, p, s = shift.shape
    return (jnp.zeros((s - 1, heads, p), jnp.float32),
            jnp.zeros((heads, p, p, a.shape[-1]), jnp.complex64))


def h3_step(state, q_t, k_t, v_t, shift, dt, a, b, c, d):
    """One step of causal H3 (the recurrences of both SSMs): ``q_t, k_t, v_t [H, P]`` ->
    ``(o_t [H, P], state)``, the state as :func:`h3_init_state` makes it."""
    keys, x = state
    k_t = k_t.astype(jnp.float32)
    window = jnp.concatenate([k_t[None], keys], 0)  # [S, H, P]: k_t, k_{t-1}, ...
    kbar = jnp.einsum("shp,hps->hp", window, shift.astype(jnp.float32))
    kv = kbar[..., :, None] * v_t.astype(jnp.float32)[..., None, :]  # [H, P, P]
    da, db = zoh(dt[:, None], a, b)  # [H, N/2]
    x = da[:, None, None] * x + db[:, None, None] * kv[..., None]
    y = 2 * jnp.sum(c[:, None, None] * x, -1).real + d[:, None, None] * kv
    o = jnp.einsum("hi,hij->hj", q_t.astype(jnp.float32), y)
    return o, (window[:-1], x)


def hyena(u, short_w, short_b, filters, bias, *, kv_mask=None, segment_ids=None):
    """Hyena of order ``N`` over one sequence (causal).

    Args:
      u: ``[L, (N + 1) D]`` the input projection: ``v`` first, then ``x_1 .. x_N``.
      short_w, short_b: ``[W, (N + 1) D]``, ``[(N + 1) D]`` the short causal convolution of
        every stream.
      filters: ``[N, D, L]`` the long filters ``h_n`` (tap ``j`` weighs the input ``j``
        positions back).
      bias: ``[N, D]`` each filter's skip ``b_n``.
      kv_mask: ``bool[L]`` or None: padded positions reach no real output.
      segment_ids: ``int[L]`` or None: packed documents (contiguous, 0 for padding), each
        run as if alone (the filters are indexed by distance, so they need no restart).

    Returns:
      ``[L, D]`` float32: ``z_{N+1}`` of ``z_1 = v``, ``z_{n+1} = x_n (h_n * z_n + b_n z_n)``
      (FFT convolutions of size ``2L``).
    """
    name = "hyena"
    length = u.shape[0]
    order_n, dim = bias.shape
    if u.shape != (length, (order_n + 1) * dim) or filters.shape != (order_n, dim, length) or \
            short_w.shape[1:] != u.shape[1:]:
        raise ValueError(f"hyena: need u [L, (N + 1) D], short_w [W, (N + 1) D], filters "
                         f"[N, D, L], bias [N, D]; got u {u.shape}, short_w {short_w.shape}, "
                         f"filters {filters.shape}, bias {bias.shape}")
    order, real = _front(name, kv_mask, length)
    seg = gathered_documents(name, segment_ids, kv_mask, order)
    u = u.astype(jnp.float32)
    if order is not None:
        u = u[order]
    u = _zero_where_padded(u, real)
    streams = causal_depthwise_conv(u[None], short_w, short_b,
                                    None if seg is None else seg[None])[0].reshape(
        length, order_n + 1, dim)
    z = streams[:, 0]
    for n in range(order_n):
        z = _zero_where_padded(z, real)
        z = streams[:, n + 1] * (causal_convolve(z, filters[n], seg) + bias[n] * z)
    if order is not None:
        z = jnp.zeros_like(z).at[order].set(z)
    return z


def hyena_step(state, u_t, t, short_w, short_b, filters, bias):
    """One cached decoding step of causal Hyena at position ``t``: ``u_t [(N + 1) D]`` ->
    ``(y_t [D], state)``. ``state = (buffer [W - 1, (N + 1) D], history [N, C, D])``: the
    short convolution's last inputs and every stage's past inputs ``z_n`` (capacity ``C``,
    ``t < C``); ``filters [N, D, C]``."""
    buffer, history = state
    order_n, dim = bias.shape
    y, buffer = causal_depthwise_step(buffer[None], u_t[None].astype(jnp.float32), short_w,
                                      short_b)
    streams = y[0].reshape(order_n + 1, dim)
    capacity = history.shape[1]
    lag = t - jnp.arange(capacity)  # the tap each cached position needs
    seen = lag >= 0
    z = streams[0]
    for n in range(order_n):
        history = history.at[n].set(lax.dynamic_update_slice_in_dim(
            history[n], z[None], t, axis=0))
        taps = jnp.where(seen, jnp.take(filters[n], jnp.clip(lag, 0, capacity - 1), axis=1), 0)
        z = streams[n + 1] * (jnp.einsum("dc,cd->d", taps, history[n]) + bias[n] * z)
    return z, (buffer[0], history)
