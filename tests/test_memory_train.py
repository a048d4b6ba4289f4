"""Contiguous streams (data.StreamBatches) and the trainer's carried memory: a run killed
between segments resumes with identical memories and metrics."""

import dataclasses
import math

import equinox as eqx
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from tests.tolerances import assert_close
from tests.train_state import final_state
from xformers_jax import data, models, nn, train

SEG, STREAMS = 8, 2


def test_streams_are_contiguous_rows_with_next_byte_targets_and_resets():
    corpus = np.arange(200, dtype=np.uint8)
    it = data.StreamBatches(corpus, batch_size=STREAMS, seq_len=SEG)
    per_stream = (corpus.size - 1) // STREAMS
    assert it.segments_per_epoch == per_stream // SEG
    batches = [next(it) for _ in range(it.segments_per_epoch)]
    for b in range(STREAMS):
        row = np.concatenate([x["inputs"][b] for x in batches])
        want = corpus[b * per_stream:b * per_stream + row.size].astype(np.int32) + 1
        np.testing.assert_array_equal(row, want)
        np.testing.assert_array_equal(np.concatenate([x["targets"][b] for x in batches]),
                                      want + 1)
    assert [bool(x["reset"].all()) for x in batches] == [True] + [False] * (len(batches) - 1)
    # The next epoch starts the streams again, with a reset.
    again = next(it)
    np.testing.assert_array_equal(again["inputs"], batches[0]["inputs"])
    assert bool(again["reset"].all()) and it.get_state() == {"epoch": 1, "position": 1}


def test_stream_state_resumes_exactly_and_processes_share_the_streams():
    corpus = np.random.default_rng(0).integers(0, 256, 500).astype(np.uint8)
    a = data.StreamBatches(corpus, batch_size=STREAMS, seq_len=SEG)
    for _ in range(5):
        next(a)
    b = data.StreamBatches(corpus, batch_size=STREAMS, seq_len=SEG)
    b.set_state(a.get_state())
    np.testing.assert_array_equal(next(a)["inputs"], next(b)["inputs"])
    # Two processes of one stream each read the rows of the two-stream batch.
    both = data.StreamBatches(corpus, batch_size=2, seq_len=SEG)
    first = next(both)["inputs"]
    for p in range(2):
        one = data.StreamBatches(corpus, batch_size=1, seq_len=SEG, process_index=p,
                                 process_count=2)
        np.testing.assert_array_equal(next(one)["inputs"][0], first[p])
    bounded = data.StreamBatches(corpus, batch_size=STREAMS, seq_len=SEG, num_epochs=1,
                                 max_segments=3)
    assert len(list(bounded)) == 3
    with pytest.raises(ValueError, match="fewer than one segment"):
        data.StreamBatches(corpus[:10], batch_size=2, seq_len=SEG)
    with pytest.raises(ValueError, match="outside an epoch"):
        b.set_state({"epoch": 0, "position": 10_000})


def _tiny_streams(c, seed):
    rng = np.random.default_rng(seed)
    split = lambda n, bound, lens=(): train._tasks._Stream(  # noqa: E731
        rng.integers(0, 256, n).astype(np.uint8), c.seq_len, bound, lens)
    lens = tuple(c.eval_mem_lens)
    return train.Task(split(600, 0), split(120, 3, lens), split(120, 3, lens),
                      vocab_size=data.BYTE_VOCAB_SIZE, num_classes=data.BYTE_VOCAB_SIZE,
                      seq_len=c.seq_len, padded=False)


train.register_task(dataclasses.replace(train.TASKS["lm_stream"], name="lm_stream_tiny",
                                        make=_tiny_streams), replace=True)


def _config(memory, eval_mem_lens=()):
    # Feedback and Memformer are model kinds of their own; the other memories are the block
    # memory of the memory LM.
    memory = dict(memory)
    kind = memory["kind"] if memory["kind"] in ("feedback", "memformer") else "memory_lm"
    c = train.base_config("lm_stream_tiny", model=kind)
    c.data.update(dict(seq_len=SEG, eval_mem_lens=tuple(eval_mem_lens)))
    c.model.update(dict(dim=16, num_layers=1, num_heads=2, hidden=32))
    if kind == "memory_lm":
        c.model.memory = ml_collections.ConfigDict(memory)
    else:
        memory.pop("kind")
        c.model.update(memory)
    c.optim.update(dict(learning_rate=3e-3, warmup_steps=2, schedule="rsqrt"))
    c.mesh = ml_collections.ConfigDict({"data": 1})
    c.update(dict(batch_size=STREAMS, num_train_steps=6, log_every=1, eval_every=2,
                  checkpoint_every=2, keep_checkpoints=2, tensorboard=False,
                  progress_bar=False))
    c.lock()
    return c


def _jit(f):
    """``jax.jit`` at XLA's lowest optimisation level (compiles fast) over pytrees with
    modules in them."""
    def on_arrays(arrays, static):
        leaves, treedef = static
        return f(*eqx.combine(arrays, jax.tree.unflatten(treedef, leaves)))

    jitted = jax.jit(on_arrays, static_argnums=1,
                     compiler_options={"xla_backend_optimization_level": 0})

    def run(*args):
        arrays, static = eqx.partition(args, eqx.is_array)
        leaves, treedef = jax.tree.flatten(static)
        return jitted(arrays, (tuple(leaves), treedef))

    return run


class _Crash(Exception):
    pass


def test_run_killed_between_segments_resumes_with_identical_memories_and_metrics(tmp_path):
    config = _config(dict(kind="xl", mem_len=SEG, eval_mem_len=2 * SEG))
    straight = train.train_and_evaluate(config, str(tmp_path / "a"))

    def crash_at_3(step):  # after the checkpoint at 2: step 3 is lost and redone
        if step == 3:
            raise _Crash

    with pytest.raises(_Crash):
        train.train_and_evaluate(config, str(tmp_path / "b"), on_step=crash_at_3)
    resumed = train.train_and_evaluate(config, str(tmp_path / "b"))
    assert resumed == straight
    assert np.isfinite(straight["validation_loss"])
    (state_a, data_a), (state_b, data_b) = (final_state(config, str(tmp_path / d))
                                            for d in ("a", "b"))
    assert data_a == data_b
    assert isinstance(state_b.carry, nn.MemoryState) and bool(state_b.carry.mask.all())
    for x, y in zip(jax.tree.leaves(state_a), jax.tree.leaves(state_b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_memory_configs_build_and_bad_ones_fail():
    task = train.make_task(_config(dict(kind="none")).data, 0)
    for memory in (dict(kind="none"), dict(kind="ernie", mem_len=SEG),
                   dict(kind="compressive", mem_len=SEG, cmem_len=4, rate=2,
                        compression="conv")):
        model = train.build_model(_config(memory).model, task, jax.random.PRNGKey(0))
        assert models.has_memory(model) == (memory["kind"] != "none")
    with pytest.raises(ValueError, match="unknown keys"):
        train.build_model(_config(dict(kind="xl", mem_len=4, rate=2)).model, task,
                          jax.random.PRNGKey(0))
    with pytest.raises(ValueError, match="memory.kind"):
        train.build_model(_config(dict(kind="lstm")).model, task, jax.random.PRNGKey(0))
    # Relative distances are clamped at the longest one training sees (segment + memories - 1)
    # unless clamp_len says otherwise (-1: none).
    for memory, clamp in ((dict(kind="xl", mem_len=4), SEG + 3),
                          (dict(kind="compressive", mem_len=4, cmem_len=2), SEG + 5),
                          (dict(kind="xl", mem_len=4, clamp_len=20), 20),
                          (dict(kind="xl", mem_len=4, clamp_len=-1), None)):
        model = train.build_model(_config(memory).model, task, jax.random.PRNGKey(0))
        schemes = [x for x in jax.tree.leaves(
            model, is_leaf=lambda x: isinstance(x, nn.TransformerXLRelative))
            if isinstance(x, nn.TransformerXLRelative)]
        assert schemes and all(x.clamp_len == clamp for x in schemes)
    with pytest.raises(ValueError, match="clamp_len must be -1.*got -2"):
        train.build_model(_config(dict(kind="xl", mem_len=4, clamp_len=-2)).model, task,
                          jax.random.PRNGKey(0))
    linear = _config(dict(kind="xl", mem_len=4)).model.unlock()
    linear.attention = ml_collections.ConfigDict(dict(kind="linear"))
    with pytest.raises(ValueError, match="exact softmax attention.*'linear'"):
        train.build_model(linear, task, jax.random.PRNGKey(0))


def test_memory_config_files_build():
    from xformers_jax_experiments.configs.lm import (compressive, ernie_doc, feedback, memformer,
                                                     transformer_xl)
    for module, arg in ((transformer_xl, "xl"), (transformer_xl, "none"), (compressive, "conv"),
                        (ernie_doc, ""), (feedback, ""), (memformer, "")):
        full = module.get_config(arg)
        small = module.get_config(f"{arg},runlocal" if arg else "runlocal")
        for c in (full, small):
            train.validate_config(c)
        assert small.data.seq_len == full.data.seq_len // 4
        assert small.data.eval_mem_lens == tuple(n // 4 for n in full.data.eval_mem_lens)
    assert transformer_xl.get_config("xl,runlocal").data.eval_mem_lens == (0, 64, 128, 512)
    assert transformer_xl.get_config("xl,cpu").data.eval_mem_lens == (0, 32, 64, 256)
    full_lengths = transformer_xl.get_config("xl,cpu256")
    assert full_lengths.data.seq_len == 256 and full_lengths.model.dim == 128
    assert full_lengths.model.memory.mem_len == 256
    assert full_lengths.model.memory.eval_mem_len == 1024
    assert feedback.get_config("runlocal").model.mem_len == 64
    small = memformer.get_config("runlocal").model
    assert (small.kind, small.num_slots, small.segments) == ("memformer", 16, 4)


@pytest.mark.parametrize("memory", [dict(kind="feedback", mem_len=5),
                                    dict(kind="memformer", num_slots=3, segments=2)])
def test_feedback_and_memformer_carry_their_memory_through_the_trainer(memory):
    # The trainer's pieces (task, model, carry, loss): the state left by segment 1 changes
    # segment 2's loss, a reset row starts afresh, and the gradient reaches the memory's own
    # weights (Memformer's slot writer: only through the slots between the two pieces of a
    # segment; the Feedback Transformer's layer mix).
    config = _config(memory)
    task = train.make_task(config.data, 0)
    model = train.build_model(config.model, task, jax.random.PRNGKey(0))
    assert models.has_memory(model) and isinstance(model, models.MemoryModel)
    fresh = task.spec.carry(model, STREAMS, False)
    it = task.spec.batches(task.train, STREAMS)
    first, second = next(it), next(it)
    loss_fn = train.make_loss_fn(task, kind=config.model.kind)

    @_jit
    def run(model, fresh, first, second):  # one program: compiling dominates the cost
        carried = loss_fn(model, dict(first, carry=fresh), None)[1]["carry"]
        (loss, _), grads = eqx.filter_value_and_grad(loss_fn, has_aux=True)(
            model, dict(second, carry=carried), None)
        loss_fresh = loss_fn(model, dict(second, carry=fresh), None)[0]
        reset = dict(second, carry=carried, reset=jnp.ones(STREAMS, bool))
        return loss, grads, loss_fresh, loss_fn(model, reset, None)[0]

    loss, grads, loss_fresh, loss_reset = run(model, fresh, first, second)
    assert abs(float(loss) - float(loss_fresh)) > 1e-6
    assert_close(loss_reset, loss_fresh)
    own = grads.wq if memory["kind"] == "memformer" else grads.layer_weights
    assert float(jnp.abs(own).max()) > 0


def test_evaluation_reports_each_evaluation_memory_length():
    config = _config(dict(kind="xl", mem_len=SEG, eval_mem_len=2 * SEG), eval_mem_lens=(0,))
    task = train.make_task(config.data, 0)
    model = train.build_model(config.model, task, jax.random.PRNGKey(0))
    eval_step = train.make_eval_step(train.make_metrics_fn(task))
    got = task.spec.evaluate(eval_step, model, task.validation, STREAMS)
    assert sorted(got) == sorted(f"{k}{s}" for k in ("loss", "accuracy", "bits_per_byte")
                                 for s in ("", "_mem0"))
    plain = train._tasks._Stream(task.validation.data, SEG, task.validation.max_segments)
    want = task.spec.evaluate(eval_step, nn.with_eval_memory(model, 0), plain, STREAMS)
    assert got["loss_mem0"] == want["loss"] != got["loss"]
    assert got["bits_per_byte_mem0"] == want["loss"] / math.log(2)
    assert got["bits_per_byte"] == got["loss"] / math.log(2)


def test_memory_lm_table_reads_every_evaluation_memory():
    from xformers_jax_experiments.studies.memory_lm import table as memory_lm_table

    runs = {
        "none": [{"step": 10, "validation_bits_per_byte": 2.5},
                 {"step": 20, "validation_bits_per_byte": 2.4, "test_bits_per_byte": 2.45}],
        "xl": [{"step": 20, "validation_bits_per_byte": 2.2, "validation_bits_per_byte_mem0": 2.6,
                "validation_bits_per_byte_mem256": 2.3, "test_bits_per_byte": 2.25,
                "test_bits_per_byte_mem0": 2.65, "test_bits_per_byte_mem256": 2.35}],
    }
    text = memory_lm_table.table(runs, {"none": 0, "xl": 1024})
    assert "| model | steps | mem 0 | mem 256 | mem 1024 |" in text
    assert "| none | 20 | 2.400 |  |  |" in text  # no memory: its figure under 0
    assert "| xl | 20 | 2.600 | 2.300 | 2.200 |" in text
    assert "| xl | 20 | 2.650 | 2.350 | 2.250 |" in text  # the test split
    assert "| model | mem | step 10 | step 20 |" in text  # the validation curves
    assert "| none | 0 | 2.500 | 2.400 |" in text
    assert "| xl | 256 |  | 2.300 |" in text and "| xl | 1024 |  | 2.200 |" in text
