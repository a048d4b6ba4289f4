"""Writes a PNG of every sparse pattern's connectivity matrix.

  python -m xformers_jax_experiments.pattern_gallery --outdir=/tmp/patterns [--length=32]
"""

from __future__ import annotations

import os

from absl import app, flags

from xformers_jax.attention import patterns as P
from xformers_jax.viz import save_pattern

_OUTDIR = flags.DEFINE_string("outdir", "pattern_gallery", "Directory for the PNG files.")
_LENGTH = flags.DEFINE_integer("length", 32, "Sequence length drawn (tokens).")


def gallery(n: int) -> dict[str, tuple]:
    """``name -> (pattern, length, causal)`` for every sparse pattern in ``attention.patterns``."""
    bp = P.BPTree(n // 2)
    return {
        "full": (P.Full(), n, False),
        "causal": (P.Causal(), n, False),
        "local": (P.Local(2, 2), n, False),
        "dilated": (P.Dilated(2, 2, 2), n, False),
        "strided": (P.Strided(4), n, True),
        "fixed": (P.Fixed(4, 1), n, True),
        "global": (P.Global((0, n // 2)), n, False),
        "random": (P.Random(3, seed=0), n, False),
        "block_local": (P.BlockLocal(4), n, False),
        "star": (P.Star(), n, False),
        "cascade_layer2": (P.Cascade(1, 2, 2), n, False),
        "logsparse": (P.LogSparse(), n, True),
        "logsparse_local": (P.LogSparse(local=3), n, True),
        "logsparse_subsequence": (P.LogSparse(subsequence=n // 4), n, True),
        "blockbert_shift1": (P.BlockBERT(4, 1), n, False),
        "longformer": (P.Longformer(2, 1, (0, n // 2)), n, False),
        "longformer_dilated": (P.Longformer(2, 2, (0,)), n, False),
        "bigbird": (P.BigBird(max(1, n // 16), seed=0), n, False),
        "image_local_1d": (P.ImageLocal1D(4, 4), n, True),
        "image_local_2d": (P.ImageLocal2D(4, n // 4, (2, 2), (1, 1)), n, True),
        "bp_tree": (bp, bp.length, False),
    }


def title(name: str, pattern, causal: bool) -> str:
    """A picture's title: its name and the pattern's ``repr`` (wrapped to the picture's width
    by ``viz.plot_pattern``)."""
    return f"{name}: {pattern!r}" + (" & causal" if causal else "")


def main(argv):
    del argv
    os.makedirs(_OUTDIR.value, exist_ok=True)
    paths = []
    for name, (pattern, length, causal) in gallery(_LENGTH.value).items():
        paths.append(save_pattern(pattern, os.path.join(_OUTDIR.value, f"{name}.png"), length,
                                  causal=causal, title=title(name, pattern, causal)))
    print(f"wrote {len(paths)} pictures to {os.path.abspath(_OUTDIR.value)}")


if __name__ == "__main__":
    app.run(main)
