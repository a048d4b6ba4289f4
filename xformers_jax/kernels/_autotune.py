"""Tile sizes fitted to the machine: the tiled kernel's cost per score element by tile size.

How much a square ``t x t`` tile costs per score element depends on the CPU (cache sizes,
vector width, the matmul kernels XLA picks for it) and on the JAX version (fusion, the scan's
per-step cost). ``pattern_tile`` in ``xformers_jax.attention`` weighs the tiles a sparse
pattern leaves non-empty at each size by this cost, and ``default_block`` is the size flash
attention uses for full and causal attention. Rather than one table measured on one CPU, the
table is measured once on first use (fwd+bwd of the kernel itself over full attention at
``_PROBE_LEN`` keys, 4 heads, for each size, in interleaved rounds: about a second of timing
plus four small compilations on a 2-core CPU) and cached per CPU model and JAX version in the user's cache directory
(``$XDG_CACHE_HOME/xformers_jax/``, default ``~/.cache/xformers_jax/``).

The environment variable ``XFORMERS_JAX_TILES`` overrides it:

- unset or ``auto``: the cached table, measured on first use;
- ``measure``: measure now and overwrite the cache (after a JAX upgrade of the same version
  string, or when the first measurement was taken on a busy machine);
- ``default``: the fixed table ``DEFAULT_TILE_COST`` (deterministic; the test suite sets it);
- ``512=1,256=1.7,128=2.1,64=2.8``: this table (sizes to relative costs).

The measurement is taken twice; if the two disagree (by more than ``_NOISE`` on some size, or
about the cheapest size) the machine was too busy to tell, and the fixed table is used and
cached instead (``measure`` tries again). On a 2-core AMD EPYC shared with other jobs (load
10-12), three single measurements all named 128 cheapest but put 512 at 1.4x, 1.5x and 3.5x.

The same mechanism is meant to pick Pallas block sizes on GPU/TPU (a table per device kind).
"""

from __future__ import annotations

import functools
import json
import os
import platform
import re
import time
from typing import Callable

import numpy as np

ENV = "XFORMERS_JAX_TILES"

# The fallback (and test) table: flash_attention fwd+bwd over Full() at L=2048 (H=4, D=64) on
# a 2-core AMD EPYC took 311, 234, 189 and 112 ms with 64, 128, 256 and 512 tiles.
DEFAULT_TILE_COST = {512: 1.0, 256: 1.69, 128: 2.1, 64: 2.79}
TILE_SIZES = tuple(sorted(DEFAULT_TILE_COST, reverse=True))
_PROBE_LEN = 1024
_CACHE_VERSION = 2  # 1: tables timed in process CPU time (wrong for small tiles)
_NOISE = 0.25


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo`` on Linux, else ``platform.processor()``)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def cache_path() -> str:
    """The cache file for this CPU model and JAX version."""
    import jax

    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    slug = re.sub(r"[^A-Za-z0-9]+", "-", f"{cpu_model()}-{os.cpu_count()}cores").strip("-")
    return os.path.join(root, "xformers_jax", f"tiles-{slug}-jax{jax.__version__}.json")


def parse_table(text: str) -> dict[int, float]:
    """``"512=1,256=1.7"`` -> ``{512: 1.0, 256: 1.7}``; raises ValueError naming the problem."""
    table = {}
    for item in filter(None, (x.strip() for x in text.split(","))):
        size, sep, cost = item.partition("=")
        try:
            size_i, cost_f = int(size), float(cost)
        except ValueError:
            size_i, cost_f = 0, 0.0
        if not sep or size_i <= 0 or size_i % 8 or not cost_f > 0:
            raise ValueError(
                f"{ENV}: expected 'auto', 'default' or 'size=cost,...' with sizes positive "
                f"multiples of 8 and costs > 0, got {text!r} (bad item {item!r})")
        table[size_i] = cost_f
    if not table:
        raise ValueError(f"{ENV}: empty tile table {text!r}")
    return table


def measure_tile_costs(sizes=TILE_SIZES, length: int = _PROBE_LEN, heads: int = 4,
                       rounds: int = 5) -> dict[int, float]:
    """Times the tiled kernel's fwd+bwd over full attention (``heads`` heads vmapped, as
    ``multihead`` runs them, D=64) at ``length`` keys with square tiles of each size; returns
    the cost per score element relative to the cheapest.

    Time is wall time, each size keeping its least time over interleaved rounds, so a burst
    of load from other processes hits every size alike and the minimum discards it. Not CPU
    time: a small tile's matmuls and reductions are too small for XLA:CPU to split across
    threads, so it runs mostly on one core and spends less CPU time per element while taking
    more wall time. On a 2-core Intel Xeon (Sapphire Rapids) CPU time named 64 the cheapest
    size (64: 1.00, 512: 1.08), and the ``peers`` suite's training step at L=2048 took 1578 ms
    on those 64 tiles against 825 ms on 512 tiles; wall time gave 512: 1.00, 256: 1.49, 128:
    1.89, 64: 1.91.
    """
    import jax
    import jax.numpy as jnp

    from ._layout import BlockLayout
    from ._tiled import attend_layout

    q, k, v = jax.random.normal(jax.random.PRNGKey(0), (3, heads, length, 64))
    steps = {}
    for t in sizes:
        n = -(-length // t)
        layout = BlockLayout(length, length, t, t, np.full((n, n), 2, np.int8),
                             np.full((n, n), -1, np.int32), np.zeros((0, t, t), bool))
        one = lambda q, k, v, layout=layout: attend_layout(  # noqa: E731
            q, k, v, layout, scale=0.125)[0]
        loss = lambda q, k, v, one=one: jnp.sum(jax.vmap(one)(q, k, v))  # noqa: E731
        steps[t] = (jax.jit(jax.grad(loss, argnums=(0, 1, 2))), float((n * t) ** 2))
        jax.block_until_ready(steps[t][0](q, k, v))  # compile and warm up
    best_time = {t: float("inf") for t in steps}
    for _ in range(rounds):
        for t, (f, _) in steps.items():
            t0 = time.perf_counter()
            jax.block_until_ready(f(q, k, v))
            best_time[t] = min(best_time[t], time.perf_counter() - t0)
    per_element = {t: best_time[t] / area for t, (_, area) in steps.items()}
    best = min(per_element.values())
    return {t: round(c / best, 3) for t, c in per_element.items()}


def _load(path: str) -> dict[int, float] | None:
    try:
        with open(path) as f:
            data = json.load(f)
        if data.get("version") != _CACHE_VERSION:
            return None
        return {int(s): float(c) for s, c in data["tile_cost"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def _store(path: str, table: dict[int, float]) -> None:
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(dict(version=_CACHE_VERSION, cpu=cpu_model(),
                           tile_cost={str(s): c for s, c in table.items()}), f)
        os.replace(tmp, path)  # atomic: concurrent first uses never read half a file
    except OSError:
        pass  # a read-only home: measure again next process


def resolve_tile_costs(setting: str | None, *, path: str | None = None,
                       measure: Callable[[], dict[int, float]] = measure_tile_costs
                       ) -> dict[int, float]:
    """The table for an ``XFORMERS_JAX_TILES`` value (see the module docstring)."""
    setting = (setting or "auto").strip()
    if setting == "default":
        return dict(DEFAULT_TILE_COST)
    if setting not in ("auto", "measure"):
        return parse_table(setting)
    path = path or cache_path()
    table = _load(path) if setting == "auto" else None
    if table is None:
        table = _stable(measure(), measure())
        _store(path, table)
    return table


def _stable(a: dict[int, float], b: dict[int, float]) -> dict[int, float]:
    """The mean of two measurements if they agree, else the fixed table."""
    if (set(a) != set(b) or min(a, key=a.get) != min(b, key=b.get)
            or any(abs(a[t] - b[t]) > _NOISE * min(a[t], b[t]) for t in a)):
        return dict(DEFAULT_TILE_COST)
    return {t: round((a[t] + b[t]) / 2, 3) for t in a}


@functools.lru_cache(maxsize=None)
def _cached(setting: str | None) -> tuple[tuple[int, float], ...]:
    return tuple(sorted(resolve_tile_costs(setting).items(), reverse=True))


def tile_costs() -> dict[int, float]:
    """This machine's cost per score element by square tile size (largest size first)."""
    return dict(_cached(os.environ.get(ENV)))


def default_block() -> int:
    """The tile size with the least cost per element: flash attention's default for full and
    causal attention (ties go to the larger tile)."""
    table = tile_costs()
    return min(table, key=lambda t: (table[t], -t))
