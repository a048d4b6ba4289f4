"""Range checks on the host, where a bad value's position is still known.

Out of range ids do not fail inside a jitted model: an embedding lookup clamps a token id past
the vocabulary to the last row, ``take_along_axis`` wraps a label of -1 to the last class and
a label past the classes gives a NaN loss. So the loaders and the trainer check the numpy
arrays once, naming the value and where it is (the file and line, or the split, key and row).
"""

from __future__ import annotations

import numpy as np


def _position(index: tuple[int, ...]) -> str:
    if len(index) == 1:
        return f"row {index[0]}"
    if len(index) == 2:
        return f"row {index[0]}, position {index[1]}"
    return f"index {index}"


def check_range(values, low: int, high: int, where: str, *, what: str = "value") -> None:
    """Raises ``ValueError`` unless every entry of ``values`` is in ``[low, high)``.

    Args:
      values: an integer array (any shape; the leading axis is the example).
      low, high: the allowed half-open range (token ids ``[0, vocab_size)``, labels
        ``[0, num_classes)``).
      where: what the array is (a file, a split and key) for the message.
      what: what one entry is ("token id", "label").

    The message names the first bad entry's value and position and how many are bad.
    """
    values = np.asarray(values)
    if values.size == 0:
        return
    bad = (values < low) | (values >= high)
    if bad.any():
        index = tuple(int(i) for i in np.argwhere(bad)[0])
        raise ValueError(
            f"{where}: {what} {values[index].item()} at {_position(index)} is outside "
            f"[{low}, {high}) ({int(bad.sum())} of {values.size} entries are)")


def check_arrays(arrays: dict, *, vocab_size: int, num_classes: int, where: str) -> None:
    """Checks a split's integer arrays: token ids (``inputs``, ``inputs1``, ``inputs2``) in
    ``[0, vocab_size)`` and ``targets`` in ``[0, num_classes)``; float inputs (continuous
    features) are not token ids and are not checked."""
    for key, values in arrays.items():
        values = np.asarray(values)
        if not np.issubdtype(values.dtype, np.integer):
            continue
        if key == "targets":
            check_range(values, 0, num_classes, f"{where} targets", what="label")
        elif key.startswith("inputs"):
            check_range(values, 0, vocab_size, f"{where} {key}", what="token id")
