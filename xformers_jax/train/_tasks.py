"""Tasks: one registry (:data:`TASKS`) of what the trainer needs per task.

Each :class:`TaskSpec` declares its data keys, how its splits are made, its model and how the
model's logits are computed; the config schema (``_config.base_config``), the trainer and the
loss read only the registry. Classification tasks (LRA ListOps, Text, Image, Pathfinder /
Path-X) train ``nn.EncoderClassifier``; Retrieval trains ``nn.DualEncoder`` on document pairs;
byte-level language modelling (``lm``) trains ``nn.CausalLM`` on next-byte prediction. Token id
0 is padding for text-like inputs; pixel inputs (Image, Pathfinder) have no padding (0 is
black). A new task is one ``register_task`` call.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable, Mapping, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import optax

from .. import data as D
from .. import nn
from . import _arch_models


@dataclasses.dataclass(frozen=True)
class Task:
    """The splits and the facts about inputs a model needs, made by a :class:`TaskSpec`.

    ``spec`` is the spec that made it; a ``Task`` built by hand (``spec=None``) trains an
    encoder classifier on ``batch["inputs"]`` (id 0 is padding when ``padded``).
    """

    train: object
    validation: object
    test: object
    vocab_size: int
    num_classes: int
    seq_len: int
    padded: bool
    spec: "TaskSpec | None" = None


@dataclasses.dataclass(frozen=True)
class TaskSpec:
    """What the trainer knows about one task: its data keys, how to make its splits, which
    model it trains and how that model's logits are computed.

    Attributes:
      name: the ``data.task`` a config names.
      data: the task's data keys and their defaults (``base_config`` copies them into
        ``config.data``; an unknown or missing key is an error).
      make: ``make(data_config, seed) -> Task`` (the splits; ``spec`` is filled in).
      model: ``model(model_config, task, key) -> eqx.Module``.
      logits: ``logits(model, batch, task, key) -> [..., num_classes]`` float logits whose
        leading axes match ``batch["targets"]``; the loss is the mean softmax cross-entropy
        over them (examples, or tokens for language modelling).
      classification: one label per example (the trainer reports the majority-class
        baseline beside the test accuracy).
      loss: ``loss(model, batch, task, key) -> (scalar, {"accuracy", ...})`` for a task
        with its own objective (ELECTRA); ``key`` is None in evaluation.
      batches: ``batches(split, batch_size, *, process_index, process_count)`` -> the
        training iterator (``get_state``/``set_state``) when the task is not the shuffled
        ``DataIterator``'s (contiguous streams: ``data.StreamBatches``).
      carry: ``carry(model, batch_size, inference) -> pytree | None``: the state the model
        carries from one batch to the next (memories; None when the model has none). The
        batch then holds it as ``"carry"`` and ``logits`` returns ``(logits, new_carry)``.
      evaluate: ``evaluate(eval_step, model, split, batch_size) -> {"loss", "accuracy"}``
        when a split is not evaluated batch by batch independently (streams with memory).
    """

    name: str
    data: Mapping
    make: Callable
    model: Callable
    logits: Callable
    classification: bool = True
    loss: Callable | None = None
    batches: Callable | None = None
    carry: Callable | None = None
    evaluate: Callable | None = None


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
    return dataclasses.replace(spec.make(data_config, seed), spec=spec)


def build_model(model_config, task: Task, key: jax.Array, *,
                sequence_shards: int = 1) -> eqx.Module:
    """The task's model with the configured attention from the ``nn`` registry.

    With ``sequence_shards > 1`` (the ``sequence`` strategy) every attention layer must be able
    to run with its sequence split over devices; a kind that cannot raises here, at build time,
    naming the kind (``nn.check_sequence_parallel``).
    """
    model = spec_of(task).model(model_config, task, key)
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


def _spec(m):
    return nn.AttentionSpec.from_config(m.attention.to_dict())


def _with_mixer(m, block):
    """``block`` plus the token mixer of ``model.mixer`` (none for kind "none")."""
    mixer = m.mixer.to_dict() if "mixer" in m else {"kind": "none"}
    if mixer["kind"] != "none":
        block["mixer"] = nn.MixerSpec.from_config(mixer)
    return block


def _block(m):
    """The block's attention and FFN (``model.ffn``; dense when the config has none)."""
    ffn = m.ffn.to_dict() if "ffn" in m else {"kind": "dense"}
    return _with_mixer(m, dict(spec=_spec(m), ffn=nn.FFNSpec.from_config(ffn)))


class LogitsAux(NamedTuple):
    """What a task's ``logits`` returns when its model reports auxiliary outputs (``nn``'s
    FFN aux: router losses and statistics per layer)."""

    logits: object
    aux: dict


# -- byte-level LM over contiguous streams, with memory (segment-level recurrence) ---------------

MEMORY_KINDS = ("none", "xl", "ernie", "compressive", "feedback", "memformer")


def _memory_lengths(mem):
    get = lambda k, d=0: int(mem.get(k, d))  # noqa: E731
    m = get("mem_len")
    return m, get("eval_mem_len", m), get("cmem_len"), get("eval_cmem_len", get("cmem_len"))


def _make_memory(mem, dim):
    """The block's memory for ``model.memory`` (None for kind "none")."""
    kind = mem.get("kind", "none")
    if kind not in MEMORY_KINDS:
        raise ValueError(f"model.memory.kind must be one of {MEMORY_KINDS}, got {kind!r}")
    known = {"none": {"kind"}, "xl": {"kind", "mem_len", "eval_mem_len", "clamp_len"},
             "ernie": {"kind", "mem_len", "eval_mem_len", "clamp_len"},
             "compressive": {"kind", "mem_len", "eval_mem_len", "cmem_len", "eval_cmem_len",
                             "rate", "compression", "clamp_len"},
             "feedback": {"kind", "mem_len"}, "memformer": {"kind", "num_slots", "segments"},
             }[kind]
    if set(mem) - known:
        raise ValueError(f"model.memory: unknown keys {sorted(set(mem) - known)} for kind "
                         f"{kind!r} (known: {sorted(known)})")
    m, em, c, ec = _memory_lengths(mem)
    if kind in ("none", "feedback", "memformer"):  # no block memory (models of their own)
        return None
    if kind in ("xl", "ernie"):
        return nn.XLMemory(m, em, same_layer=kind == "ernie")
    return functools.partial(nn.CompressiveMemory, dim, m, c, int(mem.get("rate", 2)),
                             compression=mem.get("compression", "conv"), eval_mem_len=em,
                             eval_cmem_len=ec)


def _stream_lm(m, task, key):
    mem = m.memory.to_dict()
    _make_memory(mem, m.dim)  # checks the keys
    if mem["kind"] == "feedback":  # sinusoidal input positions counted along each stream
        return nn.FeedbackLM(task.vocab_size, m.dim, m.num_layers, m.num_heads, m.hidden,
                             mem_len=int(mem.get("mem_len", task.seq_len)), block=_block(m),
                             key=key)
    if mem["kind"] == "memformer":
        return nn.Memformer(task.vocab_size, m.dim, m.num_layers, m.num_heads, m.hidden,
                            num_slots=int(mem.get("num_slots", 8)),
                            segments=int(mem.get("segments", 1)), max_len=task.seq_len,
                            block=_block(m), key=key)
    # Relative positions (Transformer-XL's, with u and v) and no input positions: segments
    # carry no absolute position, memories sit at negative offsets.
    _, em, _, ec = _memory_lengths(mem)
    mm, _, cc, _ = _memory_lengths(mem)
    em = max([em, *getattr(task.validation, "eval_mem_lens", ())])
    longest = task.seq_len + max(em, mm) + max(ec, cc)
    head_dim = m.dim // m.num_heads
    # Distances past the longest one training sees read as it (Transformer-XL's clamp_len):
    # a no-op in training, and what lets a longer evaluation memory help (-1: no clamp).
    clamp = int(mem.get("clamp_len", task.seq_len + mm + cc - 1))
    if clamp < -1:
        raise ValueError(f"model.memory.clamp_len must be -1 (no clamp) or a distance >= 0, "
                         f"got {clamp}")
    position = nn.TransformerXLRelative(m.num_heads, head_dim, longest,
                                        clamp_len=None if clamp == -1 else clamp,
                                        key=jax.random.fold_in(key, 1))
    block = dict(spec=_spec(m), position=position)
    memory = _make_memory(mem, m.dim)
    if memory is not None:
        if m.attention.kind not in nn.MEMORY_ATTENTION_KINDS:
            raise ValueError(f"model.memory.kind={mem['kind']!r} needs an exact softmax "
                             f"attention, one of {nn.MEMORY_ATTENTION_KINDS}; got "
                             f"model.attention.kind={m.attention.kind!r}")
        block["memory"] = memory
    return nn.CausalLM(task.vocab_size, m.dim, m.num_layers, m.num_heads, m.hidden,
                       positions=nn.NoPositions(), max_len=longest, block=block, key=key)


def _stream_carry(model, batch_size, inference):
    return model.init_memory(batch_size, inference=inference) if nn.has_memory(model) else None


def _stream_logits(model, batch, task, key):
    if "carry" not in batch:
        return model(batch["inputs"], key=key)
    memory = nn.reset_memory(batch["carry"], batch["reset"])
    return model(batch["inputs"], key=key, memory=memory)


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
    if not split.eval_mem_lens or isinstance(model, nn.MemoryModel) or not nn.has_memory(model):
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


def _classifier(m, task, key, cls=None):
    # Exactly the attended length (CLS pooling prepends one token): Sinkhorn's sort net and
    # Linformer's projections are sized by it.
    max_len = task.seq_len + (m.pooling == "cls")
    if cls is None:  # model.arch / model.depth_mode (train/_arch_models.py)
        model = _arch_models.classifier(m, task, key, block=_block(m), max_len=max_len)
        if model is not None:
            return model
    return (cls or nn.EncoderClassifier)(
        task.num_classes, m.dim, m.num_layers, m.num_heads, m.hidden, pooling=m.pooling,
        vocab_size=task.vocab_size, max_len=max_len, block=_block(m), key=key)


def _dual_encoder(m, task, key):
    return _classifier(m, task, key, nn.DualEncoder)


def _causal_lm(m, task, key):
    return nn.CausalLM(task.vocab_size, m.dim, m.num_layers, m.num_heads, m.hidden,
                       max_len=task.seq_len, block=_block(m), key=key)


def _classify_logits(model, batch, task, key):
    x = batch["inputs"]
    if _arch_models.is_adaptive(model):
        return LogitsAux(*model(x, mask=(x != 0) if task.padded else None, key=key))
    if isinstance(model, nn.EncoderClassifier):
        return LogitsAux(*model(x, mask=(x != 0) if task.padded else None, key=key,
                                return_aux=True))
    return model(x, mask=(x != 0) if task.padded else None, key=key)


def _pair_logits(model, batch, task, key):
    a, b = batch["inputs1"], batch["inputs2"]
    return model(a, b, mask_a=a != 0, mask_b=b != 0, key=key)


def _lm_logits(model, batch, task, key):
    return LogitsAux(*model(batch["inputs"], key=key, return_aux=True))


_LRA = dict(model=_classifier, logits=_classify_logits)
_CLASSIFIER = TaskSpec("classifier", {}, None, **_LRA)
for _task in (
    TaskSpec("listops", dict(num_train=96_000, num_eval=2_000, num_test=2_000, min_length=500,
                             max_length=2000, max_depth=10, max_args=10), _make_listops, **_LRA),
    TaskSpec("pathfinder", dict(num_train=160_000, num_eval=20_000, num_test=20_000, size=32,
                                difficulty="hard"), _make_pathfinder, **_LRA),
    TaskSpec("text", dict(source="stdlib", data_dir="", seq_len=4000, num_train=25_000,
                          num_eval=2_500, num_test=2_500), _make_text, **_LRA),
    TaskSpec("retrieval", dict(data_dir="", seq_len=4000), _make_retrieval, _dual_encoder,
             _pair_logits),
    TaskSpec("image", dict(data_dir=""), _make_image, **_LRA),
    # num_eval / num_test bound the evaluation windows (0: the whole split).
    TaskSpec("lm", dict(source="stdlib", data_dir="", seq_len=512, num_eval=256, num_test=512),
             _make_lm, _causal_lm, _lm_logits, classification=False),
    # Contiguous streams (segment-level recurrence, model.memory): seq_len is the segment;
    # num_eval / num_test bound the segments read per evaluation stream (0: all);
    # eval_mem_lens: further evaluation memory lengths, each reported (loss_mem{N}, ...).
    TaskSpec("lm_stream", dict(source="stdlib", data_dir="", seq_len=256, num_eval=64,
                               num_test=128, eval_mem_lens=()),
             _make_lm_stream, _stream_lm, _stream_logits, classification=False,
             batches=_stream_batches, carry=_stream_carry, evaluate=_stream_evaluate),
):
    register_task(_task)


def spec_of(task: Task) -> TaskSpec:
    """The task's spec: the one that made it, or the classifier spec for a hand-built task."""
    return task.spec or _CLASSIFIER


def _policy_logits(model, batch, task: Task, key, policy):
    """``(out, aux)``: out the float32 logits, or ``(logits, new_carry)`` when the batch
    carries a state; aux the model's auxiliary outputs (``{}`` if it reports none)."""
    logits = lambda m: spec_of(task).logits(m, batch, task, key)  # noqa: E731
    out = logits(model) if policy is None else policy(logits, model)
    out, aux = out if isinstance(out, LogitsAux) else (out, {})
    if "carry" in batch:
        return (out[0].astype(jnp.float32), out[1]), aux
    return out.astype(jnp.float32), aux


def _with_carry(out, batch):
    return out if "carry" in batch else (out, None)


def make_loss_fn(task: Task, policy: nn.Policy | None = None, aux_coefficients=None):
    """``loss_fn(model, batch, key) -> (mean cross-entropy, {"accuracy"})``; the mean is over
    examples (classification) or tokens (language modelling). ``policy`` (``nn.Policy``) runs
    the model in its compute dtype; the loss is always float32. The model's auxiliary
    losses (``nn.aux_losses``, each summed over layers) are added with
    ``aux_coefficients`` (``config.loss``: ``load_balancing``, ``router_z``; default
    ``base_config``'s) and logged with the router statistics (``nn.aux_metrics``)."""
    coefs = {"load_balancing": 1e-2, "router_z": 1e-3, **dict(aux_coefficients or {})}

    def loss_fn(model, batch, key):
        if spec_of(task).loss is not None:
            return spec_of(task).loss(model, batch, task, key)
        out, aux = _policy_logits(model, batch, task, key, policy)
        logits, carry = _with_carry(out, batch)
        labels = batch["targets"]
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
        metrics = {"accuracy": (logits.argmax(-1) == labels).mean()}
        if aux:  # early exit's loss over every exit, ACT's ponder cost
            loss, aux, extra = _arch_models.adaptive_loss(loss, aux, labels, coefs)
            metrics.update(extra)
        if aux:
            losses = nn.aux_losses(aux)
            loss = loss + sum(coefs[k] * v for k, v in losses.items())
            metrics.update(nn.aux_metrics(aux))
        if carry is not None:
            # The compressive memory's reconstruction loss (0 for other memories) trains the
            # compression; the new memories go back to the train step.
            aux = nn.memory_aux_loss(carry)
            loss = loss + aux
            metrics.update(reconstruction_loss=aux, carry=carry)
        return loss, metrics
    return loss_fn


def make_metrics_fn(task: Task, policy: nn.Policy | None = None):
    """``metrics_fn(model, batch) -> {"loss_sum", "correct", "count"}`` (sums over examples,
    or over tokens for language modelling, for eval)."""
    def metrics_fn(model, batch):
        if spec_of(task).loss is not None:
            loss, metrics = spec_of(task).loss(model, batch, task, None)
            n = jnp.asarray(batch["inputs"].shape[0])
            return {"loss_sum": loss * n, "correct": metrics["accuracy"] * n,
                    "count": n}
        logits, carry = _with_carry(_policy_logits(model, batch, task, None, policy)[0],
                                    batch)
        labels = batch["targets"]
        out = {"loss_sum": optax.softmax_cross_entropy_with_integer_labels(logits,
                                                                           labels).sum(),
               "correct": (logits.argmax(-1) == labels).sum(),
               "count": jnp.asarray(labels.size)}
        return out if carry is None else dict(out, carry=carry)
    return metrics_fn
