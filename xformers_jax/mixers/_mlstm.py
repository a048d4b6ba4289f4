"""The mLSTM of xLSTM (Beck et al. 2024, "xLSTM: Extended Long Short-Term Memory", Eqs. 19-27),
one head of one sequence, on the one chunked causal scan.

A matrix memory with exponential input gates and a normaliser state::

    C_t = f_t C_{t-1} + i_t k_t v_t^T      n_t = f_t n_{t-1} + i_t k_t
    h_t = C_t^T q_t / max(|n_t^T q_t|, 1)

with ``i_t = exp(i~_t)`` and ``f_t = sigmoid(f~_t)`` (or ``exp(f~_t)``). The exponential gate
overflows unless the states are kept scaled by ``exp(-m_t)`` with the stabiliser ``m_t =
max(log f_t + m_{t-1}, i~_t)`` (``m_0 = 0``, Eq. 15-17): then ``C~_t = f'_t C~_{t-1} + i'_t k_t
v_t^T`` with ``f'_t = exp(log f_t + m_{t-1} - m_t) <= 1`` and ``i'_t = exp(i~_t - m_t) <= 1``,
and ``h_t = C~_t^T q_t / max(|n~_t^T q_t|, exp(-m_t))``, which equals the unscaled ``h_t``
whatever ``m`` is.

- ``"recurrent"``: the paper's stabilised step (:func:`mlstm_step`) by a scan over positions,
  the reference and the decoding form (state ``(C~ [Dk, Dv], n~ [Dk], m)``).
- ``"chunked"`` / ``"parallel"``: ``m_t = max(log f_t + m_{t-1}, i~_t)`` is a max-plus linear
  recurrence, so it is computed for every position at once by an associative scan with the
  operator ``(a1, b1) . (a2, b2) = (a1 + a2, max(b1 + a2, b2))``; the stabiliser is then
  carried across chunks by construction, and the scaled memory is the one scan's recurrence
  with log-decays ``log f'_t <= 0`` and keys ``i'_t k_t`` (the normaliser is the same scan
  over a column of ones appended to ``v``). ``m`` is held constant in the backward pass: the
  output does not depend on it.

Packed rows (``segment_ids``): the memory, the normaliser and the stabiliser all restart at
each document's first token (``m`` from 0, as for a sequence alone): the max-plus scan is
segmented, and the scan's state restarts there.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from ._recurrences import _check, _check_2d, _f32, linear_recurrence

FORGET_GATES = ("sigmoid", "exp")


def _log_forget(name, f_logits, forget_gate):
    if forget_gate not in FORGET_GATES:
        raise ValueError(f"{name}: forget_gate must be one of {FORGET_GATES}, got "
                         f"{forget_gate!r}")
    return jax.nn.log_sigmoid(f_logits) if forget_gate == "sigmoid" else f_logits


def mlstm_init_state(dk: int, dv: int):
    """The empty stabilised memory ``(C~ [Dk, Dv], n~ [Dk], m [])`` (float32, ``m_0 = 0``)."""
    return (jnp.zeros((dk, dv), jnp.float32), jnp.zeros((dk,), jnp.float32),
            jnp.zeros((), jnp.float32))


def mlstm_step(state, q_t, k_t, v_t, i_t, f_t, forget_gate: str = "sigmoid"):
    """One stabilised mLSTM step (Beck et al. 2024, Eqs. 15-27).

    Args:
      state: ``(C~ [Dk, Dv], n~ [Dk], m [])``. q_t, k_t: ``[Dk]`` (k scaled by ``Dk^-1/2``).
      v_t: ``[Dv]``. i_t, f_t: scalar input and forget gate pre-activations.

    Returns:
      ``(h_t [Dv], state)``.
    """
    c, n, m = state
    log_f = _log_forget("mlstm_step", f_t, forget_gate)
    m_new = jnp.maximum(log_f + m, i_t)
    f_p, i_p = jnp.exp(log_f + m - m_new), jnp.exp(i_t - m_new)
    c = f_p * c + i_p * k_t[:, None] * v_t[None, :]
    n = f_p * n + i_p * k_t
    h = q_t @ c / jnp.maximum(jnp.abs(q_t @ n), jnp.exp(-m_new))
    return h, (c, n, m_new)


def _starts(name, segment_ids, length):
    """``bool[L]``: position t starts a document (``id_t != id_{t-1}``; True at 0)."""
    seg = jnp.asarray(segment_ids)
    if seg.shape != (length,) or not jnp.issubdtype(seg.dtype, jnp.integer):
        raise ValueError(f"{name}: segment_ids must be int[{length}], got "
                         f"{seg.dtype}{list(seg.shape)}")
    return jnp.concatenate([jnp.ones((1,), bool), seg[1:] != seg[:-1]])


def stabiliser(log_f, i_logits, starts=None):
    """``m_t = max(log f_t + m_{t-1}, i~_t)`` with ``m_0 = 0`` for every ``t`` by an associative
    scan (see the module docstring): ``[L]``. With ``starts: bool[L]`` (documents' first
    tokens) the recurrence restarts from ``m = 0`` there (a segmented scan)."""

    if starts is None:
        def combine(x, y):
            return x[0] + y[0], jnp.maximum(x[1] + y[0], y[1])

        total, best = lax.associative_scan(combine, (log_f, i_logits))
        return jnp.maximum(total, best)

    def combine_segments(x, y):
        # y begins a document: what lies before it is forgotten.
        return (x[0] | y[0], jnp.where(y[0], y[1], x[1] + y[1]),
                jnp.where(y[0], y[2], jnp.maximum(x[2] + y[1], y[2])))

    _, total, best = lax.associative_scan(combine_segments, (starts, log_f, i_logits))
    return jnp.maximum(total, best)


def mlstm(q, k, v, i_logits, f_logits, *, forget_gate: str = "sigmoid", kv_mask=None,
          implementation: str = "chunked", chunk_size: int = 64, segment_ids=None):
    """The mLSTM memory of one head: ``h_t = C_t^T q_t / max(|n_t^T q_t|, 1)``.

    Args:
      q, k: ``[L, Dk]`` (k already scaled by ``Dk^-1/2``, as the paper's Eq. 22). v: ``[L, Dv]``.
      i_logits: ``[L]`` input gate pre-activations (``i_t = exp(i_logits_t)``).
      f_logits: ``[L]`` forget gate pre-activations.
      forget_gate: ``"sigmoid"`` or ``"exp"``.
      kv_mask: ``bool[L]``: padded positions neither write nor forget.
      implementation: ``"chunked"``, ``"parallel"`` or ``"recurrent"`` (the paper's step).
      chunk_size: positions per chunk.
      segment_ids: ``int[L]`` or None: packed documents (contiguous runs of equal ids); the
        memory, normaliser and stabiliser restart at each document's first token.

    Returns:
      ``[L, Dv]`` float32 (the hidden state before the output gate).
    """
    name = "mlstm"
    _check(name, implementation, chunk_size)
    length = _check_2d(name, q=q, k=k, v=v)
    for arg, x in (("i_logits", i_logits), ("f_logits", f_logits)):
        if x.shape != (length,):
            raise ValueError(f"{name}: {arg} must be [{length}], got shape {x.shape}")
    starts = None if segment_ids is None else _starts(name, segment_ids, length)
    q, k, v, i_logits, f_logits = _f32(q, k, v, i_logits, f_logits)
    log_f = _log_forget(name, f_logits, forget_gate)
    if kv_mask is not None:
        if kv_mask.shape != (length,):
            raise ValueError(f"{name}: kv_mask must be bool[{length}], got shape "
                             f"{kv_mask.shape}")
        log_f = jnp.where(kv_mask, log_f, 0.0)
        i_logits = jnp.where(kv_mask, i_logits, -jnp.inf)
        k, v = (jnp.where(kv_mask[:, None], x, 0.0) for x in (k, v))
    if implementation == "recurrent":
        init = mlstm_init_state(k.shape[1], v.shape[1])

        def step(s, x):
            if starts is not None:
                s = jax.tree.map(lambda a, b: jnp.where(x[-1], a, b), init, s)
            return mlstm_step(s, *x[:5], forget_gate="exp")[::-1]  # log f is already taken

        xs = (q, k, v, i_logits, log_f) + (() if starts is None else (starts,))
        return lax.scan(step, init, xs)[1]
    m = stabiliser(lax.stop_gradient(log_f), lax.stop_gradient(i_logits), starts)
    m_prev = jnp.concatenate([jnp.zeros((1,), m.dtype), m[:-1]])
    fk = k * jnp.exp(i_logits - m)[:, None]
    ones = jnp.ones((length, 1), v.dtype)
    out = linear_recurrence(q, fk, jnp.concatenate([v, ones], -1), log_f + m_prev - m,
                            implementation=implementation, chunk_size=chunk_size,
                            segment_ids=segment_ids)
    return out[:, :-1] / jnp.maximum(jnp.abs(out[:, -1:]), jnp.exp(-m)[:, None])
