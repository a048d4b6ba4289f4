"""Build a model and switch its attention kind (or replace attention by a token mixer).

A model never names an attention function: each block's attention is an
``nn.AttentionSpec(kind, hyperparameters)`` given through ``block=dict(spec=...)``, and a
token mixer replaces it with ``block=dict(mixer=nn.MixerSpec(kind, ...))``. Every kind a spec
can name, with its hyperparameters, defaults and paper, is in CATALOGUE.md
(``nn.registered_kinds("attention")`` lists them at run time). A spec checks its kind and
hyperparameter names when it is made, and ``spec.resolved`` fills the defaults or names a
missing required one.

  python examples/switch_kinds.py
"""

import jax
import jax.numpy as jnp
import numpy as np

from xformers_jax import models, nn

# (label, the block's keyword arguments): one argument switches the kind.
BLOCKS = {
    "dot_product": dict(spec=nn.AttentionSpec("dot_product")),
    "flash": dict(spec=nn.AttentionSpec("flash", {"block_q": 32, "block_k": 32})),
    "local": dict(spec=nn.AttentionSpec("local", {"left": 16, "right": 16})),
    "performer": dict(spec=nn.AttentionSpec("performer", {"num_features": 32})),
    "nystrom": dict(spec=nn.AttentionSpec("nystrom", {"num_landmarks": 8})),
    "lsh": dict(spec=nn.AttentionSpec("lsh", {"chunk_size": 16, "num_buckets": 4})),
    "fnet (mixer)": dict(mixer=nn.MixerSpec("fnet")),
}


def build(block, *, length=64, seed=0):
    """A 2-layer classifier over byte tokens whose blocks are ``block``."""
    return models.EncoderClassifier(
        num_classes=10, dim=32, num_layers=2, num_heads=4, hidden=64, pooling="mean",
        vocab_size=256, max_len=length, block=block, key=jax.random.PRNGKey(seed))


def main(length: int = 64) -> dict:
    tokens = jax.random.randint(jax.random.PRNGKey(1), (2, length), 1, 256)
    mask = jnp.arange(length)[None, :] < jnp.array([[length], [length // 2]])
    logits = {}
    for label, block in BLOCKS.items():
        model = build(block, length=length)
        n = sum(x.size for x in jax.tree_util.tree_leaves(model) if isinstance(x, jax.Array))
        out = model(tokens, mask=mask, key=jax.random.PRNGKey(2), inference=True)
        logits[label] = np.asarray(out)
        print(f"{label:14s} parameters {n:7d}  logits {tuple(out.shape)}")

    # What a spec accepts: the declared hyperparameters with defaults; a missing required one
    # is named when the spec is resolved (before any array is built).
    for name, h in nn.get_kind("attention", "nystrom").hyperparameters.items():
        print(f"  nystrom {name}={h.default!r}: {h.doc}")
    try:
        print(nn.AttentionSpec("nystrom").resolved)
    except (TypeError, ValueError) as e:
        print("AttentionSpec('nystrom').resolved ->", type(e).__name__ + ":", e)
    return logits


if __name__ == "__main__":
    main()
