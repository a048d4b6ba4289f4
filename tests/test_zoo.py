"""The zoo: the synthetic task generators against their definitions, the tasks through the
trainer (scored positions only, early stop), and a tiny sweep end to end."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from xformers_jax import data as D
from xformers_jax import nn, train
from xformers_jax_experiments.studies.zoo import config as Z
from xformers_jax_experiments.studies.zoo import queries as Q

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_mqar_follows_zoology():
    src = D.MultiQueryAR(200, seed=3, seq_len=32, num_kv_pairs=4, vocab_size=64)
    for i in range(len(src)):
        ex = src[i]
        x, y, s = ex["inputs"], ex["targets"], ex["scored"]
        keys, values = x[0:8:2], x[1:8:2]
        assert ((1 <= keys) & (keys < 32)).all() and ((32 <= values) & (values < 64)).all()
        assert len(set(keys)) == 4 and len(set(values)) == 4
        where = np.flatnonzero(s)
        assert len(where) == 4
        # queries at even slots after the pairs, each key once, scored with its own value
        assert ((where - 8) % 2 == 0).all() and (where >= 8).all() and (where <= 30).all()
        assert sorted(x[where]) == sorted(keys)
        pair = dict(zip(keys, values))
        assert [pair[k] for k in x[where]] == list(y[where])
        assert (y[~s] == 0).all()
    np.testing.assert_array_equal(src[5]["inputs"], D.MultiQueryAR(
        200, seed=3, seq_len=32, num_kv_pairs=4, vocab_size=64)[5]["inputs"])
    assert not np.array_equal(src[5]["inputs"], D.MultiQueryAR(
        200, seed=4, seq_len=32, num_kv_pairs=4, vocab_size=64)[5]["inputs"])


def test_mqar_gaps_follow_the_power_law():
    """One query per example: the gap's frequencies match p(i) ~ a i^(a-1) within 4 sigma."""
    n, L, a = 6000, 24, 0.01
    src = D.MultiQueryAR(n, seed=0, seq_len=L, num_kv_pairs=1, vocab_size=64, power_a=a)
    gaps = np.array([(np.flatnonzero(src[i]["scored"])[0] - 2) // 2 for i in range(n)])
    p = D.power_law_probs((L - 2) // 2, a)
    counts = np.bincount(gaps, minlength=len(p))
    sigma = np.sqrt(n * p * (1 - p))
    assert (np.abs(counts - n * p) <= 4 * sigma + 1).all(), (counts, n * p)
    # the law's shape: p(1) / p(2) = 2^(1 - a)
    np.testing.assert_allclose(p[0] / p[1], 2 ** (1 - a))


def test_mqar_fills_free_positions_from_the_whole_vocabulary():
    src = D.MultiQueryAR(50, seed=1, seq_len=64, num_kv_pairs=4, vocab_size=128)
    free = np.concatenate([src[i]["inputs"][8:][~src[i]["scored"][8:]] for i in range(50)])
    assert free.min() < 64 <= free.max()  # both halves of the vocabulary
    quiet = D.MultiQueryAR(5, seed=1, seq_len=64, num_kv_pairs=4, vocab_size=128,
                           random_non_queries=False)[0]
    assert (quiet["inputs"][8:][~quiet["scored"][8:]] == 0).all()
    # The trainer's task passes the choice on (data.random_non_queries; Zoology's Figure 2
    # runs: False).
    c = Z.get_config("mqar,attention,linear,64")
    c.unlock()
    c.data.update(dict(num_train=4, num_eval=4, num_test=4))
    for random in (True, False):
        c.data.random_non_queries = random
        row = train.make_task(c.data, 0).train[0]
        assert (row["inputs"][8:][~row["scored"][8:]] != 0).any() == random


def test_selective_copying_follows_mamba():
    src = D.SelectiveCopying(100, seed=0, seq_len=48, num_tokens=8, vocab=16)
    assert src.vocab_size == 18
    for i in range(len(src)):
        x, y, s = src[i]["inputs"], src[i]["targets"], src[i]["scored"]
        context, tail = x[:40], x[40:]
        data = context[context != 0]
        assert len(data) == 8 and ((1 <= data) & (data <= 16)).all()
        assert (tail == 17).all()
        np.testing.assert_array_equal(np.flatnonzero(s), np.arange(40, 48))
        np.testing.assert_array_equal(y[40:], data)  # in order of appearance


def test_induction_heads_follow_mamba():
    src = D.InductionHeads(200, seed=0, seq_len=32, vocab=16)
    assert src.vocab_size == 17
    for i in range(len(src)):
        x, y, s = src[i]["inputs"], src[i]["targets"], src[i]["scored"]
        special = np.flatnonzero(x == 16)
        assert len(special) == 2 and special[1] == 31 and special[0] <= 29
        np.testing.assert_array_equal(np.flatnonzero(s), [31])
        assert y[31] == x[special[0] + 1]


@pytest.mark.parametrize("make,match", [
    (lambda: D.MultiQueryAR(1, seed=0, seq_len=31, num_kv_pairs=2), "even"),
    (lambda: D.MultiQueryAR(1, seed=0, seq_len=32, num_kv_pairs=9), "4 \\* num_kv_pairs"),
    (lambda: D.MultiQueryAR(1, seed=0, seq_len=64, num_kv_pairs=2, vocab_size=32),
     "must exceed seq_len"),
    (lambda: D.SelectiveCopying(1, seed=0, seq_len=20, num_tokens=16), "2 \\* num_tokens"),
    (lambda: D.InductionHeads(1, seed=0, seq_len=3), "at least 4"),
])
def test_generators_refuse_bad_settings(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_cpu_grid_trains_on_fresh_examples_every_step():
    """The CPU grid's training split is as long as its schedule (following overrides of the
    steps and the batch), so no step re-reads an example (a fixed 20k examples at V=8192 are
    memorised); the batches are a function of the seed and resume exactly from the
    iterator's state (what the trainer checkpoints)."""
    from xformers_jax.train import _tasks

    c = Z.get_config("mqar,attention,dot_product,64")
    assert c.num_train_steps == Z.CPU_STEPS
    assert c.data.num_train == c.batch_size * c.num_train_steps
    c.num_train_steps, c.batch_size = 5, 16  # as --config.num_train_steps= overrides it
    assert c.data.num_train == 80
    assert Z.get_config("mqar,attention,dot_product,64,full").data.num_train == 100_000
    task = _tasks.make_task(c.data, c.seed)
    assert len(task.train) == 80 and task.train.vocab_size == 8192

    def read(n, state=None):
        it = D.DataIterator(task.train, batch_size=16, seed=c.seed)
        if state is not None:
            it.set_state(state)
        out = [next(it)["inputs"] for _ in range(n)]
        state = it.get_state()
        it.close()
        return out, state

    first, _ = read(5)
    rows = {tuple(r) for b in first for r in b}
    assert len(rows) == 80  # five steps, 80 distinct examples: none read twice
    again, _ = read(5)
    for a, b in zip(first, again):
        np.testing.assert_array_equal(a, b)  # deterministic
    _, state = read(2)
    resumed, _ = read(3, state)
    for a, b in zip(first[2:], resumed):
        np.testing.assert_array_equal(a, b)  # resumed where it stopped


def test_scored_positions_only_and_early_stop(tmp_path):
    """MQAR through the trainer: the loss counts the scored positions only (a batch whose
    unscored targets are changed keeps its loss), and stop_at_accuracy ends the run at the
    first evaluation that reaches it."""
    import jax
    import jax.numpy as jnp

    from xformers_jax.train import _objective, _tasks

    c = Z.get_config("mqar,attention,dot_product,32")
    c.unlock()
    c.data.update(dict(num_train=64, num_eval=16, num_test=16))
    c.model.update(dict(dim=32, num_heads=1, hidden=64))
    c.update(dict(batch_size=8, num_train_steps=40, eval_every=4, log_every=4,
                  checkpoint_every=40, stop_at_accuracy=0.0))
    task = _tasks.make_task(c.data, 0)
    model = _tasks.build_model(c.model, task, jax.random.PRNGKey(0))
    batch = {k: jnp.stack([task.train[i][k] for i in range(4)]) for k in task.train[0]}
    loss_fn = _objective.make_loss_fn(task)
    loss, metrics = loss_fn(model, batch, None)
    other = dict(batch, targets=jnp.where(batch["scored"], batch["targets"], 7))
    assert float(loss_fn(model, other, None)[0]) == pytest.approx(float(loss))
    moved = dict(batch, targets=jnp.where(batch["scored"], 7, batch["targets"]))
    assert float(loss_fn(model, moved, None)[0]) != pytest.approx(float(loss))
    sums = _objective.make_metrics_fn(task)(model, batch)
    assert int(sums["count"]) == int(batch["scored"].sum()) == 4 * 2
    result = train.train_and_evaluate(c, str(tmp_path))
    assert result["step"] == 4 and result["stopped_early_at"] == 4
    # Killed after the early stop's checkpoint, before the run was recorded as finished: the
    # restart resumes as stopped instead of training on.
    from xformers_jax.train import _loop
    again = _loop._train_and_evaluate(c, str(tmp_path))
    assert again["step"] == 4 and again["stopped_early_at"] == 4
    assert again["validation_accuracy"] == result["validation_accuracy"]


def test_zoo_hyperparameters_fill_every_causal_kind():
    for slot in ("attention", "mixer"):
        kinds = Z.kinds(slot)
        assert kinds
        for kind in kinds:
            hp = Z.zoo_hyperparameters(slot, kind, 64)
            spec = {"attention": nn.AttentionSpec, "mixer": nn.MixerSpec}[slot](kind, hp)
            assert spec.kind == kind
    # Input positions as Zoology gives them: the attention slot's, none for the token mixers.
    assert Z.get_config("mqar,attention,based,64").model.positions == "sinusoidal"
    assert Z.get_config("selective_copy,mixer,mamba,256").model.positions == "none"
    # and where sinusoids are added, the tokens scaled by sqrt(d) (Vaswani et al. 2017), on
    # induction heads the table drawn N(0, 1) instead; the token mixers' tables as drawn
    assert Z.get_config("mqar,attention,dot_product,64").model.scale_embeddings
    induction = Z.get_config("induction,attention,dot_product,256").model
    assert induction.embed_std == 1.0 and not induction.get("scale_embeddings", False)
    assert not Z.get_config("mqar,mixer,mamba2,64").model.get("scale_embeddings", False)
    assert not Z.get_config("induction,mixer,mamba,256").model.get("embed_std")


def test_tiny_sweep_end_to_end(tmp_path):
    """Two kinds, one setting, a few steps: the runs, their resumption, the tables."""
    results = tmp_path / "results"
    cmd = [sys.executable, "-m", "xformers_jax_experiments.studies.zoo.run",
           f"--workdir={tmp_path / 'runs'}", "--tasks=mqar",
           "--kinds=^(attention/dot_product|mixer/mamba2)$", "--lengths=64", "--widths=64",
           "--learning_rates=3e-3", "--num_train_steps=6", "--num_processes=2",
           "--set=data.num_eval=64", "--set=data.num_test=64",
           f"--results_dir={results}"]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    record = json.loads((results / "zoo.json").read_text())
    rows = record["rows"]
    assert record["wall_s"] > 0 and record["cpu_s"] > 0  # the runs' CPU time, children's
    assert {r["kind"] for r in rows} == {"dot_product", "mamba2"}
    # the training split follows the overridden schedule: 6 steps of 64 fresh examples
    run_config = json.loads((tmp_path / "runs" / "mqar" / "attention-dot_product" /
                             "L64_d64_lr0.003" / "config.json").read_text())
    assert run_config["data"]["num_train"] == 6 * 64
    assert all(0.0 <= r["test_accuracy"] <= 1.0 for r in rows), rows
    state = {r["kind"]: r["state_bytes"] for r in rows}
    assert state["dot_product"] > 0 and state["mamba2"] > 0
    table = (results / "zoo.md").read_text()
    assert "| attention/dot_product |" in table and "| mixer/mamba2 |" in table
    # what each run cost, from its run.json, and the task's total
    assert all(r["timed"] and r["cpu_s"] > 0 and r["wall_s"] > 0 for r in rows), rows
    # the validation curve: the evaluation at the last step, as recorded in metrics.jsonl
    assert all(r["curve"][-1] == [6, round(r["validation_accuracy"], 4)] for r in rows), rows
    assert "## How the runs learned" in table
    cost = f"| mqar | 2 | 2 | {sum(r['cpu_s'] for r in rows) / 3600:.2f} | "
    assert cost in table, table
    again = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.stdout.count("already finished") == 2  # resumed: nothing run again
    # The per-query analysis restores the run's tested (best) model: on the whole test split
    # its accuracy is the run's test accuracy.
    run_dir = tmp_path / "runs" / "mqar" / "attention-dot_product" / "L64_d64_lr0.003"
    split = Q.per_query(str(run_dir), num=1000)
    tested = next(r for r in rows if r["kind"] == "dot_product")["test_accuracy"]
    assert abs(split["accuracy"] - tested) < 1e-6, (split["accuracy"], tested)


def test_per_query_tally_splits_by_pair_order_and_gap():
    # Hand-built rows of kv = 2 (keys 1, 2; values 7, 8; L = 12): queries of key 2 at gap 0
    # and key 1 at gap 3, and of key 1 at gap 1 and key 2 at gap 2.
    def row(queries):
        inputs = np.array([1, 7, 2, 8, 0, 0, 0, 0, 0, 0, 0, 0])
        targets, scored = np.zeros(12, int), np.zeros(12, bool)
        for key, gap in queries:
            inputs[4 + 2 * gap] = key
            targets[4 + 2 * gap], scored[4 + 2 * gap] = {1: 7, 2: 8}[key], True
        return dict(inputs=inputs, targets=targets, scored=scored)

    rows = [row([(2, 0), (1, 3)]), row([(1, 1), (2, 2)])]
    # Always the last pair's value (recency): right exactly for key 2's queries.
    recent = [np.full(12, 8), np.full(12, 8)]
    r = Q.tally(rows, recent, 2)
    assert r["accuracy"] == 0.5 and r["by_pair"] == [0.0, 1.0] and r["a_value"] == 1.0
    assert r["by_order"] == [0.5, 0.5] and r["by_gap"] == {0: 1.0, 1: 0.0, 2: 1.0, 3: 0.0}
    # A token that is no value of the row.
    r = Q.tally(rows, [np.full(12, 5)] * 2, 2)
    assert r["accuracy"] == 0.0 and r["a_value"] == 0.0


def test_logits_at_scored_positions_equal_the_full_logits():
    """The zoo tasks' output layer runs at the scored positions only (``Task.num_scored``,
    ``CausalLM(logits_at=)``): the loss, accuracy, evaluation sums and gradients equal those
    of the full logits scored through the mask."""
    import dataclasses

    import equinox as eqx
    import jax
    import jax.numpy as jnp

    from xformers_jax.train import _objective, _tasks

    c = Z.get_config("mqar,attention,dot_product,32")
    c.unlock()
    c.data.update(dict(num_train=8, num_eval=8, num_test=8, vocab_size=256))
    c.model.update(dict(dim=32, num_heads=1, hidden=64))
    task = _tasks.make_task(c.data, 0)
    assert task.num_scored == 2
    full_task = dataclasses.replace(task, num_scored=0)
    model = _tasks.build_model(c.model, task, jax.random.PRNGKey(0))
    batch = {k: jnp.stack([task.train[i][k] for i in range(4)]) for k in task.train[0]}
    at, view = _objective.scored_view(task, _tasks.models.get_model("causal_lm"), batch)
    assert at.shape == (4, 2) and bool(view["scored"].all())
    full = model(batch["inputs"])
    np.testing.assert_allclose(model(batch["inputs"], logits_at=at),
                               jnp.take_along_axis(full, at[..., None], axis=1),
                               rtol=1e-5, atol=1e-5)

    def value_and_grad(t):
        fn = _objective.make_loss_fn(t)
        return eqx.filter_value_and_grad(lambda m: fn(m, batch, None), has_aux=True)(model)

    (loss, metrics), grads = value_and_grad(task)
    (full_loss, full_metrics), full_grads = value_and_grad(full_task)
    np.testing.assert_allclose(float(loss), float(full_loss), rtol=1e-5)
    assert float(metrics["accuracy"]) == float(full_metrics["accuracy"])
    for g, h in zip(jax.tree.leaves(grads), jax.tree.leaves(full_grads)):
        np.testing.assert_allclose(g, h, rtol=1e-4, atol=1e-6)
    # evaluation, with targets the model gets right at the scored positions of rows 0 and 1
    # only: accuracy 1/2 by both paths
    answer = jnp.where(jnp.arange(4)[:, None] < 2, full.argmax(-1), batch["targets"])
    batch = dict(batch, targets=jnp.where(batch["scored"], answer, 0))
    sums = _objective.make_metrics_fn(task)(model, batch)
    full_sums = _objective.make_metrics_fn(full_task)(model, batch)
    for k in ("loss_sum", "correct", "count"):
        np.testing.assert_allclose(float(sums[k]), float(full_sums[k]), rtol=1e-5)
    assert int(sums["count"]) == 8 and int(sums["correct"]) == 4


def test_an_interrupted_run_reports_its_validation_accuracy(tmp_path):
    """A run stopped before its test (``preempted``: checkpointed, the sweep resumes it) shows
    its last validation accuracy and step as unfinished, not as an error; a run that failed
    shows ``error``."""
    from xformers_jax_experiments.studies.zoo import run as R

    def make(name, log, metrics):
        where = tmp_path / "runs" / name
        where.mkdir(parents=True)
        (where / "train.log").write_text(log)
        (where / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
        return R._row(str(tmp_path / "runs"), name, {})

    stopped = make("mqar/attention-based/L64_d64_lr0.003",
                   "start\npreempted at step 2300: checkpoint saved, rerun\n",
                   [{"step": 2000, "validation_accuracy": 0.125},
                    {"step": 2200, "validation_accuracy": 0.2},  # then preempted, resumed:
                    {"step": 2200, "validation_accuracy": 0.25}, {"step": 2300, "train_loss": 1}])
    failed = make("mqar/attention-linear/L64_d64_lr0.003", "Traceback\nValueError: bad\n",
                  [{"step": 200, "validation_accuracy": 0.01}])
    assert stopped.get("unfinished") and "error" not in stopped
    assert stopped["curve"] == [[2000, 0.125], [2200, 0.25]]  # a repeated step: its last
    assert failed["error"] == "ValueError: bad"
    # run.json's last start says how the run ended before the log does: a start refused before
    # it was recorded (another config) leaves a preempted run unfinished; a recorded failure is
    # the error; a killed start (no outcome) falls back to the log.
    def recorded(name, log, *sessions):
        where = tmp_path / "runs" / name
        where.mkdir(parents=True)
        (where / "train.log").write_text(log)
        (where / "metrics.jsonl").write_text(json.dumps(
            {"step": 300, "validation_accuracy": 0.5}) + "\n")
        (where / "run.json").write_text(json.dumps(
            {"config_file": "config.json", "sessions": list(sessions)}))
        return R._row(str(tmp_path / "runs"), name, {})

    ended = {"started": "2026-01-01 00:00:00", "wall_s": 1.0, "cpu_s": 1.0}
    refused = recorded("mqar/mixer-h3/L64_d64_lr0.003", "ConfigChanged: model.x: 1 -> 2\n",
                       dict(ended, outcome="preempted", step=300))
    assert refused.get("unfinished") and refused["validation_step"] == 300
    assert "error" not in refused
    broke = recorded("mqar/mixer-h3/L128_d64_lr0.003", "preempted at step 300\n",
                     dict(ended, outcome="failed: FloatingPointError: loss is nan"))
    assert broke["error"] == "FloatingPointError: loss is nan" and "unfinished" not in broke
    killed = recorded("mqar/mixer-h3/L256_d64_lr0.003", "step 300\n",
                      dict(ended, outcome="preempted"), {"started": "2026-01-01 00:01:00"})
    assert killed["error"] == "step 300" and killed["timed"] is False
    induced = make("induction/attention-dot_product/L256_d64_lr0.003", "done\n",
                   [{"step": 1000, "validation_accuracy": 0.98}, {"step": 1000,
                                                                  "test_accuracy": 0.5}])
    assert "test_L" not in induced  # no config.json: the test length is unknown
    (tmp_path / "runs" / "induction/attention-dot_product/L256_d64_lr0.003" /
     "config.json").write_text(json.dumps({"data": {"test_seq_len": 1024}}))
    induced = R._row(str(tmp_path / "runs"), "induction/attention-dot_product/L256_d64_lr0.003",
                     {})
    assert induced["test_L"] == 1024
    # A trainer holding the workdir (this process, alive) is running, not failed; a lock left
    # by a process that is gone is stale and changes nothing.
    import socket

    def locked(name, pid):
        (tmp_path / "runs" / name / "lock").write_text(json.dumps(
            {"host": socket.gethostname(), "pid": pid, "started": "", "argv": []}))
        return R._row(str(tmp_path / "runs"), name, {})

    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()
    assert "running" not in locked("mqar/attention-linear/L64_d64_lr0.003", int(gone))
    running = make("mqar/mixer-mamba2/L64_d64_lr0.003", "start\n",
                   [{"step": 4400, "validation_accuracy": 0.95}])
    assert running["error"] == "start"  # no lock: a log that stops without a result failed
    running = locked("mqar/mixer-mamba2/L64_d64_lr0.003", os.getpid())
    assert running["running"] and "error" not in running
    text = R.report([stopped, failed, induced, running], str(tmp_path / "results"), None, "cpu")
    assert "| attention/dot_product | 0.500 at L=1024 (0.980 at L=256) |" in text
    assert "| attention/based | (0.250 validation at step 2200, unfinished) |" in text
    assert "| attention/linear | error |" in text
    assert "| mixer/mamba2 | (0.950 validation at step 4400, running) |" in text
    # every run's curve at the shown steps (up to the task's last evaluation: 4400), its last
    # evaluation and its first at 0.9
    assert ("| run | step 200 | step 400 | step 1000 | step 2000 | step 3000 | step 4000 | "
            "last evaluation | best evaluation | first at 0.9 |") in text
    assert ("| attention/based L=64 d=64 lr=0.003 |  |  |  | 0.125 |  |  | 0.250 (step 2200) "
            "| 0.250 (step 2200) |  |") in text
    assert "| attention/linear L=64 d=64 lr=0.003 | 0.010 |" in text
    assert "| 0.950 (step 4400) | 0.950 (step 4400) | step 4400 |" in text
    # a curve that fell back: its best is not its last
    fell = dict(stopped, curve=[[200, 0.5], [400, 0.93], [600, 0.93], [800, 0.7]])
    text = R.report([fell], str(tmp_path / "fell"), None, "cpu")
    assert "| 0.700 (step 800) | 0.930 (step 400) | step 400 |" in text
    assert (tmp_path / "results" / "zoo_curves.png").stat().st_size > 0


def test_results_add_up_across_invocations_and_machines():
    """A run with nothing on disk keeps its row of the earlier zoo.json (another kind's, or
    one finished on another machine); a run on disk with a result replaces its earlier row."""
    from xformers_jax_experiments.studies.zoo import run as R

    def row(kind, acc=None, lr=3e-3, **extra):
        r = dict(task="mqar", slot="mixer", kind=kind, L=64, d=64, lr=lr, **extra)
        if acc is not None:
            r["test_accuracy"] = acc
        return r

    earlier = [row("h3", 0.25), row("retnet", 0.5), row("hyena", 0.2)]
    fresh = [row("retnet", 0.99), row("h3"), row("mamba", 0.3), row("retnet", 0.7, lr=1e-3)]
    merged = {(r["kind"], r["lr"]): r.get("test_accuracy") for r in R.merge_rows(earlier, fresh)}
    assert merged == {("h3", 3e-3): 0.25, ("retnet", 3e-3): 0.99, ("hyena", 3e-3): 0.2,
                      ("mamba", 3e-3): 0.3, ("retnet", 1e-3): 0.7}
    # an unfinished or failed run on disk is a result too: it replaces the earlier row
    merged = R.merge_rows(earlier, [row("h3", error="ValueError: bad")])
    assert next(r for r in merged if r["kind"] == "h3").get("test_accuracy") is None


def test_best_rows_prefer_finished_runs_then_validation():
    """Over learning rates, a finished run beats every unfinished one whatever its
    validation, and among unfinished runs the one with the higher validation is shown."""
    from xformers_jax_experiments.studies.zoo import run as R

    def row(lr, **extra):
        return dict(task="selective_copy", slot="mixer", kind="mamba", L=256, d=64, lr=lr,
                    **extra)

    unfinished = [row(3e-3, validation_accuracy=0.764), row(1e-3, validation_accuracy=0.892)]
    (best,) = R.best_rows(unfinished).values()
    assert best["lr"] == 1e-3
    (best,) = R.best_rows(unfinished[::-1]).values()
    assert best["lr"] == 1e-3
    finished = unfinished + [row(1e-2, test_accuracy=0.5, validation_accuracy=0.5)]
    (best,) = R.best_rows(finished).values()
    assert best["lr"] == 1e-2


def test_unrolled_layers_equal_the_scanned_stack():
    """``scan_layers=False`` (the zoo's two layers unrolled) computes what the scanned stack
    does, with the same parameters: logits and gradients."""
    import equinox as eqx
    import jax
    import jax.numpy as jnp

    from xformers_jax import models

    c = Z.get_config("selective_copy,mixer,gated_deltanet,32")
    c.unlock()
    assert c.model.scan_layers is False
    from tests.fast_jit import build, jit0

    task = type("T", (), dict(vocab_size=18, seq_len=32))()
    kind = models.get_model("causal_lm")
    unrolled = build(lambda key: kind.build(c.model, task, key), 0)
    c.model.scan_layers = True
    scanned = build(lambda key: kind.build(c.model, task, key), 0)
    assert scanned.layers.scan and not unrolled.layers.scan
    tokens = jax.random.randint(jax.random.PRNGKey(1), (2, 32), 0, 18)

    def loss(model):
        logits = model(tokens)
        return jnp.mean(jax.nn.logsumexp(logits, -1) - logits[..., 3]), logits

    def grad(model):
        params, static = eqx.partition(model, eqx.is_inexact_array)
        return jit0(jax.value_and_grad(lambda p: loss(eqx.combine(p, static)),
                                       has_aux=True))(params)

    (l1, o1), g1 = grad(unrolled)
    (l2, o2), g2 = grad(scanned)
    np.testing.assert_allclose(o1, o2, rtol=1e-5, atol=1e-5)
    for a, b in zip(jax.tree.leaves(eqx.filter(g1, eqx.is_inexact_array)),
                    jax.tree.leaves(eqx.filter(g2, eqx.is_inexact_array))):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_positions_study_builds_its_variants_and_trains():
    """The input-positions study (``studies/zoo/positions.py``): each variant is the zoo's
    model with the scheme, output layer and embedding scale it names; its loop trains."""
    import jax

    from xformers_jax_experiments.studies.zoo import positions as P

    key = jax.random.PRNGKey(0)
    plain = P.build("mamba", "sinusoidal", True, 1.0, 32, 18, key)
    bare = P.build("mamba", "none", True, 1.0, 32, 18, key)
    untied = P.build("mamba", "sinusoidal", False, 1.0, 32, 18, key)
    scaled = P.build("mamba", "sinusoidal", True, None, 32, 18, key)
    assert isinstance(bare.embed.positions, nn.NoPositions)
    assert isinstance(plain.embed.positions, nn.SinusoidalPositions)
    assert plain.head is None and untied.head is not None
    np.testing.assert_allclose(scaled.embed.table, 8.0 * plain.embed.table, rtol=1e-6)
    # softmax attention on induction heads, its tokens (not the table) scaled before the
    # sinusoids; unscaled unless the variant says so (the zoo's attention slot scales them)
    attention = P.build("dot_product", "sinusoidal", True, 1.0, 32, 17, key, slot="attention",
                        task="induction", scale_tokens=True)
    assert attention.embed.token_scale == 8.0
    unscaled = P.build("dot_product", "sinusoidal", True, 1.0, 32, 17, key, slot="attention",
                       task="induction")
    assert unscaled.embed.token_scale == 1.0
    np.testing.assert_allclose(attention.embed.table, unscaled.embed.table, rtol=0)
    assert set(P.VARIANTS) == {"sinusoidal", "none", "untied", "table_scaled", "tokens_scaled"}
    source = D.SelectiveCopying(8, seed=0, seq_len=32, num_tokens=4)
    acc = P.train(bare, source, steps=2, every=1, batch_size=4, learning_rate=1e-3)
    assert sorted(acc) == [1, 2] and all(0.0 <= a <= 1.0 for a in acc.values())
