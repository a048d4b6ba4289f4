"""Byte-level tasks on text every machine has: the Python standard library's source files.

Byte-level language modelling (like enwik8) and byte-level binary classification (like LRA's
IMDb text task) without any download. The corpus is every ``*.py`` file under
``sysconfig.get_paths()["stdlib"]`` (``site-packages`` excluded), sorted by relative path.
Each file belongs to exactly one split, chosen by a hash of its relative path, so splits never
overlap and a file keeps its split when other files come or go (different Python versions ship
different files; the corpus is deterministic for a given installation).

Bytes are tokens ``byte + 1``; id 0 is padding (``BYTE_VOCAB_SIZE = 257``), the same encoding
as the loaders of IMDb, AAN and enwik8.
"""

from __future__ import annotations

import os
import sysconfig
import zlib

import numpy as np

PAD_ID = 0
BYTE_VOCAB_SIZE = 257
SPLITS = ("train", "validation", "test")
# Percent of files per split (by path hash): 90 / 5 / 5, like enwik8's 90M / 5M / 5M.
_SPLIT_BOUNDS = (90, 95, 100)


def encode_bytes(data: bytes, length: int | None = None) -> np.ndarray:
    """Bytes as token ids ``int32[length]`` (``byte + 1``), truncated or padded with 0."""
    ids = np.frombuffer(data, np.uint8).astype(np.int32) + 1
    if length is None:
        return ids
    out = np.full((length,), PAD_ID, np.int32)
    out[: min(length, ids.size)] = ids[:length]
    return out


def stdlib_files(root: str | None = None) -> list[str]:
    """Relative paths of the corpus files under ``root`` (default: the stdlib), sorted."""
    root = root or sysconfig.get_paths()["stdlib"]
    found = []
    for directory, subdirs, files in os.walk(root):
        subdirs[:] = sorted(d for d in subdirs if d not in ("site-packages", "__pycache__"))
        found += [os.path.relpath(os.path.join(directory, f), root)
                  for f in files if f.endswith(".py")]
    if not found:
        raise FileNotFoundError(f"no *.py files under {root!r}")
    return sorted(found)


def split_of(relative_path: str) -> str:
    """The split ("train", "validation" or "test") a file belongs to, from a path hash."""
    bucket = zlib.crc32(relative_path.encode()) % 100
    return next(s for s, bound in zip(SPLITS, _SPLIT_BOUNDS) if bucket < bound)


def is_test_module(relative_path: str) -> bool:
    """The classification label: True for test code (``test*`` file or directory)."""
    parts = relative_path.split(os.sep)
    return any(p.startswith("test") for p in parts)


def _check_split(split: str) -> None:
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")


class ByteWindows:
    """Byte-level language modelling windows over one byte stream.

    ``source[i]`` is ``{"inputs": int32[seq_len], "targets": int32[seq_len]}``: the i-th
    non-overlapping window of the stream as tokens, and the same window shifted by one byte.
    The stream stays as uint8 (enwik8 is 100 MB); windows are encoded when read.
    """

    def __init__(self, data: bytes | np.ndarray, *, seq_len: int):
        self.stream = np.frombuffer(data, np.uint8) if isinstance(data, bytes) else data
        self.seq_len = seq_len
        if self.stream.size < seq_len + 1:
            raise ValueError(f"the stream has {self.stream.size} bytes, fewer than "
                             f"seq_len + 1 = {seq_len + 1}")

    def __len__(self) -> int:
        return (self.stream.size - 1) // self.seq_len

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        if not 0 <= index < len(self):
            raise IndexError(f"index {index} out of range for {len(self)} windows")
        start = index * self.seq_len
        window = self.stream[start : start + self.seq_len + 1].astype(np.int32) + 1
        return {"inputs": window[:-1], "targets": window[1:]}


def stdlib_bytes_lm(split: str, *, seq_len: int, root: str | None = None) -> ByteWindows:
    """Byte-level LM windows over one split's stdlib files, concatenated in path order."""
    _check_split(split)
    root = root or sysconfig.get_paths()["stdlib"]
    chunks = []
    for f in stdlib_files(root):
        if split_of(f) == split:
            with open(os.path.join(root, f), "rb") as fh:
                chunks.append(fh.read())
    return ByteWindows(b"".join(chunks), seq_len=seq_len)


def stdlib_documents(split: str, *, root: str | None = None) -> list[np.ndarray]:
    """One split's stdlib files as documents (in path order) for packing
    (``data.PackedDocuments``): each file's bytes as token ids ``byte + 1``, ``uint16[n]``
    (half the memory of int32; the packer reads them as int32)."""
    _check_split(split)
    root = root or sysconfig.get_paths()["stdlib"]
    docs = []
    for f in stdlib_files(root):
        if split_of(f) == split:
            with open(os.path.join(root, f), "rb") as fh:
                docs.append(np.frombuffer(fh.read(), np.uint8).astype(np.uint16) + 1)
    return docs


class StdlibBytesClassification:
    """Byte-level binary classification: is a snippet test code (1) or library code (0)?

    Example ``i`` depends only on ``(seed, i)``: a class drawn uniformly, then a file of that
    class in this split (weighted by size), then a random window of ``seq_len`` bytes, padded
    with 0 when the file is shorter. ``source[i]`` is ``{"inputs": int32[seq_len],
    "targets": int32[]}``.
    """

    def __init__(self, split: str, *, seq_len: int, num_examples: int, seed: int,
                 root: str | None = None):
        _check_split(split)
        self.root = root or sysconfig.get_paths()["stdlib"]
        files = [f for f in stdlib_files(self.root) if split_of(f) == split]
        self.classes = [[f for f in files if not is_test_module(f)],
                        [f for f in files if is_test_module(f)]]
        if not all(self.classes):
            raise FileNotFoundError(
                f"split {split!r} under {self.root!r} needs both test and library modules; "
                f"found {[len(c) for c in self.classes]} (is the Python test suite installed?)")
        self.sizes = [np.array([os.path.getsize(os.path.join(self.root, f)) for f in c],
                               np.float64) for c in self.classes]
        self.seq_len, self.num_examples, self.seed = seq_len, num_examples, seed

    def __len__(self) -> int:
        return self.num_examples

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        if not 0 <= index < self.num_examples:
            raise IndexError(f"index {index} out of range for {self.num_examples} examples")
        rng = np.random.default_rng([self.seed, index])
        label = int(rng.integers(2))
        sizes = self.sizes[label]
        path = self.classes[label][int(rng.choice(sizes.size, p=sizes / sizes.sum()))]
        with open(os.path.join(self.root, path), "rb") as fh:
            data = fh.read()
        start = int(rng.integers(max(1, len(data) - self.seq_len + 1)))
        return {"inputs": encode_bytes(data[start : start + self.seq_len], self.seq_len),
                "targets": np.asarray(label, np.int32)}
