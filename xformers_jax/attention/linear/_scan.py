"""The causal linear-attention recurrence, written once, in two agreeing forms.

Every causal linear-attention variant (any feature map, RFA gate, scalar decay, the FAVOR+ key
stabiliser) reduces to one decayed prefix sum (survey L 4.2 Eq 16, L 4.2.2, T1 3.2.13)::

    S_t = exp(ld_t) S_{t-1} + fk_t v_t^T        out_t = fq_t S_t

with ``fq, fk: [L, M]``, ``v: [L, E]`` and log-decays ``ld <= 0`` (0 means no decay): ``[L]``,
one decay per step, or ``[L, M]``, one per step and key feature (``S_t = diag(exp(ld_t)) S_{t-1}
+ ...``; the data-dependent gates of GLA, Yang et al. 2024). The normaliser is the same sum with
a column of ones appended to ``v``, so it shares the scan. The gated linear recurrences of
:mod:`xformers_jax.mixers` (RetNet, GLA, Mamba-2's SSD) are this recurrence with their own
``fq, fk, v, ld``.

- :func:`causal_recurrent`: a ``lax.scan`` over positions with an ``[M, E]`` state. Its custom
  VJP is two scans (recompute the states forwards, accumulate the state cotangent backwards);
  no state is ever recovered by subtracting, so there is no drift over long sequences.
- :func:`causal_chunked`: chunks of ``c`` positions; a masked ``c x c`` matmul inside a chunk
  and the state carried across chunks by a scan, so memory is ``O(L (M + E) + (L/c) M E)``.
  The intra-chunk part is rematerialised in the backward pass. With per-feature decays the
  intra-chunk scores are ``sum_m fq_tm fk_jm exp(b_tm - b_jm)``: a ``[c, c, M]`` product.
- :func:`causal_parallel`: the whole sequence as one chunk (quadratic; RetNet's parallel form).
- :func:`causal_step`: one step of the recurrence, for O(1) decoding.

Decays are applied as differences of within-chunk cumulative log-decays, which are <= 0 for
every pair that is used, so nothing overflows however strong the decay.

Packed rows: every form takes ``segment_ids: int[L]`` (several documents in one sequence, each
a contiguous run of equal ids), and the state then restarts from zero at each document's first
token, so each document's outputs and gradients are those of the document alone. Documents
are numbered by counting boundaries (:func:`documents`), so only "is there a boundary between
s and t" is ever asked, as ``doc_s == doc_t``; the restarts are masks on the terms that cross
a boundary, never ``-inf`` log-decays (which would make ``inf - inf`` in the cumulative sums).
In the chunked form: intra-chunk scores are kept for ``doc_t == doc_j``, the state carried in
is read by query t only if ``doc_t`` is the document of the position before the chunk, a key
writes into the state passed on only if it belongs to the chunk's last document, and the old
state survives the chunk only if no boundary lies in it.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from ...kernels import pad_to


def _decay(ld_t):
    """``exp(ld_t)`` shaped to scale an ``[M, E]`` state: a scalar, or ``[M, 1]``."""
    d = jnp.exp(ld_t)
    return d if d.ndim == 0 else d[:, None]


def document_starts(segment_ids):
    """``bool[L]``: True at each document's first position of packed ``segment_ids int[L]``
    (where the id differs from the previous position's; position 0 is False, as a scan
    starts from an empty state anyway)."""
    seg = jnp.asarray(segment_ids)
    return jnp.concatenate([jnp.zeros((1,), bool), seg[1:] != seg[:-1]])


def documents(segment_ids):
    """``int[L]`` document index of each position: the number of boundaries (``id_t !=
    id_{t-1}``) up to t. Positions s <= t lie in one document exactly when ``doc_s == doc_t``,
    whatever the ids (equal ids in two separate runs are two documents)."""
    seg = jnp.asarray(segment_ids)
    if seg.ndim != 1 or not jnp.issubdtype(seg.dtype, jnp.integer):
        raise ValueError(f"segment_ids must be int[L], got {seg.dtype}{list(seg.shape)}")
    return jnp.cumsum(document_starts(seg), dtype=jnp.int32)


def _continues(doc):
    """``bool[L]``: position t continues the document of position t - 1 (False at 0)."""
    return jnp.concatenate([jnp.zeros((1,), bool), doc[1:] == doc[:-1]])


def _check_segments(segment_ids, length):
    if segment_ids is None:
        return None
    doc = documents(segment_ids)
    if doc.shape != (length,):
        raise ValueError(f"segment_ids must be int[{length}] (one id per position), got "
                         f"shape {tuple(doc.shape)}")
    return doc


def _drop_first_decays(ld, doc):
    """``ld`` with 0 at each document's first token. That decay meets a restarted (zero)
    state, so it changes nothing, but in the chunks' cumulative sums a positive one (mLSTM's
    stabiliser steps down at a restart) would overflow the masked-out terms and turn their
    zero cotangents into NaN."""
    keep = _continues(doc)
    return jnp.where(keep if ld.ndim == 1 else keep[:, None], ld, jnp.zeros((), ld.dtype))


def causal_step(s, fq_t, fk_t, v_t, ld_t):
    """One step ``S_t = exp(ld_t) S_{t-1} + fk_t v_t^T``, ``out_t = fq_t S_t``.

    Args:
      s: ``[M, E]`` state. fq_t, fk_t: ``[M]``. v_t: ``[E]``. ld_t: scalar or ``[M]``.

    Returns:
      ``(out_t [E], S_t)``.
    """
    s = _decay(ld_t) * s + fk_t[:, None] * v_t[None, :]
    return fq_t @ s, s


def _scan_states(fk, v, ld, dout, keep=None):
    """Recomputes the states forwards, emitting ``S_t dout_t`` (= dL/dfq_t) for each t."""

    def step(s, x):
        k_t, v_t, ld_t, do_t = x[:4]
        s = _decay(ld_t) * s
        if keep is not None:
            s = jnp.where(x[4], s, 0.0)  # a document's first token: the state restarts
        s = s + k_t[:, None] * v_t[None, :]
        return s, s @ do_t

    init = jnp.zeros((fk.shape[1], v.shape[1]), fk.dtype)
    xs = (fk, v, ld, dout) if keep is None else (fk, v, ld, dout, keep)
    return lax.scan(step, init, xs)[1]


def causal_recurrent(fq, fk, v, ld, segment_ids=None):
    """``out_t = fq_t S_t`` with ``S_t = exp(ld_t) S_{t-1} + fk_t v_t^T`` by a per-step scan.

    Args:
      fq: ``[L, M]`` query features.
      fk: ``[L, M]`` key features.
      v: ``[L, E]`` values.
      ld: ``[L]`` or ``[L, M]`` log-decays (``<= 0``), applied to the state (or to its rows,
        one per key feature) before position t is added.
      segment_ids: ``int[L]`` or None: packed documents; the state restarts from zero at each
        document's first token (the module docstring).

    Returns:
      ``[L, E]``.
    """
    if segment_ids is None:
        return _recurrent(fq, fk, v, ld)
    keep = _continues(_check_segments(segment_ids, fq.shape[0]))
    return _recurrent_segments(fq, fk, v, ld, keep)


@jax.custom_vjp
def _recurrent(fq, fk, v, ld):
    def step(s, x):
        q_t, k_t, v_t, ld_t = x
        return causal_step(s, q_t, k_t, v_t, ld_t)[::-1]

    init = jnp.zeros((fk.shape[1], v.shape[1]), fk.dtype)
    return lax.scan(step, init, (fq, fk, v, ld))[1]


def _recurrent_fwd(fq, fk, v, ld):
    return _recurrent(fq, fk, v, ld), (fq, fk, v, ld)


def _recurrent_bwd(res, dout):
    return _recurrent_grads(*res, dout)


def _recurrent_grads(fq, fk, v, ld, dout, keep=None):
    # Scan 1 (forwards): recompute S_t; dL/dfq_t = S_t dout_t.
    dfq = _scan_states(fk, v, ld, dout, keep)

    # Scan 2 (backwards): G_t = dL/dS_t = fq_t dout_t^T + exp(ld_{t+1}) G_{t+1} (nothing
    # from t + 1 when it starts a document).
    ld_next = jnp.concatenate([ld[1:], jnp.zeros_like(ld[:1])])
    xs = (fq, dout, ld_next, fk, v)
    if keep is not None:
        xs = xs + (jnp.concatenate([keep[1:], jnp.zeros((1,), bool)]),)

    def back(g, x):
        q_t, do_t, ld_n, k_t, v_t = x[:5]
        g = _decay(ld_n) * g
        if keep is not None:
            g = jnp.where(x[5], g, 0.0)
        g = g + q_t[:, None] * do_t[None, :]
        return g, (g @ v_t, k_t @ g)

    init = jnp.zeros((fq.shape[1], dout.shape[1]), fq.dtype)
    dfk, dv = lax.scan(back, init, xs, reverse=True)[1]
    # out_i = sum_{j<=i} exp(C_i - C_j) (fq_i . fk_j) v_j with C = cumsum(ld): C enters as a
    # rescaling of fq_i by exp(C_i) and of fk_j by exp(-C_j), so dL/dC_t = fq_t.dfq_t -
    # fk_t.dfk_t, and dL/dld_s is the sum of dL/dC_t over t >= s (per feature for [L, M]
    # decays, where C_t rescales feature m of fq_t and fk_t alone). With documents, ld_s
    # enters only the pairs of its own document with j < s <= i: the sum runs over t >= s in
    # s's document, and is 0 at a document's first token (whose decay meets a zero state).
    dc = fq * dfq - fk * dfk
    if ld.ndim == 1:
        dc = jnp.sum(dc, -1)
    if keep is None:
        dld = jnp.cumsum(dc[::-1], axis=0)[::-1]
    else:
        keep_next = jnp.concatenate([keep[1:], jnp.zeros((1,), bool)])
        kn = keep_next if dc.ndim == 1 else keep_next[:, None]

        def acc(a, x):
            dc_t, kn_t = x
            a = dc_t + jnp.where(kn_t, a, 0.0)
            return a, a

        dld = lax.scan(acc, jnp.zeros_like(dc[0]), (dc, kn), reverse=True)[1]
        dld = jnp.where(keep if dc.ndim == 1 else keep[:, None], dld, 0.0)
    return dfq, dfk, dv, dld


_recurrent.defvjp(_recurrent_fwd, _recurrent_bwd)


@jax.custom_vjp
def _recurrent_segments(fq, fk, v, ld, keep):
    def step(s, x):
        q_t, k_t, v_t, ld_t, keep_t = x
        s = jnp.where(keep_t, _decay(ld_t) * s, 0.0) + k_t[:, None] * v_t[None, :]
        return s, q_t @ s

    init = jnp.zeros((fk.shape[1], v.shape[1]), fk.dtype)
    return lax.scan(step, init, (fq, fk, v, ld, keep))[1]


def _recurrent_segments_fwd(fq, fk, v, ld, keep):
    return _recurrent_segments(fq, fk, v, ld, keep), (fq, fk, v, ld, keep)


def _recurrent_segments_bwd(res, dout):
    return (*_recurrent_grads(*res[:4], dout, res[4]), None)


_recurrent_segments.defvjp(_recurrent_segments_fwd, _recurrent_segments_bwd)


def _intra_decay(b, doc=None):
    """``exp(b_t - b_j)`` for ``j <= t`` and 0 above the diagonal: ``[n, c, c]`` from ``b:
    [n, c]`` or ``[n, c, c, M]`` from ``b: [n, c, M]``. With ``doc: int[n, c]`` (document
    indices, :func:`documents`) also 0 where ``doc_t != doc_j``."""
    c = b.shape[1]
    causal = jnp.tril(jnp.ones((c, c), bool))
    if doc is not None:
        causal = causal & (doc[:, :, None] == doc[:, None, :])
    if b.ndim == 3:
        causal = causal[..., None]
    diff = b[:, :, None] - b[:, None, :]
    # The inner where keeps exp off the (positive) differences above the diagonal, whose
    # overflow would turn the masked-out gradient into NaN.
    return jnp.where(causal, jnp.exp(jnp.where(causal, diff, 0.0)), 0.0)


def _intra_chunk(fq, fk, v, b, doc=None):
    """Within-chunk outputs: ``sum_{j<=t} exp(b_t - b_j) (fq_t . fk_j) v_j`` per chunk
    (``b: [n, c]``), or ``sum_{j<=t} sum_m fq_tm fk_jm exp(b_tm - b_jm) v_j`` (``b: [n, c, M]``);
    with ``doc: int[n, c]`` the sums run over the j of t's document only. Rematerialised in
    the backward pass."""
    if b.ndim == 3:
        return _intra_gated(fq, fk, v, b, doc)
    return _intra_scalar(fq, fk, v, b, doc)


@functools.partial(jax.checkpoint, prevent_cse=False)
def _intra_scalar(fq, fk, v, b, doc=None):
    scores = jnp.einsum("ncm,ndm->ncd", fq, fk) * _intra_decay(b, doc)
    return jnp.einsum("ncd,nde->nce", scores, v)


def _gated_scores(fq, fk, decay):
    # One fused product-and-sum over the minor (feature) axis: as an einsum, XLA:CPU laid
    # the [n, c, c, M] terms out again for each contraction of the backward pass.
    return jnp.sum(fq[:, :, None] * fk[:, None] * decay, axis=-1)


@jax.custom_vjp
def _intra_gated(fq, fk, v, b, doc=None):
    """:func:`_intra_chunk` with per-feature decays (GLA). Its VJP recomputes the decays and
    needs only ``dfq`` and ``dfk``: ``b`` enters as a rescaling of ``fq_t`` by ``exp(b_t)``
    and of ``fk_j`` by ``exp(-b_j)``, so ``db = fq * dfq - fk * dfk`` (as in
    :func:`causal_recurrent`; the document mask is a constant of the same product)."""
    return jnp.einsum("ncd,nde->nce", _gated_scores(fq, fk, _intra_decay(b, doc)), v)


def _intra_gated_fwd(fq, fk, v, b, doc=None):
    return _intra_gated(fq, fk, v, b, doc), (fq, fk, v, b, doc)


def _intra_gated_bwd(res, dout):
    fq, fk, v, b, doc = res
    decay = _intra_decay(b, doc)
    dv = jnp.einsum("ncd,nce->nde", _gated_scores(fq, fk, decay), dout)
    p = decay * jnp.einsum("nce,nde->ncd", dout, v)[..., None]  # zero above the diagonal
    dfq = jnp.sum(p * fk[:, None], axis=2)
    dfk = jnp.sum(p * fq[:, :, None], axis=1)
    return dfq, dfk, dv, fq * dfq - fk * dfk, None


_intra_gated.defvjp(_intra_gated_fwd, _intra_gated_bwd)


# Positions per group of chunks (see causal_chunked): 2048 positions keep a group's working
# set (a few [c, c] score tiles and [c, M] / [c, E] slices per chunk) in cache. On the 2-core
# EPYC, fwd+bwd of 4 heads grew 9.3-10x from L=8K to 64K with every chunk at once, because
# the [L, ...] intermediates fall out of the 32 MB L3 cache at 64K.
GROUP_POSITIONS = 2048


def _chunks(fq, fk, v, b, s0, doc=None, doc_before=None):
    """Chunkwise form over ``n`` chunks starting from the state ``s0``: (out, final state).

    With ``doc: int[n, c]`` (document indices) and ``doc_before: int[n]`` (the document of
    the position before each chunk), the state restarts at every document's first token."""
    total = b[:, -1]
    if doc is not None:
        last = doc[:, -1:]
        writes = doc == last  # keys of the chunk's last document reach the state passed on
        reads = doc == doc_before[:, None]  # queries of the document carried in read it
        survives = doc_before == last[:, 0]  # no boundary in the chunk
    # Each chunk's addition to the state at its end, then the states at chunk starts.
    if b.ndim == 2:
        # A per-step decay is a scalar per position: it scales v_j's row of the addition
        # and out_t's row of the inter-chunk term. Applying it on that side leaves fk and fq
        # untouched, so heads that share them (Mamba-2's B and C, vmapped over heads with
        # their own decays) contract them once against all heads' values in one matmul.
        w = jnp.exp(total[:, None] - b)
        if doc is not None:
            w = jnp.where(writes, w, 0.0)
        kv = jnp.einsum("ncm,nce->nme", fk, v * w[..., None])
    else:
        w = jnp.exp(total[:, None, :] - b)
        if doc is not None:
            w = jnp.where(writes[..., None], w, 0.0)
        kv = jnp.einsum("ncm,nce->nme", fk * w, v)

    def carry(s, x):
        total_n, kv_n = x[:2]
        s_next = _decay(total_n) * s
        if doc is not None:
            s_next = jnp.where(x[2], s_next, 0.0)
        return s_next + kv_n, s

    xs = (total, kv) if doc is None else (total, kv, survives)
    s_end, starts = lax.scan(carry, s0, xs)
    def read():  # exp(b_t), for the queries that read the state carried in
        r = jnp.exp(b)
        return r if doc is None else jnp.where(reads if b.ndim == 2 else reads[..., None], r,
                                                0.0)

    if b.ndim == 2:
        inter = jnp.einsum("ncm,nme->nce", fq, starts) * read()[..., None]
    else:
        inter = jnp.einsum("ncm,nme->nce", fq * read(), starts)
    return inter + _intra_chunk(fq, fk, v, b, doc), s_end


def chunk_groups(fn, arrays, s0, chunk_size: int, group_positions: int = GROUP_POSITIONS):
    """Runs a chunkwise recurrence over groups of whole chunks, carrying its state.

    ``arrays`` (each ``[L, ...]``) are padded with zeros to whole chunks of ``c =
    min(chunk_size, L)`` and whole groups of about ``group_positions`` positions, and reshaped
    to ``[groups, per_group, c, ...]``. ``fn(*group_arrays, s) -> (out [per_group, c, E], s)``
    computes a group's chunks at once from the state ``s`` at its start; a ``lax.scan`` over
    groups carries the state, and each group is rematerialised in the backward pass, so what
    a group materialises (``[c, c]`` tiles per chunk, and whatever else ``fn`` builds) exists
    for one group at a time: memory ``O(L (M + E) + (L/c) M E)`` plus one group's working
    set, which stays in cache and keeps the time linear in L on CPUs.

    ``fn`` may return fewer rows than positions per chunk, ``c / r`` of them (a recurrence
    read every ``r``-th position, as DeltaProduct reads once per token of ``r`` sub-steps);
    then ``r`` must divide ``c`` and ``L``, and the result has ``L / r`` rows.

    Returns ``[L, E]`` (``[L / r, E]``).
    """
    length = arrays[0].shape[0]
    c = min(chunk_size, length)
    n = -(-length // c)
    per_group = max(1, min(n, group_positions // c))
    groups = -(-n // per_group)
    n = groups * per_group
    arrays = [pad_to(x, n * c).reshape(groups, per_group, c, *x.shape[1:]) for x in arrays]

    @functools.partial(jax.checkpoint, prevent_cse=False)
    def group(s, x):
        out, s = fn(*x, s)
        return s, out

    if groups == 1:
        out = fn(*(x[0] for x in arrays), s0)[0]
    else:
        out = lax.scan(group, s0, arrays)[1]
    rows = out.shape[-2]  # per chunk: c, or c / r
    return out.reshape(n * rows, -1)[: length * rows // c]


def causal_chunked(fq, fk, v, ld, chunk_size: int, group_positions: int = GROUP_POSITIONS,
                   segment_ids=None):
    """The same recurrence as :func:`causal_recurrent`, chunkwise parallel.

    Chunks are processed in groups of about ``group_positions`` positions
    (:func:`chunk_groups`): a ``lax.scan`` over groups carries the state, and within a group
    every chunk is computed at once. Each group is rematerialised in the backward pass, so
    memory stays ``O(L (M + E) + (L/c) M E)`` and the working set stays in cache, which keeps
    the time linear in L on CPUs.

    Args:
      fq: ``[L, M]``, fk: ``[L, M]``, v: ``[L, E]``, ld: ``[L]`` or ``[L, M]`` as in
        :func:`causal_recurrent`.
      chunk_size: positions per chunk (padded internally; padding adds nothing to the state).
      group_positions: positions per group (rounded to whole chunks).
      segment_ids: ``int[L]`` or None: packed documents; the state restarts from zero at each
        document's first token (masks on the chunk's terms, the module docstring).

    Returns:
      ``[L, E]``.
    """
    s0 = jnp.zeros((fk.shape[-1], v.shape[-1]), jnp.result_type(fk, v))
    if segment_ids is None:
        def chunks(fq, fk, v, ld, s):
            return _chunks(fq, fk, v, jnp.cumsum(ld, axis=1), s)  # within-chunk cumulative decays

        return chunk_groups(chunks, (fq, fk, v, ld), s0, chunk_size, group_positions)

    doc = _check_segments(segment_ids, fq.shape[0])
    doc_before = jnp.concatenate([doc[:1], doc[:-1]])
    ld = _drop_first_decays(ld, doc)

    def chunks_segments(fq, fk, v, ld, doc, doc_before, s):
        return _chunks(fq, fk, v, jnp.cumsum(ld, axis=1), s, doc, doc_before[:, 0])

    return chunk_groups(chunks_segments, (fq, fk, v, ld, doc, doc_before), s0, chunk_size,
                        group_positions)


def causal_parallel(fq, fk, v, ld, segment_ids=None):
    """The same recurrence in its parallel (quadratic) form: one chunk of length ``L``,
    ``out = (fq fk^T * D) v`` with ``D_tj = exp(sum_{j<s<=t} ld_s)`` for ``j <= t`` (RetNet's
    parallel retention, Sun et al. 2023, when ``ld`` is a constant ``log gamma``); with
    ``segment_ids: int[L]``, ``D_tj = 0`` across documents.

    Args and returns: as :func:`causal_recurrent`. Time ``O(L^2 M)``, memory ``O(L^2)``
    (``O(L^2 M)`` with per-feature decays).
    """
    doc = None if segment_ids is None else _check_segments(segment_ids, fq.shape[0])
    if doc is not None:
        ld = _drop_first_decays(ld, doc)
        doc = doc[None]
    b = jnp.cumsum(ld, axis=0)
    return _intra_chunk(fq[None], fk[None], v[None], b[None], doc)[0]
