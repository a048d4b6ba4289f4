"""The recurrences since the surveys (mLSTM, HGRN2, Kimi Delta Attention, RWKV-7, DeltaProduct):
every form against a numpy loop written from the paper's recurrence, step by step (outputs),
and the forms against each other (gradients); the decoding steps against the forward pass;
the reductions (KDA with one decay per step is Gated DeltaNet; DeltaProduct with one step
per token is the gated delta rule); the mLSTM stabiliser at gates that overflow unscaled;
the declared decoding state sizes against what the layers' caches hold."""

import math
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.tolerances import EXACT, EXACT_GRAD, assert_close
from xformers_jax import mixers as M
from xformers_jax import nn
from xformers_jax.attention.linear import dplr_chunked, dplr_recurrent

L, DK, DV, NH = 13, 4, 3, 2
CHUNK = 4  # does not divide L: the padded last chunk is exercised


def _jit(f, **kw):
    # Tiny shapes: compile without backend optimisation (the compile dominates).
    return jax.jit(f, compiler_options={"xla_backend_optimization_level": 0}, **kw)


def _np(*xs):
    return [np.asarray(x, np.float64) for x in xs]


def _rand(i, *shape, scale=1.0):
    return scale * jax.random.normal(jax.random.PRNGKey(i), shape)


def _unit(x):
    return x / jnp.linalg.norm(x, axis=-1, keepdims=True)


# -- references, each the paper's recurrence one position at a time (float64) ---------------

def _mlstm_loop(q, k, v, i_logits, f_logits):
    """Beck et al. 2024, Eqs. 19-21 without any stabiliser: C_t = f C + i v k^T, n_t = f n +
    i k, h_t = C q / max(|n^T q|, 1) with i = exp(i~), f = sigmoid(f~) (float64)."""
    q, k, v, ig, fg = _np(q, k, v, i_logits, f_logits)
    c, n, out = np.zeros((v.shape[1], k.shape[1])), np.zeros(k.shape[1]), []
    for t in range(len(q)):
        f, i = 1 / (1 + np.exp(-fg[t])), np.exp(ig[t])
        c = f * c + i * np.outer(v[t], k[t])
        n = f * n + i * k[t]
        out.append(c @ q[t] / max(abs(n @ q[t]), 1.0))
    return np.stack(out)


def _hgrn2_loop(q, v, log_f):
    """Qin et al. 2024, Eq. 4: h_t = Diag(f_t) h_{t-1} + (1 - f_t) (x) i_t, y_t = o_t . h_t."""
    q, v, f = _np(q, v, np.exp(np.asarray(log_f, np.float64)))
    h, out = np.zeros((q.shape[1], v.shape[1])), []
    for t in range(len(q)):
        h = f[t][:, None] * h + np.outer(1 - f[t], v[t])
        out.append(q[t] @ h)
    return np.stack(out)


def _kda_loop(q, k, v, beta, log_alpha):
    """Kimi Linear, Eq. 1: S_t = (I - beta k k^T) Diag(alpha_t) S_{t-1} + beta k v^T."""
    q, k, v, beta, alpha = _np(q, k, v, beta, np.exp(np.asarray(log_alpha, np.float64)))
    s, out = np.zeros((k.shape[1], v.shape[1])), []
    for t in range(len(q)):
        s = (np.eye(k.shape[1]) - beta[t] * np.outer(k[t], k[t])) @ np.diag(alpha[t]) @ s \
            + beta[t] * np.outer(k[t], v[t])
        out.append(q[t] @ s)
    return np.stack(out)


def _rwkv7_loop(r, k, v, log_w, kappa, a, u):
    """Peng et al. 2025, Eq. 17 (row convention, wkv [Dv, Dk]): wkv_t = wkv_{t-1} (diag(w_t) -
    kappa_t^T (a_t * kappa_t)) + v_t^T k_t; y_t = wkv_t r_t^T + (r_t . (u * k_t)) v_t."""
    r, k, v, w, kappa, a, u = _np(r, k, v, np.exp(np.asarray(log_w, np.float64)), kappa, a, u)
    wkv, out = np.zeros((v.shape[1], k.shape[1])), []
    for t in range(len(r)):
        wkv = wkv @ (np.diag(w[t]) - np.outer(kappa[t], a[t] * kappa[t])) + np.outer(v[t], k[t])
        out.append(wkv @ r[t] + (r[t] @ (u * k[t])) * v[t])
    return np.stack(out)


def _delta_product_loop(q, k, v, beta, ld):
    """Siems et al. 2025: per token, a_t S then n_h steps (I - beta k k^T) S + beta k v^T."""
    q, k, v, beta, a = _np(q, k, v, beta, np.exp(np.asarray(ld, np.float64)))
    s, out = np.zeros((q.shape[1], v.shape[2])), []
    for t in range(len(q)):
        s = a[t] * s
        for i in range(k.shape[1]):
            s = (np.eye(q.shape[1]) - beta[t, i] * np.outer(k[t, i], k[t, i])) @ s \
                + beta[t, i] * np.outer(k[t, i], v[t, i])
        out.append(q[t] @ s)
    return np.stack(out)


def _inputs():
    q, k = _rand(0, L, DK, scale=0.5), _rand(1, L, DK, scale=0.5)
    v = _rand(2, L, DV)
    gates = jax.nn.log_sigmoid(_rand(3, L, DK) + 1.0)
    return dict(
        mlstm=((q, k, v, _rand(4, L, scale=2.0), _rand(5, L, scale=2.0) + 2.0), _mlstm_loop),
        hgrn2=((q, v, gates), _hgrn2_loop),
        kda=((q, _unit(k), v, jax.nn.sigmoid(_rand(6, L)), gates), _kda_loop),
        rwkv7=((q, k, v, -jnp.exp(-0.5) * jax.nn.sigmoid(_rand(7, L, DK)),
                _unit(_rand(8, L, DK)), jax.nn.sigmoid(_rand(9, L, DK)), _rand(10, DK)),
               _rwkv7_loop),
        delta_product=((q, _unit(_rand(11, L, NH, DK)), _rand(12, L, NH, DV),
                        2 * jax.nn.sigmoid(_rand(13, L, NH)),
                        -jax.nn.softplus(_rand(14, L))), _delta_product_loop),
    )


FUNCTIONS = dict(mlstm=M.mlstm, hgrn2=M.hgrn2, kda=M.kda, rwkv7=M.rwkv7,
                 delta_product=M.delta_product)
DIFF = dict(mlstm=(0, 1, 2, 3, 4), hgrn2=(0, 1, 2), kda=(0, 1, 2, 3, 4),
            rwkv7=(0, 1, 2, 3, 4, 5, 6), delta_product=(0, 1, 2, 3, 4))


@pytest.mark.parametrize("kind", sorted(FUNCTIONS))
def test_forms_equal_the_papers_recurrence_and_each_other(kind):
    args, reference = _inputs()[kind]
    fn = FUNCTIONS[kind]
    want = reference(*args)
    w = jax.random.normal(jax.random.PRNGKey(99), want.shape)
    grads = {}
    for form in ("parallel", "recurrent", "chunked"):
        def loss(*a, form=form):
            out = fn(*a, implementation=form, chunk_size=CHUNK)
            return jnp.sum(out * w), out

        (_, out), grads[form] = _jit(jax.value_and_grad(loss, argnums=DIFF[kind],
                                                        has_aux=True))(*args)
        assert_close(out, want, EXACT, err_msg=f"{kind} {form}")
    for form in ("parallel", "chunked"):
        for i, (g, g_ref) in enumerate(zip(grads[form], grads["recurrent"])):
            assert_close(g, g_ref, EXACT_GRAD, err_msg=f"{kind} grad {i} {form} vs recurrent")


@pytest.mark.parametrize("sub_chunk", [1, 4])
@pytest.mark.parametrize("delta", [False, True])
def test_dplr_chunked_equals_its_step_with_strong_per_channel_decays(sub_chunk, delta):
    """The generalised delta rule's chunked form (chunks of 8, the last one padded; pairs
    within sub-chunks and across them) against its per-step scan, with decays of up to
    exp(-30) per step in some channels: no exponent is positive, so nothing overflows.
    ``delta``: ``a = None``, the delta rule's ``a = -k``."""
    q, k, a, b = (_rand(20 + i, L, DK, scale=0.5) for i in range(4))
    a = None if delta else a
    v = _rand(24, L, DV)
    ld = -30.0 * jax.nn.sigmoid(_rand(25, L, DK, scale=3.0))
    want = dplr_recurrent(q, k, v, a, b, ld)
    f = lambda q, k, v, a, b, ld: dplr_chunked(  # noqa: E731
        q, k, v, None if delta else a, b, ld, chunk_size=8, sub_chunk=sub_chunk)
    a = jnp.zeros_like(q) if delta else a
    assert_close(_jit(f)(q, k, v, a, b, ld), want, EXACT)
    loss = lambda fn: lambda *x: jnp.sum(fn(*x) ** 2)  # noqa: E731
    g_chunk = _jit(jax.grad(loss(f), argnums=(0, 1, 2, 3, 4, 5)))(q, k, v, a, b, ld)
    step = lambda q, k, v, a, b, ld: dplr_recurrent(  # noqa: E731
        q, k, v, None if delta else a, b, ld)
    g_step = _jit(jax.grad(loss(step), argnums=(0, 1, 2, 3, 4, 5)))(q, k, v, a, b, ld)
    for x, y in zip(g_chunk, g_step):
        assert np.all(np.isfinite(np.asarray(x)))
        assert_close(x, y, EXACT_GRAD)


_ONE_ROW = """
import jax, jax.numpy as jnp, numpy as np
from xformers_jax.attention.linear import dplr_chunked
ks = jax.random.split(jax.random.PRNGKey(0), 6)
x = [0.3 * jax.random.normal(ks[i], (1, 4, 64, 16)) for i in range(5)]
ld = -jax.nn.softplus(jax.random.normal(ks[5], (1, 4, 64, 16)))
def loss(*xs):
    f = lambda *x: dplr_chunked(*x, chunk_size=8)
    return jnp.sum(jax.vmap(jax.vmap(f))(*xs) ** 2)
grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4, 5)))
one = grad(*x, ld)
two = grad(*(jnp.concatenate([a, a]) for a in (*x, ld)))
for g1, g2 in zip(one, two):
    np.testing.assert_allclose(np.asarray(g1[0]), np.asarray(g2[0]), rtol=1e-5, atol=1e-6)
print("ok")
"""


def test_dplr_gradient_over_one_row_compiles_and_runs():
    """The chunked generalised delta rule's gradient vmapped over one row of four heads, at
    XLA's default optimisation (what a batch-1 KDA or RWKV-7 layer compiles; the suite's own
    flags lower it otherwise, so it runs in a fresh process): once a segfault of XLA:CPU
    (jaxlib 0.10.2) in the sub-chunk product. Its gradient equals the row written twice's."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    done = subprocess.run([sys.executable, "-c", _ONE_ROW], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), (
        f"exit {done.returncode}: {done.stderr[-2000:]}")


@pytest.mark.parametrize("form", ["chunked", "recurrent"])
def test_kda_with_one_decay_per_step_is_gated_deltanet(form):
    q, k, v = _rand(0, L, DK), _unit(_rand(1, L, DK)), _rand(2, L, DV)
    beta, ld = jax.nn.sigmoid(_rand(3, L)), -jax.nn.softplus(_rand(4, L))
    kda = _jit(lambda *a: M.kda(*a, implementation=form, chunk_size=CHUNK))(
        q, k, v, beta, jnp.broadcast_to(ld[:, None], (L, DK)))
    gdn = _jit(lambda *a: M.gated_delta(*a, implementation=form, chunk_size=CHUNK))(
        q, k, v, beta, ld)
    assert_close(kda, gdn, EXACT)


def test_delta_product_with_one_step_per_token_is_the_gated_delta_rule():
    q, k, v = _rand(0, L, DK), _unit(_rand(1, L, DK)), _rand(2, L, DV)
    beta, ld = jax.nn.sigmoid(_rand(3, L)), -jax.nn.softplus(_rand(4, L))
    got = _jit(lambda *a: M.delta_product(*a, chunk_size=CHUNK))(
        q, k[:, None], v[:, None], beta[:, None], ld)
    assert_close(got, _jit(lambda *a: M.gated_delta(*a, chunk_size=CHUNK))(q, k, v, beta, ld),
                 EXACT)


def test_mlstm_stabiliser_keeps_huge_input_gates_finite():
    """Input gates of exp(200) overflow float32 unscaled; the stabilised forms agree with the
    float64 loop, whose h does not depend on the scale."""
    q, k, v = _rand(0, L, DK), _rand(1, L, DK, scale=0.5), _rand(2, L, DV)
    ig = 200.0 + 5 * _rand(3, L)
    fg = _rand(4, L) + 3.0
    want = _mlstm_loop(q, k, v, ig, fg)
    for form in ("chunked", "recurrent"):
        def loss(i, form=form):
            out = M.mlstm(q, k, v, i, fg, implementation=form, chunk_size=CHUNK)
            return jnp.sum(out), out

        g, got = _jit(jax.grad(loss, has_aux=True))(ig)
        assert_close(got, want, EXACT, err_msg=form)
        assert np.all(np.isfinite(np.asarray(g))), form


def test_mlstm_exp_forget_gate_matches_its_recurrence():
    q, k, v = _rand(0, L, DK), _rand(1, L, DK, scale=0.5), _rand(2, L, DV)
    ig, fg = _rand(3, L), -jax.nn.softplus(_rand(4, L)) + 0.2  # some f_t = exp(f~) > 1
    want = _jit(lambda *a: M.mlstm(*a, forget_gate="exp", implementation="recurrent"))(
        q, k, v, ig, fg)
    got = _jit(lambda *a: M.mlstm(*a, forget_gate="exp", chunk_size=CHUNK))(q, k, v, ig, fg)
    assert_close(got, want, EXACT)


STEPS = dict(
    kda=lambda s, q, k, v, beta, la: M.kda_step(s, q, k, v, beta, la),
    rwkv7=lambda s, r, k, v, lw, kappa, a, u: M.rwkv7_step(s, r, k, v, lw, kappa, a, u),
    delta_product=lambda s, *x: M.delta_product_step(s, *x),
)


@pytest.mark.parametrize("kind", ["kda", "rwkv7", "delta_product", "mlstm"])
def test_decoding_steps_equal_the_forward_pass(kind):
    args, _ = _inputs()[kind]
    want = _jit(lambda *a: FUNCTIONS[kind](*a, chunk_size=CHUNK))(*args)
    if kind == "mlstm":
        state, step = M.mlstm_init_state(DK, DV), M.mlstm_step
        per_step = args
    else:
        state, step = jnp.zeros((DK, DV)), STEPS[kind]
        per_step = args[:-1] if kind == "rwkv7" else args
    extra = (args[-1],) if kind == "rwkv7" else ()

    def decode(state, per_step):
        return jax.lax.scan(lambda s, x: step(s, *x, *extra)[::-1], state, per_step)[1]

    assert_close(_jit(decode)(state, tuple(per_step)), want, EXACT)


@pytest.mark.parametrize("kind", sorted(FUNCTIONS))
def test_padding_writes_nothing(kind):
    """Padded positions (with NaN content in every per-position input) change no real output."""
    args, _ = _inputs()[kind]
    mask = jnp.arange(L) % 4 != 1
    real = [i for i in range(L) if mask[i]]
    run = _jit(lambda *a, kv_mask=None: FUNCTIONS[kind](*a, kv_mask=kv_mask, chunk_size=CHUNK))
    want = run(*(a[np.asarray(real)] if a.ndim and a.shape[0] == L else a for a in args))
    junk = [jnp.where(mask.reshape(-1, *[1] * (a.ndim - 1)), a, jnp.nan)
            if a.ndim and a.shape[0] == L and i in DIFF[kind][1:] else a
            for i, a in enumerate(args)]
    got = run(*junk, kv_mask=mask)
    assert_close(got[np.asarray(real)], want, EXACT)


def test_errors_name_the_problem():
    q, v = _rand(0, L, DK), _rand(1, L, DV)
    with pytest.raises(ValueError, match=r"kda: log_alpha must be \[L, D\], got shape \(13,\)"):
        M.kda(q, q, v, jnp.ones(L), jnp.zeros((L,)))
    with pytest.raises(ValueError, match="forget_gate must be one of"):
        M.mlstm(q, q, v, jnp.ones(L), jnp.ones(L), forget_gate="tanh")
    with pytest.raises(ValueError, match=r"need q \[L, Dk\], k \[L, n_h, Dk\]"):
        M.delta_product(q, q, v, jnp.ones(L), jnp.zeros(L))
    with pytest.raises(ValueError, match="implementation must be one of"):
        M.hgrn2(q, v, q, implementation="fft")


def _numbers(formula, **sizes):
    """A record's ``state_size`` (``"H (D_k D_v + D_k + 1)"``: juxtaposition multiplies)
    evaluated at ``sizes``."""
    expr = re.sub(r"(?<=[\w)])\s*(?=[(])|(?<=[\w)])\s+(?=[\w(])", "*", formula)
    return eval(expr, {}, sizes)  # noqa: S307 -- a formula of our own records


@pytest.mark.parametrize("name", ["mlstm", "hgrn2", "kda", "rwkv7", "delta_product", "retnet",
                                  "gla", "gated_deltanet", "mamba2"])
def test_declared_state_size_is_what_decoding_keeps(name):
    kind = nn.get_kind("mixer", name)
    hp = dict(kind.test_hyperparameters)
    layer = nn._mixer.make_mixer(nn.MixerSpec(name, hp), 16, 2, causal=True, max_len=16,
                                 key=jax.random.PRNGKey(0))
    cache = jax.eval_shape(lambda: layer.init_cache(1, 16))
    kept = sum(math.prod(x.shape) for x in jax.tree.leaves(cache.state))
    dk = 4 if name == "gla" else 8
    sizes = dict(H=2, D_k=dk, D_v=8, N=hp.get("state_size", 0), P=16, W=4, E=32)
    assert kind.state_size and _numbers(kind.state_size, **sizes) == kept, (kind.state_size,
                                                                            kept)
    if "short_conv" in kind.hyperparameters:
        # The last W - 1 = 3 steps' q, k and v projections (before the convolution) beside it.
        layer = nn._mixer.make_mixer(nn.MixerSpec(name, {**hp, "short_conv": 4}), 16, 2,
                                     causal=True, max_len=16, key=jax.random.PRNGKey(0))
        cache = jax.eval_shape(lambda: layer.init_cache(1, 16))
        channels = sum(w.shape[1] for w in (layer.wq, layer.wk, layer.wv))
        assert sum(math.prod(x.shape) for x in jax.tree.leaves(cache.state)) == (
            kept + 3 * channels)


def test_taylor_map_is_the_second_order_expansion_and_based_its_normalised_kernel():
    """Based (Arora et al. 2024, Eq. 4): phi(q).phi(k) = 1 + s + s^2/2 with s = q.k / sqrt(F),
    and causal linear attention with it is sum_j K_ij v_j / sum_j K_ij over j <= i."""
    from xformers_jax.attention import linear_attention, taylor_features

    q, k, v = _rand(0, L, DK), _rand(1, L, DK), _rand(2, L, DV)
    s = np.asarray(q, np.float64) @ np.asarray(k, np.float64).T / math.sqrt(DK)
    kernel = 1 + s + s * s / 2
    root = DK ** -0.25
    got = taylor_features(q * root) @ taylor_features(k * root).T
    assert_close(got, kernel, EXACT)
    kernel = np.tril(kernel)
    want = kernel @ np.asarray(v, np.float64) / kernel.sum(-1, keepdims=True)
    for form in ("chunked", "recurrent"):
        out = _jit(lambda q, k, v: linear_attention(q, k, v, feature_map="taylor", causal=True,
                                                    implementation=form, chunk_size=CHUNK))
        assert_close(out(q, k, v), want, EXACT, err_msg=form)
