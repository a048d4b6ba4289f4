"""The trainer's compression switches end to end, each checked in what a few steps of
``train.train_and_evaluate`` at a tiny size saved. Trainer runs cost most of this file's time
(compiles), so one teacher run carries several switches: LayerDrop training and layer
pruning, a lottery ticket (one-shot pruning with rewinding) interrupted and resumed, int8
quantization (int8 arrays in the saved checkpoint); a student is then distilled from it,
restored with orbax, with KD and TinyBERT's losses (which fall); a half-depth student from every
other teacher layer with the cosine loss (DistilBERT); QAT fine-tuned from the teacher's
checkpoint (``init_from``). The gradual schedule's
masks and resume are checked in test_compress_prune.py."""

import os

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from xformers_jax import compress as C
from xformers_jax import parallel, train
from xformers_jax.train import _compress

TEACHER = dict(dim=32, num_layers=2, num_heads=2, hidden=64)


def _config(model=TEACHER, steps=6, **changes):
    c = train.base_config("listops")
    c.data.update(dict(num_train=64, num_eval=16, num_test=16, min_length=8, max_length=24,
                       max_depth=3, max_args=3))
    c.model.update(dict(model, pooling="cls"))
    c.optim.update(dict(learning_rate=3e-3, warmup_steps=1, schedule="constant",
                        weight_decay=0.0))
    c.update(dict(batch_size=16, num_train_steps=steps, log_every=1, eval_every=steps,
                  checkpoint_every=steps, keep_checkpoints=8, tensorboard=False,
                  progress_bar=False, plot=False))
    c.calibration.num_batches = 2
    for path, value in changes.items():
        section, _, key = path.rpartition(".")
        (c[section] if section else c)[key] = value
    c.lock()
    return c


def _model(config, workdir, step, sub="checkpoints"):
    """The model saved at ``step`` (restored by path with orbax)."""
    task = train.make_task(config.data, config.seed)
    like = eqx.filter_eval_shape(train.build_model, config.model, task, jax.random.PRNGKey(0))
    like = _compress.prepare_model(config, like, None) if not config.distill.teacher else like
    return parallel.restore_checkpoint(os.path.join(workdir, sub, str(step), "state"), like,
                                       prefix="model")


def _matrices(model):
    """The prunable matrices of ``model`` by path (``compress.MATMUL_WEIGHTS``)."""
    return {jax.tree_util.keystr(p): np.asarray(w) for p, w in
            jax.tree_util.tree_flatten_with_path(eqx.filter(model, eqx.is_array))[0]
            if getattr(p[-1], "name", None) in C.MATMUL_WEIGHTS}


@pytest.fixture(scope="module", autouse=True)
def _fast_compiles():
    """The trainer's programs compiled with XLA's optimisations mostly off (they run a few
    tiny steps; compiling is most of the time)."""
    before = jax.config.read("jax_disable_most_optimizations")
    jax.config.update("jax_disable_most_optimizations", True)
    yield
    jax.config.update("jax_disable_most_optimizations", before)


class _Crash(Exception):
    pass


TICKET = {"prune.sparsity": 0.5, "prune.rewind_step": 2, "prune.end_step": 4,
          "prune.layerdrop": 0.5, "prune.layers": 1, "quantize": "int8",
          # per-token activation scales: calibration is checked in test_compress_quant.py
          "calibration.method": "dynamic",
          "checkpoint_every": 2, "eval_every": 2}


@pytest.fixture(scope="module")
def teacher(tmp_path_factory):
    """A 2-layer teacher trained with LayerDrop and a lottery ticket (pruned to 50% at step 4
    and rewound to step 2), crashed after step 5 and resumed from its step-4 checkpoint, then
    int8-quantized and cut to one layer: (config, result, workdir)."""
    workdir = str(tmp_path_factory.mktemp("teacher"))
    config = _config(**TICKET)

    def crash(step):
        if step == 5:
            raise _Crash

    with pytest.raises(_Crash):
        train.train_and_evaluate(config, workdir, on_step=crash)
    return config, train.train_and_evaluate(config, workdir), workdir


def test_int8_checkpoint_holds_int8_matrices_and_layers_are_pruned(teacher):
    config, result, workdir = teacher
    stored = parallel.checkpoint_contents(os.path.join(workdir, "quantized"))
    floats = parallel.checkpoint_contents(os.path.join(workdir, "float_model"))
    q = {k: v for k, v in stored.items() if k.endswith("/q")}
    # Every matmul weight and the token table, each an int8 array of its float shape.
    names = {k.rsplit("/", 2)[-2] for k in q}
    assert names == {"wq", "wk", "wv", "wo", "w1", "w2", "head", "table"}
    for k, v in q.items():
        assert v.dtype == jnp.int8 and floats[k[:-2]].shape == v.shape
        assert floats[k[:-2]].dtype == jnp.float32
    assert result["array_bytes_int8"] * 3 < result["array_bytes_float"]
    assert 0 <= result["test_accuracy_int8"] <= 1
    # LayerDrop: the stack was trained with it, and the pruned model keeps layer 0 of 2.
    assert _compress.prepare_model(config, train.build_model(
        config.model, train.make_task(config.data, 0), jax.random.PRNGKey(0)),
        None).encoder.layers.layerdrop == 0.5
    assert result["layers_kept"] == [0] and 0 <= result["test_accuracy_layers_pruned"] <= 1


def test_lottery_ticket_rewound_and_zeros_survive_the_resume(teacher):
    config, result, workdir = teacher
    early, ticket, last = (_model(config, workdir, s) for s in (2, 4, 6))
    # The weights the optimizer kept for rewinding are the step-2 checkpoint's.
    stored = parallel.checkpoint_contents(os.path.join(workdir, "checkpoints", "4", "state"))
    prefix = next(k for k in stored if k.endswith("/early/head"))[:-len("/head")]
    kept = parallel.restore_checkpoint(os.path.join(workdir, "checkpoints", "4", "state"),
                                       early, prefix=prefix)
    for a, b in zip(jax.tree.leaves(eqx.filter(early, eqx.is_array)),
                    jax.tree.leaves(eqx.filter(kept, eqx.is_array))):
        np.testing.assert_array_equal(a, b)
    at2, at4 = _matrices(early), _matrices(ticket)
    for k, w in at4.items():
        for layer in w.reshape(-1, *w.shape[-2:]):  # exactly half of each layer's matrix
            assert (layer == 0).sum() == layer.size // 2, k
    for a, b in zip(jax.tree.leaves(eqx.filter(early, eqx.is_array)),
                    jax.tree.leaves(eqx.filter(ticket, eqx.is_array))):
        # Every parameter (embeddings, norms too) rewound to step 2, zero where pruned (up to
        # the rounding of the update that carries the rewinding: p + (w2 - p)).
        np.testing.assert_allclose(b, np.where(b != 0, a, 0), rtol=1e-6, atol=1e-9)
    # Trained on from the ticket with the masks fixed, through the crash after step 5 and the
    # resume from step 4: the pruned weights are still exactly zero.
    for k, w in _matrices(last).items():
        assert np.all(w[at4[k] == 0] == 0) and not np.array_equal(w, at4[k]), k
    assert result["step"] == 6 and result["sparsity"] == pytest.approx(0.5, abs=0.02)
    # Best checkpoints only from the pruning step on: the dense step 2 is never the best.
    assert result["best_step"] in (4, 6) and _compress.best_from_step(config) == 4


def test_student_distilled_from_restored_teacher(teacher, tmp_path):
    _, _, teacher_dir = teacher
    student = dict(dim=16, num_layers=1, num_heads=2, hidden=32)
    config = _config(model=student, steps=6, **{
        "distill.teacher": teacher_dir, "distill.alpha": 1.0, "distill.temperature": 2.0,
        "distill.tinybert_attention": 1.0, "distill.tinybert_hidden": 1.0,
        "distill.dim": 32, "distill.num_layers": 2, "distill.hidden": 64,
        "optim.learning_rate": 1e-2})
    workdir = str(tmp_path)
    train.train_and_evaluate(config, workdir)
    rows = [r for r in train.read_jsonl(os.path.join(workdir, "metrics.jsonl"))
            if "train_kd" in r]
    assert len(rows) == 6
    for name in ("train_kd", "train_tinybert_attention", "train_tinybert_hidden", "train_loss"):
        first, last = np.mean([r[name] for r in rows[:2]]), np.mean([r[name] for r in rows[-2:]])
        assert last < first, (name, [r[name] for r in rows])
    assert all(r["train_loss"] == pytest.approx(
        r["train_kd"] + r["train_tinybert_attention"] + r["train_tinybert_hidden"], rel=1e-4)
        for r in rows)  # alpha = 1: no cross-entropy term
    # The learned projections [student layers + 1, 16, 32] are trained and checkpointed.
    state = os.path.join(workdir, "checkpoints", "6", "state")
    assert parallel.checkpoint_contents(state)["model/projections/w"].shape == (2, 16, 32)
    init = C.TinyBertProjections(16, 32, 1, key=jax.random.fold_in(jax.random.PRNGKey(0), 1))
    restored = parallel.restore_checkpoint(state, init, prefix="model/projections")
    assert not np.allclose(restored.w, init.w)


def test_qat_fine_tuned_from_the_float_checkpoint(teacher, tmp_path):
    """``init_from``: QAT starts from the teacher's weights (the standard recipe), not afresh."""
    _, _, teacher_dir = teacher
    config = _config(steps=2, **{"quantize": "qat", "init_from": teacher_dir,
                                 "optim.learning_rate": 1e-4,
                                 "calibration.method": "dynamic"})
    result = train.train_and_evaluate(config, str(tmp_path))
    task = train.make_task(config.data, config.seed)
    start = _compress.restore_model(teacher_dir, config.model, task, jax.random.PRNGKey(0))
    fresh = train.build_model(config.model, task, jax.random.PRNGKey(0))
    tuned = C.dequantize_model(_model(config, str(tmp_path), 2))
    arrays = [jax.tree.leaves(eqx.filter(m, eqx.is_array)) for m in (start, tuned, fresh)]
    # Two Adam steps of 1e-4 move each weight by at most ~2e-4; the fresh model is far off.
    assert max(float(np.max(np.abs(a - b))) for a, b in zip(arrays[0], arrays[1])) < 1e-3
    assert max(float(np.max(np.abs(a - b))) for a, b in zip(arrays[0], arrays[2])) > 0.1
    assert 0 <= result["test_accuracy_int8"] <= 1
    with pytest.raises(ValueError, match="init_from and distill.init"):
        train.validate_config(_config(**{"init_from": teacher_dir,
                                         "distill.teacher": teacher_dir,
                                         "distill.init": "every_other"}))


def test_distilbert_student_every_other_layer_with_cosine_loss(teacher, tmp_path):
    """DistilBERT: the half-depth student starts from the teacher's layer 0 of 2 (and its
    embeddings, norm and head), trained with KD and the cosine loss on the last hidden
    states, which falls."""
    _, _, teacher_dir = teacher
    config = _config(model=dict(TEACHER, num_layers=1), steps=6, **{
        "distill.teacher": teacher_dir, "distill.num_layers": 2, "distill.init": "every_other",
        "distill.alpha": 0.5, "distill.cosine": 1.0, "optim.learning_rate": 1e-2})
    task = train.make_task(config.data, config.seed)
    key = jax.random.PRNGKey(0)
    t = _compress.load_teacher(config, task, key)
    s = _compress.prepare_model(config, train.build_model(config.model, task, key), t)
    t_layers = jax.tree.leaves(eqx.filter(t.encoder.layers, eqx.is_array))
    for a, b in zip(t_layers, jax.tree.leaves(eqx.filter(s.encoder.layers, eqx.is_array))):
        np.testing.assert_array_equal(a[:1], b)  # stacked layers: the teacher's layer 0
    np.testing.assert_array_equal(t.head, s.head)
    workdir = str(tmp_path)
    train.train_and_evaluate(config, workdir)
    rows = [r for r in train.read_jsonl(os.path.join(workdir, "metrics.jsonl"))
            if "train_cosine" in r]
    assert len(rows) == 6
    cos = [r["train_cosine"] for r in rows]
    assert np.mean(cos[-2:]) < np.mean(cos[:2]), cos
    assert all(r["train_loss"] == pytest.approx(
        0.5 * r["train_ce"] + 0.5 * r["train_kd"] + r["train_cosine"], rel=1e-4) for r in rows)
