"""Every command and code block README.md shows is exercised: the Python block runs, the
install lines name extras pyproject.toml defines, the main command's flags and config resolve
to the run README describes and, shortened to a few steps, print the summary line README
shows on the same data, and the test command (which CI runs verbatim, .ci/run) installs what
the suite's tools need."""

import importlib.util
import json
import os
import pathlib
import re
import shlex
import subprocess
import sys
import tomllib

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
EXTRAS = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]


def _blocks(language):
    return re.findall(rf"^```{language}\n(.*?)^```", README, re.M | re.S)


def _marked(marker):
    """The command in the bash block after ``<!-- marker -->`` (as .ci/run reads it)."""
    after = README.split(f"<!-- {marker} -->", 1)[1]
    return re.search(r"```bash\n(.*?)\n", after).group(1)


def test_python_block_runs():
    (block,) = _blocks("python")
    namespace = {}
    exec(compile(block, "README.md", "exec"), namespace)  # noqa: S102 - README's own code
    assert namespace["logits"].shape == (8, 10)
    assert np.isfinite(np.asarray(namespace["logits"])).all()


def test_every_bash_line_is_known():
    """Each command README shows is one this file (or CI) exercises."""
    commands = [c for block in _blocks("bash") for c in block.strip().splitlines()]
    assert commands == [_marked("install"), _marked("main-command"), _marked("test-command")]


def test_installs_name_existing_extras():
    for command in (_marked("install"), _marked("test-command")):
        for extras in re.findall(r"\.\[([\w,]+)\]", command):
            for extra in extras.split(","):
                assert extra in EXTRAS, f"README installs the unknown extra {extra!r}"


def test_the_test_command_installs_the_suites_tools():
    # tests/test_docs.py builds the site: CI must install the docs tools, or it only skips.
    extras = re.search(r"\.\[([\w,]+)\]", _marked("test-command")).group(1).split(",")
    assert {"test", "docs"} <= set(extras)
    ci = (ROOT / ".ci" / "run").read_text()
    assert "test-command" in ci


def test_main_command_resolves(tmp_path):
    """The main command as README prints it, with ``--print_config``: its module, flags, config
    file and variant resolve, to the run README describes (Performer, 800 steps)."""
    argv = shlex.split(_marked("main-command"))
    assert argv[:3] == ["python", "-m", "xformers_jax_experiments.train"]
    argv = [a if not a.startswith("--workdir=") else f"--workdir={tmp_path}" for a in argv]
    done = subprocess.run([sys.executable, *argv[1:], "--print_config"], cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    config = json.loads(done.stdout)
    assert config["model"]["attention"]["kind"] == "performer"
    assert config["data"]["task"] == "listops"
    assert f"step {config['num_train_steps']} " in README
    assert not any(tmp_path.iterdir())  # --print_config trains nothing


SUMMARY = re.compile(r"step (\d+) \(best checkpoint: step \d+\): test accuracy (\d\.\d{4}), "
                     r"test loss \d+\.\d{4} \(majority class: (\d\.\d{4})\)")


def test_main_command_runs_and_prints_the_line_readme_shows(tmp_path):
    """The main command verbatim, shortened to 4 steps: it says what it does before the first
    step and ends with the summary line README shows, on the same data (the majority-class
    baseline README states)."""
    argv = shlex.split(_marked("main-command"))
    argv = [a if not a.startswith("--workdir=") else f"--workdir={tmp_path / 'run'}"
            for a in argv]
    short = ["--config.num_train_steps=4", "--config.eval_every=2", "--config.log_every=2",
             "--config.checkpoint_every=2", "--config.progress_bar=False"]
    done = subprocess.run([sys.executable, *argv[1:], *short], cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stderr.lstrip().startswith("listops: classifier with performer attention")
    (line,) = [m for m in SUMMARY.finditer(done.stdout)]
    (shown,) = [m for m in SUMMARY.finditer(README)]
    assert line.group(1) == "4" and shown.group(1) == "800"
    assert line.group(3) == shown.group(3)  # the baseline README states is this data's
    if importlib.util.find_spec("matplotlib"):
        assert (tmp_path / "run" / "curves.png").exists()
