"""xformers_jax_experiments/sweep.py: get_hyper sweeps, the TPU pod dry run, a tiny local
sweep's table."""

import shlex
import textwrap

import pytest

from xformers_jax_experiments import sweep

_CONFIG = textwrap.dedent('''
    from xformers_jax import train


    def get_config(arg=None):
        c = train.base_config("listops")
        c.data.update(dict(num_train=32, num_eval=8, num_test=8, min_length=4, max_length=12,
                           max_depth=2, max_args=3))
        c.model.update(dict(dim=8, num_layers=1, num_heads=1, hidden=16, pooling="mean"))
        c.update(dict(batch_size=8, num_train_steps=2, log_every=1, eval_every=2,
                      checkpoint_every=2, tensorboard=False, progress_bar=False, plot=False))
        c.lock()
        return c


    def get_hyper(hyper):
        return hyper.product([hyper.sweep("config.optim.learning_rate", [1e-3, 3e-3]),
                              hyper.sweep("config.model.pooling", ["mean"])])
''')


def _config_file(tmp_path):
    path = tmp_path / "tiny.py"
    path.write_text(_CONFIG)
    return str(path)


def test_hyper_combinators():
    h = sweep.Hyper()
    runs = h.product([h.sweep("config.a", [1, 2]), h.sweep("config.b", ["x", "y"])])
    assert runs == [{"config.a": 1, "config.b": "x"}, {"config.a": 1, "config.b": "y"},
                    {"config.a": 2, "config.b": "x"}, {"config.a": 2, "config.b": "y"}]
    assert h.chainit([h.sweep("config.a", [1]), h.fixed("config.b", 2)]) == [
        {"config.a": 1}, {"config.b": 2}]
    assert h.zipit([h.sweep("config.a", [1, 2]), h.sweep("config.b", [3, 4])]) == [
        {"config.a": 1, "config.b": 3}, {"config.a": 2, "config.b": 4}]
    with pytest.raises(ValueError, match="equal length"):
        h.zipit([h.sweep("config.a", [1]), h.sweep("config.b", [3, 4])])
    with pytest.raises(ValueError, match="start with 'config.'"):
        h.sweep("optim.learning_rate", [1])


def test_tpu_dry_run_emits_the_pod_commands(tmp_path):
    config = _config_file(tmp_path) + ":arg"
    runs = sweep.load_hyper(config)
    assert runs == [{"config.optim.learning_rate": 1e-3, "config.model.pooling": "mean"},
                    {"config.optim.learning_rate": 3e-3, "config.model.pooling": "mean"}]
    cmds = sweep.tpu_commands(config, "/mnt/runs", runs, ["num_train_steps=5"], tpu="pod",
                              zone="us-central2-b", project="proj")
    assert len(cmds) == 2
    argv = shlex.split(cmds[1])
    assert argv[:9] == ["gcloud", "compute", "tpus", "tpu-vm", "ssh", "pod",
                        "--zone=us-central2-b", "--project=proj", "--worker=all"]
    remote = argv[9]
    assert remote.startswith("--command=cd ~/xformers_jax && ")
    assert shlex.split(remote.split(" && ", 1)[1]) == [
        "python3", "-m", "xformers_jax_experiments.train", f"--config={config}",
        "--workdir=/mnt/runs/001", "--config.num_train_steps=5",
        "--config.optim.learning_rate=0.003", "--config.model.pooling=mean", "--multihost"]


def test_tiny_local_sweep_gathers_a_table(tmp_path):
    config = _config_file(tmp_path)
    base = str(tmp_path / "runs")
    runs = sweep.load_hyper(config)
    codes = sweep.run_local(config, base, runs, num_processes=2, log=lambda _: None)
    assert codes == [0, 0], open(f"{base}/000/train.log").read()[-2000:]
    rows = sweep.gather(base, runs)
    assert [r["optim.learning_rate"] for r in rows] == [1e-3, 3e-3]
    for r in rows:
        assert 0.0 <= r["test_accuracy"] <= 1.0 and r["test_loss"] > 0
    text = sweep.table(rows)
    assert text.splitlines()[0].startswith("| run | optim.learning_rate | model.pooling |")
    assert "| 001 | 0.003 | mean |" in text


def test_resume_keeps_finished_runs(tmp_path):
    # A run whose directory holds a finished run's metrics is not started again; any other
    # is (here it fails: the config file does not exist).
    base = str(tmp_path / "runs")
    runs = [{"config.a": 1}, {"config.a": 2}]
    (tmp_path / "runs" / "000").mkdir(parents=True)
    (tmp_path / "runs" / "000" / "metrics.jsonl").write_text(
        '{"step": 2, "train_loss": 1.0}\n{"step": 2, "test_accuracy": 0.5}\n')
    logs = []
    codes = sweep.run_local(str(tmp_path / "missing.py"), base, runs, resume=True,
                            log=logs.append)
    assert codes[0] == 0 and codes[1] != 0
    assert any("000 already finished" in line for line in logs)
    assert not any("start 000" in line for line in logs)
    assert [r.get("test_accuracy") for r in sweep.gather(base, runs)] == [0.5, None]


def test_the_listops_configs_sweep_has_several_runs_that_validate():
    from xformers_jax import train
    from xformers_jax_experiments.configs.lra import listops

    config = "xformers_jax_experiments/configs/lra/listops.py:performer,runlocal"
    runs = sweep.load_hyper(config)
    assert len(runs) == 6
    assert {r["config.optim.learning_rate"] for r in runs} == {5e-4, 1e-3, 2e-3}
    assert {r["config.seed"] for r in runs} == {0, 1}

    for run in runs:  # every run's overrides apply to the config and validate
        c = listops.get_config("performer,runlocal")
        with c.unlocked():
            for key, value in run.items():  # "config.optim.learning_rate"
                *path, last = key.split(".")[1:]
                node = c
                for part in path:
                    node = node[part]
                node[last] = value
        train.validate_config(c)
