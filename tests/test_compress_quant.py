"""Quantization: fake quantization and its straight-through gradient against numpy, the int8
matmul against the dequantized float matmul, int4 packing, activation calibration, and the
int8 model path (the quantized model's matmuls are int8 x int8 -> int32)."""

import equinox as eqx
import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

from tests._compress_model import fast_jit, small_classifier
from tests.tolerances import EXACT, assert_close
from xformers_jax import compress as C

_FAST = {"xla_backend_optimization_level": 0}


def _np_fake_quant(x, s, bits):
    q = 2 ** (bits - 1) - 1
    return np.clip(np.round(x / s), -q, q) * s


@pytest.mark.parametrize("bits", [8, 4])
def test_fake_quant_matches_numpy(bits):
    rng = np.random.default_rng(bits)
    x = rng.normal(size=(6, 40)).astype(np.float32) * 3
    s = np.float32(0.05 if bits == 8 else 0.4)
    got = C.fake_quant(jnp.asarray(x), s, bits)
    assert_close(got, _np_fake_quant(x.astype(np.float64), s, bits))
    # per-channel scales broadcast
    sc = np.abs(x).max(0, keepdims=True) / (2 ** (bits - 1) - 1)
    assert_close(C.fake_quant(jnp.asarray(x), sc, bits), _np_fake_quant(x, sc, bits))
    assert_close(C.dequantize(C.quantize(jnp.asarray(x), sc, bits), sc),
                 _np_fake_quant(x, sc, bits))


def test_straight_through_gradient_identity_inside_zero_outside():
    rng = np.random.default_rng(0)
    x = rng.uniform(-2, 2, size=(200,)).astype(np.float32)
    s, q = 0.01, 127  # range [-1.27, 1.27]
    x = x[np.abs(np.abs(x) - q * s) > 1e-3]  # keep away from the boundary
    w = rng.normal(size=x.shape).astype(np.float32)
    g = jax.grad(lambda v: jnp.sum(w * C.fake_quant(v, s)))(jnp.asarray(x))
    inside = np.abs(x) <= q * s
    assert inside.any() and (~inside).any()
    np.testing.assert_array_equal(np.asarray(g), np.where(inside, w, 0.0))


def test_int8_matmul_equals_dequantized_float_matmul_within_one_step():
    rng = np.random.default_rng(1)
    x = rng.normal(size=(5, 7, 48)).astype(np.float32)
    w = rng.normal(size=(48, 24)).astype(np.float32) / 7
    qw = C.QuantizedWeight.from_float(jnp.asarray(w))
    y = np.asarray(jnp.asarray(x) @ qw, np.float64)
    # the same numbers dequantized and multiplied in float64
    sx = np.abs(x).max(-1, keepdims=True) / 127
    qx = np.clip(np.round(x / sx), -127, 127)
    sw = np.abs(w).max(0) / 127
    qwn = np.clip(np.round(w / sw), -127, 127)
    np.testing.assert_array_equal(np.asarray(qw.q), qwn.astype(np.int8))
    ref = (qx * sx) @ (qwn * sw)
    assert_close(y, ref, dtype=jnp.float32)
    # and the float product within one quantization step of each operand per term
    # |x w - x' w'| <= sum |x| |w - w'| + |x - x'| |w| + |x - x'| |w - w'|, each error <= s / 2
    bound = (0.5 * sw * np.abs(x).sum(-1, keepdims=True) + 0.5 * sx * np.abs(w).sum(0)
             + 0.25 * 48 * sx * sw)
    err = np.abs(y - x.astype(np.float64) @ w)
    assert (err <= bound + 1e-6).all(), float((err - bound).max())
    # the integer product itself is exact
    acc = C.int8_matmul(jnp.asarray(qx, jnp.int8), qw.q)
    assert acc.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(acc), (qx @ qwn).astype(np.int64))


def test_int8_matmul_rejects_float_and_bad_shapes():
    a = jnp.ones((3, 4), jnp.int8)
    with pytest.raises(ValueError, match="int8"):
        C.int8_matmul(a.astype(jnp.float32), a.T)
    with pytest.raises(ValueError, match=r"\(3, 4\)"):
        C.int8_matmul(a, a)


def test_int4_pack_roundtrip_and_groupwise_reference():
    rng = np.random.default_rng(2)
    w = rng.normal(size=(64, 12)).astype(np.float32)
    q4 = C.Int4Weight.from_float(jnp.asarray(w), group=16)
    assert q4.packed.dtype == jnp.uint8 and q4.packed.shape == (32, 12)
    g = w.reshape(4, 16, 12)
    s = np.abs(g).max(1, keepdims=True) / 7
    ref = (np.clip(np.round(g / s), -7, 7) * s).reshape(64, 12)
    assert_close(q4.dequantize(), ref)
    x = rng.normal(size=(3, 64)).astype(np.float32)
    assert_close(jnp.asarray(x) @ q4, x @ ref, EXACT)
    with pytest.raises(ValueError, match="multiple of group"):
        C.Int4Weight.from_float(jnp.ones((24, 4)), group=16)


class _TwoLayer(eqx.Module):
    w1: jax.Array
    w2: jax.Array

    def __call__(self, x):
        return jax.nn.relu(x @ self.w1.astype(x.dtype)) @ self.w2.astype(x.dtype)


def test_calibration_max_and_percentile_against_numpy():
    rng = np.random.default_rng(3)
    m = _TwoLayer(jnp.asarray(rng.normal(size=(8, 16)), jnp.float32),
                  jnp.asarray(rng.normal(size=(16, 4)), jnp.float32))
    batches = [jnp.asarray(rng.normal(size=(5, 8)), jnp.float32) for _ in range(3)]
    hidden = [np.maximum(np.asarray(b) @ np.asarray(m.w1), 0) for b in batches]
    apply = lambda model, b: model(b)  # noqa: E731
    s = C.calibrate(m, batches, apply, method="max")
    np.testing.assert_allclose(s[".w1"], max(np.abs(b).max() for b in batches) / 127, rtol=1e-6)
    np.testing.assert_allclose(s[".w2"], max(h.max() for h in hidden) / 127, rtol=1e-6)
    p = C.calibrate(m, batches, apply, method="percentile", percentile=90.0)
    ref = np.mean([np.percentile(np.abs(np.asarray(b)), 90.0) for b in batches]) / 127
    np.testing.assert_allclose(p[".w1"], ref, rtol=1e-5)
    with pytest.raises(ValueError, match="method"):
        C.calibrate(m, batches, apply, method="mse")


@pytest.fixture(scope="module")
def classifier():
    m = small_classifier()
    x = jax.random.randint(jax.random.PRNGKey(1), (3, 16), 1, 12).at[0, 10:].set(0)
    return m, x


_run = eqx.filter_jit(lambda m, x: m(x, mask=x != 0))


def _subjaxprs(params):
    for p in params.values():
        for v in (p if isinstance(p, (tuple, list)) else (p,)):
            if isinstance(v, jax.extend.core.ClosedJaxpr):
                yield v.jaxpr
            elif isinstance(v, jax.extend.core.Jaxpr):
                yield v


def _dot_dtypes(jaxpr):
    out = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            out.append((str(eqn.invars[0].aval.dtype), str(eqn.invars[1].aval.dtype),
                        str(eqn.outvars[0].aval.dtype)))
        for sub in _subjaxprs(eqn.params):
            out += _dot_dtypes(sub)
    return out


def test_int8_model_computes_in_int8_and_tracks_float(classifier):
    m, x = classifier
    q = C.quantize_model(m, "int8")
    assert q.encoder.layers.layers.attn.wq.q.dtype == jnp.int8
    assert q.encoder.embed.table.q.dtype == jnp.int8
    dots = _dot_dtypes(jax.make_jaxpr(lambda mm: mm(x, mask=x != 0))(q).jaxpr)
    int8 = [d for d in dots if d[:2] == ("int8", "int8")]
    # q, k, v, o, w1, w2 in the stacked layer and the head
    assert len(int8) >= 7 and all(d[2] == "int32" for d in int8), dots
    y, yq = _run(m, x), _run(q, x)
    assert float(jnp.abs(yq - y).max()) < 0.05 * float(jnp.abs(y).max())
    # the fake-quantized (QAT) forward computes the same numbers in float
    yf = _run(C.quantize_model(m, "fake"), x)
    assert float(jnp.abs(yf - yq).max()) < 0.01 * float(jnp.abs(y).max())
    assert C.model_bytes(q) < 0.45 * C.model_bytes(m)


def test_quantized_weight_bf16_input_and_fake_equals_int8_per_layer():
    rng = np.random.default_rng(4)
    w = jnp.asarray(rng.normal(size=(32, 8)), jnp.float32)
    x = jnp.asarray(rng.normal(size=(4, 32)), jnp.float32)
    qw = C.QuantizedWeight.from_float(w)
    fw = C.FakeQuantWeight(w)
    assert_close(x @ qw, x @ fw)
    yb = x.astype(jnp.bfloat16) @ qw
    assert yb.dtype == jnp.bfloat16
    # the same integers as the float32 path on the bf16-rounded input; only the output rounds
    assert_close(yb, x.astype(jnp.bfloat16).astype(jnp.float32) @ qw, dtype=jnp.bfloat16)


def test_static_activation_scales_and_qat_gradients(classifier):
    m, x = classifier
    apply = lambda model, b: model(b, mask=b != 0)  # noqa: E731
    scales = C.calibrate(m, [x], apply)
    assert scales[".encoder.layers.layers.attn.wq"].shape == (2,)  # one per layer
    q = C.quantize_model(m, "int8", act_scales=scales)
    assert q.encoder.layers.layers.ffn.w1.act_scale.shape == (2,)
    y, yq = _run(m, x), _run(q, x)
    assert float(jnp.abs(yq - y).max()) < 0.05 * float(jnp.abs(y).max())
    # QAT: gradients reach the float weights through the fake quantization
    f = C.quantize_model(m, "fake")
    g = fast_jit(eqx.filter_grad(lambda mm: jnp.sum(apply(mm, x) ** 2)))(f)
    assert g.encoder.layers.layers.ffn.w1.w.shape == (2, 16, 32)
    assert float(jnp.abs(g.encoder.layers.layers.ffn.w1.w).sum()) > 0
    back = C.quantize_model(f, "int8")
    assert back.encoder.layers.layers.ffn.w1.q.dtype == jnp.int8
    assert_close(C.dequantize_model(f).head, m.head)
    with pytest.raises(ValueError, match="mode"):
        C.quantize_model(m, "int2")
    with pytest.raises(ValueError, match="already quantized"):
        C.quantize_model(q, "int8")
