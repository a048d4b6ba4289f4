"""Contiguous streams for models that carry state across segments (segment-level recurrence).

The corpus is cut into ``B`` contiguous streams, one per batch row, and batch ``t`` is segment
``t`` of every stream, as Transformer-XL trains (Dai et al., 2019): row ``b`` of consecutive
batches is consecutive text, so a memory carried from one step to the next holds the text just
before the segment. The iterator's state is two integers (``epoch``, ``position``); with the
model's memory checkpointed beside it, a resumed run continues exactly.
"""

from __future__ import annotations

from typing import Any, Iterator

import numpy as np


class StreamBatches:
    """Batches ``{"inputs": int32[B, L], "targets": int32[B, L], "reset": bool[B]}`` of byte
    tokens (``byte + 1``, like :class:`ByteWindows`) from ``B`` contiguous streams.

    The global batch of ``batch_size * process_count`` streams cuts the corpus into equal
    contiguous pieces (the remainder is dropped); this process reads rows
    ``process_index * batch_size ...``. Each stream gives ``segments_per_epoch`` segments of
    ``seq_len`` tokens (targets are the next bytes, reading one byte past the segment);
    ``reset`` is True at a stream's first segment (a memory must start empty there).
    After the last segment the next epoch starts the streams again (``num_epochs=None``) or
    iteration stops. ``max_segments`` (> 0) reads at most that many segments per epoch.

    Args:
      data: the corpus as ``bytes`` or ``uint8[N]``.
      batch_size: streams on this process. seq_len: segment length.
      process_index, process_count: this process's share of the global batch.
      num_epochs: None repeats forever. max_segments: bound on segments per epoch (0: all).
    """

    def __init__(self, data, *, batch_size: int, seq_len: int, process_index: int = 0,
                 process_count: int = 1, num_epochs: int | None = None, max_segments: int = 0):
        stream = np.frombuffer(data, np.uint8) if isinstance(data, bytes) else np.asarray(data)
        if stream.dtype != np.uint8 or stream.ndim != 1:
            raise ValueError(f"StreamBatches: data must be bytes or uint8[N], got "
                             f"{stream.dtype}{list(stream.shape)}")
        if batch_size < 1 or seq_len < 1:
            raise ValueError(f"StreamBatches: batch_size and seq_len must be >= 1, got "
                             f"{batch_size}, {seq_len}")
        if not 0 <= process_index < process_count:
            raise ValueError(f"StreamBatches: need 0 <= process_index < process_count, got "
                             f"{process_index}, {process_count}")
        total = batch_size * process_count
        per_stream = (stream.size - 1) // total
        segments = per_stream // seq_len
        if segments < 1:
            raise ValueError(f"StreamBatches: {stream.size} bytes cut into {total} streams give "
                             f"{per_stream} bytes each, fewer than one segment of {seq_len}")
        if max_segments > 0:
            segments = min(segments, max_segments)
        rows = np.arange(process_index * batch_size, (process_index + 1) * batch_size)
        self.starts = rows * per_stream
        self.stream, self.seq_len, self.batch_size = stream, seq_len, batch_size
        self.segments_per_epoch, self.num_epochs = segments, num_epochs
        self.epoch, self.position = 0, 0

    def get_state(self) -> dict[str, int]:
        """``{"epoch", "position"}``: the next batch is segment ``position`` of ``epoch``."""
        return {"epoch": self.epoch, "position": self.position}

    def set_state(self, state: dict[str, Any]) -> None:
        position = int(state["position"])
        if not 0 <= position <= self.segments_per_epoch:
            raise ValueError(f"StreamBatches: position {position} is outside an epoch of "
                             f"{self.segments_per_epoch} segments")
        self.epoch, self.position = int(state["epoch"]), position

    def segment(self, t: int) -> dict[str, np.ndarray]:
        """Segment ``t`` of every stream (no state change)."""
        if not 0 <= t < self.segments_per_epoch:
            raise IndexError(f"segment {t} out of range for {self.segments_per_epoch}")
        idx = self.starts[:, None] + t * self.seq_len + np.arange(self.seq_len + 1)[None]
        tokens = self.stream[idx].astype(np.int32) + 1
        return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:],
                "reset": np.full((self.batch_size,), t == 0)}

    def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        if self.position >= self.segments_per_epoch:
            self.epoch, self.position = self.epoch + 1, 0
        if self.num_epochs is not None and self.epoch >= self.num_epochs:
            raise StopIteration
        batch = self.segment(self.position)
        self.position += 1
        return batch
