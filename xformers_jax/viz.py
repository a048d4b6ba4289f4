"""Pictures of attention patterns: the connectivity matrix drawn as in the figures of Fournier
et al. (2021, "A Practical Survey on Faster and Lighter Transformers", Figs 10-15) and Lin et
al. (2022, "A Survey of Transformers", Figs 4-5): rows are queries (output positions),
columns keys (input positions), a filled square where a query attends to a key.

matplotlib is an optional dependency, imported only when drawing.
"""

from __future__ import annotations

import numpy as np


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg", force=False)
        import matplotlib.pyplot as plt
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError(
            "xformers_jax.viz needs matplotlib (an optional dependency): pip install matplotlib"
        ) from e
    return plt


def connectivity(pattern, lq: int, lk: int | None = None, *, causal: bool = False) -> np.ndarray:
    """``bool[lq, lk]`` (or ``[H, lq, lk]`` for a ``PerHead``) connectivity of ``pattern``."""
    from .attention.patterns import Causal

    lk = lq if lk is None else lk
    if causal:
        pattern = pattern & Causal()
    return pattern.dense(lq, lk)


def plot_pattern(pattern, lq: int, lk: int | None = None, *, causal: bool = False, ax=None,
                 title: str | None = None, color: str = "#1f77b4", grid: bool = True):
    """Draws the connectivity matrix of ``pattern`` (queries down, keys across).

    Args:
      pattern: a ``Pattern`` (or a ``PerHead``: its heads are overlaid, the union drawn).
      lq, lk: lengths (``lk`` defaults to ``lq``); keep them small (tens) for a readable grid.
      causal: draw ``pattern & Causal()``.
      ax: a matplotlib ``Axes`` to draw on (a new figure otherwise).
      title: defaults to the pattern's ``repr``.

    Returns:
      the ``Axes``.
    """
    plt = _pyplot()
    from matplotlib.colors import ListedColormap

    m = connectivity(pattern, lq, lk, causal=causal)
    if m.ndim == 3:
        m = m.any(0)
    if ax is None:
        size = 4.0
        _, ax = plt.subplots(figsize=(size, size * m.shape[0] / max(m.shape[1], 1)))
    ax.imshow(m, cmap=ListedColormap(["white", color]), vmin=0, vmax=1, interpolation="nearest")
    if grid and max(m.shape) <= 64:
        ax.set_xticks(np.arange(-0.5, m.shape[1], 1), minor=True)
        ax.set_yticks(np.arange(-0.5, m.shape[0], 1), minor=True)
        ax.grid(which="minor", color="#cccccc", linewidth=0.3)
        ax.tick_params(which="minor", length=0)
    ax.set_xlabel("key position j")
    ax.set_ylabel("query position i")
    ax.set_title(_wrap(title if title is not None else repr(pattern), ax, fontsize=7),
                 fontsize=7)
    return ax


def _wrap(title: str, ax, fontsize: float) -> str:
    """``title`` broken into lines as wide as the figure (a pattern's ``repr`` is often wider
    than its picture and would be clipped), at spaces where it can."""
    import textwrap

    width_pt = ax.figure.get_figwidth() * 72
    chars = max(int(width_pt / (0.62 * fontsize)), 16)  # an average glyph is ~0.6 em wide
    return "\n".join(textwrap.wrap(title, chars, break_long_words=True))


def save_pattern(pattern, path: str, lq: int, lk: int | None = None, **kwargs) -> str:
    """Draws ``pattern`` (see :func:`plot_pattern`) into a PNG file at ``path``; returns it."""
    plt = _pyplot()
    ax = plot_pattern(pattern, lq, lk, **kwargs)
    ax.figure.tight_layout()
    ax.figure.savefig(path, dpi=150)
    plt.close(ax.figure)
    return path
