"""Deterministic, sharded, checkpointable batch iterators over indexable sources.

A source is anything with ``len(source)`` and ``source[i] -> dict[str, np.ndarray]`` whose
example ``i`` is a pure function of ``i`` (the generators here derive each example's rng from
``(seed, i)``). The iterator shuffles indices per epoch with a seeded permutation, gives each
process a disjoint, equally long slice of it (multi-host: ``jax.process_index()`` and
``jax.process_count()``), and stacks examples into batches. Its whole position is
``{"epoch", "position", "seed"}``, a small dict that orbax saves next to the train state, so a
restarted run reads exactly the batches it would have read.
"""

from __future__ import annotations

from typing import Any, Iterator

import numpy as np


class ArraySource:
    """A source over in-memory arrays sharing their leading (example) axis."""

    def __init__(self, arrays: dict[str, np.ndarray]):
        sizes = {k: len(v) for k, v in arrays.items()}
        if not arrays or len(set(sizes.values())) != 1:
            raise ValueError(f"arrays need one common, non-empty leading axis, got {sizes}")
        self.arrays = arrays

    def __len__(self) -> int:
        return len(next(iter(self.arrays.values())))

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        return {k: v[index] for k, v in self.arrays.items()}


def materialize(source) -> ArraySource:
    """Reads every example of ``source`` once (e.g. a generated split) into arrays."""
    examples = [source[i] for i in range(len(source))]
    return ArraySource({k: np.stack([e[k] for e in examples]) for k in examples[0]})


class DataIterator:
    """Batches ``{name: array[batch_size, ...]}`` from ``source``, forever or ``num_epochs``.

    Args:
      source: ``len`` and ``__getitem__`` returning a dict of numpy arrays.
      batch_size: examples per batch on THIS process (the per-host batch).
      seed: shuffling seed; ``shuffle=False`` keeps index order (evaluation).
      process_index, process_count: this process's slice; every process gets
        ``len(source) // process_count`` examples per epoch, the remainder is dropped so all
        hosts run the same number of steps.
      num_epochs: None repeats forever; otherwise StopIteration after that many epochs.
      drop_remainder: drop the last partial batch of each epoch (True for training).
    """

    def __init__(self, source, *, batch_size: int, seed: int = 0, shuffle: bool = True,
                 process_index: int = 0, process_count: int = 1,
                 num_epochs: int | None = None, drop_remainder: bool = True):
        if not 0 <= process_index < process_count:
            raise ValueError(f"need 0 <= process_index < process_count, got "
                             f"{process_index}, {process_count}")
        self.per_process = len(source) // process_count
        if batch_size < 1 or (drop_remainder and self.per_process < batch_size):
            raise ValueError(f"batch_size={batch_size} does not fit {self.per_process} examples "
                             f"per process ({len(source)} over {process_count} processes)")
        self.source, self.batch_size = source, batch_size
        self.shuffle, self.num_epochs, self.drop_remainder = shuffle, num_epochs, drop_remainder
        self.process_index, self.process_count = process_index, process_count
        self.epoch, self.position, self.seed = 0, 0, seed
        self._order_epoch, self._order = None, None

    def indices_of_epoch(self, epoch: int) -> np.ndarray:
        """This process's example indices for ``epoch``, in reading order."""
        n = len(self.source)
        order = (np.random.default_rng([self.seed, epoch]).permutation(n) if self.shuffle
                 else np.arange(n))
        usable = self.per_process * self.process_count
        return order[:usable][self.process_index :: self.process_count]

    def get_state(self) -> dict[str, int]:
        """The position: ``{"epoch", "position" (examples read this epoch), "seed"}``."""
        return {"epoch": int(self.epoch), "position": int(self.position),
                "seed": int(self.seed)}

    def set_state(self, state: dict[str, Any]) -> None:
        """Restores a position from ``get_state``; the next batch is the one that followed."""
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self.seed = int(state["seed"])

    def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        while True:
            if self.num_epochs is not None and self.epoch >= self.num_epochs:
                raise StopIteration
            if self._order_epoch != self.epoch:
                self._order, self._order_epoch = self.indices_of_epoch(self.epoch), self.epoch
            remaining = self.per_process - self.position
            if remaining >= self.batch_size or (remaining > 0 and not self.drop_remainder):
                break
            self.epoch, self.position = self.epoch + 1, 0
        take = self._order[self.position : self.position + self.batch_size]
        self.position += len(take)
        examples = [self.source[int(i)] for i in take]
        return {k: np.stack([e[k] for e in examples]) for k in examples[0]}
