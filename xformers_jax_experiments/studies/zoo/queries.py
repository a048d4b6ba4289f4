r"""Which MQAR queries a trained zoo run answers, and what it answers otherwise.

  python -m xformers_jax_experiments.studies.zoo.queries RUN_DIR [RUN_DIR ...]

``RUN_DIR`` is one run of the sweep (``WORKDIR/mqar/KIND/L{L}_d{D}_lr{LR}``). The run's model
(its best step, else its latest) answers the first ``--num`` examples of its test split, and
the accuracy is split by the queried pair's index in the prefix (1 = the first pair), by the
query's order among the row's queries, and by its gap (Zoology's power law), beside how often
the answer is one of the row's values at all. A model that has learnt to copy *a* value from
the context but not to bind it to its key answers one of the ``kv`` values about every time
and the right one about ``1 / kv`` of the time, evenly over pairs and gaps; one that has
learnt recency answers the last pair.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np


def tally(examples, predictions, num_kv_pairs: int) -> dict:
    """The split accuracies of ``predictions int[N, L]`` (the argmax at every position) on
    MQAR ``examples`` (dicts of ``inputs``, ``targets``, ``scored``): ``accuracy``,
    ``by_pair`` / ``by_order`` (lists over ``kv``), ``by_gap`` (``{gap: accuracy}``, gaps at
    or beyond 8 pooled as 8) and ``a_value`` (the share of answers that are one of the row's
    values)."""
    kv = num_kv_pairs
    pair, order, gap = np.zeros((kv, 2)), np.zeros((kv, 2)), {}
    right, a_value = [], []
    for e, p in zip(examples, predictions):
        inputs, targets = np.asarray(e["inputs"]), np.asarray(e["targets"])
        keys, values = list(inputs[0:2 * kv:2]), set(inputs[1:2 * kv:2].tolist())
        for n, q in enumerate(np.nonzero(np.asarray(e["scored"]))[0]):
            ok = float(p[q] == targets[q])
            pair[keys.index(inputs[q])] += (ok, 1)
            order[n] += (ok, 1)
            g = min(int(q - 2 * kv) // 2, 8)
            gap[g] = gap.get(g, np.zeros(2)) + (ok, 1)
            right.append(ok)
            a_value.append(float(int(p[q]) in values))
    share = lambda t: float(t[0] / t[1]) if t[1] else float("nan")
    return dict(accuracy=float(np.mean(right)), by_pair=[share(t) for t in pair],
                by_order=[share(t) for t in order],
                by_gap={g: share(t) for g, t in sorted(gap.items())},
                a_value=float(np.mean(a_value)))


def per_query(run_dir: str, num: int = 500) -> dict:
    """:func:`tally` of the run in ``run_dir`` on the first ``num`` test examples."""
    import jax
    import jax.numpy as jnp
    import ml_collections

    from xformers_jax import train
    from xformers_jax.train._tasks import get_task, make_task

    with open(os.path.join(run_dir, "config.json")) as f:
        c = ml_collections.ConfigDict(json.load(f))
    if c.data.task != "mqar":
        raise ValueError(f"{run_dir}: a run of task {c.data.task!r}, not 'mqar'")
    # A run recorded before a task setting existed ran at that setting's default.
    c.data = ml_collections.ConfigDict({**get_task("mqar").data, **c.data.to_dict()})
    task = make_task(c.data, c.seed)
    model = train.restore_model(run_dir, c.model, task, jax.random.PRNGKey(c.seed))
    num = min(num, len(task.test))
    examples = [task.test[i] for i in range(num)]
    inputs = jnp.asarray(np.stack([e["inputs"] for e in examples]))
    forward = jax.jit(lambda m, x: jnp.argmax(m(x), -1))
    predictions = np.concatenate([np.asarray(forward(model, inputs[i:i + 100]))
                                  for i in range(0, num, 100)])
    return tally(examples, predictions, c.data.num_kv_pairs)


def main(argv) -> None:
    for run_dir in argv:
        r = per_query(run_dir)
        print(f"{run_dir}: accuracy {r['accuracy']:.3f}; an answer is one of the row's values "
              f"{r['a_value']:.3f}")
        print("  by pair (1 = first): " + " ".join(f"{a:.3f}" for a in r["by_pair"]))
        print("  by query order:      " + " ".join(f"{a:.3f}" for a in r["by_order"]))
        print("  by gap (8 = 8+):     " + " ".join(f"{g}:{a:.2f}" for g, a in r["by_gap"].items()))


if __name__ == "__main__":
    main(sys.argv[1:])
