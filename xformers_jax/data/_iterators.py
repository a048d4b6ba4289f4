"""Deterministic, process-sharded, checkpointable batches: a Grain pipeline over a source.

A source is a Grain random-access data source: ``len(source)`` and ``source[i] ->
dict[str, np.ndarray]`` whose example ``i`` is a pure function of ``i`` (the generators here
derive each example's rng from ``(seed, i)``; the loaders hold arrays). :func:`batches` builds
the pipeline as Grain transformations (``grain.MapDataset``): a global shuffle per epoch,
cut into global batches, of which this process reads its contiguous block of rows
(``grain.sharding.ShardOptions`` index and count), repeated epochs. The global batches are
the same for any process count, so :class:`DataIterator`'s state (Grain's iterator state, a
small dict: the index of the next global batch) is the same on every process and for every
process count: the trainer stores it in the run's orbax checkpoint, and a run restarted on
another number of processes reads exactly the global batches it would have read. Worker processes
(``worker_count``, Grain's ``mp_prefetch``) are optional; the default reads in one
background thread.
"""

from __future__ import annotations

from typing import Any, Iterator

import grain
import numpy as np
from absl import flags


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


def _shuffle_seed(seed: int) -> int:
    # Grain reshuffles epoch e with seed + e, so nearby user seeds would replay each other's
    # orders one epoch apart; a hashed 32-bit seed keeps seeds s and s + 1 unrelated.
    return int(np.random.SeedSequence(seed).generate_state(1)[0])


def batches(source, *, batch_size: int, seed: int = 0, shuffle: bool = True,
            shard_options: grain.sharding.ShardOptions | None = None,
            num_epochs: int | None = None, drop_remainder: bool = True) -> grain.MapDataset:
    """The batches of ``source`` as a Grain ``MapDataset``: ``{name: array[batch_size, ...]}``.

    Per epoch: a global permutation of all examples (seeded, different each epoch) cut into
    global batches of ``batch_size * shard_count`` examples; this process's batch is rows
    ``shard_index * batch_size`` to ``(shard_index + 1) * batch_size`` of each (the rows its
    devices hold when the batch axis is split over processes in order, as
    ``jax.make_array_from_process_local_data`` assembles them). The processes' shares are
    disjoint and, with ``shard_options.drop_remainder`` (as the trainer sets it), equally
    many, so all hosts run the same number of steps; the global batches, and so the run, do
    not depend on the process count. Batches do not cross epochs (``drop_remainder`` drops
    each epoch's last partial batch). ``num_epochs=None`` repeats forever.
    """
    shard = shard_options or grain.sharding.NoSharding()
    n, count = len(source), shard.shard_count
    if batch_size < 1 or (drop_remainder and n < batch_size * count):
        raise ValueError(f"batch_size={batch_size} per process does not fit {n} examples "
                         f"over {count} processes (a global batch of {batch_size * count})")
    ds = grain.MapDataset.source(source)
    if shuffle:
        ds = ds.shuffle(seed=_shuffle_seed(seed))
    # Process-sized batch k is block k % count of global batch k // count.
    ds = ds.batch(batch_size, drop_remainder=drop_remainder)
    usable = len(ds) // count * count if shard.drop_remainder else len(ds)
    return ds[shard.shard_index:usable:count].repeat(num_epochs)


class DataIterator:
    """Batches ``{name: array[batch_size, ...]}`` from ``source``, forever or ``num_epochs``.

    Args:
      source: ``len`` and ``__getitem__`` returning a dict of numpy arrays.
      batch_size: examples per batch on THIS process (the per-host batch).
      seed: shuffling seed; ``shuffle=False`` keeps index order (evaluation).
      process_index, process_count: this process's share (Grain ``ShardOptions`` with
        ``drop_remainder=True``): rows ``process_index * batch_size ...`` of each global batch
        of ``batch_size * process_count`` examples (:func:`batches`); every process reads
        the same number of batches, and the state is the same on every process.
      num_epochs: None repeats forever; otherwise StopIteration after that many epochs.
      drop_remainder: drop the last partial batch of each epoch (True for training).
      worker_count: Grain worker processes producing batches (0: none, the batches are
        read by one background thread of this process). The iterator state records the
        workers, so a run resumes with the same ``worker_count``.
      prefetch: batches read ahead of the consumer.
    """

    def __init__(self, source, *, batch_size: int, seed: int = 0, shuffle: bool = True,
                 process_index: int = 0, process_count: int = 1,
                 num_epochs: int | None = None, drop_remainder: bool = True,
                 worker_count: int = 0, prefetch: int = 2):
        if not 0 <= process_index < process_count:
            raise ValueError(f"need 0 <= process_index < process_count, got "
                             f"{process_index}, {process_count}")
        self.shard_options = grain.sharding.ShardOptions(process_index, process_count,
                                                         drop_remainder=True)
        self.dataset = batches(source, batch_size=batch_size, seed=seed, shuffle=shuffle,
                               shard_options=self.shard_options, num_epochs=num_epochs,
                               drop_remainder=drop_remainder)
        read = grain.ReadOptions(num_threads=1 if prefetch else 0,
                                 prefetch_buffer_size=prefetch)
        pipeline = self.dataset.to_iter_dataset(read)
        if worker_count:
            # Grain's workers read absl flags; outside an absl app they are not parsed yet.
            if not flags.FLAGS.is_parsed():
                flags.FLAGS.mark_as_parsed()
            pipeline = pipeline.mp_prefetch(
                grain.MultiprocessingOptions(num_workers=worker_count))
        self.iterator = iter(pipeline)

    def get_state(self) -> dict[str, Any]:
        """Grain's iterator state (a JSON-serialisable dict)."""
        return self.iterator.get_state()

    def set_state(self, state: dict[str, Any]) -> None:
        """Restores a position from ``get_state``; the next batch is the one that followed."""
        if set(state) == {"epoch", "position", "seed"}:
            raise ValueError(f"{state} is the position of the iterator before the Grain "
                             f"pipeline, whose batches differ: it cannot resume them")
        self.iterator.set_state(state)

    def close(self) -> None:
        """Stops the read-ahead thread and the worker processes (idempotent)."""
        self.iterator.close()

    def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        return next(self.iterator)
