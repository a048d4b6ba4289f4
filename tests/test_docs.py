"""The documentation site builds with strict checking: a broken cross-reference, a missing
snippet (a guide's script or a generated table), a page left out of the navigation or a
docstring section that cannot be read fails it."""

import importlib.util
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
TOOLS = ("mkdocs", "material", "mkdocstrings_handlers.python", "griffe_public_redundant_aliases")
MISSING = [m for m in TOOLS if importlib.util.find_spec(m.split(".")[0]) is None
           or importlib.util.find_spec(m) is None]


def _build(config, site):
    # Not -q: under -q mkdocs drops the warnings before --strict counts them.
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f",
                           str(config), "-d", str(site)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.skipif(bool(MISSING), reason=f"the docs tools are not installed ({MISSING}): "
                                          "pip install -e '.[docs]'")
def test_docs_build_strict(tmp_path):
    done = _build(ROOT / "mkdocs.yml", tmp_path / "site")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    # The API reference lists the re-exported names, not only the package docstrings.
    attention = (tmp_path / "site" / "api" / "attention" / "index.html").read_text()
    assert 'id="xformers_jax.attention.flash_attention"' in attention
    catalogue = (tmp_path / "site" / "catalogue" / "index.html").read_text()
    assert "num_landmarks" in catalogue
    guide = (tmp_path / "site" / "guides" / "new_kind" / "index.html").read_text()
    assert "register_kind" in guide


@pytest.mark.skipif(bool(MISSING), reason=f"the docs tools are not installed ({MISSING})")
def test_docs_build_fails_on_a_broken_reference(tmp_path):
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "index.md").write_text(
        "# Home\n\nSee [nothing][xformers_jax.kinds.no_such_function].\n\n::: xformers_jax.kinds\n")
    config = ROOT / "mkdocs.yml"
    text = config.read_text().split("\nnav:")[0]
    text = text.replace("docs_dir: docs", f"docs_dir: {docs}").replace('["."]', f'["{ROOT}"]')
    (tmp_path / "mkdocs.yml").write_text(text + "\nnav:\n  - Home: index.md\n")
    done = _build(tmp_path / "mkdocs.yml", tmp_path / "site")
    assert done.returncode != 0
    assert "no_such_function" in done.stdout + done.stderr
