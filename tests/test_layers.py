"""The import graph: layers point one way, and modules form a DAG.

Reads every module of the project with ``ast`` (imports inside functions included) and checks
that no module imports a higher layer and that no import cycle exists module by module, so
the kernel layer can be read, tested and reused without what is built on it.
"""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("xformers_jax", "pallas_kernels")

# Lowest first. A module may import modules of its own layer or of a lower one.
LAYERS = (
    ("xformers_jax.axes",),
    ("xformers_jax.kernels",),
    ("pallas_kernels",),
    ("xformers_jax.attention", "xformers_jax.experts", "xformers_jax.mixers"),
    ("xformers_jax.data",),
    ("xformers_jax.nn",),
    ("xformers_jax.models",),
    ("xformers_jax.compress",),
    ("xformers_jax.parallel",),
    ("xformers_jax.train", "xformers_jax.viz", "xformers_jax"),
)


def _modules():
    mods = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            is_pkg = parts[-1] == "__init__"
            if is_pkg:
                parts = parts[:-1]
            mods[".".join(parts)] = (path, is_pkg)
    return mods


def _imports(name, path, is_pkg, known):
    out = set()
    package = name.split(".") if is_pkg else name.split(".")[:-1]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            mod = ".".join(base + ([node.module] if node.module else []))
            targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in known else mod
                       for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in known:
                t = t.rpartition(".")[0]
            if t and t != name:
                out.add(t)
    return out


def _layer(module):
    best = None
    for rank, prefixes in enumerate(LAYERS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and (best is None or len(p) > best[1]):
                best = (rank, len(p))
    assert best is not None, f"{module} is in no layer: add it to LAYERS"
    return best[0]


def _graph():
    mods = _modules()
    return {m: _imports(m, p, is_pkg, mods) for m, (p, is_pkg) in mods.items()}


def test_no_module_imports_a_higher_layer():
    bad = [f"{m} -> {t}" for m, ts in _graph().items() for t in ts
           if not m.endswith("__init__") and _layer(t) > _layer(m)
           and not t.startswith(m + ".")]
    assert not bad, "imports pointing up a layer:\n" + "\n".join(sorted(bad))


def test_kernel_layer_imports_nothing_of_the_project_above_it():
    graph = _graph()
    for m, ts in graph.items():
        if m.startswith(("xformers_jax.kernels", "pallas_kernels")):
            up = {t for t in ts if not t.startswith(("xformers_jax.kernels", "pallas_kernels"))
                  and t != "xformers_jax"}
            assert not up, f"{m} imports {sorted(up)}"


def test_modules_form_a_dag():
    graph = _graph()
    # A package's __init__ re-exports its children; the edge from a child back to its own
    # package's __init__ (``from . import x``) is resolved to the child module by _imports.
    state, stack = {}, []

    def visit(m):
        state[m] = 1
        stack.append(m)
        for t in sorted(graph.get(m, ())):
            if t.startswith(m + "."):
                continue  # a package importing its own children
            if state.get(t) == 1:
                cycle = stack[stack.index(t):] + [t]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if t not in state:
                visit(t)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)
