"""The shared settings of the segment-level recurrence configs (``lm_stream`` task: the
corpus cut into ``batch_size`` contiguous streams, memory carried across steps).

Sizes: a small byte-level Transformer-XL in the style of the paper's enwik8 model scaled down
(our choice, no paper setting): 6 layers, 8 heads, dim 512, MLP 2048, segment 256, memory 256
(evaluation memory 1024), batch 32 streams, 50K steps. ``runlocal``: segment 64, memory 64
(evaluation 256), a dim-64 2-layer model, 200 steps on 8 streams; every memory length (keys
ending in ``_len``, and ``eval_mem_lens``) is a quarter. ``cpu``: segment 32, memory lengths
an eighth, a dim-128 2-layer model, 1500 steps on 16 streams (the memory comparison on one
CPU). ``cpu256``: the ``cpu`` model (dim 128, 2 layers, 16 streams) at the full lengths,
segment 256 with the memory lengths unscaled (Transformer-XL: memory 256, evaluation memory
1024), 6000 steps (3.3 steps/s without memory and 2.2 with Transformer-XL's on a quiet
2-core Sapphire Rapids; evaluation every 2000 steps). Reported loss is nats per byte;
evaluation also reports ``bits_per_byte``, and with ``eval_mem_lens`` (``data.eval_mem_lens``)
the same metrics at each of those evaluation memory lengths (``bits_per_byte_mem{N}``), read
in the same run.
"""

import ml_collections

from xformers_jax import train


# The memory models that are model kinds of their own (their options in the model section);
# the other memories are the block memory of the ``memory_lm`` kind (its ``memory`` section).
MODEL_KINDS = ("feedback", "memformer")


def config(memory: dict, size: str | None, *, eval_mem_lens=()):
    """``memory``: ``kind`` ("none", "xl", "ernie", "compressive": ``memory_lm``'s block
    memory; "feedback", "memformer": those model kinds) plus its settings."""
    memory = dict(memory)
    kind = memory["kind"] if memory["kind"] in MODEL_KINDS else "memory_lm"
    c = train.base_config("lm_stream", model=kind)
    c.data.update(dict(source="stdlib", seq_len=256, num_eval=64, num_test=128,
                       eval_mem_lens=tuple(eval_mem_lens)))
    c.model.update(dict(dim=512, num_layers=6, num_heads=8, hidden=2048))
    if kind == "memory_lm":
        c.model.memory = ml_collections.ConfigDict(memory)
        lengths = c.model.memory
    else:
        memory.pop("kind")
        c.model.update(memory)
        lengths = c.model
    c.optim.update(dict(learning_rate=2.5e-4, schedule="cosine", warmup_steps=2000,
                        weight_decay=0.01))
    c.update(dict(batch_size=32, num_train_steps=50_000, eval_every=2000,
                  checkpoint_every=2000))
    if size == "runlocal":
        c.data.update(dict(seq_len=64, num_eval=16, num_test=16,
                           eval_mem_lens=tuple(n // 4 for n in eval_mem_lens)))
        c.model.update(dict(dim=64, num_layers=2, num_heads=4, hidden=256))
        lengths.update({k: v // 4 for k, v in memory.items() if k.endswith("_len")})
        c.optim.update(dict(learning_rate=2e-3, warmup_steps=20))
        c.update(dict(batch_size=8, num_train_steps=200, log_every=20, eval_every=100,
                      checkpoint_every=100))
    elif size in ("cpu", "cpu256"):
        # The memory comparison on one CPU: a dim-128 2-layer model on 16 streams, trained
        # long enough to learn to read the memory (200 steps of runlocal are not); ``cpu``:
        # segment 32, every memory length an eighth, 1500 steps; ``cpu256``: the full lengths,
        # 6000 steps (each ~8x the cost of a ``cpu`` step; after 3000 the two were level).
        div = 8 if size == "cpu" else 1
        c.data.update(dict(seq_len=256 // div, num_eval=64, num_test=128,
                           eval_mem_lens=tuple(n // div for n in eval_mem_lens)))
        c.model.update(dict(dim=128, num_layers=2, num_heads=4, hidden=512))
        lengths.update({k: v // div for k, v in memory.items() if k.endswith("_len")})
        c.optim.update(dict(learning_rate=1e-3, warmup_steps=100))
        every = 500 if size == "cpu" else 2000
        c.update(dict(batch_size=16, num_train_steps=1500 if size == "cpu" else 6000,
                      log_every=100, eval_every=every, checkpoint_every=every))
    elif size is not None:
        raise ValueError(f"size must be 'runlocal', 'cpu', 'cpu256' or absent, got {size!r}")
    c.lock()
    return c


def parse(arg):
    parts = (arg or "").split(",")
    return parts[0], (parts[1] if len(parts) > 1 else None)
