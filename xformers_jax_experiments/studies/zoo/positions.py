r"""Whether input positions let the zoo's models learn selective copying and induction heads.

  python -m xformers_jax_experiments.studies.zoo.positions [--steps=600] [--num_tokens=4]
  python -m xformers_jax_experiments.studies.zoo.positions --task=induction \
      --kinds=attention/dot_product --steps=1500 \
      --variants=sinusoidal,none,table_scaled,tokens_scaled

The zoo's model (``config.py``: 2 layers, d = 64, tied output layer, the 4x MLP) with each
kind of ``--kinds`` (``SLOT/KIND``; the default: the token mixers Mamba and Mamba-2), trained
by a plain loop (Adam, one rate, no schedule or weight decay: nothing of the trainer) on
Mamba's selective copying (``data.SelectiveCopying``, ``--num_tokens`` tokens at
``--seq_len``) or induction heads (``data.InductionHeads`` at ``--seq_len``), in the
``--variants`` of :data:`VARIANTS`: with and without sinusoidal input positions, and three
ways to give the tokens their weight back with the positions kept: an output layer of its
own (untied), the embedding table scaled by ``sqrt(d)`` (so the tied output layer too), and
the looked-up token embeddings scaled by ``sqrt(d)`` before the sinusoids are added, the table
left as it is (Vaswani et al. 2017, section 3.4; ``causal_lm``'s ``scale_embeddings``).
Prints the training accuracy on the scored positions (that step's batch) every ``--every``
steps as a markdown table: the zoo's README quotes it.

Sinusoids add a value in [-1, 1] to every channel while the table's rows, drawn N(0, 1/d),
have norm about 1: at d = 64 a token is about a sixth of its own input.
"""

from __future__ import annotations

import math
import sys

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import app, flags

from xformers_jax import data, models
from xformers_jax_experiments.studies.zoo import config as Z

FLAGS = flags.FLAGS


def _define_flags() -> None:
    # Defined when run as a script only: a module that defines flags on import collides with
    # another's of the same name in one process (the test suite imports both).
    flags.DEFINE_integer("steps", 600, "training steps of each model")
    flags.DEFINE_integer("every", 100, "steps between the table's columns")
    flags.DEFINE_integer("num_tokens", 4, "tokens to copy")
    flags.DEFINE_integer("seq_len", 64, "sequence length")
    flags.DEFINE_integer("batch_size", 64, "examples per step")
    flags.DEFINE_float("learning_rate", 3e-3, "Adam's rate")
    flags.DEFINE_enum("task", "selective_copy", ["selective_copy", "induction"], "the task")
    flags.DEFINE_list("kinds", ["mixer/mamba", "mixer/mamba2"], "SLOT/KIND of each model")
    flags.DEFINE_list("variants", ["sinusoidal", "none", "untied", "table_scaled"],
                      f"which of {sorted(VARIANTS)}")


# name: (the row's label, positions, tied output layer, embedding table scale (None:
# sqrt(d)), the looked-up tokens scaled by sqrt(d) before the positions)
VARIANTS = {
    "sinusoidal": ("sinusoidal positions", "sinusoidal", True, 1.0, False),
    "none": ("no positions", "none", True, 1.0, False),
    "untied": ("sinusoidal positions, output layer untied", "sinusoidal", False, 1.0, False),
    "table_scaled": ("sinusoidal positions, embeddings scaled by sqrt(d)", "sinusoidal", True,
                     None, False),
    "tokens_scaled": ("sinusoidal positions, token embeddings times sqrt(d) before them "
                      "(the table unscaled)", "sinusoidal", True, 1.0, True),
}


def build(kind: str, positions: str, tied: bool, scale: float | None, seq_len: int, vocab: int,
          key, *, slot: str = "mixer", task: str = "selective_copy",
          scale_tokens: bool = False):
    """The zoo's model of ``slot``'s ``kind`` for ``task`` (``config.get_config``) with
    ``positions``, ``tied``, the embedding table times ``scale`` (None: ``sqrt(dim)``) and
    ``scale_tokens`` (``causal_lm``'s ``scale_embeddings``)."""
    c = Z.get_config(f"{task},{slot},{kind},{seq_len}")
    c.unlock()
    # the table N(0, 1/d) times scale: its standard deviation scale / sqrt(d)
    std = 1.0 if scale is None else scale / math.sqrt(c.model.dim)
    c.model.update(dict(positions=positions, tie_embeddings=tied,
                        scale_embeddings=scale_tokens, embed_std=std))
    spec = type("Task", (), dict(vocab_size=vocab, seq_len=seq_len))()
    return models.get_model("causal_lm").build(c.model, spec, key)


def train(model, source, *, steps: int, every: int, batch_size: int, learning_rate: float):
    """Adam on the scored positions' cross-entropy; the batch accuracy at each ``every``."""
    opt = optax.adam(learning_rate)
    params = eqx.filter(model, eqx.is_inexact_array)
    state = opt.init(params)

    @eqx.filter_jit
    def step(model, state, inputs, targets, scored):
        def loss(model):
            logits = model(inputs)
            ce = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
            right = (logits.argmax(-1) == targets) * scored
            return (ce * scored).sum() / scored.sum(), right.sum() / scored.sum()

        (_, acc), grads = eqx.filter_value_and_grad(loss, has_aux=True)(model)
        updates, state = opt.update(eqx.filter(grads, eqx.is_inexact_array), state,
                                    eqx.filter(model, eqx.is_inexact_array))
        return eqx.apply_updates(model, updates), state, acc

    out = {}
    for i in range(1, steps + 1):
        rows = [source[(i - 1) * batch_size + b] for b in range(batch_size)]
        batch = {k: jnp.asarray(np.stack([r[k] for r in rows])) for k in rows[0]}
        model, state, acc = step(model, state, batch["inputs"], batch["targets"],
                                 batch["scored"])
        if i % every == 0:
            out[i] = float(acc)
            # progress of a long study, apart from the table on stdout
            print(f"step {i}: batch accuracy {out[i]:.3f}", file=sys.stderr, flush=True)
    return out


def main(argv):
    del argv
    unknown = sorted(set(FLAGS.variants) - set(VARIANTS))
    if unknown:
        raise app.UsageError(f"--variants: unknown {unknown}; choose from {sorted(VARIANTS)}")
    n = FLAGS.steps * FLAGS.batch_size
    if FLAGS.task == "selective_copy":
        source = data.SelectiveCopying(n, seed=0, seq_len=FLAGS.seq_len,
                                       num_tokens=FLAGS.num_tokens)
        what = f"Selective copying of {FLAGS.num_tokens} tokens"
    else:
        source = data.InductionHeads(n, seed=0, seq_len=FLAGS.seq_len)
        what = "Induction heads"
    columns = list(range(FLAGS.every, FLAGS.steps + 1, FLAGS.every))
    print(f"{what} at L = {FLAGS.seq_len}, batch {FLAGS.batch_size}, Adam at "
          f"{FLAGS.learning_rate:g}: training accuracy on the scored positions (chance "
          f"1/{source.vocab}) at steps {columns[0]}..{columns[-1]}\n")
    print("| model | " + " | ".join(f"step {c}" for c in columns) + " |")
    print("|---|" + "---|" * len(columns))
    for slot_kind in FLAGS.kinds:
        slot, kind = slot_kind.split("/")
        for variant in FLAGS.variants:
            name, positions, tied, scale, scale_tokens = VARIANTS[variant]
            model = build(kind, positions, tied, scale, FLAGS.seq_len, source.vocab_size,
                          jax.random.PRNGKey(0), slot=slot, task=FLAGS.task,
                          scale_tokens=scale_tokens)
            acc = train(model, source, steps=FLAGS.steps, every=FLAGS.every,
                        batch_size=FLAGS.batch_size, learning_rate=FLAGS.learning_rate)
            print(f"| {kind}, {name} | " + " | ".join(f"{acc[c]:.3f}" for c in columns)
                  + " |", flush=True)


if __name__ == "__main__":
    _define_flags()
    app.run(main)
