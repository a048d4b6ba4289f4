"""Tasks: the data splits, the model and the loss / metrics the trainer uses for a config.

Classification tasks (LRA ListOps, Text, Image, Pathfinder / Path-X) train
``nn.EncoderClassifier``; Retrieval trains ``nn.DualEncoder`` on document pairs; byte-level
language modelling (``lm``) trains ``nn.CausalLM`` on next-byte prediction. Token id 0 is
padding for text-like inputs; pixel inputs (Image, Pathfinder) have no padding (0 is black).
"""

from __future__ import annotations

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import optax

from .. import data as D
from .. import nn


@dataclasses.dataclass(frozen=True)
class Task:
    """The splits and the facts about inputs a model needs."""

    train: object
    validation: object
    test: object
    vocab_size: int
    num_classes: int
    seq_len: int
    padded: bool
    pair: bool = False
    lm: bool = False


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
    """The task named by ``data_config.task`` (see ``DATA_SCHEMAS``); splits use seeds
    derived from ``seed`` so that they never share an example index stream."""
    c, name = data_config, data_config.task
    if name == "listops":
        split = lambda n, s: D.materialize(D.ListOps(  # noqa: E731
            n, seed=s, min_length=c.min_length, max_length=c.max_length,
            max_depth=c.max_depth, max_args=c.max_args))
        return Task(split(c.num_train, 3 * seed), split(c.num_eval, 3 * seed + 1),
                    split(c.num_test, 3 * seed + 2), vocab_size=D.LISTOPS_VOCAB_SIZE,
                    num_classes=10, seq_len=c.max_length, padded=True)
    if name == "pathfinder":
        split = lambda n, s: D.materialize(  # noqa: E731
            D.Pathfinder(n, seed=s, size=c.size, difficulty=c.difficulty))
        return Task(split(c.num_train, 3 * seed), split(c.num_eval, 3 * seed + 1),
                    split(c.num_test, 3 * seed + 2), vocab_size=256, num_classes=2,
                    seq_len=c.size * c.size, padded=False)
    if name == "text":
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
    if name == "retrieval":
        splits = [D.load_aan(c.data_dir, s, seq_len=c.seq_len)
                  for s in ("train", "validation", "test")]
        return Task(*splits, vocab_size=D.BYTE_VOCAB_SIZE, num_classes=2, seq_len=c.seq_len,
                    padded=True, pair=True)
    if name == "image":
        splits = [D.load_cifar10(c.data_dir, s) for s in ("train", "validation", "test")]
        return Task(*splits, vocab_size=256, num_classes=10, seq_len=1024, padded=False)
    if name == "lm":
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
                    seq_len=c.seq_len, padded=False, lm=True)
    raise ValueError(f"unknown task {name!r}")


def build_model(model_config, task: Task, key: jax.Array) -> eqx.Module:
    """``nn.EncoderClassifier`` (or ``nn.DualEncoder`` for pairs) with the configured attention
    from the ``nn`` registry."""
    m = model_config
    spec = nn.AttentionSpec.from_config(m.attention.to_dict())
    if task.lm:
        return nn.CausalLM(task.vocab_size, m.dim, m.num_layers, m.num_heads, m.hidden,
                           max_len=task.seq_len, block=dict(spec=spec), key=key)
    cls = nn.DualEncoder if task.pair else nn.EncoderClassifier
    # Exactly the attended length (CLS pooling prepends one token): Sinkhorn's sort net and
    # Linformer's projections are sized by it.
    max_len = task.seq_len + (m.pooling == "cls")
    return cls(task.num_classes, m.dim, m.num_layers, m.num_heads, m.hidden, pooling=m.pooling,
               vocab_size=task.vocab_size, max_len=max_len, block=dict(spec=spec), key=key)


def _logits(model, batch, task: Task, key):
    if task.lm:
        return model(batch["inputs"], key=key)
    if task.pair:
        a, b = batch["inputs1"], batch["inputs2"]
        return model(a, b, mask_a=a != 0, mask_b=b != 0, key=key)
    x = batch["inputs"]
    return model(x, mask=(x != 0) if task.padded else None, key=key)


def _policy_logits(model, batch, task: Task, key, policy):
    if policy is None:
        return _logits(model, batch, task, key).astype(jnp.float32)
    return policy(lambda m: _logits(m, batch, task, key), model).astype(jnp.float32)


def make_loss_fn(task: Task, policy: nn.Policy | None = None):
    """``loss_fn(model, batch, key) -> (mean cross-entropy, {"accuracy"})``; the mean is over
    examples (classification) or tokens (language modelling). ``policy`` (``nn.Policy``) runs
    the model in its compute dtype; the loss is always float32."""
    def loss_fn(model, batch, key):
        logits = _policy_logits(model, batch, task, key, policy)
        labels = batch["targets"]
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
        return loss, {"accuracy": (logits.argmax(-1) == labels).mean()}
    return loss_fn


def make_metrics_fn(task: Task, policy: nn.Policy | None = None):
    """``metrics_fn(model, batch) -> {"loss_sum", "correct", "count"}`` (sums over examples,
    or over tokens for language modelling, for eval)."""
    def metrics_fn(model, batch):
        logits = _policy_logits(model, batch, task, None, policy)
        labels = batch["targets"]
        return {"loss_sum": optax.softmax_cross_entropy_with_integer_labels(logits,
                                                                            labels).sum(),
                "correct": (logits.argmax(-1) == labels).sum(),
                "count": jnp.asarray(labels.size)}
    return metrics_fn
