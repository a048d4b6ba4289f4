"""The experiments package is ``xformers_jax_experiments``: nothing names the old top-level
``experiments`` (an import of it would load another project's package, or an old checkout's)."""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
OLD = re.compile(r"(?<![\w/.-])experiments[./]")


def _files():
    yield from (ROOT / "xformers_jax_experiments").rglob("*.py")
    yield from (ROOT / "xformers_jax_experiments").rglob("*.sh")
    yield from (ROOT / "xformers_jax_experiments").rglob("*.md")
    yield from (ROOT / "tests").rglob("*.py")
    yield from (ROOT / name for name in ("README.md", "BUILD.md", "BENCHMARKS.md",
                                         "CATALOGUE.md", "pyproject.toml", ".gitignore"))


def test_nothing_names_the_old_package():
    stale = []
    for path in _files():
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if OLD.search(line):
                stale.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not stale, "\n".join(stale)
