"""The zoo: every causal attention kind and token mixer on associative recall, selective copying
and induction heads (``xformers_jax.data._synthetic``), in Zoology's protocol.

  python -m xformers_jax_experiments.train \
      --config=xformers_jax_experiments/studies/zoo/config.py:TASK,SLOT,KIND,L[,GRID] \
      --workdir=/tmp/zoo --config.model.dim=64 --config.optim.learning_rate=1e-3

One run: a 2-layer ``causal_lm`` (Zoology, Arora et al. 2023, section 3: two layers, weight
decay 0.1, the best of a small learning-rate grid, early stop at 0.99 accuracy) whose
attention slot (``SLOT=attention``) or token-mixer slot (``SLOT=mixer``) holds ``KIND`` with
:func:`zoo_hyperparameters`, on ``TASK`` (``mqar``, ``selective_copy``, ``induction``) at
length ``L``. MQAR's pairs follow Zoology's grid: ``kv = L / 16`` ((64, 4), (128, 8),
(256, 16)). The width is ``model.dim`` (one head per 32 channels, MLP 4x). ``GRID`` picks the
schedule: ``cpu`` (the default: at most ``CPU_STEPS`` = 10000 steps of batch 64, each on
examples no earlier step read, an evaluation every 200) or ``full`` (Zoology's: 100k
examples, 64 epochs of batch 64). The study's runner (``run.py``) sweeps kinds, settings,
widths and learning rates through ``xformers_jax_experiments.sweep``.
"""

from __future__ import annotations

import math

from xformers_jax import nn, train
from xformers_jax.attention import patterns as P

TASKS = ("mqar", "selective_copy", "induction")
GRIDS = ("cpu", "full")
# MQAR's (L, kv) grid (Zoology, Figure 2) and the widths swept; the learning rates: Zoology
# takes the best of 4 in [1e-4, 1e-2]; the CPU grid the best of 2.
MQAR_SETTINGS = ((64, 4), (128, 8), (256, 16))
WIDTHS = {"cpu": (64, 128), "full": (64, 128, 256, 512)}
LEARNING_RATES = {"cpu": (1e-3, 3e-3), "full": (1e-4, 3.2e-4, 1e-3, 1e-2)}
# Selective copying and induction heads train at one length (Mamba: 4096 and 256; the CPU grid
# copies over 256 tokens) and induction is tested at longer ones too.
LENGTHS = {"selective_copy": {"cpu": (256,), "full": (4096,)},
           "induction": {"cpu": (256,), "full": (256,)}}
INDUCTION_TEST_LENGTHS = {"cpu": (256, 1024), "full": (256, 4096, 65536)}
# The CPU grid's schedule: long enough that the cosine schedule still has most of its
# learning rate at MQAR's phase transition (softmax attention at L=64, d=64, V=8192 binds keys
# to values between steps 1400 and 2800 under a 10000-step schedule and stops early at 0.99
# by step 5000; under a 3000-step one it had only learnt the last pair when the rate ran
# out: 0.47), each step on fresh examples (get_config): a fixed set of 20k examples at
# V=8192 is memorised instead.
CPU_STEPS = 10000


def zoo_hyperparameters(slot: str, kind: str, seq_len: int) -> dict:
    """The kind's hyperparameters in the zoo: its registered defaults, with the sizes that
    shape what it can see set for sequences of ``seq_len`` (windows, blocks and spans of
    ``seq_len / 4``, 64 random features or landmarks, 16 clusters or top-k keys, a short
    convolution of 4 taps on q, k and v where a recurrence offers one; the rule is the same
    for every kind of a family so that a kind is not tuned against the others).
    Required hyperparameters no rule covers take the kind's test value (named in the
    results as such)."""
    k = nn.get_kind(slot, kind)
    quarter = max(4, seq_len // 4)
    side = 2 ** (int(math.log2(seq_len)) // 2)
    rules = {
        "window": quarter, "left": quarter, "max_span": seq_len, "block_size": 16,
        "num_features": 64, "num_landmarks": 64, "num_clusters": 16, "top_k": 16,
        "num_buckets": 8, "chunk_size": 16, "segment_size": 16, "rank": 16, "length": 16,
        "sinks": 4, "shape": (seq_len // side, side), "global_tokens": (0,),
        "num_global": 1, "radius": quarter // 16 or 1, "pool_size": 4, "stride": 4,
        "spans": (16, None),
        # Every sub-quadratic layer of Zoology's grid carries a short convolution (Based's
        # BaseConv, H3's shift, Hyena's and Mamba's convolutions); the recurrences that offer
        # one on q, k and v take the 4 taps of Gated DeltaNet's and Kimi Linear's layers.
        "short_conv": 4,
    }
    if k.hyperparameters.get("pattern", None) is not None and k.hyperparameters["pattern"].required:
        rules["pattern"] = P.Local(quarter, 0)  # a kind that needs a pattern: a causal window
    test = dict(k.test_hyperparameters) if k.test_hyperparameters else {}
    hp = {}
    for name, h in k.hyperparameters.items():
        if name in rules:
            hp[name] = rules[name]
        elif h.required:
            hp[name] = test[name]
    if "pattern" in hp and {"block_q", "block_k"} <= set(k.hyperparameters):
        hp.update(block_q=16, block_k=16)  # the pattern's tiles
    return hp


def kinds(slot: str) -> list[str]:
    """The registered kinds of ``slot`` (``attention`` or ``mixer``) that can run causally."""
    return [name for name in nn.registered_kinds(slot) if nn.get_kind(slot, name).causal]


def parse(arg: str | None):
    parts = (arg or "").split(",")
    if len(parts) not in (4, 5) or parts[0] not in TASKS or parts[1] not in ("attention",
                                                                           "mixer"):
        raise ValueError(f"config arg must be 'TASK,SLOT,KIND,L[,GRID]' with TASK in {TASKS} "
                         f"and SLOT attention or mixer, got {arg!r}")
    grid = parts[4] if len(parts) == 5 else "cpu"
    if grid not in GRIDS:
        raise ValueError(f"GRID must be one of {GRIDS}, got {grid!r}")
    return parts[0], parts[1], parts[2], int(parts[3]), grid


def get_config(arg=None):
    task, slot, kind, seq_len, grid = parse(arg)
    c = train.base_config(task)
    c.data.update(dict(seq_len=seq_len))
    if task == "mqar":
        c.data.update(dict(num_kv_pairs=seq_len // 16))
    if task == "induction":
        c.data.update(dict(test_seq_len=max(INDUCTION_TEST_LENGTHS[grid])))
    hp = zoo_hyperparameters(slot, kind, seq_len)
    section = dict(kind=kind, **hp)
    if slot == "attention":
        c.model.attention = type(c.model.attention)(section)
    else:
        c.model.mixer = type(c.model.mixer)(section)
    # Zoology's language model ties its output layer to the input embeddings: the value
    # read at a query is scored against the embeddings, one mechanism for every token, where
    # an untied head learns each of MQAR's 4096 values' output rows separately.
    # The two layers unrolled rather than scanned: fwd+bwd of the model (batch 64 of 256, d=64,
    # one thread of the 2-core EPYC, CPU time) 767 ms against 1374 for softmax attention,
    # 1308 against 1672 for Gated DeltaNet, 604 against 712 for S4D, 2151 against 2294 for
    # Mamba-2, the same for Mamba; the scan stacks each layer's residuals and keeps XLA from
    # fusing across its body.
    # Input positions as Zoology's figure gives them (max_position_embeddings for its softmax
    # attention, 0 for every other mixer) and Mamba, H3 and Hyena's models (none): the
    # attention slot's kinds have no order of their own, the token mixers do. Sinusoids added
    # to every token held Mamba and Mamba-2 at chance on selective copying (this folder's
    # README.md, positions.py); without them the same models learn it. Where sinusoids are
    # added, the token embeddings are scaled by sqrt(d) as the paper that defines them does
    # (Vaswani et al. 2017, section 3.4): unscaled (rows of norm about 1 against the
    # sinusoid's sqrt(d / 2)), softmax attention stayed at chance on induction heads.
    # On induction heads the table itself is drawn N(0, 1) instead (PyTorch's nn.Embedding
    # default: the tokens as large, and the tied output layer's logits sqrt(d) times larger):
    # with the tokens scaled, softmax attention stayed at chance at L = 128 for 3000 steps and
    # at L = 256 for 5400, while with the table scaled it learnt L = 128 by step 2000
    # (README.md, positions.py; at L = 256 under the trainer it has not yet left chance).
    c.model.update(dict(dim=64, num_layers=2, num_heads=2, hidden=256, tie_embeddings=True,
                        scan_layers=False,
                        positions="sinusoidal" if slot == "attention" else "none"))
    if slot == "attention" and task == "induction":
        c.model.embed_std = 1.0
    elif slot == "attention":
        c.model.scale_embeddings = True
    c.optim.update(dict(learning_rate=1e-3, schedule="cosine", warmup_steps=100,
                        weight_decay=0.1))
    c.stop_at_accuracy = 0.99
    c.tensorboard = False
    c.progress_bar = False
    if grid == "cpu":
        c.data.update(dict(num_eval=500, num_test=1_000))
        c.update(dict(batch_size=64, num_train_steps=CPU_STEPS, log_every=100, eval_every=200,
                      checkpoint_every=500))
        # Every step reads examples no earlier step read: the training split is as long as
        # the schedule (example i is a function of (seed, i), generated when read), following
        # num_train_steps and batch_size when they are overridden.
        c.data.num_train = c.get_ref("num_train_steps") * c.get_ref("batch_size")
    else:
        c.data.update(dict(num_train=100_000, num_eval=3_000, num_test=3_000))
        steps = 64 * 100_000 // 64
        c.update(dict(batch_size=64, num_train_steps=steps, log_every=500, eval_every=2000,
                      checkpoint_every=10_000))
    c.lock()
    return c
