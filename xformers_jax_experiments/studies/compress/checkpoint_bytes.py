"""Where an int8 checkpoint's bytes go, against float32, at the ListOps main job's model size
and at LRA's ListOps size.

  python -m xformers_jax_experiments.studies.compress.checkpoint_bytes [--workdir=runs/teacher]

For each size the model (the trainer's ListOps classifier; with ``--workdir``, the main job's
trained float model saved there by ``quantize="int8"``) is quantized to int8
(``compress.quantize_model``: per-channel weight scales, one activation scale per layer) and
both are saved with ``parallel.save_checkpoint`` (orbax). Prints one JSON line per size:
array bytes split into int8 values, float32 scales and the float32 parameters left unquantized
(norms, biases, the CLS vector), the orbax directory's bytes split into array data and
metadata files, and the ratios. The arrays bound the ratio: a ``[k, n]`` matrix costs
``k * n + 4 * n`` bytes in int8 (a scale per output channel) against ``4 * k * n``, so
``4 / (1 + 4 / k)`` at best (3.76x for k = 64).

Measured (randomly initialised models; orbax compresses the array data a little, so a
directory can be smaller than its arrays):

- main job (dim 64, 2 layers, MLP 128): arrays 272,912 bytes float32 against 75,244 int8
  (3.63x: 67,200 int8 values, 3,932 bytes of scales, 4,112 bytes of float32 norms, biases and
  CLS); orbax directories 262,574 against 100,475 bytes (2.61x). The int8 directory's
  overhead is metadata, 20,099 bytes (twice the float checkpoint's 10,601: 32 arrays against
  17, each weight stored as values, scales and an activation scale), and 5,132 bytes of
  per-array storage beyond the arrays' 75,244. At this size 4x is out of reach even for the
  bare arrays.
- LRA's ListOps model (dim 512, 4 layers, MLP 1024): arrays 33,671,200 against 8,524,972
  bytes (3.95x), directories 31,128,364 against 7,827,809 bytes (3.98x); metadata is 0.3%.
"""

from __future__ import annotations

import json
import os
import tempfile

import equinox as eqx
import jax
import jax.numpy as jnp
from absl import app, flags

from xformers_jax import compress as C
from xformers_jax import parallel, train
from xformers_jax_experiments.configs.lra import listops

_WORKDIR = flags.DEFINE_string("workdir", "", "A trainer workdir holding float_model/ (the "
                               "main job's trained model); empty: random initialisation.")


def _files(path):
    """``(data bytes, metadata bytes)`` of an orbax directory: OCDBT's array data files (``d/``)
    against everything else (manifests, ``_METADATA``, ``_sharding``, zarr metadata)."""
    data = meta = 0
    for root, _, files in os.walk(path):
        for f in files:
            n = os.path.getsize(os.path.join(root, f))
            if os.sep + "d" in root[len(path):] or root.endswith(os.sep + "d"):
                data += n
            else:
                meta += n
    return data, meta


def _split(model):
    """Array bytes: int8 values, float32 quantization scales, other float parameters."""
    out = dict(int8=0, scales=0, float_params=0)
    wrappers = lambda x: isinstance(x, (C.QuantizedWeight, C.Int4Weight))  # noqa: E731
    for leaf in jax.tree_util.tree_leaves(model, is_leaf=wrappers):
        if wrappers(leaf):
            for a in jax.tree_util.tree_leaves(leaf):
                key = "int8" if a.dtype in (jnp.int8, jnp.uint8) else "scales"
                out[key] += a.size * a.dtype.itemsize
        elif eqx.is_array(leaf):
            out["float_params"] += leaf.size * leaf.dtype.itemsize
    return out


def measure(name, model):
    stats = {}
    # One activation scale per weight and layer, as calibration gives (its value is irrelevant
    # to the bytes).
    paths = [p for p, w in jax.tree_util.tree_flatten_with_path(model)[0]
             if getattr(p[-1], "name", None) in C.MATMUL_WEIGHTS]
    q = C.quantize_model(model, "int8", act_scales={
        jax.tree_util.keystr(p): jnp.full(w.shape[:-2], 0.05)
        for p, w in jax.tree_util.tree_flatten_with_path(model)[0] if p in paths})
    with tempfile.TemporaryDirectory() as tmp:
        for tag, m in (("float", model), ("int8", q)):
            d = os.path.join(tmp, tag)
            parallel.save_checkpoint(d, m)
            data, meta = _files(d)
            stats[tag] = dict(arrays=C.model_bytes(m), dir=data + meta, dir_data=data,
                              dir_metadata=meta, leaves=len(jax.tree_util.tree_leaves(m)))
    stats["int8"]["split"] = _split(q)
    stats["ratio_arrays"] = stats["float"]["arrays"] / stats["int8"]["arrays"]
    stats["ratio_dir"] = stats["float"]["dir"] / stats["int8"]["dir"]
    stats["ratio_dir_data"] = stats["float"]["dir_data"] / stats["int8"]["dir_data"]
    print(json.dumps(dict(size=name, **stats)))


def main(argv):
    del argv
    for size in ("main", None):
        c = listops.get_config("transformer" + ("," + size if size else ""))
        c.unlock()  # only the vocabulary and the length matter here: a few examples
        c.data.update(dict(num_train=8, num_eval=8, num_test=8))
        task = train.make_task(c.data, 0)
        model = train.build_model(c.model, task, jax.random.PRNGKey(0))
        if size == "main" and _WORKDIR.value:
            model = parallel.restore_checkpoint(
                os.path.join(_WORKDIR.value, "float_model"),
                eqx.filter_eval_shape(lambda: model))
        measure(f"{size or 'lra'}: dim {c.model.dim}, {c.model.num_layers} layers, MLP "
                f"{c.model.hidden}", model)


if __name__ == "__main__":
    app.run(main)
