"""The public attention functions and modules declare their array shapes with jaxtyping
(annotations only, nothing checks them at run time): the annotations resolve, and a call's
arrays match them with every named axis bound to one size."""

import inspect
import typing

import jax
import jax.numpy as jnp
import jaxtyping
import pytest

from xformers_jax import attention as A
from xformers_jax import nn

Q, K, D, DV = 4, 6, 8, 3


def _arrays():
    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    q = jax.random.normal(keys[0], (Q, D))
    k = jax.random.normal(keys[1], (K, D))
    v = jax.random.normal(keys[2], (K, DV))
    return dict(q=q, k=k, v=v, kv_mask=jnp.arange(K) < 5)


CASES = {
    "dot_product_attention": lambda a: A.dot_product_attention(**a),
    "flash_attention": lambda a: A.flash_attention(**a),
    "block_sparse_attention": lambda a: A.block_sparse_attention(
        layout=A.patterns.Full(), block_q=8, block_k=8, **a),
    "linear_attention": lambda a: A.linear_attention(**a),
    "performer_attention": lambda a: A.performer_attention(projection=a.pop("projection"), **a),
}


def _zeros(struct):
    return jnp.zeros(struct.shape, struct.dtype)


def _first(hint):
    # The plain output of a function returning ``out | (out, extra)``.
    args = typing.get_args(hint)
    return args[0] if args and not isinstance(hint, type) else hint


@pytest.mark.parametrize("name", sorted(CASES))
def test_attention_function_shapes_match_the_annotations(name):
    fn = getattr(A, name)
    hints = typing.get_type_hints(fn)
    arrays = _arrays()
    if name == "performer_attention":
        arrays["projection"] = jax.random.normal(jax.random.PRNGKey(1), (5, D))
    if name in ("linear_attention", "performer_attention"):  # self attention only
        arrays["q"] = jax.random.normal(jax.random.PRNGKey(2), (K, D))
    # Traced, not run: the shapes are what the annotations speak of.
    out = _zeros(jax.eval_shape(lambda: CASES[name](dict(arrays))))
    with jaxtyping.jaxtyped("context"):
        for arg, value in arrays.items():
            assert isinstance(value, hints[arg]), (arg, hints[arg], value.shape)
        assert isinstance(out, _first(hints["return"])), (hints["return"], out.shape)
        wrong = jnp.ones((arrays["q"].shape[0] + 1, DV))
        assert not isinstance(wrong, _first(hints["return"]))  # q_seq is bound already


def test_multihead_attention_module_shapes_match_the_annotations():
    layer = nn.MultiHeadAttention(16, 2, key=jax.random.PRNGKey(0))
    hints = typing.get_type_hints(nn.MultiHeadAttention.__call__)
    x = jnp.ones((2, K, 16))
    args = dict(x=x, kv_mask=jnp.ones((2, K), bool), q_mask=jnp.ones((2, K), bool),
                positions=jnp.broadcast_to(jnp.arange(K), (2, K)))
    out = _zeros(jax.eval_shape(lambda: layer(**args)))
    with jaxtyping.jaxtyped("context"):
        for arg, value in args.items():
            assert isinstance(value, hints[arg]), (arg, hints[arg])
        assert isinstance(out, hints["x"])  # [batch q_seq dim] in and out


# Public functions taking q, k, v that do not follow the one-sequence contract's shapes, so
# they carry no q/k/v annotations:
NOT_ONE_SEQUENCE = {
    # one decoding step: q, k [Dk], v [Dv], no sequence axis
    "average_attention_step", "delta_rule_step", "linear_attention_step",
    # all heads at once: [L, H, D] arrays
    "collaborative_attention",  # v [Lk, H, Dv]
    "multiscale_attention", "per_head_block_sparse_attention", "predictive_attention",
    "talking_heads_attention",
}


def test_every_qkv_attention_function_is_annotated():
    names = [n for n in dir(A) if not n.startswith("_")]
    fns = {n: getattr(A, n) for n in names if inspect.isfunction(getattr(A, n))}
    qkv = {n for n, fn in fns.items() if {"q", "k", "v"} <= set(inspect.signature(fn).parameters)}
    assert NOT_ONE_SEQUENCE <= qkv, NOT_ONE_SEQUENCE - qkv  # the skip list stays current
    for name in sorted(qkv - NOT_ONE_SEQUENCE):
        hints = typing.get_type_hints(fns[name])  # every annotation resolves
        for arg in ("q", "k", "v"):
            assert isinstance(hints.get(arg), type) and issubclass(
                hints[arg], jaxtyping.AbstractArray), (name, arg, hints.get(arg))
        for arg in ("kv_mask", "q_mask"):
            if arg in inspect.signature(fns[name]).parameters:
                assert arg in hints, (name, arg)
