"""Gated linear recurrences on the one chunked causal scan (``attention.linear.causal_chunked``).

Each is ``S_t = A_t S_{t-1} + k_t v_t^T``, ``o_t = q_t S_t`` for some decay ``A_t``:

- RetNet retention (Sun et al. 2023, "Retentive Network: A Successor to Transformer for Large
  Language Models"): a fixed per-head decay ``gamma``, ``ld_t = log gamma``.
- GLA (Yang et al. 2024, "Gated Linear Attention Transformers with Hardware-Efficient
  Training"): data-dependent per-key-feature gates, ``S_t = diag(alpha_t) S_{t-1} + ...``.
- Mamba-2's SSD (Dao and Gu 2024, "Transformers are SSMs: Generalized Models and Efficient
  Algorithms Through Structured State Space Duality"): a scalar data-dependent decay per head,
  ``S_t = exp(dt_t a) S_{t-1} + dt_t B_t x_t^T``, ``y_t = C_t S_t``.
- Gated DeltaNet (Yang, Kautz and Hatamizadeh 2025, "Gated Delta Networks: Improving Mamba2
  with Delta Rule"): ``S_t = a_t (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T``, the delta
  rule's chunked triangular solve (``attention.linear.gated_delta_chunked``) with decays.

Every function takes one sequence and one head. ``implementation`` picks the form:
``"parallel"`` (quadratic, one chunk), ``"recurrent"`` (a scan over positions) or
``"chunked"`` (chunks of ``chunk_size``; the training form). All forms compute the same
function, outputs and gradients. ``kv_mask`` (``bool[L]``, True for real tokens) makes padded
positions write nothing and decay nothing, so real outputs do not depend on the padding.
``segment_ids`` (``int[L]``, packed documents, each a contiguous run of equal ids) restarts the
state from zero at each document's first token (the scan's document reset), so each document's
outputs and gradients are those of the document alone (``retention``, ``gla``, ``ssd``,
``hgrn2``).
"""

from __future__ import annotations

import jax.numpy as jnp

from ..attention.linear import (causal_chunked, causal_parallel, causal_recurrent,
                                gated_delta_chunked, gated_delta_recurrent)

FORMS = ("parallel", "recurrent", "chunked")


def _check(name, implementation, chunk_size):
    if implementation not in FORMS:
        raise ValueError(f"{name}: implementation must be one of {FORMS}, got "
                         f"{implementation!r}")
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"{name}: chunk_size must be a positive int, got {chunk_size!r}")


def _check_2d(name, **arrays):
    length = None
    for arg, a in arrays.items():
        if a.ndim != 2:
            raise ValueError(f"{name}: {arg} must be [L, D], got shape {a.shape}")
        if length is not None and a.shape[0] != length:
            shapes = {n: x.shape for n, x in arrays.items()}
            raise ValueError(f"{name}: every input needs the same length L, got {shapes}")
        length = a.shape[0]
    return length


def _mask(name, kv_mask, length, fk, v, ld):
    if kv_mask is None:
        return fk, v, ld
    if kv_mask.shape != (length,):
        raise ValueError(f"{name}: kv_mask must be bool[{length}], got shape {kv_mask.shape}")
    m = kv_mask[:, None]
    ldm = kv_mask if ld.ndim == 1 else m
    return jnp.where(m, fk, 0), jnp.where(m, v, 0), jnp.where(ldm, ld, 0)


def linear_recurrence(fq, fk, v, ld, *, implementation: str = "chunked", chunk_size: int = 64,
                      segment_ids=None):
    """``o_t = fq_t S_t``, ``S_t = diag(exp(ld_t)) S_{t-1} + fk_t v_t^T`` in the chosen form.

    Args:
      fq, fk: ``[L, M]``. v: ``[L, E]``. ld: ``[L]`` or ``[L, M]`` log-decays ``<= 0``.
      implementation: ``"parallel"``, ``"recurrent"`` or ``"chunked"``.
      chunk_size: positions per chunk of the chunked form.
      segment_ids: ``int[L]`` or None: the state restarts at each document's first token.

    Returns:
      ``[L, E]`` (float32 or wider: the scan runs in the inputs' promoted dtype).
    """
    if implementation == "parallel":
        return causal_parallel(fq, fk, v, ld, segment_ids=segment_ids)
    if implementation == "recurrent":
        return causal_recurrent(fq, fk, v, ld, segment_ids=segment_ids)
    return causal_chunked(fq, fk, v, ld, chunk_size, segment_ids=segment_ids)


def _f32(*xs):
    return tuple(x.astype(jnp.float32) for x in xs)


def retention(q, k, v, log_gamma, *, kv_mask=None, implementation: str = "chunked",
              chunk_size: int = 64, segment_ids=None):
    """RetNet retention of one head: ``o = (q k^T * D) v`` with ``D_nm = gamma^(n-m)`` for
    ``n >= m`` (Sun et al. 2023, Eq. 5-7; parallel, recurrent and chunkwise forms).

    Args:
      q, k: ``[L, Dk]`` (k already scaled by ``Dk^-1/2``). v: ``[L, Dv]``.
      log_gamma: scalar ``log gamma < 0``, the head's decay.
      kv_mask: ``bool[L]`` or None. implementation, chunk_size, segment_ids: see the module
        docstring.

    Returns:
      ``[L, Dv]`` float32.
    """
    name = "retention"
    _check(name, implementation, chunk_size)
    length = _check_2d(name, q=q, k=k, v=v)
    q, k, v = _f32(q, k, v)
    ld = jnp.broadcast_to(jnp.asarray(log_gamma, jnp.float32), (length,))
    k, v, ld = _mask(name, kv_mask, length, k, v, ld)
    return linear_recurrence(q, k, v, ld, implementation=implementation, chunk_size=chunk_size,
                             segment_ids=segment_ids)


# GLA's per-key-feature gates make its intra-chunk scores a [c, c, Dk] product, so its chunks
# are smaller than the scalar-decay recurrences' 64 (the paper's secondary chunks are 16).
# fwd+bwd of 4 heads (keys 32, values 64) at L=8192 on a 2-core Sapphire Rapids, separate
# processes: chunks of 8 / 16 / 64 took 186-195 / 189-200 / 487 ms with autodiff of the
# intra-chunk product; with its own VJP (attention/linear/_scan.py), 8 / 16 take 134-142 /
# 131-133 ms (interleaved in one process).
GLA_CHUNK = 16


def gla(q, k, v, log_gates, *, kv_mask=None, implementation: str = "chunked",
        chunk_size: int = GLA_CHUNK, segment_ids=None):
    """Gated linear attention of one head (Yang et al. 2024, Eq. 3): ``S_t = diag(alpha_t)
    S_{t-1} + k_t v_t^T``, ``o_t = q_t S_t`` with ``log_gates = log alpha: [L, Dk] <= 0``.
    ``chunk_size`` defaults to ``GLA_CHUNK`` (16); ``segment_ids``: the module docstring.

    Returns ``[L, Dv]`` float32.
    """
    name = "gla"
    _check(name, implementation, chunk_size)
    length = _check_2d(name, q=q, k=k, v=v, log_gates=log_gates)
    if log_gates.shape != k.shape:
        raise ValueError(f"gla: log_gates must have k's shape {k.shape}, got {log_gates.shape}")
    q, k, v, ld = _f32(q, k, v, log_gates)
    k, v, ld = _mask(name, kv_mask, length, k, v, ld)
    return linear_recurrence(q, k, v, ld, implementation=implementation, chunk_size=chunk_size,
                             segment_ids=segment_ids)


def ssd(x, dt, a, b, c, *, kv_mask=None, implementation: str = "chunked", chunk_size: int = 64,
        segment_ids=None):
    """Mamba-2's state space dual layer for one head (Dao and Gu 2024, Eq. 1 with scalar
    ``A_t = exp(dt_t a)``): ``h_t = exp(dt_t a) h_{t-1} + dt_t B_t x_t^T``, ``y_t = C_t h_t``.

    Args:
      x: ``[L, P]`` the head's inputs. dt: ``[L]`` step sizes ``> 0``. a: scalar ``< 0``.
      b, c: ``[L, N]`` input and output projections of the state.
      kv_mask, implementation, chunk_size, segment_ids: see the module docstring.

    Returns:
      ``[L, P]`` float32 (without the skip term ``D x``).
    """
    name = "ssd"
    _check(name, implementation, chunk_size)
    length = _check_2d(name, x=x, b=b, c=c)
    if dt.shape != (length,):
        raise ValueError(f"ssd: dt must be [{length}], got shape {dt.shape}")
    x, dt, b, c = _f32(x, dt, b, c)
    # dt_t scales the write dt_t B_t x_t^T; it is applied to x rather than to B, so the
    # C B^T scores do not depend on the head and are computed once for heads sharing B and C
    # (vmapped over heads with b, c unbatched: Mamba-2's single group).
    fk, v, ld = _mask(name, kv_mask, length, b, x * dt[:, None], dt * a)
    return linear_recurrence(c, fk, v, ld, implementation=implementation, chunk_size=chunk_size,
                             segment_ids=segment_ids)


def gated_delta(q, k, v, beta, ld, *, kv_mask=None, implementation: str = "chunked",
                chunk_size: int = 64, segment_ids=None):
    """The gated delta rule of one head (Yang, Kautz and Hatamizadeh 2025, Eq. 10):
    ``S_t = a_t (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T``, ``o_t = q_t S_t``.

    Args:
      q, k: ``[L, Dk]`` (the paper L2-normalises them). v: ``[L, Dv]``.
      beta: ``[L]`` in ``[0, 1]``. ld: ``[L]`` log-decays ``log a_t <= 0``.
      implementation: ``"chunked"`` (triangular solve per chunk), ``"recurrent"``, or
        ``"parallel"`` (the chunked form with a single chunk).
      segment_ids: ``int[L]`` packed documents (contiguous ids), or None: the state restarts
        from zero at each document's first position (``a_t = 0`` there), so each document's
        outputs and gradients are those of the document alone.

    Returns:
      ``[L, Dv]`` float32.
    """
    name = "gated_delta"
    _check(name, implementation, chunk_size)
    length = _check_2d(name, q=q, k=k, v=v)
    for arg, x in (("beta", beta), ("ld", ld)):
        if x.shape != (length,):
            raise ValueError(f"gated_delta: {arg} must be [{length}], got shape {x.shape}")
    if segment_ids is not None and (segment_ids.shape != (length,)
                                    or not jnp.issubdtype(segment_ids.dtype, jnp.integer)):
        raise ValueError(f"gated_delta: segment_ids must be int[{length}], got "
                         f"{segment_ids.dtype}{list(segment_ids.shape)}")
    q, k, v, beta, ld = _f32(q, k, v, beta, ld)
    k, v, ld = _mask(name, kv_mask, length, k, v, ld)
    if kv_mask is not None:
        beta = jnp.where(kv_mask, beta, 0)
    if implementation == "recurrent":
        return gated_delta_recurrent(q, k, v, beta, ld, segment_ids=segment_ids)
    chunk = length if implementation == "parallel" else chunk_size
    return gated_delta_chunked(q, k, v, beta, ld, chunk_size=chunk, segment_ids=segment_ids)


def hgrn2(q, v, log_f, *, kv_mask=None, implementation: str = "chunked",
          chunk_size: int = GLA_CHUNK, segment_ids=None):
    """HGRN2's gated linear recurrence of one head with outer-product state expansion (Qin et
    al. 2024, "HGRN2: Gated Linear RNNs with State Expansion", Eq. 4): ``S_t = diag(f_t)
    S_{t-1} + (1 - f_t) v_t^T``, ``o_t = q_t^T S_t``; the input gate is tied to the forget
    gate, ``1 - f_t`` serving as the key (GLA with ``k = 1 - alpha``).

    Args:
      q: ``[L, Dk]`` (the output gate read as a query). v: ``[L, Dv]`` (the input).
      log_f: ``[L, Dk]`` log forget gates ``log f_t < 0``.
      kv_mask, implementation, chunk_size, segment_ids: as :func:`gla` (chunk default 16).

    Returns ``[L, Dv]`` float32.
    """
    name = "hgrn2"
    _check(name, implementation, chunk_size)
    length = _check_2d(name, q=q, v=v, log_f=log_f)
    if log_f.shape != q.shape:
        raise ValueError(f"hgrn2: log_f must have q's shape {q.shape}, got {log_f.shape}")
    q, v, ld = _f32(q, v, log_f)
    k, v, ld = _mask(name, kv_mask, length, -jnp.expm1(ld), v, ld)
    return linear_recurrence(q, k, v, ld, implementation=implementation, chunk_size=chunk_size,
                             segment_ids=segment_ids)
