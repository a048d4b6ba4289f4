"""The delta rule of fast weight programmers (Schlag et al. 2021): ``delta_rule_attention``.

Survey L 4.2.2: instead of only adding ``phi(k) v^T`` to the memory, each step retrieves the
value currently bound to the key, ``vbar_t = S_{t-1}^T phi(k_t)``, and replaces it by a convex
combination with the new value::

    S_t = S_{t-1} + beta_t phi(k_t) (v_t - vbar_t)^T        out_t = S_t^T phi(q_t)

with ``beta_t = sigmoid(beta_logits_t)`` and sum-normalised features ``phi(x) / sum(phi(x))``
(which replaces the attention denominator). The chunked form (Yang et al. 2024, "Parallelizing
linear transformers with the delta rule") writes a chunk's updates as ``S_0 + K^T U'`` where the
pseudo-values solve the unit lower-triangular system
``(I + tril(diag(beta) K K^T, -1)) U' = diag(beta) (V - K S_0)`` (solved here by the system's
inverse, :func:`unit_lower_inverse`, as Yang et al.'s UT transform does).

The gated delta rule (Yang, Kautz and Hatamizadeh 2025, "Gated Delta Networks: Improving
Mamba2 with Delta Rule") decays the memory before each write, ``S_t = a_t (I - beta_t k_t
k_t^T) S_{t-1} + beta_t k_t v_t^T`` with ``a_t = exp(ld_t)``. Within a chunk with cumulative
log-decays ``b`` (``gamma_t = exp(b_t)``) the state is ``gamma_t S_0 + sum_{j<=t}
exp(b_t - b_j) k_j u_j^T`` where ``(I + tril(diag(beta) (Gamma * K K^T), -1)) U =
diag(beta) V - diag(beta gamma) K S_0`` and ``Gamma_tj = exp(b_t - b_j)``; ``ld = 0`` is the
plain delta rule. :func:`gated_delta_recurrent` and :func:`gated_delta_chunked` are the two
forms (both used by ``delta_rule_attention`` and by the Gated DeltaNet mixer).

Packed documents (``segment_ids``): the state restarts from zero at each document's first
token, i.e. ``a_t = 0`` there. In the chunked form that is a mask, never a ``-inf``
log-decay (whose cumulative sums would give ``inf - inf``): with ``d_t`` the number of
document starts in the chunk up to ``t``, every pair ``(t, j)`` with ``d_t != d_j`` drops out
of ``Gamma`` (the system, the scores), the carried-in state reaches only the positions with
``d_t = 0`` (the document of the chunk's previous token), and the state written out comes
from the chunk's last document alone (:func:`document_masks`).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, Bool, Float

from .. import _contract as C
from ._feature_maps import resolve_feature_map
from ._linear import _guard, check_implementation, check_per_position
from ._scan import GROUP_POSITIONS, chunk_groups, document_starts


def _features(fm, x, arrays, root_scale, eps):
    phi = fm.fn(x.astype(C.STATS_DTYPE) * root_scale, *arrays)
    if fm.log_space:
        # Sum normalisation cancels any per-row shift, so a row maximum leaks nothing.
        phi = jnp.exp(phi - lax.stop_gradient(jnp.max(phi, axis=-1, keepdims=True)))
    return phi / _guard(jnp.sum(phi, axis=-1, keepdims=True), fm.positive, eps)


def gated_delta_step(s, fq_t, fk_t, v_t, beta_t, ld_t=0.0):
    """One step of the (gated) delta rule: ``S_t = a_t S_{t-1} + beta_t k_t (v_t - a_t
    S_{t-1}^T k_t)^T``, ``out_t = fq_t S_t`` with ``a_t = exp(ld_t)``.

    Args:
      s: ``[M, E]``. fq_t, fk_t: ``[M]``. v_t: ``[E]``. beta_t, ld_t: scalars.

    Returns:
      ``(out_t [E], S_t)``.
    """
    s = jnp.exp(ld_t) * s
    s = s + (beta_t * fk_t)[:, None] * (v_t - fk_t @ s)[None, :]
    return fq_t @ s, s


def document_masks(starts):
    """The masks of a chunk's documents from ``starts bool[n, c]`` (True at a document's first
    position, including position 0 of a chunk whose previous token is in another document):
    ``(same [n, c, c]`` (positions t, j in one document), ``carried [n, c]`` (t in the
    document of the chunk's previous token: it reads the carried-in state), ``last [n, c]``
    (j in the chunk's last document: it reaches the state written out))``."""
    doc = jnp.cumsum(starts.astype(jnp.int32), axis=1)
    return doc[:, :, None] == doc[:, None, :], doc == 0, doc == doc[:, -1:]


def gated_delta_recurrent(fq, fk, v, beta, ld=None, segment_ids=None):
    """The (gated) delta rule by a per-step scan.

    Args:
      fq, fk: ``[L, M]``. v: ``[L, E]``. beta: ``[L]`` write strengths in ``[0, 1]``.
      ld: ``[L]`` log-decays ``<= 0`` (None: no decay, the delta rule).
      segment_ids: ``int[L]`` packed documents (contiguous ids), or None: the state restarts
        from zero at each document's first position.

    Returns:
      ``[L, E]``.
    """
    ld = jnp.zeros_like(beta) if ld is None else ld
    init = jnp.zeros((fk.shape[1], v.shape[1]), jnp.result_type(fk, v))
    if segment_ids is None:
        def step(s, x):
            return gated_delta_step(s, *x)[::-1]

        return lax.scan(step, init, (fq, fk, v, beta, ld))[1]

    def reset_step(s, x):
        start, *x = x
        return gated_delta_step(jnp.where(start, jnp.zeros_like(s), s), *x)[::-1]

    xs = (document_starts(segment_ids), fq, fk, v, beta, ld)
    return lax.scan(reset_step, init, xs)[1]


def _diagonal_blocks(x, size):
    """The ``size x size`` blocks on the diagonal of ``x [..., P, P]``: ``[..., P / size, size,
    size]``."""
    p = x.shape[-1]
    x = x.reshape(*x.shape[:-2], p // size, size, p // size, size)
    return jnp.moveaxis(jnp.diagonal(x, axis1=-4, axis2=-2), -1, -3)


def unit_lower_inverse(strict):
    """``(I + strict)^-1`` for strictly lower-triangular ``strict [..., c, c]``, by recursive
    block inversion: the inverses of the diagonal blocks double in size each level,
    ``[[A, 0], [C, B]]^-1 = [[A^-1, 0], [-B^-1 C A^-1, B^-1]]``, so ``log2 c`` levels of batched
    matrix products (c padded to a power of two with an identity block).

    It replaces a LAPACK triangular solve (``trsm``), which on the CPU backend runs one small
    system at a time outside XLA: over the thousands of 64 x 64 chunk systems of a long
    sequence that took seconds per thousand positions, and under a loaded machine the
    gated delta rule at L = 8192 did not finish. Block inversion of a triangular matrix is as
    stable as substitution (Higham, "Accuracy and Stability of Numerical Algorithms", 14.2).
    """
    c = strict.shape[-1]
    p = 1 << max(c - 1, 0).bit_length()
    if p != c:
        strict = jnp.pad(strict, [(0, 0)] * (strict.ndim - 2) + [(0, p - c), (0, p - c)])
    inv = jnp.ones((*strict.shape[:-2], p, 1, 1), strict.dtype)  # 1 x 1 blocks: unit diagonal
    size = 1
    while size < p:
        a_inv, b_inv = inv[..., 0::2, :, :], inv[..., 1::2, :, :]
        lower_left = _diagonal_blocks(strict, 2 * size)[..., size:, :size]
        off = -(b_inv @ lower_left @ a_inv)
        top = jnp.concatenate([a_inv, jnp.zeros_like(a_inv)], -1)
        inv = jnp.concatenate([top, jnp.concatenate([off, b_inv], -1)], -2)
        size *= 2
    return inv[..., 0, :c, :c]


def _kept(x, keep):
    """``x`` where ``keep`` (zero elsewhere), or ``x`` itself when ``keep`` is None."""
    return x if keep is None else jnp.where(keep, x, jnp.zeros((), x.dtype))


def _every(x, r):
    """Positions ``r - 1, 2 r - 1, ...`` of ``x [n, c]`` (None stays None)."""
    return None if x is None else x[:, r - 1::r]


def _delta_chunks(fq, fk, v, beta, ld, s0, query_stride=1, starts=None):
    """The chunkwise (gated) delta rule over ``n`` chunks (``[n, c, ...]`` arrays) starting
    from the state ``s0``: (out ``[n, c / r, E]``, final state), read at every ``r``-th
    position (``r = query_stride``: positions ``r - 1, 2 r - 1, ...`` of each chunk; the rows
    of ``fq`` between them are not read). ``starts bool[n, c]``: document starts (packed
    documents, see the module docstring), or None."""
    r = query_stride
    fq = fq[:, r - 1::r]
    dv = v.shape[-1]
    c = v.shape[1]
    beta = beta[..., None]
    b = jnp.cumsum(ld, axis=1)  # within-chunk cumulative log-decays, <= 0
    causal = jnp.tril(jnp.ones((c, c), bool))
    carried = last = None
    if starts is not None:
        same, carried, last = document_masks(starts)
        causal = causal & same
    # exp(b_t - b_j) for j <= t only: the inner where keeps exp off the positive differences.
    diff = b[:, :, None] - b[:, None, :]
    gamma = jnp.where(causal, jnp.exp(jnp.where(causal, diff, 0.0)), 0.0)
    inverse = unit_lower_inverse(jnp.tril(beta * gamma * jnp.einsum("ncm,ndm->ncd", fk, fk), -1))
    uw = inverse @ jnp.concatenate([beta * v, beta * _kept(jnp.exp(b), carried)[..., None] * fk],
                                   -1)
    u, w = uw[..., :dv], uw[..., dv:]
    scores = gamma[:, r - 1::r] * jnp.einsum("ncm,ndm->ncd", fq, fk)
    qg = fq * _kept(jnp.exp(b[:, r - 1::r]), _every(carried, r))[..., None]
    kg = fk * _kept(jnp.exp(b[:, -1:] - b), last)[..., None]
    total = _kept(jnp.exp(b[:, -1]), None if carried is None else carried[:, -1])

    @functools.partial(jax.checkpoint, prevent_cse=False)
    def chunk(s, x):
        q_n, k_n, u_n, w_n, p_n, t_n = x
        pseudo = u_n - w_n @ s
        return t_n * s + k_n.T @ pseudo, q_n @ s + p_n @ pseudo

    s_end, out = lax.scan(chunk, s0, (qg, kg, u, w, scores, total))
    return out, s_end


def gated_delta_chunked(fq, fk, v, beta, ld=None, chunk_size: int = 64,
                        group_positions: int = GROUP_POSITIONS, *, query_stride: int = 1,
                        segment_ids=None):
    """The same recurrence as :func:`gated_delta_recurrent`, chunkwise: a unit lower-triangular
    solve per chunk (the WY form, see the module docstring) and a scan over chunks.

    Chunks go in groups of about ``group_positions`` positions through the chunked scan's
    :func:`~._scan.chunk_groups`: the chunk systems' inverses (``log2 c`` levels of ``[c, c]``
    blocks per chunk) are built for one group at a time and rebuilt in the backward pass,
    so neither they nor what their backward needs are ever held for the whole sequence.

    Args: as :func:`gated_delta_recurrent`; chunk_size: positions per chunk (padding writes
    nothing and does not decay); group_positions: positions per group; query_stride: ``r``,
    read the state only after every ``r``-th position (positions ``r - 1, 2 r - 1, ...``; the
    other rows of ``fq`` are not read), as DeltaProduct reads once per token after its ``r``
    delta steps: the output scores and reads of the other rows are never computed. ``r``
    must divide ``L`` and ``chunk_size``; segment_ids: ``int[L]`` packed documents, or None
    (the state restarts at each document's first position: masks on the chunks' own
    matrices, see the module docstring).

    Returns ``[L / r, E]``.
    """
    length = fk.shape[0]
    if not (isinstance(query_stride, int) and query_stride >= 1 and length % query_stride == 0
            and (min(chunk_size, length) % query_stride == 0)):
        raise ValueError(f"gated_delta_chunked: query_stride must be a positive int dividing "
                         f"L = {length} and chunk_size = {chunk_size}, got {query_stride!r}")
    ld = jnp.zeros_like(beta) if ld is None else ld
    s0 = jnp.zeros((fk.shape[-1], v.shape[-1]), jnp.result_type(fk, v))
    if segment_ids is None:
        fn = functools.partial(_delta_chunks, query_stride=query_stride)
        return chunk_groups(fn, (fq, fk, v, beta, ld), s0, chunk_size, group_positions)

    def fn(fq, fk, v, beta, ld, starts, s):
        return _delta_chunks(fq, fk, v, beta, ld, s, query_stride, starts)

    # Each position's start flag travels with it through the chunking (the padding's zeros
    # start nothing, and write nothing).
    arrays = (fq, fk, v, beta, ld, document_starts(segment_ids))
    return chunk_groups(fn, arrays, s0, chunk_size, group_positions)


def delta_rule_attention(
    q: Float[Array, "q_seq qk_dim"],
    k: Float[Array, "kv_seq qk_dim"],
    v: Float[Array, "kv_seq v_dim"],
    beta_logits,
    *feature_arrays,
    feature_map="dpfp",
    causal: bool = True,
    kv_mask: Bool[Array, "kv_seq"] | None = None,
    scale: float | None = None,
    implementation: str = "chunked",
    chunk_size: int = 64,
    eps: float = 1e-6,
    segment_ids=None,
    key=None,
) -> Float[Array, "q_seq v_dim"]:
    """Causal linear attention with the delta-rule (write-and-remove) memory update.

    Survey L 4.2.1-4.2.2 (Schlag et al. 2021, DPFP features and the delta rule). The method is
    a recurrence, so it exists only causally: ``causal=False`` raises.

    Args:
      q: ``[L, Dk]``.
      k: ``[L, Dk]``.
      v: ``[L, Dv]``.
      beta_logits: ``[L]`` (or a scalar): write strengths ``beta = sigmoid(beta_logits)``.
      *feature_arrays, feature_map, scale, eps: as in :func:`linear_attention` (default
        feature map: DPFP with ``nu = 1``).
      causal: must be True.
      kv_mask: ``bool[L]``, True for real tokens; padded tokens write nothing.
      implementation: ``"chunked"`` (triangular solve per chunk, scan over chunks) or
        ``"recurrent"`` (per-step scan).
      chunk_size: positions per chunk.
      segment_ids: ``int[L]`` packed documents (contiguous ids, 0 for padding), or None: the
        memory restarts empty at each document's first position, so each document's outputs
        and gradients are those of the document alone.

    Returns:
      ``[L, Dv]`` in q's dtype.
    """
    name = "delta_rule_attention"
    if not causal:
        raise ValueError(
            f"{name}: the delta rule is a recurrence over positions and exists only with "
            "causal=True"
        )
    check_implementation(name, implementation, chunk_size)
    x = C.check_qkv(name, q, k, v)
    C.check_same_length(name, x, "needs Lq == Lk")
    kv_mask = C.check_kv_mask(name, kv_mask, x.lk)
    if isinstance(segment_ids, (tuple, list)):
        raise ValueError(f"{name}: the delta rule is a recurrence over one sequence; pass one "
                         f"segment_ids array [L], not a pair of {len(segment_ids)}")
    segs = C.check_segment_ids(name, segment_ids, x.lq, x.lk)
    segment_ids = None if segs is None else segs[1]
    fm = resolve_feature_map(name, feature_map, feature_arrays)
    beta_logits = check_per_position(name, "beta_logits", beta_logits, x.lk)
    if kv_mask is not None:
        # Selected before the sigmoid too, so a padded NaN logit gets a zero gradient.
        beta_logits = jnp.where(kv_mask, beta_logits, 0.0)
    beta = jax.nn.sigmoid(beta_logits)
    root_scale = math.sqrt(C.resolve_scale(x.dk, scale))
    fq = _features(fm, x.q, feature_arrays, root_scale, eps)
    k_in = x.k if kv_mask is None else jnp.where(kv_mask[:, None], x.k, 0)
    fk = _features(fm, k_in, feature_arrays, root_scale, eps)
    vf = x.v.astype(C.STATS_DTYPE)
    if kv_mask is not None:
        beta = jnp.where(kv_mask, beta, 0.0)
        fk = jnp.where(kv_mask[:, None], fk, 0.0)
        vf = jnp.where(kv_mask[:, None], vf, 0.0)
    if implementation == "chunked":
        out = gated_delta_chunked(fq, fk, vf, beta, chunk_size=chunk_size,
                                  segment_ids=segment_ids)
    else:
        out = gated_delta_recurrent(fq, fk, vf, beta, segment_ids=segment_ids)
    return out.astype(x.q.dtype)


def delta_rule_init_state(dk: int, dv: int, *feature_arrays, feature_map="dpfp"):
    """An empty delta-rule memory ``[M, dv]`` (float32) for :func:`delta_rule_step`."""
    name = "delta_rule_init_state"
    fm = resolve_feature_map(name, feature_map, feature_arrays)
    dk = C.check_positive_int(name, "dk", dk)
    dv = C.check_positive_int(name, "dv", dv)
    m = jax.eval_shape(lambda: fm.fn(jnp.zeros((1, dk), C.STATS_DTYPE), *feature_arrays)).shape[-1]
    return jnp.zeros((m, dv), C.STATS_DTYPE)


def delta_rule_step(state, q, k, v, beta_logit, *feature_arrays, feature_map="dpfp",
                    scale: float | None = None, eps: float = 1e-6):
    """One O(1) decoding step of :func:`delta_rule_attention`.

    Args:
      state: ``[M, Dv]`` memory from :func:`delta_rule_init_state` or a previous step.
      q: ``[Dk]``, k: ``[Dk]``, v: ``[Dv]``: this token.
      beta_logit: scalar write strength logit.
      *feature_arrays, feature_map, scale, eps: as in :func:`delta_rule_attention`.

    Returns:
      ``(out [Dv] in q's dtype, new state)``.
    """
    name = "delta_rule_step"
    x = C.check_token(name, q, k, v)
    fm = resolve_feature_map(name, feature_map, feature_arrays)
    root_scale = math.sqrt(C.resolve_scale(x.dk, scale))
    fq = _features(fm, x.q, feature_arrays, root_scale, eps)
    fk = _features(fm, x.k, feature_arrays, root_scale, eps)
    beta = jax.nn.sigmoid(check_per_position(name, "beta_logit", beta_logit, 1))
    s = state + (beta[0] * fk[0])[:, None] * (x.v[0].astype(C.STATS_DTYPE) - fk[0] @ state)[None, :]
    return (fq[0] @ s).astype(x.q.dtype), s
