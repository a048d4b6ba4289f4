"""Pallas kernels: planner vs brute force, interpret-mode equality with the XLA path,
dispatch, and cross-lowering for CUDA (Triton) and TPU (Mosaic) on CPU.

Interpret mode is slow, so each case bundles several features (padding, segments, odd shapes,
vmap) into one jitted value-and-gradient computation.
"""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels
from pallas_kernels import _gpu_blocksparse, _tpu_blocksparse
from pallas_kernels._common import PallasAttention
from tests.tolerances import EXACT, EXACT_GRAD, assert_close
from xformers_jax.attention import block_sparse_attention, flash_attention, multihead
from xformers_jax.attention import patterns as P
from xformers_jax.kernels import _dispatch, _planner
from xformers_jax.kernels._tiled import attend_layout
from xformers_jax.attention.patterns._base import EMPTY, FULL, PARTIAL

# On a GPU (XFORMERS_JAX_TEST_PLATFORM=cuda, see conftest.py) the Triton kernels run compiled;
# elsewhere in interpret mode. The Mosaic (TPU) kernels run in interpret mode on the CPU only.
ON_GPU = jax.default_backend() == "gpu"
GPU = PallasAttention("gpu", "gpu", _gpu_blocksparse, 32, 32, interpret=not ON_GPU)
TPU = PallasAttention("tpu", "tpu", _tpu_blocksparse, 32, 128, interpret=True)
cpu_only = pytest.mark.skipif(jax.default_backend() != "cpu", reason="interpret mode: CPU only")
gpu_only = pytest.mark.skipif(not ON_GPU, reason="needs a GPU")


@dataclasses.dataclass(frozen=True)
class Global(P.Pattern):
    """The first ``n`` positions see and are seen by everything (BigBird's global tokens)."""

    n: int

    def mask(self, i, j, lq, lk):
        return (i < self.n) | (j < self.n)


@dataclasses.dataclass(frozen=True)
class RandomBlocks(P.Pattern):
    """Fixed random ``size x size`` blocks (BigBird's random attention), drawn from ``seed``."""

    size: int
    density: float
    seed: int

    def mask(self, i, j, lq, lk):
        rng = np.random.default_rng(self.seed)
        pick = rng.random((64, 64)) < self.density  # positions may run past lq, lk (padding)
        return pick[i // self.size % 64, j // self.size % 64]


@dataclasses.dataclass(frozen=True)
class Strided(P.Pattern):
    """Sparse Transformer's strided pattern: every ``stride``-th key column."""

    stride: int

    def mask(self, i, j, lq, lk):
        return np.broadcast_to(j % self.stride == self.stride - 1, np.broadcast_shapes(
            np.shape(i), np.shape(j)))


def bigbird(n=8):
    return P.Local(16, 16) | Global(n) | RandomBlocks(24, 0.15, 0)


# -- planner ---------------------------------------------------------------------------------


def _brute(dense, bq, bk):
    """Kinds of every ``bq x bk`` tile of a bool matrix (keys past its width are masked)."""
    lq, lk = dense.shape
    nq, nk = -(-lq // bq), -(-lk // bk)
    kinds = np.zeros((nq, nk), np.int8)
    for a in range(nq):
        for b in range(nk):
            tile = dense[a * bq : (a + 1) * bq, b * bk : (b + 1) * bk]
            full = tile.all() and (b + 1) * bk <= lk
            kinds[a, b] = FULL if full else PARTIAL if tile.any() else EMPTY
    return kinds


@pytest.mark.parametrize(
    "pattern, band",
    [(P.Causal(), True), (P.Local(20, 7), True), (P.Local(9, 0) & P.Causal(), True),
     (bigbird(), False), (Strided(5) | P.Local(3, 0), False)],
    ids=["causal", "local", "local_causal", "bigbird", "strided"],
)
@pytest.mark.parametrize("tiles", [((64, 64), (32, 32)), ((48, 40), (32, 64)), ((32, 32), (32, 32))])
def test_planner_matches_brute_force(pattern, band, tiles):
    (lbq, lbk), (bq, bk) = tiles
    lq, lk = 150, 170
    layout = pattern.layout(lq, lk, lbq, lbk)
    dense = pattern.dense(lq, lk)
    plan = _planner.plan(layout, bq, bk)
    np.testing.assert_array_equal(plan.kinds, _brute(dense, bq, bk))
    assert (plan.band is not None) == band
    # Every listed block, expanded with its mask (or the band), reproduces the pattern.
    rebuilt = np.zeros((plan.nq * bq, plan.nk * bk), bool)
    i = np.arange(bq)[:, None]
    j = np.arange(bk)[None, :]
    for a in range(plan.nq):
        n, n_full = plan.rows.counts[a], plan.rows.full[a]
        listed = plan.rows.blocks[a, :n]
        want = np.flatnonzero(plan.kinds[a] == FULL).tolist() + np.flatnonzero(
            plan.kinds[a] == PARTIAL).tolist()
        assert listed.tolist() == want
        assert (plan.rows.blocks[a, n:] == (listed[-1] if n else 0)).all()  # padding repeats
        for t, b in enumerate(listed):
            if t < n_full:
                tile = True
            elif plan.band is not None:
                left, right = plan.band
                ii, jj = a * bq + i, b * bk + j
                tile = (jj >= ii - left) & (jj <= ii + right) & (jj < lk)
            else:
                tile = plan.masks[plan.rows.mask_ids[a, t]]
            rebuilt[a * bq : (a + 1) * bq, b * bk : (b + 1) * bk] = tile
    np.testing.assert_array_equal(rebuilt[:lq, :lk], dense)
    assert rebuilt[:lq, lk:].sum() == 0
    # The transposed (dk, dv) lists hold the same tiles, column by column.
    for b in range(plan.nk):
        n = plan.cols.counts[b]
        assert sorted(plan.cols.blocks[b, :n].tolist()) == np.flatnonzero(plan.kinds[:, b]).tolist()
        assert plan.cols.full[b] == np.count_nonzero(plan.kinds[:, b] == FULL)
    # Runs: where every row's FULL and PARTIAL blocks are consecutive, the kernels compute
    # the t-th listed block from the run's start instead of loading it.
    for blocks in (plan.rows, plan.cols):
        consecutive = True
        for r in range(blocks.blocks.shape[0]):
            n, n_full = blocks.counts[r], blocks.full[r]
            f, p = blocks.blocks[r, :n_full], blocks.blocks[r, n_full:n]
            consecutive &= bool((np.diff(f) == 1).all() and (np.diff(p) == 1).all())
            if blocks.runs:
                np.testing.assert_array_equal(f, blocks.starts[r, 0] + np.arange(len(f)))
                np.testing.assert_array_equal(p, blocks.starts[r, 1] + np.arange(len(p)))
        assert blocks.runs == consecutive
    if band:
        assert plan.rows.runs and plan.cols.runs
    # Partial masks are de-duplicated.
    flat = {m.tobytes() for m in plan.masks}
    assert len(flat) == len(plan.masks)


# -- interpret-mode equality with the XLA path ---------------------------------------------


def _inputs(lq, lk, d, dtype, batch=None):
    ks = jax.random.split(jax.random.PRNGKey(1), 4)
    lead = () if batch is None else (batch,)
    q = jax.random.normal(ks[0], lead + (lq, d), jnp.float32).astype(dtype)
    k = jax.random.normal(ks[1], lead + (lk, d), jnp.float32).astype(dtype)
    v = jax.random.normal(ks[2], lead + (lk, d + 8), jnp.float32).astype(dtype)
    w = jax.random.normal(ks[3], lead + (lq, d + 8), jnp.float32)
    return q, k, v, w


def _value_and_grads(fn, layout, q, k, v, w, kv_mask, segments, batched, lse_weight=None):
    def loss(q, k, v):
        def one(q, k, v, kv_mask, segments):
            out, lse = fn(q, k, v, layout, kv_mask=kv_mask, segments=segments, bias=None,
                          scale=0.25)
            return out, lse

        if batched:
            out, lse = jax.vmap(one)(q, k, v, kv_mask, segments)
        else:
            out, lse = one(q, k, v, kv_mask, segments)
        value = jnp.sum(out.astype(jnp.float32) * w)
        if lse_weight is not None:
            value = value + jnp.sum(jnp.where(jnp.isfinite(lse), lse * lse_weight, 0.0))
        return value, (out, lse)

    (_, (out, lse)), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(
        q, k, v)
    return out, lse, grads


CASES = {
    # name: (pattern, lq, lk, d, dtype, kv_mask, segments, batched)
    "causal_padding_segments_odd": (P.Causal(), 75, 75, 40, jnp.float32, True, True, False),
    "bigbird_vmap": (bigbird(), 160, 160, 32, jnp.float32, False, False, True),
    "strided_cross_padding": (Strided(6) | P.Local(8, 0), 96, 130, 32, jnp.float32, True, False,
                              False),
    "random_bf16": (RandomBlocks(32, 0.3, 3) | P.Local(4, 4), 128, 128, 64, jnp.bfloat16, True,
                    True, False),
}
KERNEL_CASES = [pytest.param("gpu", c, id=f"gpu-{c}") for c in CASES] + [
    # The same kernels loading every listed block's index instead of computing it from runs.
    pytest.param("gpu_tables", "causal_padding_segments_odd", id="gpu_tables-causal"),
    # The forward with its own tiles (16 x 64 against the backward's 32 x 32): the two plans
    # cover different padded lengths (queries 80 and 96, keys 128 and 96 at L = 75).
    pytest.param("gpu_split", "causal_padding_segments_odd", id="gpu_split-causal"),
    pytest.param("gpu_split", "strided_cross_padding", id="gpu_split-strided"),
] + [
    pytest.param("tpu", c, marks=cpu_only, id=f"tpu-{c}")
    for c in ("causal_padding_segments_odd", "bigbird_vmap", "random_bf16")
]


@pytest.mark.parametrize("backend, case", KERNEL_CASES)
def test_kernel_matches_xla_path(backend, case):
    pattern, lq, lk, d, dtype, with_kv_mask, with_segments, batched = CASES[case]
    kernel = {"gpu": GPU, "gpu_tables": GPU.with_options(runs=False),
              "gpu_split": GPU.with_options(forward_blocks=(16, 64)), "tpu": TPU}[backend]
    layout = pattern.layout(lq, lk, 64, 64)
    batch = 2 if batched else None
    q, k, v, w = _inputs(lq, lk, d, dtype, batch)
    lead = () if batch is None else (batch,)
    kv_mask = (jnp.arange(lk) < lk - 11) if with_kv_mask else None
    segments = None
    if with_segments:
        ids = jnp.cumsum(jnp.arange(max(lq, lk)) % 37 == 36).astype(jnp.int32)
        segments = (ids[:lq], ids[:lk])
    if batched:
        kv_mask = None if kv_mask is None else jnp.broadcast_to(kv_mask, lead + (lk,))
        segments = None if segments is None else tuple(
            jnp.broadcast_to(s, lead + s.shape) for s in segments)
    got = _value_and_grads(kernel, layout, q, k, v, w, kv_mask, segments, batched)
    ref_in = (q, k, v) if dtype == jnp.float32 else tuple(x.astype(jnp.float32) for x in (q, k, v))
    want = _value_and_grads(attend_layout, layout, *ref_in, w, kv_mask, segments, batched)
    assert got[0].dtype == dtype and got[1].dtype == jnp.float32
    assert_close(got[0], want[0], EXACT, dtype)
    finite = np.isfinite(np.asarray(want[1]))
    np.testing.assert_array_equal(np.isfinite(np.asarray(got[1])), finite)
    assert_close(np.asarray(got[1])[finite], np.asarray(want[1])[finite], EXACT, dtype)
    for g, r in zip(got[2], want[2]):
        assert g.dtype == dtype
        assert_close(g, r, EXACT_GRAD, dtype)


def test_gradient_through_the_log_sum_exp_matches_xla_path():
    """Callers that merge partial attentions by their log-sum-exp (Long-Short, ring attention)
    differentiate through it: the kernel's backward must take the lse cotangent."""
    layout = P.Causal().layout(75, 75, 64, 64)
    q, k, v, w = _inputs(75, 75, 32, jnp.float32)
    u = jax.random.normal(jax.random.PRNGKey(7), (75,))
    kv_mask = jnp.arange(75) < 64
    got = _value_and_grads(GPU, layout, q, k, v, w, kv_mask, None, False, lse_weight=u)
    want = _value_and_grads(attend_layout, layout, q, k, v, w, kv_mask, None, False,
                            lse_weight=u)
    without = _value_and_grads(attend_layout, layout, q, k, v, w, kv_mask, None, False)
    assert not np.allclose(np.asarray(want[2][0]), np.asarray(without[2][0]))
    for g, r in zip(got[2], want[2]):
        assert_close(g, r, EXACT_GRAD, jnp.float32)


def test_query_that_sees_nothing_gives_zero_and_finite_grads():
    # Keys 0..31 are all masked, so causal queries 0..31 see no key at all.
    layout = P.Causal().layout(64, 64, 64, 64)
    q, k, v, w = _inputs(64, 64, 32, jnp.float32)
    kv_mask = jnp.arange(64) >= 32
    out, lse, grads = _value_and_grads(GPU, layout, q, k, v, w, kv_mask, None, False)
    assert np.all(np.asarray(out[:32]) == 0) and np.all(np.isneginf(np.asarray(lse[:32])))
    assert all(np.isfinite(np.asarray(g)).all() for g in grads)
    assert np.all(np.asarray(grads[1][:32]) == 0)  # masked keys get no gradient


# -- dispatch --------------------------------------------------------------------------------


@cpu_only
def test_registered_and_reasons_on_cpu():
    for op in ("flash_attention", "block_sparse_attention"):
        names = [kern.name for kern in pallas_kernels.kernels_for(op)]
        assert names == ["pallas_gpu_mosaic", "pallas_gpu_blocksparse", "pallas_tpu_blocksparse"]
    q, k, v, _ = _inputs(40, 40, 16, jnp.float32)
    with pytest.raises(NotImplementedError, match="runs on backend 'gpu', not 'cpu'"):
        flash_attention(q, k, v, causal=True, implementation="pallas")
    with pytest.raises(NotImplementedError, match="dropout is not implemented"):
        flash_attention(q, k, v, dropout_rate=0.1, key=jax.random.PRNGKey(0),
                        implementation="pallas")
    # implementation=None falls back to the XLA path on CPU.
    assert_close(flash_attention(q, k, v, causal=True),
                 flash_attention(q, k, v, causal=True, implementation="xla"))
    reasons = GPU.unsupported(dict(dtype=jnp.float32, dk=512, dv=64, bias="callable",
                                   dropout_rate=0.0, backend="gpu"))
    assert any("head dim 512" in r for r in reasons) and any("callable bias" in r for r in reasons)
    assert any("multiple of 128" in r for r in TPU.with_options(block_k=64).unsupported(
        dict(dtype=jnp.float32, dk=64, dv=64, bias="none", dropout_rate=0.0, backend="tpu")))


def test_dispatch_runs_a_registered_kernel(monkeypatch):
    monkeypatch.setitem(_dispatch._REGISTRY, "block_sparse_attention", [GPU])
    q, k, v, _ = _inputs(64, 64, 16, jnp.float32)
    pattern = P.Local(8, 8) | Global(4)
    seen = []
    monkeypatch.setattr(GPU.backend, "forward", _spy(GPU.backend.forward, seen))
    out = block_sparse_attention(q, k, v, pattern, block_q=32, block_k=32,
                                 implementation="pallas")
    assert seen, "the Pallas kernel was not called"
    assert_close(out, block_sparse_attention(q, k, v, pattern, block_q=32, block_k=32,
                                             implementation="xla"))


@gpu_only
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_public_api_runs_the_kernel_on_gpu(dtype):
    """On a GPU, implementation=None and "pallas" both take the Triton kernel, through
    ``multihead`` (vmapped grid axes), with padding, and equal the XLA path."""
    ks = jax.random.split(jax.random.PRNGKey(3), 3)
    q, k, v = (jax.random.normal(kk, (2, 200, 3, 64), jnp.float32).astype(dtype) for kk in ks)
    kv_mask = jnp.arange(200)[None, :] < jnp.array([[200], [150]])
    for call in (
        lambda impl: multihead(flash_attention)(q, k, v, causal=True, kv_mask=kv_mask,
                                                implementation=impl),
        lambda impl: multihead(block_sparse_attention)(q, k, v, bigbird(), block_q=32,
                                                       block_k=32, implementation=impl),
    ):
        want = jax.jit(jax.value_and_grad(
            lambda q: jnp.sum(call("xla").astype(jnp.float32) ** 2)))(q)
        for impl in (None, "pallas"):
            got = jax.jit(jax.value_and_grad(
                lambda q: jnp.sum(call(impl).astype(jnp.float32) ** 2)))(q)
            assert_close(got[0], want[0], EXACT, dtype)
            assert_close(got[1], want[1], EXACT_GRAD, dtype)
    kernels = [k.name for k in pallas_kernels.kernels_for("flash_attention")]
    call = dict(dtype=dtype, dropout_rate=0.0, bias="none", dk=64, dv=64, backend="gpu")
    assert not pallas_kernels.kernels_for("flash_attention")[0].unsupported(call), kernels


def test_forward_and_backward_kernels_run_on_their_own_tiles(monkeypatch):
    """``forward_blocks`` gives the forward kernel its own plan; each kernel gets the padded
    inputs cut to the rows its own tiles cover (75 rows: 80 and 128 for 16 x 64 tiles, 96 and
    96 for 32 x 32)."""
    seen = {}

    def record(name, fn):
        def wrapped(cfg, plan, q, k, *rest):
            seen[name] = (plan.block_q, plan.block_k, cfg.num_stages, q.shape[0], k.shape[0])
            return fn(cfg, plan, q, k, *rest)
        return wrapped

    for name in ("forward", "backward"):
        monkeypatch.setattr(GPU.backend, name, record(name, getattr(GPU.backend, name)))
    kernel = GPU.with_options(forward_blocks=(16, 64), forward_num_stages=3)
    layout = P.Causal().layout(75, 75, 64, 64)
    q, k, v, w = _inputs(75, 75, 32, jnp.float32)
    jax.eval_shape(lambda q, k, v: _value_and_grads(kernel, layout, q, k, v, w,
                                                    jnp.arange(75) < 70, None, False), q, k, v)
    assert seen == {"forward": (16, 64, 3, 80, 128), "backward": (32, 32, None, 96, 96)}


@pytest.mark.parametrize("pattern, lq, want", [
    (P.Full(), 256, (64, 128)),
    (RandomBlocks(64, 0.3, 1), 512, (64, 64)),  # 64 x 128 tiles: half-empty, more area
])
def test_default_forward_tiles_only_where_they_add_no_work(monkeypatch, pattern, lq, want):
    seen = []

    def record(cfg, plan, *rest):
        seen.append((plan.block_q, plan.block_k))
        rows = rest[0].shape[0]  # the forward's padded queries
        return jnp.zeros((rows, 64), rest[0].dtype), jnp.zeros((rows,), jnp.float32)

    monkeypatch.setattr(GPU.backend, "forward", record)
    kernel = GPU.with_options(block_q=None, block_k=None)
    q, k, v, _ = _inputs(lq, lq, 56, jnp.bfloat16)
    jax.eval_shape(lambda q, k, v: kernel(q, k, v[:, :56], pattern.layout(lq, lq, 64, 64),
                                          scale=0.1), q, k, v)
    assert seen == [want]


def _spy(fn, seen):
    def wrapped(*a, **kw):
        seen.append(True)
        return fn(*a, **kw)

    return wrapped


# -- cross-lowering ----------------------------------------------------------------------------


def _lower(kernel, platform, pattern, dtype, *, with_extras, d=64):
    lq = lk = 256
    layout = pattern.layout(lq, lk, 128, 128)
    q, k, v, w = _inputs(lq, lk, d, dtype, batch=2)
    kv_mask = jnp.ones((2, lk), bool) if with_extras else None
    ids = jnp.zeros((2, lq), jnp.int32)
    segments = (ids, ids) if with_extras else None

    def loss(q, k, v):
        out, _ = jax.vmap(lambda q, k, v, m, s: kernel(
            q, k, v, layout, kv_mask=m, segments=s, bias=None, scale=0.125))(
            q, k, v, kv_mask, segments)
        return jnp.sum(out.astype(jnp.float32) * w)

    fn = jax.value_and_grad(loss, argnums=(0, 1, 2))
    return jax.jit(fn).trace(q, k, v).lower(lowering_platforms=(platform,)).as_text()


LOWERINGS = [
    (kern, plat, name, pat, dtype, extras)
    for kern, plat in ((GPU.with_options(interpret=False, block_q=64, block_k=64), "cuda"),
                       (TPU.with_options(interpret=False, block_q=128, block_k=128), "tpu"))
    for name, pat, dtype, extras in (
        ("causal_extras_bf16", P.Causal(), jnp.bfloat16, True),
        ("bigbird_f32", bigbird(16), jnp.float32, False),
    )
]


@pytest.mark.parametrize("kernel, platform, name, pattern, dtype, extras", LOWERINGS,
                         ids=[f"{p}-{n}" for _, p, n, *_ in LOWERINGS])
def test_lowers_for_hardware(kernel, platform, name, pattern, dtype, extras):
    text = _lower(kernel, platform, pattern, dtype, with_extras=extras)
    # Forward, dq and dk/dv kernels all reach the backend's custom call.
    marker = "__gpu$xla.gpu.triton" if platform == "cuda" else "tpu_custom_call"
    assert text.count(marker) >= 3, text[:2000]


@pytest.mark.parametrize("d", [56, 120])  # values d + 8 wide: head dims 64 and 128
def test_default_tiles_lower_for_cuda(d):
    """The registered kernel's defaults: the forward has its own tiles (and, above head dim
    64, three pipeline stages), and all three kernels lower for CUDA."""
    kernel = GPU.with_options(interpret=False, block_q=None, block_k=None)
    dv = d + 8  # _inputs' value width
    forward, backward = kernel.forward_options(d, dv), kernel.blocks(d, dv)
    assert forward == ((64, 128, None) if d == 56 else (128, 64, 3))
    assert backward == ((64, 64) if d == 56 else (128, 64))
    text = _lower(kernel, "cuda", P.Causal(), jnp.bfloat16, with_extras=True, d=d)
    assert text.count("__gpu$xla.gpu.triton") >= 3, text[:2000]
    stages = set(re.findall(r"num_stages = (\d+)", text))
    assert stages == ({"2"} if d == 56 else {"2", "3"}), stages


def test_default_forward_options_where_three_stages_do_not_fit():
    kernel = GPU.with_options(block_q=None, block_k=None)
    assert kernel.forward_options(256, 256) == (128, 64, None)  # 3 stages would not fit
    for dk in (56, 120):  # float32: the backward's tiles (the forward's were measured in bf16)
        assert kernel.forward_options(dk, dk + 8, jnp.float32) == (*kernel.blocks(dk, dk + 8),
                                                                   None)


def test_triton_kernel_cannot_lower_for_tpu():
    # By construction: Triton compiler params (num_warps, num_stages) are GPU-only, and the
    # Mosaic kernel is the TPU one. Recorded so a change in this behaviour is noticed.
    kernel = GPU.with_options(interpret=False, block_q=64, block_k=64)
    # Pallas registers the Triton lowering (and so learns that its params are CUDA's) on the
    # first CUDA lowering in the process; without one the TPU lowering fails on an assert.
    _lower(kernel, "cuda", P.Causal(), jnp.float32, with_extras=False)
    with pytest.raises(ValueError, match="cannot be used for tpu lowering"):
        _lower(kernel, "tpu", P.Causal(), jnp.float32, with_extras=False)
