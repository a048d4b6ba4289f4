"""Write a new attention kind, register it, and use it in a model by name.

The kind here is sigmoid attention (Ramapuram et al. 2024, *Theory, Analysis, and Best
Practices for Sigmoid Self-Attention*): each key's weight is ``sigmoid(q.k / sqrt(D) + b)``
on its own, with no normalisation over the keys, and ``b = -log(Lk)`` keeps the sum of the
weights near one at initialisation.

Three steps, as for every kind in the library:

1. the pure function on one sequence and one head, obeying the attention contract
   (``causal`` never leaks the future; ``kv_mask`` removes padded keys from every output and
   gradient; shapes checked with a clear error);
2. a ``Kind`` record: its paper, cost, whether it is causal and how it decodes, and every
   hyperparameter with its default and meaning; and an ``AttentionAdapter`` that runs it on
   ``[batch, length, heads, dim]`` (``multihead`` does the lifting);
3. ``nn.register_kind(kind)``; from then on ``nn.AttentionSpec("sigmoid", {...})`` names it in
   any model, and the library's registry-wide tests (tests/test_kinds*.py) would check it like
   every built-in kind if it were declared in a family's ``_kinds.py``.

  python examples/new_kind.py
"""

import math

import jax
import jax.numpy as jnp

from xformers_jax import models, nn
from xformers_jax.attention import multihead
from xformers_jax.kinds import AttentionAdapter, Kind, Paper


def sigmoid_attention(q, k, v, *, causal=False, kv_mask=None, offset=None, scale=None,
                      key=None):
    """Sigmoid attention for one sequence and one head: ``[Lq, Dk], [Lk, Dk], [Lk, Dv] ->
    [Lq, Dv]``; ``offset`` is the score bias ``b`` (default ``-log(Lk)``)."""
    del key  # deterministic
    if q.ndim != 2 or k.ndim != 2 or v.ndim != 2 or q.shape[1] != k.shape[1] \
            or k.shape[0] != v.shape[0]:
        raise ValueError(f"sigmoid_attention: expected q [Lq, Dk], k [Lk, Dk], v [Lk, Dv], got "
                         f"{q.shape}, {k.shape}, {v.shape}; lift the function with multihead "
                         "for batched multi-head inputs")
    lq, lk = q.shape[0], k.shape[0]
    scale = 1 / math.sqrt(q.shape[1]) if scale is None else scale
    offset = -math.log(lk) if offset is None else offset
    scores = jnp.einsum("qd,kd->qk", q.astype(jnp.float32), k.astype(jnp.float32)) * scale
    weights = jax.nn.sigmoid(scores + offset)
    keep = jnp.ones((lq, lk), bool)
    if causal:
        keep &= jnp.arange(lk)[None, :] <= jnp.arange(lq)[:, None]
    if kv_mask is not None:
        keep &= kv_mask[None, :]
    # jnp.where, not a multiply: a NaN in a padded key's score must not reach the output.
    weights = jnp.where(keep, weights, 0.0)
    values = jnp.where(keep.any(0)[:, None], v.astype(jnp.float32), 0.0)
    return (weights @ values).astype(q.dtype)


def _attend(q, k, v, params, *, causal, kv_mask, bias, key, q_mask=None, offset):
    """The adapter: the one-head function lifted to ``[B, L, H, D]`` (each query's output
    depends on that query alone, so padded queries need no care here)."""
    del params, bias, q_mask
    return multihead(sigmoid_attention)(q, k, v, causal=causal, kv_mask=kv_mask, key=key,
                                        offset=offset)


SIGMOID = Kind(
    "sigmoid", sigmoid_attention, "exact",
    Paper("Ramapuram et al.", 2024,
          "Theory, Analysis, and Best Practices for Sigmoid Self-Attention"),
    time="O(L^2 D)", memory="O(L^2)", causal=True, decoding=None,
    test_hyperparameters={},
    hyperparameters={"offset": (None, "the score bias b; None: -log(Lk)")},
    adapter=AttentionAdapter(_attend))


def main(length: int = 32) -> dict:
    if "sigmoid" not in nn.registered_kinds("attention"):
        nn.register_kind(SIGMOID)
    block = dict(spec=nn.AttentionSpec("sigmoid", {"offset": -2.0}))
    key = jax.random.PRNGKey(0)

    # A causal language model with the new kind: changing later tokens changes no earlier
    # logit (the contract's causal check, which tests/test_kinds.py runs for every kind).
    lm = models.CausalLM(256, 32, 2, 4, 64, max_len=length, block=block, key=key)
    tokens = jax.random.randint(jax.random.PRNGKey(1), (2, length), 0, 256)
    changed = tokens.at[:, length // 2:].set(7)
    leak = float(jnp.abs(lm(tokens)[:, :length // 2] - lm(changed)[:, :length // 2]).max())

    # A classifier with padding: junk in the padded positions changes no logit.
    clf = models.EncoderClassifier(10, 32, 2, 4, 64, pooling="mean", vocab_size=256,
                                   max_len=length, block=block, key=key)
    mask = jnp.arange(length)[None, :] < jnp.array([[length], [length // 2]])
    junk = jnp.where(mask, tokens, 99)
    padding_effect = float(jnp.abs(clf(tokens, mask=mask) - clf(junk, mask=mask)).max())

    print(f"registered: {nn.get_kind('attention', 'sigmoid').paper}")
    print(f"causal LM: earlier logits moved by later tokens: {leak:.1e}")
    print(f"classifier: logits moved by junk in the padding: {padding_effect:.1e}")
    return dict(leak=leak, padding_effect=padding_effect)


if __name__ == "__main__":
    main()
