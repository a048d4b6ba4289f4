"""The machine-fitted tile table (xformers_jax/kernels/_autotune.py).

No test here measures anything: measurement is replaced by counting fakes, so the suite stays
deterministic and never autotunes (conftest.py sets XFORMERS_JAX_TILES=default).
"""

import json
import os

import pytest

from xformers_jax.attention import pattern_tile
from xformers_jax.attention import patterns as P
from xformers_jax.kernels import _autotune as A


def test_the_suite_runs_on_the_fixed_table():
    assert os.environ[A.ENV] == "default"
    assert A.tile_costs() == A.DEFAULT_TILE_COST
    assert A.default_block() == 512


def test_parse_table_and_its_errors():
    assert A.parse_table("512=1, 256=1.5,64=3") == {512: 1.0, 256: 1.5, 64: 3.0}
    for bad in ("512", "512=x", "100=1", "512=0", "-64=1", ""):
        with pytest.raises(ValueError, match=A.ENV):
            A.parse_table(bad)


class _Fake:
    def __init__(self, *tables):
        self.tables, self.calls = list(tables), 0

    def __call__(self):
        self.calls += 1
        return dict(self.tables[(self.calls - 1) % len(self.tables)])


def test_measured_once_then_read_from_the_cache(tmp_path):
    path = str(tmp_path / "sub" / "tiles.json")
    fake = _Fake({512: 1.3, 256: 1.0, 128: 1.2, 64: 2.0}, {512: 1.4, 256: 1.0, 128: 1.3, 64: 2.2})
    first = A.resolve_tile_costs("auto", path=path, measure=fake)
    assert fake.calls == 2  # two measurements, averaged when they agree
    assert first == {512: 1.35, 256: 1.0, 128: 1.25, 64: 2.1}
    assert json.load(open(path))["tile_cost"] == {str(k): v for k, v in first.items()}
    assert A.resolve_tile_costs(None, path=path, measure=fake) == first
    assert fake.calls == 2  # the second process reads the file
    A.resolve_tile_costs("measure", path=path, measure=fake)
    assert fake.calls == 4  # "measure" measures again and rewrites it


def test_disagreeing_measurements_fall_back_to_the_fixed_table(tmp_path):
    path = str(tmp_path / "tiles.json")
    noisy = _Fake({512: 1.0, 256: 1.1, 128: 1.5, 64: 2.0}, {512: 1.3, 256: 1.0, 128: 1.5, 64: 2.0})
    assert A.resolve_tile_costs("auto", path=path, measure=noisy) == A.DEFAULT_TILE_COST
    assert A.resolve_tile_costs("auto", path=path, measure=noisy) == A.DEFAULT_TILE_COST
    assert noisy.calls == 2  # the fallback is cached too


def test_a_corrupt_cache_is_measured_again(tmp_path):
    path = tmp_path / "tiles.json"
    path.write_text("{not json")
    fake = _Fake({512: 1.0, 256: 2.0})
    assert A.resolve_tile_costs("auto", path=str(path), measure=fake) == {512: 1.0, 256: 2.0}
    assert fake.calls == 2


def test_override_and_default_never_measure(tmp_path):
    fake = _Fake({512: 1.0})
    path = str(tmp_path / "tiles.json")
    assert A.resolve_tile_costs("default", path=path, measure=fake) == A.DEFAULT_TILE_COST
    assert A.resolve_tile_costs("512=1,64=5", path=path, measure=fake) == {512: 1.0, 64: 5.0}
    assert fake.calls == 0 and not os.path.exists(path)


def test_cache_file_is_per_cpu_model_and_jax_version(monkeypatch, tmp_path):
    import jax

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    path = A.cache_path()
    assert path.startswith(str(tmp_path / "xformers_jax"))
    assert jax.__version__ in os.path.basename(path)
    monkeypatch.setattr(A, "cpu_model", lambda: "Some Other CPU")
    assert A.cache_path() != path and "Some-Other-CPU" in A.cache_path()


def test_pattern_tile_and_flash_default_follow_the_table(monkeypatch):
    n = 4096
    assert pattern_tile(P.BigBird(64), n, n) == 64
    # A machine where small tiles are ruinous: BigBird is computed on large tiles instead, and
    # a machine where 256 is cheapest per element makes it flash's default tile.
    monkeypatch.setenv(A.ENV, "512=1,256=1.1,128=30,64=40")
    assert pattern_tile(P.BigBird(64), n, n) in (256, 512)
    monkeypatch.setenv(A.ENV, "512=1.2,256=1,128=3")
    assert A.default_block() == 256
    assert pattern_tile(P.Full(), n, n) == 256
