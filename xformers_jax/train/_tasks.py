"""Tasks: one registry (:data:`TASKS`) of the data the trainer trains on.

Each :class:`TaskSpec` declares its data keys, how its splits are made, its type (how a batch
becomes a model's inputs and what its outputs are scored against: classification of one input
or of a pair, language modelling, over contiguous streams with a carried memory, or a model's
own self-supervised objective) and the model kind it trains by default. Which model trains is
the config's ``model.kind`` (``xformers_jax.models``); the task knows no model family.
Classification tasks (LRA ListOps, Text, Image, Pathfinder / Path-X) default to the encoder
classifier; Retrieval to the dual encoder; byte-level language modelling (``lm``) and the
synthetic recall and copying tasks (``mqar``, ``selective_copy``, ``induction``: scored at
their answer positions only, ``batch["scored"]``) to the causal LM, over streams
(``lm_stream``) to the memory LM; ``electra`` pre-trains ELECTRA. Token id 0
is padding for text-like inputs; pixel inputs (Image, Pathfinder) have no padding (0 is black).
A new task is one ``register_task`` call.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Mapping

import equinox as eqx
import jax

from .. import data as D
from .. import models, nn


@dataclasses.dataclass(frozen=True)
class Task:
    """The splits and the facts about inputs a model needs, made by a :class:`TaskSpec`.

    ``spec`` is the spec that made it; a ``Task`` built by hand (``spec=None``) is a
    classification of ``batch["inputs"]`` (id 0 is padding when ``padded``). ``packed``:
    the rows pack several documents (``data.PackedDocuments``; a batch holds their
    ``segment_ids``), which the model must keep apart. ``num_scored``: the positions scored
    in every example when the task scores a fixed number of chosen ones (``batch["scored"]``
    marks them; the synthetic recall and copying tasks), else 0: a model kind that takes
    ``logits_at`` (``models.ModelKind.logits_at``) then computes its output layer and loss
    at those positions only (``train._objective``).
    """

    train: object
    validation: object
    test: object
    vocab_size: int
    num_classes: int
    seq_len: int
    padded: bool
    spec: "TaskSpec | None" = None
    packed: bool = False
    num_scored: int = 0


@dataclasses.dataclass(frozen=True)
class TaskSpec:
    """What the trainer knows about one task: its data keys, how to make its splits, its type
    and the model kind it trains by default.

    Attributes:
      name: the ``data.task`` a config names.
      data: the task's data keys and their defaults (``base_config`` copies them into
        ``config.data``; an unknown or missing key is an error).
      make: ``make(data_config, seed) -> Task`` (the splits; ``spec`` is filled in).
      type: one of ``models.TASK_TYPES``: ``classification`` (``inputs`` -> ``[B, classes]``
        logits against ``targets``), ``pair_classification`` (``inputs1``, ``inputs2``),
        ``language_model`` (``inputs`` -> ``[B, L, vocab]`` logits against ``targets``),
        ``stream_language_model`` (the same over contiguous streams, the model's memory
        carried from batch to batch) or ``self_supervised`` (``inputs`` only: the loss is the
        model's own terms, e.g. ELECTRA's).
      model: the model kind (``models.registered_models()``) ``base_config`` puts in
        ``config.model``.
      batches: ``batches(split, batch_size, *, process_index, process_count)`` -> the
        training iterator (``get_state``/``set_state``) when the task is not the shuffled
        ``DataIterator``'s (contiguous streams: ``data.StreamBatches``).
      carry: ``carry(model, batch_size, inference) -> pytree | None``: the state the model
        carries from one batch to the next (memories; None when the model has none). The
        batch then holds it as ``"carry"`` and the model returns ``(logits, new_carry)``.
      evaluate: ``evaluate(eval_step, model, split, batch_size) -> {"loss", "accuracy"}``
        when a split is not evaluated batch by batch independently (streams with memory).
    """

    name: str
    data: Mapping
    make: Callable
    type: str = "classification"
    model: str = "classifier"
    batches: Callable | None = None
    carry: Callable | None = None
    evaluate: Callable | None = None

    def __post_init__(self):
        if self.type not in models.TASK_TYPES:
            raise ValueError(f"task {self.name!r}: type must be one of {models.TASK_TYPES}, "
                             f"got {self.type!r}")

    @property
    def classification(self) -> bool:
        """One label per example (the trainer reports the majority-class baseline)."""
        return self.type in ("classification", "pair_classification")


TASKS: dict[str, TaskSpec] = {}


def register_task(spec: TaskSpec, *, replace: bool = False) -> TaskSpec:
    """Adds a task to the registry (``replace=True`` to replace one of the same name)."""
    if spec.name in TASKS and not replace:
        raise ValueError(f"task {spec.name!r} is already registered; pass replace=True")
    TASKS[spec.name] = spec
    return spec


def get_task(name: str) -> TaskSpec:
    if name not in TASKS:
        raise ValueError(f"task must be one of {sorted(TASKS)}, got {name!r}")
    return TASKS[name]


class _Spaced:
    """``num`` examples of ``source`` at evenly spaced indices (a bounded evaluation split)."""

    def __init__(self, source, num: int):
        self.source, self.num = source, min(num, len(source)) if num > 0 else len(source)

    def __len__(self) -> int:
        return self.num

    def __getitem__(self, index: int):
        if not 0 <= index < self.num:
            raise IndexError(f"index {index} out of range for {self.num} examples")
        return self.source[index * len(self.source) // self.num]


def make_task(data_config, seed: int) -> Task:
    """The task named by ``data_config.task`` (see ``TASKS``); splits use seeds derived from
    ``seed`` so that they never share an example index stream."""
    spec = get_task(data_config.task)
    task = spec.make(data_config, seed)
    # Token ids and labels out of range would be clamped or wrapped silently inside the
    # model (data._checks): refuse them here, naming the split, the row and the value.
    for name in ("train", "validation", "test"):
        arrays = getattr(getattr(task, name), "arrays", None)
        if arrays is not None:
            D.check_arrays(arrays, vocab_size=task.vocab_size, num_classes=task.num_classes,
                           where=f"task {data_config.task!r} {name} split")
    return dataclasses.replace(task, spec=spec)


def build_model(model_config, task: Task, key: jax.Array, *,
                sequence_shards: int = 1) -> eqx.Module:
    """The model ``model_config`` (a config's ``model`` section) names, for ``task``.

    The kind must serve the task's type; with packed rows (``data.pack=True``) it must take
    segment ids (``ModelKind.packs``) and every kind in its slots honour them
    (``nn.check_segments``), checked here, before the first step. With ``sequence_shards > 1`` (the ``sequence``
    strategy) every attention layer must be able to run with its sequence split over devices;
    a kind that cannot raises here, at build time, naming the kind
    (``nn.check_sequence_parallel``).
    """
    kind = models.get_model(model_config.kind)
    kind_type = spec_of(task).type
    if kind_type not in kind.serves:
        raise ValueError(f"model.kind={kind.name!r} trains {list(kind.serves)} tasks, not "
                         f"{kind_type!r} ones (task {spec_of(task).name!r})")
    if task.packed and not kind.packs:
        raise ValueError(f"data.pack=True: model.kind={kind.name!r} does not take packed rows "
                         "(segment ids); kinds that do: "
                         f"{[n for n in models.registered_models() if models.get_model(n).packs]}")
    model = kind.build(model_config, task, key)
    if task.packed:
        nn.check_segments(model)
    if sequence_shards > 1:
        nn.check_sequence_parallel(model, sequence_shards)
    return model


# -- the tasks ----------------------------------------------------------------------------------

def _three(split, c, seed):
    return (split(c.num_train, 3 * seed), split(c.num_eval, 3 * seed + 1),
            split(c.num_test, 3 * seed + 2))


def _make_listops(c, seed):
    split = lambda n, s: D.materialize(D.ListOps(  # noqa: E731
        n, seed=s, min_length=c.min_length, max_length=c.max_length,
        max_depth=c.max_depth, max_args=c.max_args))
    return Task(*_three(split, c, seed), vocab_size=D.LISTOPS_VOCAB_SIZE, num_classes=10,
                seq_len=c.max_length, padded=True)


def _make_pathfinder(c, seed):
    split = lambda n, s: D.materialize(  # noqa: E731
        D.Pathfinder(n, seed=s, size=c.size, difficulty=c.difficulty))
    return Task(*_three(split, c, seed), vocab_size=256, num_classes=2,
                seq_len=c.size * c.size, padded=False)


def _make_text(c, seed):
    if c.source == "imdb":
        train = D.load_imdb(c.data_dir, "train", seq_len=c.seq_len)
        test = D.load_imdb(c.data_dir, "test", seq_len=c.seq_len)
        validation = test  # LRA's Text task has no separate validation split
    elif c.source == "stdlib":
        split = lambda s, n, k: D.StdlibBytesClassification(  # noqa: E731
            s, seq_len=c.seq_len, num_examples=n, seed=3 * seed + k)
        train, validation, test = (split("train", c.num_train, 0),
                                   split("validation", c.num_eval, 1),
                                   split("test", c.num_test, 2))
    else:
        raise ValueError(f"data.source must be 'stdlib' or 'imdb', got {c.source!r}")
    return Task(train, validation, test, vocab_size=D.BYTE_VOCAB_SIZE, num_classes=2,
                seq_len=c.seq_len, padded=True)


def _make_retrieval(c, seed):
    splits = [D.load_aan(c.data_dir, s, seq_len=c.seq_len)
              for s in ("train", "validation", "test")]
    return Task(*splits, vocab_size=D.BYTE_VOCAB_SIZE, num_classes=2, seq_len=c.seq_len,
                padded=True)


def _make_image(c, seed):
    splits = [D.load_cifar10(c.data_dir, s) for s in ("train", "validation", "test")]
    return Task(*splits, vocab_size=256, num_classes=10, seq_len=1024, padded=False)


def _make_lm(c, seed):
    if c.get("pack", False):
        return _make_packed_lm(c, seed)
    if c.source == "stdlib":
        train, validation, test = (D.stdlib_bytes_lm(s, seq_len=c.seq_len)
                                   for s in ("train", "validation", "test"))
    elif c.source == "enwik8":
        train, validation, test = (D.load_enwik8(c.data_dir, s, seq_len=c.seq_len)
                                   for s in ("train", "validation", "test"))
    else:
        raise ValueError(f"data.source must be 'stdlib' or 'enwik8', got {c.source!r}")
    return Task(train, _Spaced(validation, c.num_eval), _Spaced(test, c.num_test),
                vocab_size=D.BYTE_VOCAB_SIZE, num_classes=D.BYTE_VOCAB_SIZE,
                seq_len=c.seq_len, padded=False)


def _make_packed_lm(c, seed):
    # Each stdlib file is a document, packed into rows (data.PackedDocuments); the training
    # rows in a seeded order, the evaluation rows in path order.
    if c.source != "stdlib":
        raise ValueError(f"data.pack=True packs documents, and data.source={c.source!r} is one "
                         "stream without document boundaries; use data.source='stdlib' (each "
                         "file a document) or data.pack=False")
    train, validation, test = (
        D.PackedDocuments(D.stdlib_documents(s), seq_len=c.seq_len, seed=seed,
                          shuffle=s == "train")
        for s in ("train", "validation", "test"))
    return Task(train, _Spaced(validation, c.num_eval), _Spaced(test, c.num_test),
                vocab_size=D.BYTE_VOCAB_SIZE, num_classes=D.BYTE_VOCAB_SIZE,
                seq_len=c.seq_len, padded=False, packed=True)


# -- byte-level LM over contiguous streams, with memory (segment-level recurrence) ---------------

def _stream_carry(model, batch_size, inference):
    if not models.has_memory(model):
        return None
    return model.init_memory(batch_size, inference=inference)


class _Stream:
    """One split of a streamed corpus: its bytes, the segment length, a bound on the
    segments an evaluation reads per stream (0: all) and the further evaluation memory
    lengths to report."""

    def __init__(self, data, seq_len: int, max_segments: int = 0, eval_mem_lens=()):
        self.data, self.seq_len, self.max_segments = data, seq_len, max_segments
        self.eval_mem_lens = tuple(int(n) for n in eval_mem_lens)

    def __len__(self) -> int:
        return (self.data.size - 1) // self.seq_len


def _stream_batches(split, batch_size, *, process_index=0, process_count=1, num_epochs=None):
    return D.StreamBatches(split.data, batch_size=batch_size, seq_len=split.seq_len,
                           process_index=process_index, process_count=process_count,
                           num_epochs=num_epochs, max_segments=split.max_segments)


def _stream_evaluate(eval_step, model, split, batch_size):
    """Reads every stream once, segment after segment, carrying the memory (evaluation
    lengths, ``eval_mem_len``) from an empty one: ``loss``, ``accuracy`` and
    ``bits_per_byte``; and the same as ``loss_mem{N}``, ... with the evaluation memory
    length ``N`` for each of the split's ``eval_mem_lens`` (block memories only)."""
    out = _stream_read(eval_step, model, split, batch_size)
    if not split.eval_mem_lens or isinstance(model, models.MemoryModel) or not models.has_memory(model):
        return out
    for n in split.eval_mem_lens:
        more = _stream_read(eval_step, nn.with_eval_memory(model, n), split, batch_size)
        out |= {f"{k}_mem{n}": v for k, v in more.items()}
    return out


def _stream_read(eval_step, model, split, batch_size):
    batch_size = min(batch_size, len(split))
    carry = _stream_carry(model, batch_size, True)
    totals = {}
    for batch in _stream_batches(split, batch_size, num_epochs=1):
        if carry is not None:
            batch = dict(batch, carry=carry)
        out = dict(eval_step(model, batch))
        carry = out.pop("carry", None)
        for k, v in out.items():
            totals[k] = totals.get(k, 0.0) + float(v)
    loss = totals["loss_sum"] / totals["count"]
    return {"loss": loss, "accuracy": totals["correct"] / totals["count"],
            "bits_per_byte": loss / math.log(2)}


def _make_lm_stream(c, seed):
    if c.source == "stdlib":
        train, validation, test = (D.stdlib_bytes_lm(s, seq_len=c.seq_len).stream
                                   for s in ("train", "validation", "test"))
    elif c.source == "enwik8":
        train, validation, test = (D.load_enwik8(c.data_dir, s, seq_len=c.seq_len).stream
                                   for s in ("train", "validation", "test"))
    else:
        raise ValueError(f"data.source must be 'stdlib' or 'enwik8', got {c.source!r}")
    lens = tuple(c.eval_mem_lens)
    return Task(_Stream(train, c.seq_len), _Stream(validation, c.seq_len, c.num_eval, lens),
                _Stream(test, c.seq_len, c.num_test, lens), vocab_size=D.BYTE_VOCAB_SIZE,
                num_classes=D.BYTE_VOCAB_SIZE, seq_len=c.seq_len, padded=False)


# -- synthetic recall and copying (Zoology, Mamba): scored at chosen positions only --------------

def _make_mqar(c, seed):
    split = lambda n, s: D.MultiQueryAR(  # noqa: E731
        n, seed=s, seq_len=c.seq_len, num_kv_pairs=c.num_kv_pairs, vocab_size=c.vocab_size,
        power_a=c.power_a, random_non_queries=c.random_non_queries)
    return Task(*_three(split, c, seed), vocab_size=c.vocab_size, num_classes=c.vocab_size,
                seq_len=c.seq_len, padded=False, num_scored=c.num_kv_pairs)


def _make_selective_copy(c, seed):
    split = lambda n, s: D.SelectiveCopying(  # noqa: E731
        n, seed=s, seq_len=c.seq_len, num_tokens=c.num_tokens, vocab=c.vocab)
    train, validation, test = _three(split, c, seed)
    return Task(train, validation, test, vocab_size=train.vocab_size,
                num_classes=train.vocab_size, seq_len=c.seq_len, padded=False,
                num_scored=c.num_tokens)


def _make_induction(c, seed):
    # The test split may be longer than training (extrapolation): the model is built for the
    # longer of the two.
    test_len = c.test_seq_len or c.seq_len
    train = D.InductionHeads(c.num_train, seed=3 * seed, seq_len=c.seq_len, vocab=c.vocab)
    validation = D.InductionHeads(c.num_eval, seed=3 * seed + 1, seq_len=c.seq_len,
                                  vocab=c.vocab)
    test = D.InductionHeads(c.num_test, seed=3 * seed + 2, seq_len=test_len, vocab=c.vocab)
    return Task(train, validation, test, vocab_size=train.vocab_size,
                num_classes=train.vocab_size, seq_len=max(c.seq_len, test_len), padded=False,
                num_scored=1)


def _make_electra(c, seed):
    # Text windows whose id 0 is padding: ELECTRA masks and scores the real bytes only.
    return dataclasses.replace(_make_lm(c, seed), padded=True)


_CLASSIFIER = TaskSpec("classifier", {}, None)
for _task in (
    TaskSpec("listops", dict(num_train=96_000, num_eval=2_000, num_test=2_000, min_length=500,
                             max_length=2000, max_depth=10, max_args=10), _make_listops),
    TaskSpec("pathfinder", dict(num_train=160_000, num_eval=20_000, num_test=20_000, size=32,
                                difficulty="hard"), _make_pathfinder),
    TaskSpec("text", dict(source="stdlib", data_dir="", seq_len=4000, num_train=25_000,
                          num_eval=2_500, num_test=2_500), _make_text),
    TaskSpec("retrieval", dict(data_dir="", seq_len=4000), _make_retrieval,
             type="pair_classification", model="dual_encoder"),
    TaskSpec("image", dict(data_dir=""), _make_image),
    # num_eval / num_test bound the evaluation windows (0: the whole split). pack: each
    # stdlib file a document, packed into rows with segment ids (data.PackedDocuments), the
    # loss the mean over real tokens (train._objective); False: windows of the concatenation.
    TaskSpec("lm", dict(source="stdlib", data_dir="", seq_len=512, num_eval=256, num_test=512,
                        pack=False),
             _make_lm, type="language_model", model="causal_lm"),
    # Contiguous streams (segment-level recurrence, model.memory): seq_len is the segment;
    # num_eval / num_test bound the segments read per evaluation stream (0: all);
    # eval_mem_lens: further evaluation memory lengths, each reported (loss_mem{N}, ...).
    TaskSpec("lm_stream", dict(source="stdlib", data_dir="", seq_len=256, num_eval=64,
                               num_test=128, eval_mem_lens=()),
             _make_lm_stream, type="stream_language_model", model="memory_lm",
             batches=_stream_batches, carry=_stream_carry, evaluate=_stream_evaluate),
    # Synthetic recall and copying (data._synthetic), scored at their answer positions only.
    # MQAR's defaults are Zoology's smallest setting (L=64, 4 pairs; 100k / 3k examples) and
    # its generator's default filler (random tokens between the queries; Zoology's Figure 2
    # runs set random_non_queries=False: zeros).
    TaskSpec("mqar", dict(seq_len=64, num_kv_pairs=4, vocab_size=8192, power_a=0.01,
                          random_non_queries=True, num_train=100_000, num_eval=3_000,
                          num_test=3_000),
             _make_mqar, type="language_model", model="causal_lm"),
    TaskSpec("selective_copy", dict(seq_len=256, num_tokens=16, vocab=16, num_train=100_000,
                                    num_eval=3_000, num_test=3_000),
             _make_selective_copy, type="language_model", model="causal_lm"),
    # test_seq_len: the test split's length (0: seq_len), for length extrapolation.
    TaskSpec("induction", dict(seq_len=256, test_seq_len=0, vocab=16, num_train=100_000,
                               num_eval=3_000, num_test=3_000),
             _make_induction, type="language_model", model="causal_lm"),
    # ELECTRA's replaced-token detection on byte-level text windows.
    TaskSpec("electra", dict(source="stdlib", data_dir="", seq_len=128, num_eval=256,
                             num_test=512), _make_electra, type="self_supervised",
             model="electra"),
):
    register_task(_task)


def spec_of(task: Task) -> TaskSpec:
    """The task's spec: the one that made it, or the classifier spec for a hand-built task."""
    return task.spec or _CLASSIFIER


def model_inputs(task: Task, batch) -> tuple[tuple, dict]:
    """``(args, kwargs)`` a model of ``task``'s type is called with on ``batch`` (besides
    ``key`` and ``return_aux``): the inputs and their padding masks (id 0, when the task is
    padded), the packed rows' ``segment_ids`` (language modelling on packed documents), or
    the next segment of each stream and its carried memory (rows whose ``reset`` is True
    start from an empty one)."""
    kind = spec_of(task).type
    if kind == "pair_classification":
        a, b = batch["inputs1"], batch["inputs2"]
        return (a, b), dict(mask_a=a != 0, mask_b=b != 0)
    x = batch["inputs"]
    if kind in ("language_model", "stream_language_model"):
        if "carry" in batch:
            return (x,), dict(memory=nn.reset_memory(batch["carry"], batch["reset"]))
        if "segment_ids" in batch:
            return (x,), {"segment_ids": batch["segment_ids"]}
        return (x,), {}
    return (x,), dict(mask=(x != 0) if task.padded else None)
