"""Flex attention on the Pallas kernels (GPU Triton and TPU Mosaic block-sparse), in interpret
mode on the CPU: score functions, mask functions of traced arrays and sink logits inside the
kernels' tiles, forward and backward, against the dense definition (``test_flex.dense_flex``:
the same functions on a materialised score matrix); outputs and gradients (q, k, v and the
captured parameters) in float32 to 1e-5, causal with padded keys, through ``multihead`` (``b``
and ``h`` mapped), with packed rows as a mask function or as the kernels' ``segment_ids``.
Then what dispatch refuses, and cross-lowering for CUDA and TPU.

Interpret mode is slow, so each case bundles a score function, a mask and a sink into one
jitted value-and-gradient computation.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import _gpu_blocksparse, _gpu_mosaic, _tpu_blocksparse
from pallas_kernels._common import PallasAttention
from xformers_jax import kernels
from xformers_jax.attention import (
    alibi_score,
    flex_attention,
    multihead,
    soft_cap_score,
    streaming_mask,
)
from xformers_jax.attention import patterns as P
from xformers_jax.attention.patterns import document_mask
from xformers_jax.kernels import _dispatch

from .fast_jit import jit0
from .test_flex import dense_flex

ON_GPU = jax.default_backend() == "gpu"
GPU = PallasAttention("gpu", "gpu", _gpu_blocksparse, 32, 32, interpret=not ON_GPU)
TPU = PallasAttention("tpu", "tpu", _tpu_blocksparse, 32, 128, interpret=True)
cpu_only = pytest.mark.skipif(jax.default_backend() != "cpu", reason="interpret mode: CPU only")

F32 = dict(atol=1e-5, rtol=1e-5)
B, L, H, D = 1, 40, 2, 8  # 40: a padded last tile at 32 x 32 (GPU) and 32 x 128 (TPU)
DOCS = np.repeat(np.arange(4), [7, 13, 16, 4])  # documents across tile edges


def _alibi_streaming(p):
    """ALiBi with trained slopes (captured, with gradients), StreamingLLM's first 3 keys plus
    a window of 5 (a static layout), a learned sink logit per head."""
    return dict(score_mod=alibi_score(p["slopes"]), mask_mod=streaming_mask(5, 3),
                sink=p["sink"]), dict(
        score_mod=lambda s, b, h, i, j: s - p["slopes"][h] * jnp.abs(i - j),
        mask_fn=lambda b, h, i, j: (j < 3) | ((j >= i - 5) & (j <= i)), sink=p["sink"])


def _softcap_documents(p):
    """Gemma's soft cap, and the document mask of segment ids that are traced (evaluated in
    the tile from a captured int array: the ids are data, not parameters)."""
    cap = soft_cap_score(1.5)
    docs = jax.lax.stop_gradient(p["docs"]).astype(jnp.int32)
    return dict(score_mod=cap, mask_mod=document_mask(docs)), dict(
        score_mod=cap, mask_fn=lambda b, h, i, j: docs[i] == docs[j])


def _softcap_segment_ids(p):
    """Gemma's soft cap on packed rows given as the kernel's ``segment_ids`` (the trainer's
    form: run-time data, the segment mask applied in the kernels' tiles)."""
    cap = soft_cap_score(1.5)
    docs = jax.lax.stop_gradient(p["docs"]).astype(jnp.int32)
    return dict(score_mod=cap, segment_ids=docs), dict(
        score_mod=cap, mask_fn=lambda b, h, i, j: docs[i] == docs[j])


CASES = {
    "alibi_streaming_sink": (_alibi_streaming, {"slopes": jnp.asarray([0.25, 0.0625]),
                                                "sink": jnp.asarray([0.7, -0.4])}),
    # The ids travel as floats only so that the loss differentiates every parameter.
    "softcap_documents": (_softcap_documents, {"docs": jnp.asarray(DOCS, jnp.float32)}),
    "softcap_segment_ids": (_softcap_segment_ids, {"docs": jnp.asarray(DOCS, jnp.float32)}),
}
KERNELS = {"gpu": GPU, "tpu": TPU}


def _qkvw():
    ks = jax.random.split(jax.random.PRNGKey(5), 4)
    q, k, v = (jax.random.normal(kk, (B, L, H, D)) for kk in ks[:3])
    return q, k, v, jax.random.normal(ks[3], (B, L, H, D))


def _loss_flex(make, q, k, v, w, p, kv_mask):
    flex, _ = make(p)
    # Per-head sinks are lifted by multihead like any per-head argument.
    sink = flex.pop("sink", None)

    def one(q, k, v, kv_mask, h, sink):
        return flex_attention(q, k, v, causal=True, kv_mask=kv_mask, head_index=h, sink=sink,
                              block_q=16, block_k=16, implementation="pallas", **flex)

    # [B, L, H, D]: heads mapped inside batch.
    heads = jax.vmap(one, in_axes=(1, 1, 1, None, 0, 0 if sink is not None else None),
                     out_axes=1)
    out = jax.vmap(heads, in_axes=(0, 0, 0, 0, None, None))(
        q, k, v, kv_mask, jnp.arange(H), sink)
    return jnp.sum(out * w)


def _loss_dense(make, q, k, v, w, p, kv_mask):
    _, ref = make(p)
    sink = ref.pop("sink", None)

    def one(q, k, v, kv_mask, b, h):
        return dense_flex(q, k, v, causal=True, kv_mask=kv_mask, b=b, h=h,
                          sink=None if sink is None else sink[h], **ref)

    heads = jax.vmap(one, in_axes=(1, 1, 1, None, None, 0), out_axes=1)
    out = jax.vmap(heads, in_axes=(0, 0, 0, 0, 0, None))(q, k, v, kv_mask, jnp.arange(B),
                                                         jnp.arange(H))
    return jnp.sum(out * w)


@cpu_only
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("backend", sorted(KERNELS))
def test_kernel_equals_the_dense_definition(monkeypatch, backend, case):
    monkeypatch.setitem(_dispatch._REGISTRY, "block_sparse_attention", [KERNELS[backend]])
    seen = []
    backend_module = KERNELS[backend].backend
    for name in ("forward", "backward"):
        fn = getattr(backend_module, name)
        monkeypatch.setattr(backend_module, name, functools.partial(
            lambda fn, name, *a: seen.append(name) or fn(*a), fn, name))
    make, params = CASES[case]
    q, k, v, w = _qkvw()
    kv_mask = jnp.broadcast_to(jnp.arange(L) < 33, (B, L))
    grad_args = (0, 1, 2, 4)
    got = jit0(jax.value_and_grad(functools.partial(_loss_flex, make), grad_args))(
        q, k, v, w, params, kv_mask)
    assert set(seen) == {"forward", "backward"}, "the Pallas kernels did not run"
    want = jit0(jax.value_and_grad(functools.partial(_loss_dense, make), grad_args))(
        q, k, v, w, params, kv_mask)
    np.testing.assert_allclose(got[0], want[0], **F32)
    for what, g, r in zip(("dq", "dk", "dv", "d_params"), got[1], want[1]):
        for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(g), jax.tree.leaves(r)):
            if "docs" not in jax.tree_util.keystr(path):
                assert what != "d_params" or np.abs(np.asarray(b)).max() > 0, path
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), **F32,
                                           err_msg=f"{what}{jax.tree_util.keystr(path)}")


# -- what dispatch runs where ---------------------------------------------------------------


def _call(**flex):
    names = tuple(n for n in ("score_mod", "mask_mod", "sink") if flex.get(n) is not None)
    prims = kernels.flex_primitives(flex.get("score_mod"), flex.get("mask_mod"))
    return dict(dtype=jnp.bfloat16, dk=64, dv=64, bias="none", dropout_rate=0.0, flex=names,
                flex_primitives=prims)


def test_compiled_kernels_refuse_only_what_they_cannot_lower():
    """Elementwise score functions and sinks run in the compiled block-sparse kernels;
    indexing a captured array by ``h`` (ALiBi) or by position (traced document ids) keeps a
    call on the XLA path, with the reason. The Hopper kernels take flex calls: those they
    cannot apply themselves (``_gpu_mosaic.mosaic_score``) run the Triton kernels, and they
    refuse what Triton cannot lower."""
    slopes = jnp.ones(4)
    for kern, platform in ((GPU, "gpu"), (TPU.with_options(block_k=128), "tpu")):
        compiled = kern.with_options(interpret=False)
        for ok in (_call(score_mod=soft_cap_score(30.0), sink=jnp.float32(0.0)),
                   _call(mask_mod=lambda b, h, i, j: (i - j) % 3 != 0)):
            assert compiled.unsupported(dict(ok, backend=platform)) == []
        why = compiled.unsupported(dict(_call(score_mod=alibi_score(slopes)), backend=platform))
        assert len(why) == 1 and "dynamic_slice" in why[0], why
        why = compiled.unsupported(dict(_call(mask_mod=document_mask(jnp.asarray(DOCS)).fn),
                                        backend=platform))
        assert len(why) == 1 and "gather" in why[0], why
        # Interpret mode runs them all.
        assert kern.unsupported(dict(_call(score_mod=alibi_score(slopes)),
                                     backend="cpu")) == []
    mosaic = PallasAttention("mosaic", "gpu", _gpu_mosaic).with_options(interpret=False)
    flex_why = lambda why: [r for r in why if "flex" in r]  # noqa: E731  (not the device's)
    assert flex_why(mosaic.unsupported(dict(_call(score_mod=soft_cap_score(30.0)),
                                            backend="gpu"))) == []
    why = flex_why(mosaic.unsupported(dict(_call(score_mod=alibi_score(slopes)), backend="gpu")))
    assert len(why) == 1 and "dynamic_slice" in why[0], why


LOWERINGS = [(GPU.with_options(interpret=False, block_q=64, block_k=64), "cuda",
              "__gpu$xla.gpu.triton"),
             (TPU.with_options(interpret=False, block_q=128, block_k=128), "tpu",
              "tpu_custom_call")]


@pytest.mark.parametrize("kernel, platform, marker", LOWERINGS, ids=["cuda", "tpu"])
def test_flex_lowers_for_hardware(kernel, platform, marker):
    """A soft cap whose size depends on ``h``, a mask function of positions and a sink, all
    three kernels, under vmap over heads: lowered for the hardware from the CPU."""
    lay = P.Causal().layout(256, 256, 128, 128)
    q = k = v = jnp.ones((2, 256, 64), jnp.bfloat16)

    def score(s, b, h, i, j):
        cap = 20.0 + 10.0 * h.astype(jnp.float32)
        return cap * jnp.tanh(s / cap)

    def loss(q, k, v, sink):
        out, _ = jax.vmap(lambda q, k, v, h: kernel(
            q, k, v, lay, scale=0.125, score_mod=score, sink=sink, index=(0, h),
            mask_mod=lambda b, h, i, j: (i - j) % 7 != 3))(q, k, v, jnp.arange(2))
        return jnp.sum(out.astype(jnp.float32))

    fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))
    text = fn.trace(q, k, v, jnp.float32(0.5)).lower(lowering_platforms=(platform,)).as_text()
    assert text.count(marker) >= 3, text[:2000]


@pytest.mark.skipif(not ON_GPU, reason="needs a GPU")
def test_compiled_triton_kernel_equals_the_xla_path_on_gpu():
    """On a GPU: ``implementation=None`` and ``"pallas"`` take the Triton kernel (the Hopper
    forward refuses flex calls) for a soft cap of ``h``, a mask function of positions and
    per-head sinks, and equal the XLA path, gradients included."""
    ks = jax.random.split(jax.random.PRNGKey(3), 3)
    q, k, v = (jax.random.normal(kk, (2, 200, 2, 64)) for kk in ks)
    sinks = jnp.asarray([0.3, -0.5])

    def score(s, b, h, i, j):
        cap = 20.0 + 10.0 * h.astype(jnp.float32)
        return cap * jnp.tanh(s / cap)

    def loss(impl, q, sinks):
        out = multihead(flex_attention, kwarg_axes={"sink": "heads"})(
            q, k, v, score_mod=score, mask_mod=lambda b, h, i, j: (i - j) % 7 != 3,
            causal=True, sink=sinks, head_index=jnp.arange(2), implementation=impl)
        return jnp.sum(out ** 2)

    want = jax.jit(jax.value_and_grad(functools.partial(loss, "xla"), (0, 1)))(q, sinks)
    for impl in (None, "pallas"):
        got = jax.jit(jax.value_and_grad(functools.partial(loss, impl), (0, 1)))(q, sinks)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-4, rtol=2e-4)
