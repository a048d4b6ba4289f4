"""Compress a trained model: int8 quantization and magnitude pruning, measured on the test set.

A model is trained on ListOps with the trainer (as ``lra_compare.py`` does), restored from its
workdir with ``train.restore_model``, then made lighter by the functions of
``xformers_jax.compress``:

- ``quantize_model(model, "int8", act_scales=calibrate(...))``: int8 weights per output
  channel and int8 x int8 -> int32 matmuls, activations scaled from a few calibration batches;
- ``magnitude_masks`` + ``apply_masks``: the smallest half of each weight matrix set to zero
  (one-shot here; the trainer's ``--config.prune.sparsity`` prunes gradually while training).

The trainer does the first after training with ``--config.quantize=int8``, and distillation
with ``--config.distill.teacher=WORKDIR``; see ``xformers_jax_experiments/configs/compress.py``.

  python examples/compress.py --steps=400 --workdir=/tmp/compress
"""

import argparse
import os
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

from xformers_jax import compress, train

try:  # run as a script (examples/ on sys.path) or imported as examples.compress
    from lra_compare import config_for
except ImportError:
    from examples.lra_compare import config_for


def accuracy(model, inputs, targets) -> float:
    logits = jax.jit(lambda m, x: m(x, mask=x != 0, inference=True))(model, inputs)
    return float(jnp.mean(jnp.argmax(logits, -1) == targets))


def main(steps: int = 400, workdir: str | None = None) -> dict:
    workdir = workdir or tempfile.mkdtemp(prefix="compress_")
    config = config_for("transformer", steps)
    run = os.path.join(workdir, "float")
    train.train_and_evaluate(config, run)

    task = train.make_task(config.data, config.seed)
    model = train.restore_model(run, config.model, task, jax.random.PRNGKey(0))
    inputs = jnp.asarray(task.test.arrays["inputs"])
    targets = jnp.asarray(task.test.arrays["targets"])

    calibration = [jnp.asarray(task.train.arrays["inputs"][i:i + 32]) for i in (0, 32)]
    scales = compress.calibrate(model, calibration, lambda m, x: m(x, mask=x != 0))
    int8 = compress.quantize_model(model, "int8", act_scales=scales)
    pruned = compress.apply_masks(model, compress.magnitude_masks(model, 0.5))

    rows = {
        "float32": (model, accuracy(model, inputs, targets)),
        "int8": (int8, accuracy(int8, inputs, targets)),
        "50% pruned": (pruned, accuracy(pruned, inputs, targets)),
    }
    print(f"ListOps test set ({len(targets)} examples, trained {steps} steps):")
    for label, (m, acc) in rows.items():
        print(f"{label:10s} accuracy {acc:.3f}  arrays {compress.model_bytes(m):8d} bytes")
    print(f"pruned weights that are zero: {compress.sparsity_report(pruned)['total']:.2f}")
    agree = np.mean(np.argmax(int8(inputs, mask=inputs != 0, inference=True), -1)
                    == np.argmax(model(inputs, mask=inputs != 0, inference=True), -1))
    print(f"int8 and float32 predict the same class for {agree:.1%} of the test set")
    return {label: dict(accuracy=acc, bytes=compress.model_bytes(m))
            for label, (m, acc) in rows.items()} | dict(agreement=float(agree))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--workdir", default=None)
    args = parser.parse_args()
    main(args.steps, args.workdir)
