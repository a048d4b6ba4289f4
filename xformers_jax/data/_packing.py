"""Packing variable-length documents into fixed-length rows (sequence packing).

Training a language model on documents shorter than its context wastes the padding of every
row; packing fills each row with several documents, and the model keeps them apart with the
row's segment ids (``models.CausalLM(tokens, segment_ids=...)``: positions restart at each
document, no document attends to another). A document of ``n`` tokens gives ``n - 1``
(input, target) pairs, so no target crosses a document boundary. A document longer than a row
is cut into pieces of ``seq_len + 1`` tokens that overlap by one (as ``ByteWindows`` cuts a
stream: every token is the target once); each piece is a document of its own, seen without
the pieces before it. Pieces are placed in a seeded random order (``shuffle``), each into the
current row while it fits, else into a new row (next fit).

The plan (which pieces go into which row) is made once, on the host, with numpy; row ``i`` is
read on demand from the concatenated documents, so :class:`PackedDocuments` is a Grain
random-access source whose row ``i`` is a pure function of ``(documents, seq_len, seed, i)``:
``data.batches`` / ``data.DataIterator`` shuffle, shard and checkpoint it like any other.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

PAD_ID = 0


class PackedDocuments:
    """Rows of ``seq_len`` positions packed with whole documents (or pieces of long ones).

    ``source[i]`` is ``{"inputs", "targets", "segment_ids", "positions"}``, each
    ``int32[seq_len]``: the tokens of the row's documents one after another, each document's
    next tokens as targets, ``segment_ids`` ``1, 2, ...`` numbering the row's documents (0 for
    the padding at the end, where inputs and targets are :data:`PAD_ID`), and ``positions``
    each token's offset in its document (0 at each document's first token; 0 in the padding):
    what ``nn.document_positions(segment_ids)`` gives on the real tokens.

    Args:
      documents: token id arrays (any integer dtype; ids are not checked here, the trainer's
        ``data.check_arrays`` and guard do); documents of fewer than 2 tokens have no target
        and are left out.
      seq_len: positions per row.
      seed: the order in which pieces are placed (``shuffle``).
      shuffle: False keeps the documents' order (evaluation splits).

    Attributes:
      fill: the fraction of all rows' positions that hold a real token.
      num_documents: the pieces placed (documents after cutting the long ones).
    """

    def __init__(self, documents: Sequence[np.ndarray], *, seq_len: int, seed: int = 0,
                 shuffle: bool = True):
        if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
            raise ValueError(f"PackedDocuments: seq_len must be a positive integer, got "
                             f"{seq_len!r}")
        docs = [np.asarray(d).reshape(-1) for d in documents]
        bad = [i for i, d in enumerate(docs) if not np.issubdtype(d.dtype, np.integer)]
        if bad:
            raise ValueError(f"PackedDocuments: documents must be integer token ids; document "
                             f"{bad[0]} has dtype {docs[bad[0]].dtype}")
        lengths = np.array([d.size for d in docs], np.int64)
        self.tokens = np.concatenate(docs) if docs else np.zeros((0,), np.int32)
        starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]) if docs else lengths
        # Pieces of at most seq_len + 1 tokens, starting every seq_len tokens of a document;
        # each gives length - 1 (input, target) pairs, at least one.
        piece_starts, piece_lengths = [], []
        for start, n in zip(starts, lengths):
            offsets = np.arange(0, max(n - 1, 0), seq_len)
            piece_starts.append(start + offsets)
            piece_lengths.append(np.minimum(n - offsets, seq_len + 1))
        self.piece_starts = np.concatenate(piece_starts) if docs else np.zeros(0, np.int64)
        self.piece_lengths = np.concatenate(piece_lengths) if docs else np.zeros(0, np.int64)
        if self.piece_starts.size == 0:
            raise ValueError(f"PackedDocuments: no document has 2 or more tokens (got "
                             f"{len(docs)} documents)")
        order = np.arange(self.piece_starts.size)
        if shuffle:
            order = np.random.default_rng(seed).permutation(order)
        self.order = order
        # Next fit: a row takes pieces while their pairs fit in seq_len positions.
        row_starts, used = [0], 0
        for j, p in enumerate(order):
            pairs = int(self.piece_lengths[p]) - 1
            if used + pairs > seq_len:
                row_starts.append(j)
                used = 0
            used += pairs
        self.row_starts = np.asarray(row_starts + [order.size], np.int64)
        self.seq_len = seq_len
        self.num_documents = int(order.size)
        self.fill = float((self.piece_lengths - 1).sum() / (len(self) * seq_len))

    def __len__(self) -> int:
        return self.row_starts.size - 1

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        if not 0 <= index < len(self):
            raise IndexError(f"index {index} out of range for {len(self)} packed rows")
        out = {name: np.zeros((self.seq_len,), np.int32)
               for name in ("inputs", "targets", "segment_ids", "positions")}
        at = 0
        pieces = self.order[self.row_starts[index]:self.row_starts[index + 1]]
        for number, p in enumerate(pieces, start=1):
            start, n = int(self.piece_starts[p]), int(self.piece_lengths[p])
            piece = self.tokens[start:start + n].astype(np.int32)
            out["inputs"][at:at + n - 1] = piece[:-1]
            out["targets"][at:at + n - 1] = piece[1:]
            out["segment_ids"][at:at + n - 1] = number
            out["positions"][at:at + n - 1] = np.arange(n - 1)
            at += n - 1
        return out
