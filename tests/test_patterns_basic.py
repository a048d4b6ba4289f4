"""The pattern protocol: layouts agree with dense masks; closed forms agree with the generic scan."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from xformers_jax.attention.patterns import (EMPTY, FULL, PARTIAL, Causal, Full, KeyPadding,
                                             Local, Pattern, Segments)

BASIC = [Full(), Causal(), Local(3, 0), Local(2, 9), KeyPadding(23), Segments((7, 20, 4)),
         Local(4, 4) | Segments((10, 25)), Causal() & KeyPadding(30), Local(1, 1) & Causal()]


@pytest.mark.parametrize("pattern", BASIC, ids=repr)
@pytest.mark.parametrize("lq,lk,bq,bk", [(31, 31, 8, 8), (40, 37, 16, 4), (5, 50, 8, 16)])
def test_layout_encodes_the_dense_mask(pattern, lq, lk, bq, bk):
    layout = pattern.layout(lq, lk, bq, bk)
    np.testing.assert_array_equal(layout.dense(), pattern.dense(lq, lk))
    # Closed-form tile kinds agree with the generic chunked evaluation.
    generic = Pattern.block_kinds(pattern, lq, lk, bq, bk)
    np.testing.assert_array_equal(pattern.block_kinds(lq, lk, bq, bk), generic)


@given(lq=st.integers(1, 60), lk=st.integers(1, 60), bq=st.integers(1, 20),
       bk=st.integers(1, 20), left=st.integers(0, 30), right=st.integers(0, 30))
def test_local_layout_on_random_shapes(lq, lk, bq, bk, left, right):
    p = Local(left, right) & Causal() if right % 2 else Local(left, right)
    np.testing.assert_array_equal(p.layout(lq, lk, bq, bk).dense(), p.dense(lq, lk))


def test_causal_skips_the_upper_triangle_and_shares_one_partial_mask():
    n = 8
    layout = Causal().layout(64 * n, 64 * n, 64, 64)
    assert layout.num_nonempty == n * (n + 1) // 2
    assert len(layout.partial_masks) == 1
    assert (layout.kinds == PARTIAL).sum() == n
    np.testing.assert_array_equal(layout.row_counts, np.arange(1, n + 1))


def test_tiles_crossing_the_key_length_are_never_full():
    layout = Full().layout(16, 20, 8, 8)
    assert (layout.kinds[:, -1] == PARTIAL).all() and (layout.kinds[:, :-1] == FULL).all()
    assert layout.partial_masks[0][:, :4].all() and not layout.partial_masks[0][:, 4:].any()


def test_local_band_cost_is_proportional_to_the_window():
    layout = Local(64, 64).layout(4096, 4096, 64, 64)
    assert layout.density < 0.05
    assert (layout.kinds == EMPTY).sum() > 0.9 * layout.kinds.size


def test_patterns_are_hashable_and_layouts_cached():
    assert Local(3, 2) == Local(3, 2) and hash(Local(3, 2)) == hash(Local(3, 2))
    assert Local(3, 2).layout(40, 40, 8, 8) is Local(3, 2).layout(40, 40, 8, 8)
    assert (Causal() | Local(1, 1)).causal_safe is False
    assert (Full() & Causal()).causal_safe is True


@pytest.mark.parametrize("bad", [lambda: Local(-1, 2), lambda: KeyPadding(-3),
                                 lambda: Segments((3, 0)), lambda: Causal().layout(10, 10, 0, 4),
                                 lambda: Causal() | "x"])
def test_bad_patterns_raise(bad):
    with pytest.raises((ValueError, TypeError)):
        bad()
