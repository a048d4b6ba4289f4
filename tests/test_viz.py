"""xformers_jax.viz and the pattern gallery: every picture's title fits in its figure."""

import pytest

pytest.importorskip("matplotlib")


def test_every_gallery_title_fits_its_figure(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from xformers_jax.viz import plot_pattern
    from xformers_jax_experiments.pattern_gallery import gallery, title

    for name, (pattern, length, causal) in gallery(32).items():
        ax = plot_pattern(pattern, length, causal=causal, title=title(name, pattern, causal))
        fig = ax.figure
        fig.tight_layout()
        fig.canvas.draw()
        box, frame = ax.title.get_window_extent(), fig.bbox
        assert box.x0 >= frame.x0 - 1 and box.x1 <= frame.x1 + 1, (name, ax.title.get_text())
        assert ax.title.get_text().replace("\n", " ") == title(name, pattern, causal)
        plt.close(fig)
