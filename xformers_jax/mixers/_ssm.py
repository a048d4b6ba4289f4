"""Diagonal state space models: S4D (convolution kernel), S5 (MIMO, associative scan) and
Mamba's selective scan.

- S4D (Gu, Gupta, Goel and Re 2022, "On the Parameterization and Initialization of Diagonal
  State Space Models"): per channel, ``x'(t) = A x(t) + B u(t)``, ``y = C x + D u`` with
  diagonal complex ``A`` (N/2 conjugate pairs), discretised by zero-order hold,
  ``dA = exp(dt A)``, ``dB = (dA - 1) / A * B``. The output is a causal convolution with the
  Vandermonde kernel ``K_l = 2 Re(sum_n C_n dB_n dA_n^l)``, computed by FFT for training, or
  the recurrence ``x_t = dA x_{t-1} + dB u_t``, ``y_t = 2 Re(C x_t)`` for decoding.
- S5 (Smith, Warrington and Linderman 2023, "Simplified State Space Layers for Sequence
  Modeling"): one multi-input multi-output diagonal system ``x_t = dLambda x_{t-1} + dB u_t``,
  ``y_t = Re(C x_t) + D u_t`` over all channels, computed by ``jax.lax.associative_scan``.
- Mamba (Gu and Dao 2023, "Mamba: Linear-Time Sequence Modeling with Selective State Spaces",
  Algorithm 2): per channel ``d`` and state ``n``, ``h_t = exp(dt_td A_dn) h_{t-1} + dt_td
  B_tn x_td``, ``y_td = sum_n C_tn h_tdn`` with input-dependent ``dt, B, C``, by an associative
  scan over groups of positions.

Bidirectional forms (for classification) add a second system run from the end
(``reverse=True`` runs one system backwards). ``kv_mask`` makes padded positions neither
write nor decay, so padding content and amount change no real output.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from ..kernels import pad_to
from ._document_conv import document_convolve, document_starts, gathered_documents

SSM_FORMS = ("fft", "recurrent")
# Positions per block of the S4D kernel's Vandermonde product (see s4d_kernel): about sqrt(L)
# at the lengths that matter, so both factors stay small.
KERNEL_BLOCK = 128
SCAN_FORMS = ("associative", "sequential")
# The selective scan's forms: also ``"loop"``, a loop over positions with its own backward,
# and ``"auto"``: the loop on a CPU, the associative scan on an accelerator. fwd+bwd, one
# thread of the 2-core EPYC: Mamba's zoo shape (64 sequences of 256, D=128, N=16) 311 ms
# looped, 703 sequential, 2018 associative; one sequence of 8192 (D=512, N=16) 785 looped,
# 2812 associative. The associative scan's log-depth levels are what an accelerator runs in
# parallel; on a CPU they are memory passes over [G, D, N].
SELECTIVE_FORMS = SCAN_FORMS + ("loop", "auto")


def _check_form(name, implementation, forms):
    if implementation not in forms:
        raise ValueError(f"{name}: implementation must be one of {forms}, got "
                         f"{implementation!r}")


def _masked_input(name, u, kv_mask):
    if kv_mask is None:
        return u
    if kv_mask.shape != u.shape[:1]:
        raise ValueError(f"{name}: kv_mask must be bool[{u.shape[0]}], got shape "
                         f"{kv_mask.shape}")
    return jnp.where(kv_mask[:, None], u, 0)


def zoh(dt, a, b):
    """Zero-order hold: ``(exp(dt a), (exp(dt a) - 1) / a * b)`` (elementwise, complex ok)."""
    da = jnp.exp(dt * a)
    return da, (da - 1) / a * b


def s4d_kernel(dt, a, b, c, length: int):
    """The S4D convolution kernel ``K[h, l] = 2 Re(sum_n C_hn dB_hn dA_hn^l)``.

    Args:
      dt: ``[H]`` step sizes. a: ``[H, N]`` complex (``Re a < 0``). b, c: ``[H, N]`` complex.
      length: ``L``.

    Returns:
      ``[H, L]`` float32 (the Vandermonde product, ``O(H N L)`` time).
    """
    da, db = zoh(dt[:, None], a, b)
    cb = c * db
    # Positions l = s B + j (blocks of B ~ sqrt(L)): dA^l = dA^(s B) dA^j, so the kernel is
    # one batched matrix product K[h, s, j] = 2 Re(sum_n W[h, s, n] V[h, n, j]) with
    # W = C dB dA^(s B) and V = dA^j, taken in real arithmetic as [Re W, -Im W] @ [Re V; Im V].
    # That needs H N (L / B + B) exponentials instead of H N L, and the product runs at
    # matrix-multiply speed (the Vandermonde matrix itself, [H, N, L], is never formed).
    block = min(length, KERNEL_BLOCK)
    n = -(-length // block)
    step = dt[:, None] * a  # [H, N]
    w = cb[:, None, :] * jnp.exp(step[:, None, :] * (jnp.arange(n) * block)[:, None])
    v = jnp.exp(step[..., None] * jnp.arange(block))  # [H, N, B]
    wr = jnp.concatenate([w.real, -w.imag], -1)  # [H, n, 2N]
    vr = jnp.concatenate([v.real, v.imag], 1)  # [H, 2N, B]
    k = 2 * jnp.einsum("hsm,hmj->hsj", wr, vr)
    return k.reshape(a.shape[0], n * block)[:, :length]


def causal_convolve(u, kernel, segment_ids=None):
    """``y[t, h] = sum_{s <= t} kernel[h, t - s] u[s, h]`` by FFT (zero-padded to ``2L``, so
    the convolution is linear, not circular), in float32. u: ``[L, H]``; kernel: ``[H, L]``;
    or u ``[L, *C]`` with a kernel ``[*K, L]`` whose leading axes broadcast against ``C`` (H3's
    per-head kernel ``[H, 1, 1, L]`` over its ``[L, H, P, P]`` outer products).

    With ``segment_ids int[L]`` (packed documents, each a contiguous run of one id, 0 for
    padding) the sum runs over ``s`` in ``t``'s document only, exactly (a divide and conquer
    over blocks, ``O(L log^2 L)``: ``_document_conv.document_convolve``); padding's inputs
    are dropped and its outputs are zero. It costs about ``log2(L) / 2`` row convolutions:
    on a 2-core CPU, 128 channels, 8 documents, 4-7x this function's time without ids
    forward and 7-11x forward and backward at L = 2K to 8K."""
    length = u.shape[0]
    if kernel.shape[-1] != length:
        raise ValueError(f"causal_convolve: the kernel's last axis must have the sequence "
                         f"length {length}, got kernel {kernel.shape} for u {u.shape}")
    if segment_ids is not None:
        return document_convolve(u, kernel, segment_ids)
    n = 2 * length
    uf = jnp.fft.rfft(u.astype(jnp.float32), n=n, axis=0)
    kf = jnp.fft.rfft(jnp.moveaxis(kernel.astype(jnp.float32), -1, 0), n=n, axis=0)
    return jnp.fft.irfft(uf * kf, n=n, axis=0)[:length]


def s4d(u, dt, a, b, c, d, *, c_reverse=None, kv_mask=None, segment_ids=None,
        implementation: str = "fft"):
    """S4D over one sequence: ``y = K * u + D u`` (plus ``flip(K' * flip(u))`` when
    ``c_reverse`` gives the backward system's output matrix: the bidirectional form).

    Args:
      u: ``[L, H]``. dt: ``[H]``. a, b, c: ``[H, N]`` complex. d: ``[H]``.
      c_reverse: ``[H, N]`` complex or None (causal).
      kv_mask: ``bool[L]`` or None: padded steps neither write nor decay. The convolution's
        kernel is indexed by distance, so the real positions are gathered to the front (in
        order) before it and the outputs scattered back: a hole in the middle then changes no
        distance between real tokens (``O(L)`` gathers beside the ``O(L log L)`` FFT).
      segment_ids: ``int[L]`` or None: packed documents (contiguous, 0 for padding); each
        document's outputs are its own: the FFT form convolves within documents
        (:func:`causal_convolve` with ``segment_ids``), the recurrent form restarts its state
        where the id changes (and, run backwards, where it changes going backwards).
      implementation: ``"fft"`` (kernel and FFT convolution) or ``"recurrent"`` (a scan over
        positions with a complex ``[H, N]`` state).

    Returns:
      ``[L, H]`` float32.
    """
    name = "s4d"
    _check_form(name, implementation, SSM_FORMS)
    if u.ndim != 2 or a.shape != (u.shape[1], a.shape[-1]) or dt.shape != u.shape[1:]:
        raise ValueError(f"s4d: u must be [L, H] with dt [H] and a, b, c [H, N], got u "
                         f"{u.shape}, dt {dt.shape}, a {a.shape}")
    u = _masked_input(name, u, kv_mask).astype(jnp.float32)
    # The real positions first (a stable order), then the padded ones, whose zero inputs then
    # follow every real token.
    order = None if kv_mask is None else jnp.argsort(~kv_mask, stable=True)
    if segment_ids is not None and segment_ids.shape != u.shape[:1]:
        raise ValueError(f"s4d: segment_ids must be int[L] = [{u.shape[0]}], got "
                         f"{segment_ids.shape} (u {u.shape})")
    seg = gathered_documents(name, segment_ids, kv_mask, order)

    def one_way(u, c, seg):
        if implementation == "fft":
            return causal_convolve(u, s4d_kernel(dt, a, b, c, u.shape[0]), seg)
        da, db = zoh(dt[:, None], a, b)
        start = None if seg is None else document_starts(seg)

        def step(x, inputs):
            u_t, start_t = inputs
            x = da * x if start_t is None else jnp.where(start_t, 0, da * x)
            x = x + db * u_t[:, None]
            return x, 2 * jnp.sum(c * x, -1).real

        return lax.scan(step, jnp.zeros(a.shape, jnp.complex64), (u, start))[1]

    uc = u if order is None else u[order]
    y = one_way(uc, c, seg)
    if c_reverse is not None:
        y = y + one_way(uc[::-1], c_reverse, None if seg is None else seg[::-1])[::-1]
    if order is not None:
        y = jnp.zeros_like(y).at[order].set(y)
    return y + d * u


def s4d_step(x, u_t, dt, a, b, c, d):
    """One decoding step of causal S4D: state ``x [H, N]`` complex, ``u_t [H]`` -> ``(y_t [H],
    x)``."""
    da, db = zoh(dt[:, None], a, b)
    x = da * x + db * u_t[:, None].astype(jnp.float32)
    return 2 * jnp.sum(c * x, -1).real + d * u_t, x


def _linear_scan(a, bx, implementation, reverse=False):
    """``x_t = a_t x_{t-1} + bx_t`` along axis 0 (associative scan or a sequential loop)."""
    if implementation == "associative":
        def combine(left, right):
            a1, b1 = left
            a2, b2 = right
            return a1 * a2, a2 * b1 + b2

        return lax.associative_scan(combine, (a, bx), reverse=reverse)[1]

    def step(x, inputs):
        a_t, b_t = inputs
        x = a_t * x + b_t
        return x, x

    return lax.scan(step, jnp.zeros_like(bx[0]), (a, bx), reverse=reverse)[1]


def s5(u, lam, dt, b, c, d, *, c_reverse=None, kv_mask=None, segment_ids=None,
       implementation: str = "associative"):
    """S5 over one sequence: ``x_t = dLambda x_{t-1} + dB u_t``, ``y_t = Re(C x_t) + D u_t``.

    Args:
      u: ``[L, H]``. lam: ``[P]`` complex (``Re < 0``). dt: ``[P]``. b: ``[P, H]`` complex.
      c: ``[H, P]`` complex. d: ``[H]``. c_reverse: ``[H, P]`` or None: adds
        ``Re(C' x'_t)`` of the same system run backwards (bidirectional S5).
      kv_mask: ``bool[L]``: padded steps neither write nor decay.
      segment_ids: ``int[L]`` or None: packed documents; the state restarts from zero where
        the id changes (the transition into a document's first step is 0, and, run
        backwards, the one out of its last), so each document's outputs are its own.
      implementation: ``"associative"`` (``lax.associative_scan``) or ``"sequential"``.

    Returns:
      ``[L, H]`` float32.
    """
    name = "s5"
    _check_form(name, implementation, SCAN_FORMS)
    if u.ndim != 2 or b.shape != (lam.shape[0], u.shape[1]) or c.shape != b.shape[::-1]:
        raise ValueError(f"s5: u must be [L, H] with lam [P], b [P, H], c [H, P]; got u "
                         f"{u.shape}, lam {lam.shape}, b {b.shape}, c {c.shape}")
    u = _masked_input(name, u, kv_mask).astype(jnp.float32)
    da, db = zoh(dt, lam, b.T)  # [P], [H, P]
    bu = u.astype(jnp.complex64) @ db  # [L, P]
    a = jnp.broadcast_to(da, bu.shape)
    if kv_mask is not None:
        a = jnp.where(kv_mask[:, None], a, 1)
    a_reverse = a
    if segment_ids is not None:
        if segment_ids.shape != u.shape[:1]:
            raise ValueError(f"s5: segment_ids must be int[L] = [{u.shape[0]}], got "
                             f"{segment_ids.shape}")
        change = segment_ids[1:] != segment_ids[:-1]
        no = jnp.zeros((1,), bool)
        a_reverse = jnp.where(jnp.concatenate([change, no])[:, None], 0, a)
        a = jnp.where(jnp.concatenate([no, change])[:, None], 0, a)
    y = (_linear_scan(a, bu, implementation) @ c.T).real
    if c_reverse is not None:
        y = y + (_linear_scan(a_reverse, bu, implementation, reverse=True) @ c_reverse.T).real
    return y + d * u


def s5_step(x, u_t, lam, dt, b, c, d):
    """One decoding step of causal S5: state ``x [P]`` complex, ``u_t [H]``."""
    da, db = zoh(dt, lam, b.T)
    x = da * x + u_t.astype(jnp.complex64) @ db
    return (c @ x).real + d * u_t, x


def _advance(h, a, x_t, d_t, b_t, keep_t):
    """One position of the selective scan: ``(h_t, da_t)`` with ``da_t = exp(dt_t A)`` (0
    where a document starts, ``keep_t`` False) and ``h_t = da_t h_{t-1} + dt_t x_t B_t^T``."""
    da = jnp.where(keep_t, jnp.exp(d_t[:, None] * a), 0.0)
    return da * h + (d_t * x_t)[:, None] * b_t[None, :], da


@jax.custom_vjp
def _selective_loop(h0, x, delta, a, b, c, keep):
    """``(y [G, D], h_G [D, N])`` of the selective scan over one group from ``h0``: a loop over
    positions (the state, ``D N`` floats, is all it carries), differentiated by the reverse
    loop of :func:`_selective_loop_bwd` rather than by autodiff of the loop, which on XLA:CPU
    spends most of its time copying and broadcasting the per-step ``[D, N]`` values it stacks."""
    return _selective_loop_fwd(h0, x, delta, a, b, c, keep)[0]


def _selective_loop_fwd(h0, x, delta, a, b, c, keep):
    def step(h, inputs):
        h = _advance(h, a, *inputs[:4])[0]
        return h, h @ inputs[4]

    h, y = lax.scan(step, h0, (x, delta, b, keep, c))
    return (y, h), (h0, x, delta, a, b, c, keep)


def _selective_loop_bwd(res, cotangents):
    """The reverse loop: with ``g_t`` the cotangent of ``h_t`` (``gy_t C_t^T`` plus what
    ``h_{t+1} = da_{t+1} h_t + ...`` sends back), ``da_t = exp(dt_t A)``:
    ``d h_{t-1} = da_t g_t``, ``d dt_t = sum_n (g_t h_{t-1} da_t A) + x_t sum_n g_t B_t``,
    ``d x_t = dt_t sum_n g_t B_t``, ``d B_t = g_t^T (dt_t x_t)``, ``d A = sum_t g_t h_{t-1}
    da_t dt_t``; ``d C_t = h_t^T gy_t`` from the recomputed states."""
    h0, x, delta, a, b, c, keep = res
    gy, gh_last = cotangents

    def states(h, inputs):
        return _advance(h, a, *inputs)[0], h

    h_prev = lax.scan(states, h0, (x, delta, b, keep))[1]  # h_{t-1}, [G, D, N]

    def back(carry, inputs):
        g_next, g_a = carry
        gy_t, c_t, x_t, d_t, b_t, keep_t, hp_t = inputs
        g = gy_t[:, None] * c_t[None, :] + g_next
        h_t, da = _advance(hp_t, a, x_t, d_t, b_t, keep_t)
        q = g * hp_t * da
        gu = g @ b_t  # [D]: the cotangent of dt_t x_t
        gd = jnp.sum(q * a, -1) + gu * x_t
        return (da * g, g_a + q * d_t[:, None]), (gd, gu * d_t, (d_t * x_t) @ g, gy_t @ h_t)

    (g_h0, g_a), (g_delta, g_x, g_b, g_c) = lax.scan(
        back, (gh_last, jnp.zeros_like(a)), (gy, c, x, delta, b, keep, h_prev), reverse=True)
    return g_h0, g_x, g_delta, g_a, g_b, g_c, None


_selective_loop.defvjp(_selective_loop_fwd, _selective_loop_bwd)


# Positions per group of the selective scan: each group's [G, D, N] scan elements are built,
# scanned and contracted with C inside one rematerialised step, so memory is O(L D + (L/G) D N
# + G D N) rather than O(L D N).
SELECTIVE_GROUP = 1024


def selective_scan(x, delta, a, b, c, *, kv_mask=None, implementation: str = "auto",
                   group_positions: int = SELECTIVE_GROUP, reverse: bool = False,
                   segment_ids=None):
    """Mamba's selective scan of one sequence (Gu and Dao 2023, Algorithm 2, without ``D x``).

    Args:
      x: ``[L, D]``. delta: ``[L, D]`` step sizes ``> 0``. a: ``[D, N]`` (``< 0``).
      b, c: ``[L, N]``. kv_mask: ``bool[L]``: padded steps neither write nor decay.
      implementation: ``"associative"`` (``lax.associative_scan`` within groups of
        ``group_positions``, a scan carrying the state across groups), ``"loop"`` (a loop
        over positions within each group with its own backward pass, a reverse loop that
        recomputes the group's states: the fastest form on a CPU), ``"sequential"`` (a
        loop over positions differentiated by autodiff: the reference) or ``"auto"`` (the
        default: the loop on a CPU, the associative scan on an accelerator).
      reverse: run from the last position to the first (the bidirectional form's second
        direction).
      segment_ids: ``int[L]`` or None: packed documents; the state restarts from zero where
        the id changes (in the direction of the scan), so each document's outputs are its
        own.

    Returns:
      ``[L, D]`` float32.
    """
    name = "selective_scan"
    _check_form(name, implementation, SELECTIVE_FORMS)
    if implementation == "auto":
        implementation = "loop" if jax.default_backend() == "cpu" else "associative"
    length, dim = x.shape
    if delta.shape != x.shape or a.shape[0] != dim or b.shape != (length, a.shape[1]) or \
            c.shape != b.shape:
        raise ValueError(f"selective_scan: need x, delta [L, D], a [D, N], b, c [L, N]; got x "
                         f"{x.shape}, delta {delta.shape}, a {a.shape}, b {b.shape}, c {c.shape}")
    x, delta, b, c = (t.astype(jnp.float32) for t in (x, delta, b, c))
    if kv_mask is not None:
        x = _masked_input(name, x, kv_mask)
        delta = jnp.where(kv_mask[:, None], delta, 0)  # exp(0 A) = 1: no decay, no write
    if segment_ids is not None and segment_ids.shape != (length,):
        raise ValueError(f"selective_scan: segment_ids must be int[L] = [{length}], got "
                         f"{segment_ids.shape}")
    if reverse:
        x, delta, b, c = (t[::-1] for t in (x, delta, b, c))
        segment_ids = None if segment_ids is None else segment_ids[::-1]
    # Where a document starts (in the scan's direction) the decay of the state before is 0.
    keep = jnp.ones((length,), bool) if segment_ids is None else jnp.concatenate(
        [jnp.ones((1,), bool), segment_ids[1:] == segment_ids[:-1]])
    if implementation == "sequential":
        def step(h, inputs):
            x_t, d_t, b_t, c_t, keep_t = inputs
            h = _advance(h, a, x_t, d_t, b_t, keep_t)[0]
            return h, h @ c_t

        y = lax.scan(step, jnp.zeros(a.shape, jnp.float32), (x, delta, b, c, keep))[1]
        return y[::-1] if reverse else y

    g = min(group_positions, length)
    n = -(-length // g)
    x, delta, b, c = (pad_to(t, n * g).reshape(n, g, -1) for t in (x, delta, b, c))
    keep = pad_to(keep, n * g).reshape(n, g)

    def loop_group(h0, inputs):
        x_g, d_g, b_g, c_g, keep_g = inputs
        y_g, h = _selective_loop(h0, x_g, d_g, a, b_g, c_g, keep_g)
        return h, y_g

    @functools.partial(jax.checkpoint, prevent_cse=False)
    def group(h0, inputs):
        x_g, d_g, b_g, c_g, keep_g = inputs
        da = jnp.where(keep_g[:, None, None], jnp.exp(d_g[..., None] * a), 0.0)  # [G, D, N]
        bx = (d_g * x_g)[..., None] * b_g[:, None, :]
        bx = bx.at[0].add(da[0] * h0)
        h = _linear_scan(da, bx, "associative")
        return h[-1], jnp.einsum("gdn,gn->gd", h, c_g)

    # The loop's backward keeps only its inputs (it recomputes a group's states), so it
    # needs no rematerialisation.
    y = lax.scan(loop_group if implementation == "loop" else group,
                 jnp.zeros(a.shape, jnp.float32), (x, delta, b, c, keep))[1]
    y = y.reshape(n * g, dim)[:length]
    return y[::-1] if reverse else y


def selective_step(h, x_t, delta_t, a, b_t, c_t):
    """One decoding step of the selective scan: ``h [D, N]`` -> ``(y_t [D], h)``."""
    h = jnp.exp(delta_t[:, None] * a) * h + (delta_t * x_t)[:, None] * b_t[None, :]
    return h @ c_t, h
