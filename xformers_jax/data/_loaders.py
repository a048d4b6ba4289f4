"""Loaders for the data a user brings: the real LRA files and the classic corpora.

Nothing is downloaded. Each loader reads the format as distributed and raises
``FileNotFoundError`` naming the exact path it expected when it is missing. Text becomes byte
tokens (``byte + 1``, padding 0) like the offline byte tasks.

- IMDb reviews (LRA "Text"): ``<data_dir>/aclImdb/{train,test}/{neg,pos}/*.txt``.
- AAN pairs (LRA "Retrieval"): ``<data_dir>/new_aan_pairs.{train,eval,test}.tsv`` with columns
  label, id1, id2, text1, text2 (tab separated; an optional header line).
- CIFAR-10 python batches (LRA "Image"): ``<data_dir>/cifar-10-batches-py/data_batch_{1..5}``
  and ``test_batch``; LRA's image task is the grayscale image as 1024 pixel tokens, with the last
  10% of the training images as validation.
- ListOps TSV from LRA's release: ``<data_dir>/basic_{train,val,test}.tsv`` (Source, Target).
- enwik8: the raw 100,000,000-byte file ``<data_dir>/enwik8``, split 90M / 5M / 5M.
"""

from __future__ import annotations

import csv
import math
import os
import pickle

import numpy as np

from ._bytes import ByteWindows, encode_bytes
from ._checks import check_range
from ._iterators import ArraySource
from ._listops import encode as encode_listops, tokenize as tokenize_listops

_SPLITS = ("train", "validation", "test")


def _require(path: str, what: str) -> str:
    if not os.path.exists(path):
        raise FileNotFoundError(f"{what} not found: expected {path!r} (nothing is downloaded; "
                                f"put the files there or pass another data_dir)")
    return path


def _check_split(split: str, allowed=_SPLITS) -> None:
    if split not in allowed:
        raise ValueError(f"split must be one of {allowed}, got {split!r}")


def load_imdb(data_dir: str, split: str, *, seq_len: int) -> ArraySource:
    """IMDb reviews as byte tokens ``int32[N, seq_len]`` and labels (neg 0, pos 1).

    ``split``: "train" or "test" (LRA evaluates on test). Files are read in sorted order.
    """
    _check_split(split, ("train", "test"))
    inputs, targets = [], []
    for label, name in enumerate(("neg", "pos")):
        directory = _require(os.path.join(data_dir, "aclImdb", split, name), "IMDb reviews")
        for f in sorted(os.listdir(directory)):
            if f.endswith(".txt"):
                with open(os.path.join(directory, f), "rb") as fh:
                    inputs.append(encode_bytes(fh.read(), seq_len))
                targets.append(label)
    return ArraySource({"inputs": np.stack(inputs), "targets": np.asarray(targets, np.int32)})


def load_aan(data_dir: str, split: str, *, seq_len: int) -> ArraySource:
    """AAN document pairs: ``inputs1``, ``inputs2`` byte tokens ``int32[N, seq_len]``, labels."""
    _check_split(split)
    name = {"train": "train", "validation": "eval", "test": "test"}[split]
    path = _require(os.path.join(data_dir, f"new_aan_pairs.{name}.tsv"), "AAN pairs")
    first, second, targets = [], [], []
    with open(path, newline="", encoding="utf-8") as fh:
        reader = csv.reader(fh, delimiter="\t", quoting=csv.QUOTE_NONE)
        for row in reader:
            where = f"{path}, line {reader.line_num}"
            if reader.line_num == 1 and row and _is_header(row[0]):
                continue
            if len(row) != 5:
                raise ValueError(f"{where}: expected 5 tab-separated columns, got {len(row)}")
            label = _label(row[0], 2, where)
            first.append(encode_bytes(row[3].encode(), seq_len))
            second.append(encode_bytes(row[4].encode(), seq_len))
            targets.append(label)
    return ArraySource({"inputs1": np.stack(first), "inputs2": np.stack(second),
                        "targets": np.asarray(targets, np.int32)})


# The only globals a CIFAR python batch refers to: numpy's array, dtype and scalar
# reconstruction (``numpy.core`` before numpy 2, ``numpy._core`` after) and ``_codecs.encode``
# (how protocol 2 writes bytes from Python 3). A pickle naming anything else (``os.system``,
# ``builtins.eval``, ...) is refused before it is called: unpickling calls what it names.
_CIFAR_GLOBALS = frozenset({
    *((m, n) for m in ("numpy.core.multiarray", "numpy._core.multiarray")
      for n in ("_reconstruct", "scalar")),
    ("numpy", "ndarray"), ("numpy", "dtype"), ("_codecs", "encode")})


class _ArrayUnpickler(pickle.Unpickler):
    """Unpickles dicts, lists, bytes, numbers and numpy arrays, and nothing that runs code."""

    def find_class(self, module, name):
        if (module, name) in _CIFAR_GLOBALS:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(
            f"refusing to load {module}.{name} from a data file: a CIFAR batch holds only "
            "numpy arrays, bytes and lists (a pickle naming other callables can run code)")


def _read_cifar_batch(path: str) -> dict:
    """One CIFAR python batch (``{b"data": uint8[N, 3072], b"labels": [N ints], ...}``),
    read without running code from the file (a restricted unpickler: numpy arrays and
    builtins only; ``pickle.UnpicklingError`` names anything else the file asks for)."""
    with open(path, "rb") as fh:
        batch = _ArrayUnpickler(fh, encoding="bytes").load()
    if not isinstance(batch, dict) or b"data" not in batch or b"labels" not in batch:
        raise ValueError(f"{path}: not a CIFAR batch (a dict with b'data' and b'labels'), got "
                         f"{type(batch).__name__}"
                         f"{sorted(batch) if isinstance(batch, dict) else ''}")
    return batch


def _is_header(cell: str) -> bool:
    try:
        float(cell)
    except ValueError:
        return True
    return False


def _label(cell: str, num_classes: int, where: str) -> int:
    """A label cell as an int in ``[0, num_classes)`` (``"1"`` or ``"1.0"``; ``"0.5"``, ``"-1"``
    and ``"10"`` of 10 classes raise naming the line)."""
    try:
        value = float(cell)
    except ValueError:
        raise ValueError(f"{where}: label {cell!r} is not a number") from None
    if not math.isfinite(value) or value != int(value):
        raise ValueError(f"{where}: label {cell!r} is not an integer")
    if not 0 <= value < num_classes:
        raise ValueError(f"{where}: label {int(value)} is outside [0, {num_classes})")
    return int(value)


def _cifar_batches(data_dir: str, names) -> tuple[np.ndarray, np.ndarray]:
    images, labels = [], []
    for name in names:
        path = _require(os.path.join(data_dir, "cifar-10-batches-py", name), "CIFAR-10 batch")
        batch = _read_cifar_batch(path)
        data = np.asarray(batch[b"data"])
        if data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != 3 * 32 * 32:
            raise ValueError(f"{path}: b'data' must be uint8[N, 3072], got {data.dtype}"
                             f"{list(data.shape)}")
        label = np.asarray(batch[b"labels"])
        if label.shape != (len(data),) or not np.issubdtype(label.dtype, np.integer):
            raise ValueError(f"{path}: b'labels' must be {len(data)} integers, got "
                             f"{label.dtype}{list(label.shape)}")
        check_range(label, 0, 10, f"{path}: label of image", what="label")
        images.append(data.reshape(-1, 3, 32, 32))
        labels.append(label.astype(np.int32))
    return np.concatenate(images).transpose(0, 2, 3, 1), np.concatenate(labels)


def load_cifar10(data_dir: str, split: str, *, grayscale: bool = True) -> ArraySource:
    """CIFAR-10: ``inputs`` int32[N, 1024] gray pixel tokens (LRA Image) or uint8[N,32,32,3].

    Gray uses ITU-R 601 weights (as ``tf.image.rgb_to_grayscale``, which LRA used), truncated.
    Train / validation are the first 90% / last 10% of the five training batches.
    """
    _check_split(split)
    if split == "test":
        images, labels = _cifar_batches(data_dir, ["test_batch"])
    else:
        images, labels = _cifar_batches(data_dir, [f"data_batch_{i}" for i in range(1, 6)])
        cut = len(labels) * 9 // 10
        images, labels = (images[:cut], labels[:cut]) if split == "train" else (
            images[cut:], labels[cut:])
    if grayscale:
        gray = images.astype(np.float32) @ np.array([0.2989, 0.5870, 0.1140], np.float32)
        images = np.clip(gray, 0, 255).astype(np.int32).reshape(len(labels), -1)
    return ArraySource({"inputs": images, "targets": labels})


def load_listops_tsv(data_dir: str, split: str, *, max_length: int = 2000) -> ArraySource:
    """LRA's released ListOps TSV (``Source``, ``Target``) as token ids and labels."""
    _check_split(split)
    name = {"train": "train", "validation": "val", "test": "test"}[split]
    path = _require(os.path.join(data_dir, f"basic_{name}.tsv"), "ListOps TSV")
    inputs, targets = [], []
    with open(path, newline="", encoding="utf-8") as fh:
        reader = csv.DictReader(fh, delimiter="\t")
        for row in reader:
            where = f"{path}, line {reader.line_num}"
            try:
                inputs.append(encode_listops(tokenize_listops(row["Source"]), max_length))
            except ValueError as e:
                raise ValueError(f"{where}: {e}") from None
            targets.append(_label(row["Target"], 10, where))
    return ArraySource({"inputs": np.stack(inputs), "targets": np.asarray(targets, np.int32)})


def load_enwik8(data_dir: str, split: str, *, seq_len: int) -> ByteWindows:
    """enwik8 byte LM windows; splits at 90% and 95% of the file (90M / 5M / 5M bytes)."""
    _check_split(split)
    path = _require(os.path.join(data_dir, "enwik8"), "enwik8 (unzipped)")
    data = np.memmap(path, np.uint8, mode="r")
    first, second = data.size * 9 // 10, data.size * 19 // 20
    part = {"train": data[:first], "validation": data[first:second], "test": data[second:]}
    return ByteWindows(part[split], seq_len=seq_len)
